"""The multiple-choice scores of :mod:`fedunlearn.evaluation.harness_mc` against lm-eval's own.

:func:`lm_eval_choice_logprobs` asks lm-evaluation-harness (the ``lm-eval`` package, a
development dependency) for the ``loglikelihood`` of each continuation ``" A"`` … ``" D"``
after :func:`~fedunlearn.evaluation.harness_mc.harness_prompt`, through its ``HFLM`` wrapper
of the same model and tokenizer, exactly the requests its ``mmlu`` tasks make. Compared with
:func:`~fedunlearn.evaluation.harness_mc.choice_logprobs` per question and choice, this checks
the prompt encoding, the truncation and the summed log-probabilities against the harness
itself rather than against a re-derivation of its formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.evaluation.harness_mc import LETTERS, choice_logprobs, harness_prompt


def lm_eval_choice_logprobs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, Any]],
    *,
    batch_size: int = 4,
) -> torch.Tensor:
    """``[n, 4]`` lm-eval log-likelihoods of the four answer letters of each record."""
    from lm_eval.api.instance import Instance  # a development dependency only
    from lm_eval.models.huggingface import HFLM

    device = str(next(model.parameters()).device)
    harness = HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size)
    requests = [
        Instance(
            request_type="loglikelihood",
            doc=dict(record),
            arguments=(harness_prompt(record), f" {letter}"),
            idx=i,
        )
        for record in records
        for i, letter in enumerate(LETTERS)
    ]
    scores = [logprob for logprob, _ in harness.loglikelihood(requests, disable_tqdm=True)]
    return torch.tensor(scores, dtype=torch.float64).view(len(records), len(LETTERS))


def compare_with_lm_eval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, Any]],
    *,
    batch_size: int = 4,
) -> dict[str, Any]:
    """Both scorings of ``records``: the largest absolute difference of a log-likelihood, the
    questions whose predicted letter differs, and both ``[n, 4]`` tables (as lists)."""
    ours = choice_logprobs(model, tokenizer, records, batch_size=batch_size).double()
    theirs = lm_eval_choice_logprobs(model, tokenizer, records, batch_size=batch_size)
    differs = (ours.argmax(dim=1) != theirs.argmax(dim=1)).nonzero().flatten().tolist()
    return {
        "questions": len(records),
        "max_abs_difference": float((ours - theirs).abs().max()),
        "predictions_differ": differs,
        "harness_mc": ours.tolist(),
        "lm_eval": theirs.tolist(),
    }
