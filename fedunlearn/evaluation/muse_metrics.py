"""MUSE-style metrics (docs/algorithms.md, "Evaluation metrics"): KnowMem, VerbMem and PrivLeak.

* **KnowMem**: mean ROUGE-L F1 of the greedy answer to
  :func:`~fedunlearn.qa_format.format_prompt` ``(question)`` against the short answer. On the
  forget QA it measures remaining knowledge (lower after unlearning); on the retain QA it is the
  utility metric.
* **VerbMem**: mean ROUGE-L F1 of the greedy continuation of a raw text prefix (no QA format)
  against the true continuation.
* **PrivLeak**: Min-K% Prob membership score (Shi et al., k = 0.4) of forget (members) and
  holdout (non-members) texts, ROC AUC of the two, and
  ``PrivLeak = (AUC_unlearned - AUC_retrain) / AUC_retrain * 100`` (close to 0 is best).

ROUGE-L uses :func:`fedunlearn.evaluation.tofu_metrics.rouge_l_scores` (``rouge-score`` with
stemming).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.evaluation.generation import greedy_from_ids, greedy_generate
from fedunlearn.evaluation.intervals import record_scores
from fedunlearn.evaluation.likelihood import (
    eval_mode,
    length_sorted_batches,
    logits_in_chunks,
    model_device,
    resolve_pad_id,
)
from fedunlearn.evaluation.tofu_metrics import rouge_l_scores

if TYPE_CHECKING:
    from fedunlearn.benchmarks.muse import MuseData

__all__ = [
    "MIN_K_RATIO",
    "evaluate_muse",
    "greedy_continue",
    "knowmem",
    "membership_auc",
    "min_k_percent_scores",
    "privleak",
    "rouge_l_f1",
    "verbmem",
]

#: Share of lowest-probability tokens averaged by the Min-K% Prob score used for PrivLeak.
MIN_K_RATIO = 0.4


def rouge_l_f1(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """Per-pair ROUGE-L F1 (stemmed) of ``predictions`` against ``references``."""
    return rouge_l_scores(predictions, references, measure="fmeasure")


def greedy_continue(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 32,
    max_prompt_tokens: int | None = None,
) -> list[str]:
    """Greedy continuation of each raw ``prompt`` text (no QA formatting).

    :func:`~fedunlearn.evaluation.generation.greedy_generate` always wraps its input in the QA
    prompt, so this is its raw-text sibling: prompts are tokenised with the tokenizer's special
    tokens (a BOS where the tokenizer adds one), optionally cut to their LAST
    ``max_prompt_tokens`` tokens, grouped by length and LEFT-padded by hand; decoding stops at
    EOS or after ``max_new_tokens`` tokens.

    Returns:
        The decoded continuations in input order, without prompt or special tokens, stripped.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer needs an EOS token")
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    if max_prompt_tokens is not None:
        encoded = [ids[-max_prompt_tokens:] for ids in encoded]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenisation")
    return greedy_from_ids(
        model, tokenizer, encoded, max_new_tokens=max_new_tokens, batch_size=batch_size
    )


def knowmem(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    qa: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 32,
    max_new_tokens: int = 32,
) -> tuple[float, list[str]]:
    """KnowMem: mean ROUGE-L F1 of the greedy answers to ``qa`` and the generations.

    Each record needs ``question`` and ``answer``; the prompt is
    :func:`~fedunlearn.qa_format.format_prompt` ``(question)``.
    """
    if not qa:
        raise ValueError("knowmem needs at least one QA record")
    generations = greedy_generate(
        model,
        tokenizer,
        [str(r["question"]) for r in qa],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    scores = rouge_l_f1(generations, [str(r["answer"]) for r in qa])
    return float(np.mean(scores)), generations


def verbmem(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 32,
    max_new_tokens: int = 128,
    max_prompt_tokens: int | None = None,
) -> tuple[float, list[str]]:
    """VerbMem: mean ROUGE-L F1 of the greedy continuation of each ``prompt`` against ``gt``.

    Prompts are raw text (see :func:`greedy_continue`); returns the mean and the generations.
    """
    if not probes:
        raise ValueError("verbmem needs at least one probe")
    generations = greedy_continue(
        model,
        tokenizer,
        [str(p["prompt"]) for p in probes],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        max_prompt_tokens=max_prompt_tokens,
    )
    scores = rouge_l_f1(generations, [str(p["gt"]) for p in probes])
    return float(np.mean(scores)), generations


def min_k_percent_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    k: float = MIN_K_RATIO,
    batch_size: int = 32,
    max_length: int = 512,
) -> list[float]:
    """Min-K% Prob (Shi et al.) of each text; higher means more likely a training member.

    Each text is tokenised with the tokenizer's special tokens and cut to its first
    ``max_length`` tokens; the ``n`` scored tokens are all but the first (each predicted from
    its prefix). The score is the mean of the ``max(1, int(k * n))`` lowest token
    log-probabilities (MUSE rounds down the same way). One forward pass per batch of
    right-padded, length-grouped texts; the result equals the unbatched computation.

    Raises:
        ValueError: on ``k`` outside ``(0, 1]`` or a text with fewer than two tokens.
    """
    if not 0 < k <= 1:
        raise ValueError(f"k must be in (0, 1], got {k!r}")
    encoded = [tokenizer(t)["input_ids"][:max_length] for t in texts]
    for i, ids in enumerate(encoded):
        if len(ids) < 2:
            raise ValueError(f"text {i} has {len(ids)} token(s); Min-K% needs at least 2")
    scores = [0.0] * len(encoded)
    if not encoded:
        return scores
    pad_id = resolve_pad_id(tokenizer)
    device = model_device(model)
    with eval_mode(model), torch.no_grad():
        for batch in length_sorted_batches([len(ids) for ids in encoded], batch_size):
            width = max(len(encoded[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids = encoded[i]
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention[row, : len(ids)] = 1
            for part, logits in logits_in_chunks(model, input_ids, attention):
                shift_logits = logits[:, :-1, :].float()
                targets = input_ids[part, 1:].to(device)
                token_logp = -F.cross_entropy(
                    shift_logits.reshape(-1, shift_logits.size(-1)),
                    targets.reshape(-1),
                    reduction="none",
                ).view(targets.shape)
                del logits, shift_logits
                token_logp = token_logp.double().cpu()
                for row, i in enumerate(batch[part]):
                    n = len(encoded[i]) - 1
                    lowest = torch.sort(token_logp[row, :n]).values[: max(1, int(k * n))]
                    scores[i] = float(lowest.mean())
    return scores


def membership_auc(
    member_scores: Sequence[float] | np.ndarray, nonmember_scores: Sequence[float] | np.ndarray
) -> float:
    """ROC AUC of telling members from non-members by score (higher score = member).

    Rank-based (Mann-Whitney U / (n_members * n_nonmembers)): the probability that a random
    member scores higher than a random non-member, a tie counting 1/2. 1 = perfect separation,
    0.5 = indistinguishable.
    """
    members = np.asarray(member_scores, dtype=np.float64).ravel()
    nonmembers = np.asarray(nonmember_scores, dtype=np.float64).ravel()
    if members.size == 0 or nonmembers.size == 0:
        raise ValueError("membership_auc needs at least one member and one non-member score")
    if not (np.all(np.isfinite(members)) and np.all(np.isfinite(nonmembers))):
        raise ValueError("membership_auc got non-finite scores")
    ranks = stats.rankdata(np.concatenate([members, nonmembers]))  # ties get the mean rank
    m, n = members.size, nonmembers.size
    return float((ranks[:m].sum() - m * (m + 1) / 2) / (m * n))


def privleak(auc_unlearned: float, auc_retrain: float) -> float:
    """``(AUC_unlearned - AUC_retrain) / AUC_retrain * 100``: 0 = leaks like the retrain model.

    Large positive values mean the forget set still leaks (under-unlearning); large negative
    values mean the model treats forget texts as *less* familiar than never-seen ones
    (over-unlearning), which is detectable too.
    """
    if auc_retrain <= 0:
        raise ValueError(f"auc_retrain must be > 0, got {auc_retrain!r}")
    return float((auc_unlearned - auc_retrain) / auc_retrain * 100.0)


def evaluate_muse(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: MuseData,
    *,
    retrain_auc: float | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 32,
    verbmem_max_new_tokens: int = 128,
    n_samples: int = 3,
    k: float = MIN_K_RATIO,
    max_length: int = 512,
) -> dict[str, Any]:
    """Full MUSE-style evaluation of ``model`` as one flat, JSON-serialisable dict.

    Args:
        model: causal LM on its device.
        tokenizer: matching tokenizer.
        data: a :class:`fedunlearn.benchmarks.muse.MuseData`.
        retrain_auc: ``privleak_auc`` of the retrain reference model (trained without the
            forget set); ``privleak`` is ``None`` without it.
        batch_size: batch size of generation and likelihood passes.
        max_new_tokens: generation budget of KnowMem answers.
        verbmem_max_new_tokens: generation budget of VerbMem continuations.
        n_samples: how many forget QA and verbmem probes (with generations) to return.
        k: Min-K% ratio of the PrivLeak score.
        max_length: truncation length (tokens) of Min-K% scoring.

    Returns:
        ``knowmem_forget``, ``knowmem_retain`` (utility), ``verbmem_forget`` (floats in
        [0, 1], ``None`` where the data has no such records), ``privleak_auc`` (AUC of forget
        vs holdout texts under Min-K%, see ``MuseData.privleak_texts``; ``None`` without both),
        ``privleak`` (percent, ``None`` without ``retrain_auc``) and ``samples``:
        ``{"knowmem_forget": [{question, answer, generation}], "verbmem_forget": [{prompt,
        gt, generation}]}``.
    """
    result: dict[str, Any] = {}
    per_item: dict[str, Any] = {}  # every list its own item set (record_scores)
    samples: dict[str, list[dict[str, str]]] = {"knowmem_forget": [], "verbmem_forget": []}
    n_show = max(n_samples, 0)
    for name, records in (("forget", data.forget_qa), ("retain", data.retain_qa)):
        if not records:
            result[f"knowmem_{name}"] = None
            continue
        score, generations = knowmem(
            model, tokenizer, records, batch_size=batch_size, max_new_tokens=max_new_tokens
        )
        result[f"knowmem_{name}"] = score
        values = rouge_l_f1(generations, [str(r["answer"]) for r in records])
        questions = [r["question"] for r in records]
        record_scores(per_item, f"knowmem_{name}", values, f"knowmem_{name}", questions)
        if name == "forget":
            samples["knowmem_forget"] = [
                {"question": str(r["question"]), "answer": str(r["answer"]), "generation": g}
                for r, g in list(zip(records, generations, strict=True))[:n_show]
            ]
    if data.verbmem:
        score, generations = verbmem(
            model,
            tokenizer,
            data.verbmem,
            batch_size=batch_size,
            max_new_tokens=verbmem_max_new_tokens,
        )
        result["verbmem_forget"] = score
        values = rouge_l_f1(generations, [str(p["gt"]) for p in data.verbmem])
        prompts = [p["prompt"] for p in data.verbmem]
        record_scores(per_item, "verbmem_forget", values, "verbmem_forget", prompts)
        samples["verbmem_forget"] = [
            {"prompt": str(p["prompt"]), "gt": str(p["gt"]), "generation": g}
            for p, g in list(zip(data.verbmem, generations, strict=True))[:n_show]
        ]
    else:
        result["verbmem_forget"] = None
    members, nonmembers = data.privleak_texts()
    if members and nonmembers:

        def scores(texts: Sequence[str]) -> list[float]:
            return min_k_percent_scores(
                model, tokenizer, texts, k=k, batch_size=batch_size, max_length=max_length
            )

        result["privleak_auc"] = membership_auc(scores(members), scores(nonmembers))
    else:
        result["privleak_auc"] = None
    result["privleak"] = (
        None
        if retrain_auc is None or result["privleak_auc"] is None
        else privleak(result["privleak_auc"], retrain_auc)
    )
    result["samples"] = samples
    result.update(per_item)
    return result
