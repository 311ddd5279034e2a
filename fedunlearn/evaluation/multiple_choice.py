"""Multiple-choice accuracy by answer likelihood, WMDP / MMLU style (docs/algorithms.md,
"Evaluation metrics").

Each choice is scored as an answer to :func:`fedunlearn.qa_format.format_prompt` of the
question with :func:`fedunlearn.evaluation.likelihood.answer_nll` (mean token NLL of the choice
tokens plus EOS, i.e. length-normalised). The predicted choice is the one with the lowest NLL
(highest length-normalised log-likelihood); ties go to the LOWER index, where NLLs within
:data:`TIE_TOLERANCE` of the minimum count as tied (so float noise from batching or from
averaging over different token counts cannot decide a tie). A question counts as correct when
the prediction equals its ``answer`` index.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.benchmarks.wmdp import WmdpData
from fedunlearn.evaluation.intervals import record_scores
from fedunlearn.evaluation.likelihood import answer_nll

TIE_TOLERANCE = 1e-6

__all__ = [
    "TIE_TOLERANCE",
    "choice_nll",
    "evaluate_wmdp",
    "multiple_choice_accuracy",
    "multiple_choice_correct",
    "predicted_choices",
]


def _num_choices(questions: Sequence[dict[str, Any]]) -> int:
    counts = {len(q["choices"]) for q in questions}
    if len(counts) > 1:
        raise ValueError(f"questions have different numbers of choices: {sorted(counts)}")
    k = counts.pop() if counts else 0
    if questions and k < 2:
        raise ValueError(f"a multiple-choice question needs >= 2 choices, got {k}")
    return k


def choice_nll(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[dict[str, Any]],
    *,
    batch_size: int = 32,
) -> torch.Tensor:
    """Length-normalised NLL of every choice as the answer to its question.

    Args:
        model: causal LM (evaluated in eval mode, without gradients, on its device).
        tokenizer: its tokenizer.
        questions: records with ``question`` and ``choices`` (all with the same number).
        batch_size: (question, choice) pairs per forward pass.

    Returns:
        Float32 CPU tensor ``[len(questions), n_choices]``.
    """
    k = _num_choices(questions)
    flat_q = [q["question"] for q in questions for _ in range(k)]
    flat_a = [str(c) for q in questions for c in q["choices"]]
    nll = answer_nll(model, tokenizer, flat_q, flat_a, batch_size=batch_size)
    return nll.view(len(questions), k)


def predicted_choices(nll: torch.Tensor) -> list[int]:
    """Index of the lowest NLL in every row of ``nll`` ``[n, n_choices]``.

    Ties (values within :data:`TIE_TOLERANCE` of the row minimum) go to the lowest index.
    """
    predicted = []
    for row in nll.tolist():
        lowest = min(row)
        predicted.append(next(j for j, x in enumerate(row) if x <= lowest + TIE_TOLERANCE))
    return predicted


def multiple_choice_correct(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[dict[str, Any]],
    *,
    batch_size: int = 32,
) -> list[bool]:
    """Whether the lowest-NLL choice is the ``answer`` of each question (ties: lower index)."""
    predicted = predicted_choices(choice_nll(model, tokenizer, questions, batch_size=batch_size))
    return [p == int(q["answer"]) for p, q in zip(predicted, questions, strict=True)]


def multiple_choice_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[dict[str, Any]],
    *,
    batch_size: int = 32,
) -> float:
    """Share of ``questions`` answered correctly (see :func:`multiple_choice_correct`)."""
    if not questions:
        raise ValueError("no questions to evaluate")
    correct = multiple_choice_correct(model, tokenizer, questions, batch_size=batch_size)
    return sum(correct) / len(correct)


def evaluate_wmdp(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: WmdpData,
    *,
    domains: Sequence[str] | None = None,
    general_samples: int | None = None,
    seed: int = 0,
    batch_size: int = 32,
    n_samples: int = 3,
) -> dict[str, Any]:
    """WMDP-style report: accuracy per hazard domain and on the general set.

    Args:
        model, tokenizer: the model under test.
        data: the benchmark.
        domains: hazard domains to evaluate (None = all of ``data``).
        general_samples: evaluate a seeded subsample of this many general questions
            (None, or more than there are = all of them).
        seed: seed of that subsample.
        batch_size: (question, choice) pairs per forward pass.
        n_samples: questions per domain copied into ``samples`` for a human to read.

    Returns:
        ``accuracy_<domain>`` per domain, ``hazard_accuracy`` (mean over those domains),
        ``general_accuracy``, ``chance`` (mean of ``1 / n_choices`` over the evaluated
        questions, 0.25 for four options), ``num_questions`` (per domain and ``general``) and
        ``samples``: per domain (and ``general``) the first ``n_samples`` questions with the
        ``chosen`` and ``correct`` choice texts. An accuracy over zero questions is None.
        ``scores`` / ``score_sets`` / ``question_digests``: every accuracy's per-question
        correctness (1 or 0), its question set and that set's digest
        (:mod:`fedunlearn.evaluation.intervals`).
    """
    chosen_domains = data.domains if domains is None else list(domains)
    unknown = [d for d in chosen_domains if d not in data.questions]
    if unknown:
        raise KeyError(f"unknown domains {unknown}; known: {data.domains}")
    general = list(data.general_questions)
    if general_samples is not None and general_samples < len(general):
        if general_samples < 0:
            raise ValueError(f"general_samples must be >= 0, got {general_samples}")
        keep = sorted(random.Random(seed).sample(range(len(general)), general_samples))
        general = [general[i] for i in keep]

    sets = {d: list(data.questions[d]) for d in chosen_domains}
    sets["general"] = general
    report: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    inverse_choices: list[float] = []
    accuracies: dict[str, float | None] = {}
    scores: dict[str, Any] = {}  # the per-question correctness (record_scores)
    for name, questions in sets.items():
        counts[name] = len(questions)
        if not questions:
            accuracies[name] = None
            samples[name] = []
            continue
        nll = choice_nll(model, tokenizer, questions, batch_size=batch_size)
        predicted = predicted_choices(nll)
        correct = [p == int(q["answer"]) for p, q in zip(predicted, questions, strict=True)]
        accuracies[name] = sum(correct) / len(correct)
        metric = "general_accuracy" if name == "general" else f"accuracy_{name}"
        record_scores(scores, metric, correct, name, [q["question"] for q in questions])
        inverse_choices.extend(1.0 / len(q["choices"]) for q in questions)
        samples[name] = [
            {
                "question": q["question"],
                "choices": list(q["choices"]),
                "chosen": q["choices"][p],
                "correct": q["choices"][int(q["answer"])],
                "nll": [round(x, 4) for x in row],
            }
            for q, p, row in zip(questions[:n_samples], predicted, nll.tolist(), strict=False)
        ]
    for d in chosen_domains:
        report[f"accuracy_{d}"] = accuracies[d]
    hazard = [a for d in chosen_domains if (a := accuracies[d]) is not None]
    report["hazard_accuracy"] = sum(hazard) / len(hazard) if hazard else None
    report["general_accuracy"] = accuracies["general"]
    report["chance"] = sum(inverse_choices) / len(inverse_choices) if inverse_choices else None
    report["num_questions"] = counts
    report["samples"] = samples
    report.update(scores)
    return report
