"""TOFU-style QA metrics (docs/algorithms.md, "Evaluation metrics").

Per split the evaluation reports

* ``rouge_l``: ROUGE-L recall of the greedy generation against the answer;
* ``exact_match``: share of generations equal to the answer after normalisation;
* ``prob``: forget/retain: mean ``P(a|q)``; extra sets (real authors, world facts): mean of
  the normalised ``P_c / (P_c + Σ P_wrong)`` with ``P_c`` the probability of the answer;
* ``truth_ratio``: from ``TR = geomean(P_wrong) / P_correct`` ("correct" = paraphrased answer
  on forget/retain, original answer on the extra sets); forget: ``mean(min(TR, 1/TR))``,
  other sets: ``mean(max(0, 1 - TR))``.

Across splits: forget quality (KS-test p-value of the forget truth ratios against those of a
retain-only reference model) and model utility (harmonic mean of {prob, rouge_l, truth_ratio}
on {retain, real_authors, world_facts}). All probabilities are length-normalised,
``P(a|q) = exp(-mean token NLL)``, and are combined in log space.

:func:`aggregate_official_logs` runs the same per-question formulas (:func:`split_scores`) on
the TOFU authors' published evaluation logs; its docstring lists the conventions that differ.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from scipy import stats
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.evaluation.generation import greedy_generate
from fedunlearn.evaluation.intervals import record_scores
from fedunlearn.evaluation.likelihood import answer_nll
from fedunlearn.evaluation.tofu_logs import read_official_log_dir

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer

__all__ = [
    "EXTRA_SPLITS",
    "OFFICIAL_TRUNCATE",
    "SPLIT_KINDS",
    "UTILITY_SPLITS",
    "aggregate_official_logs",
    "evaluate_split",
    "evaluate_tofu",
    "exact_match",
    "forget_quality",
    "log_truth_ratio",
    "model_utility",
    "normalize_answer",
    "normalized_probability",
    "rouge_l_recall",
    "rouge_l_scores",
    "split_scores",
    "truth_ratio",
    "truth_ratio_from_nll",
    "truth_ratio_score",
]

#: Split name -> split kind understood by :func:`evaluate_split`.
SPLIT_KINDS: dict[str, str] = {
    "forget": "forget",
    "retain": "retain",
    "real_authors": "extra",
    "world_facts": "extra",
}
#: The never-forgotten extra sets.
EXTRA_SPLITS: tuple[str, ...] = ("real_authors", "world_facts")
#: Splits whose {prob, rouge_l, truth_ratio} enter model utility.
UTILITY_SPLITS: tuple[str, ...] = ("retain", "real_authors", "world_facts")
_UTILITY_METRICS: tuple[str, ...] = ("prob", "rouge_l", "truth_ratio")
#: The official TOFU evaluation scores the first 300 questions of each set.
OFFICIAL_TRUNCATE = 300


# ----------------------------------------------------------------------------- text metrics


@lru_cache(maxsize=1)
def _rouge_scorer() -> RougeScorer:
    # imported here: it loads NLTK (over a second), and every client process imports this
    # module through the scenarios without scoring any text
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l_scores(
    predictions: Sequence[str], references: Sequence[str], *, measure: str = "recall"
) -> list[float]:
    """Per-pair ROUGE-L (``measure`` in ``recall``/``precision``/``fmeasure``), stemmed."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if measure not in ("recall", "precision", "fmeasure"):
        raise ValueError(f"unknown ROUGE measure {measure!r}")
    scorer = _rouge_scorer()
    return [
        float(getattr(scorer.score(ref, pred)["rougeL"], measure))
        for pred, ref in zip(predictions, references, strict=True)
    ]


def rouge_l_recall(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """Per-pair ROUGE-L recall of ``predictions`` against ``references`` (stemmed)."""
    return rouge_l_scores(predictions, references, measure="recall")


_TRAILING_PUNCT = re.compile(f"[{re.escape(string.punctuation)}\\s]+$")


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace and strip trailing punctuation."""
    return _TRAILING_PUNCT.sub("", " ".join(text.lower().split()))


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """1.0 where prediction and reference agree after :func:`normalize_answer`, else 0.0."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    return [
        float(normalize_answer(p) == normalize_answer(r))
        for p, r in zip(predictions, references, strict=True)
    ]


# ------------------------------------------------------------------------ probability metrics


def _check_wrong(wrong: torch.Tensor, correct: torch.Tensor) -> None:
    if wrong.dim() != 2 or correct.dim() != 1 or wrong.size(0) != correct.size(0):
        raise ValueError(
            f"expected wrong [n, k] and correct [n], got {tuple(wrong.shape)} and "
            f"{tuple(correct.shape)}"
        )


def log_truth_ratio(nll_wrong: torch.Tensor, nll_correct: torch.Tensor) -> torch.Tensor:
    """``log TR`` from mean token NLLs: ``nll_correct - mean_k nll_wrong``.

    ``TR = geomean_k(P_wrong) / P_correct`` with ``P = exp(-NLL)``, so its log is the difference
    of NLLs and never under- or overflows.

    Args:
        nll_wrong: ``[n, k]`` NLLs of the wrong (perturbed) answers; NaN marks a missing entry
            (ragged numbers of perturbed answers).
        nll_correct: ``[n]`` NLLs of the correct answer.
    """
    _check_wrong(nll_wrong, nll_correct)
    return nll_correct - torch.nanmean(nll_wrong, dim=1)


def truth_ratio_from_nll(nll_wrong: torch.Tensor, nll_correct: torch.Tensor) -> torch.Tensor:
    """``TR = exp(log_truth_ratio(nll_wrong, nll_correct))`` (see :func:`log_truth_ratio`)."""
    return torch.exp(log_truth_ratio(nll_wrong, nll_correct))


def truth_ratio(p_wrong: torch.Tensor, p_correct: torch.Tensor) -> torch.Tensor:
    """``TR = geomean_k(p_wrong) / p_correct`` per question, computed in log space.

    Args:
        p_wrong: ``[n, k]`` probabilities of the wrong answers (NaN = missing entry).
        p_correct: ``[n]`` probabilities of the correct answer.
    """
    return truth_ratio_from_nll(-torch.log(p_wrong), -torch.log(p_correct))


def truth_ratio_scores(
    truth_ratios: Sequence[float] | torch.Tensor, *, forget: bool
) -> torch.Tensor:
    """Per-question truth-ratio scores (float64): ``min(TR, 1/TR)`` with ``forget=True`` (1 =
    the model cannot tell right from wrong), ``max(0, 1 - TR)`` otherwise (1 = the correct
    answer dominates)."""
    tr = torch.as_tensor(truth_ratios, dtype=torch.float64)
    if tr.numel() == 0:
        raise ValueError("no truth ratios")
    return torch.minimum(tr, 1.0 / tr) if forget else torch.clamp(1.0 - tr, min=0.0)


def truth_ratio_score(truth_ratios: Sequence[float] | torch.Tensor, *, forget: bool) -> float:
    """Reported truth-ratio score: the mean of :func:`truth_ratio_scores`."""
    return float(truth_ratio_scores(truth_ratios, forget=forget).mean())


def normalized_probability(nll_correct: torch.Tensor, nll_wrong: torch.Tensor) -> torch.Tensor:
    """``P_c / (P_c + Σ_k P_wrong_k)`` per question from mean token NLLs (log-sum-exp).

    Args:
        nll_correct: ``[n]`` NLLs of the correct answer.
        nll_wrong: ``[n, k]`` NLLs of the wrong answers; NaN marks a missing entry.
    """
    _check_wrong(nll_wrong, nll_correct)
    log_p_wrong = torch.nan_to_num(-nll_wrong, nan=-math.inf)
    log_all = torch.cat([-nll_correct.unsqueeze(1), log_p_wrong], dim=1)
    return torch.exp(-nll_correct - torch.logsumexp(log_all, dim=1))


# ------------------------------------------------------------------------- aggregate metrics


def forget_quality(
    tr_unlearned: Sequence[float] | torch.Tensor, tr_reference: Sequence[float] | torch.Tensor
) -> float:
    """P-value of the two-sample KS test between forget truth ratios of two models.

    ``tr_reference`` are the per-question forget truth ratios of the retain-only reference
    model; a high p-value means the unlearned model is indistinguishable from it.
    """
    a = np.asarray(tr_unlearned, dtype=np.float64).ravel()
    b = np.asarray(tr_reference, dtype=np.float64).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError("forget_quality needs non-empty truth-ratio samples")
    return float(stats.ks_2samp(a, b).pvalue)


def model_utility(values: Sequence[float]) -> float:
    """Harmonic mean of non-negative metric values.

    Returns 0.0 when any value is 0 (the limit of the harmonic mean; ``scipy.stats.hmean`` would
    warn). Raises ``ValueError`` on an empty input, a negative or a non-finite value.
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("model_utility needs at least one value")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"model_utility got non-finite values: {arr.tolist()}")
    if np.any(arr < 0):
        raise ValueError(f"model_utility needs non-negative values, got {arr.tolist()}")
    if np.any(arr == 0):
        return 0.0
    return float(stats.hmean(arr))


# ----------------------------------------------------------------- per-question -> split scores


def split_scores(
    nll_answer: torch.Tensor,
    nll_correct: torch.Tensor,
    nll_wrong: torch.Tensor,
    rouge_l: torch.Tensor,
    *,
    kind: str,
    truncate: int | None = None,
) -> dict[str, Any]:
    """``prob``, ``rouge_l``, ``truth_ratio`` and ``truth_ratios`` of one split from
    per-question numbers (the model-free half of :func:`evaluate_split`), and ``per_question``:
    ``{"prob" | "rouge_l" | "truth_ratio": [one value per question]}``, whose means they are.

    Args:
        nll_answer: ``[n]`` mean token NLLs of the answers.
        nll_correct: ``[n]`` NLLs of the "correct" side of the truth ratio (paraphrased answer
            on forget/retain, the answer itself on the extra sets).
        nll_wrong: ``[n, k]`` NLLs of the perturbed answers (NaN = missing entry).
        rouge_l: ``[n]`` ROUGE-L recall of the generations.
        kind: ``"forget"``, ``"retain"`` or ``"extra"``; ``extra`` sets report the normalised
            probability :func:`normalized_probability`, the others ``mean exp(-nll_answer)``.
        truncate: score only the first ``truncate`` questions (the official TOFU logs cover
            the first 300 of each set); ``None`` scores all of them.
    """
    if kind not in ("forget", "retain", "extra"):
        raise ValueError(f"kind must be 'forget', 'retain' or 'extra', got {kind!r}")
    if truncate is not None and truncate < 1:
        raise ValueError(f"truncate must be a positive number of questions, got {truncate}")
    n = len(nll_answer)
    if not len(nll_correct) == len(nll_wrong) == len(rouge_l) == n or n == 0:
        raise ValueError(
            f"per-question inputs must be non-empty and of one length, got {n}, "
            f"{len(nll_correct)}, {len(nll_wrong)}, {len(rouge_l)}"
        )
    keep = slice(0, truncate)
    nll_answer, nll_correct = nll_answer[keep].double(), nll_correct[keep].double()
    nll_wrong = nll_wrong[keep].double()
    if kind == "extra":
        probs = normalized_probability(nll_answer, nll_wrong)
    else:
        probs = torch.exp(-nll_answer)
    tr = truth_ratio_from_nll(nll_wrong, nll_correct)
    tr_scores = truth_ratio_scores(tr, forget=kind == "forget")
    rouge = rouge_l[keep].double()
    return {
        "rouge_l": float(rouge.mean()),
        "prob": float(probs.mean()),
        "truth_ratio": float(tr_scores.mean()),
        "truth_ratios": [float(x) for x in tr.tolist()],
        "per_question": {
            "rouge_l": rouge.tolist(),
            "prob": probs.tolist(),
            "truth_ratio": tr_scores.tolist(),
        },
    }


# ------------------------------------------------------------------------------ evaluation


def _perturbed(record: Mapping[str, Any], index: int) -> list[str]:
    wrong = record.get("perturbed_answer")
    if isinstance(wrong, str):
        wrong = [wrong]
    if not wrong:
        raise ValueError(f"record {index} has no perturbed answers")
    return list(wrong)


def evaluate_split(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[Mapping[str, Any]],
    *,
    kind: str,
    batch_size: int = 32,
    max_new_tokens: int = 48,
    max_length: int = 512,
    n_samples: int = 3,
) -> dict[str, Any]:
    """TOFU metrics of one split.

    All answer likelihoods of the split (answers, paraphrases, every perturbed answer) are
    scored in one batched :func:`answer_nll` call; generation is one batched
    :func:`greedy_generate` call.

    Args:
        model: causal LM on its device.
        tokenizer: matching tokenizer.
        records: QA records with ``question``, ``answer``, ``perturbed_answer`` (list) and, for
            ``forget``/``retain``, ``paraphrased_answer``.
        kind: ``"forget"``, ``"retain"`` or ``"extra"`` (real authors / world facts).
        batch_size: batch size of likelihood and generation passes.
        max_new_tokens: generation budget.
        max_length: truncation length for likelihood scoring.
        n_samples: how many (question, answer, generation) samples to return.

    Returns:
        ``rouge_l``, ``exact_match``, ``prob``, ``truth_ratio`` (floats), ``truth_ratios``
        (raw per-question TR list) and ``samples`` (list of dicts).
    """
    if kind not in ("forget", "retain", "extra"):
        raise ValueError(f"kind must be 'forget', 'retain' or 'extra', got {kind!r}")
    if not records:
        raise ValueError("evaluate_split needs at least one record")
    n = len(records)
    questions = [str(r["question"]) for r in records]
    answers = [str(r["answer"]) for r in records]
    wrong = [_perturbed(r, i) for i, r in enumerate(records)]
    uses_paraphrase = kind != "extra"

    pair_q: list[str] = list(questions)
    pair_a: list[str] = list(answers)
    if uses_paraphrase:
        pair_q += questions
        pair_a += [str(r["paraphrased_answer"]) for r in records]
    wrong_start = len(pair_q)
    for q, ws in zip(questions, wrong, strict=True):
        pair_q += [q] * len(ws)
        pair_a += ws
    nll = answer_nll(model, tokenizer, pair_q, pair_a, batch_size=batch_size, max_length=max_length)

    nll_answer = nll[:n]
    nll_correct = nll[n : 2 * n] if uses_paraphrase else nll_answer
    k = max(len(ws) for ws in wrong)
    nll_wrong = torch.full((n, k), math.nan)
    pos = wrong_start
    for i, ws in enumerate(wrong):
        nll_wrong[i, : len(ws)] = nll[pos : pos + len(ws)]
        pos += len(ws)

    generations = greedy_generate(
        model, tokenizer, questions, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    scores = split_scores(
        nll_answer,
        nll_correct,
        nll_wrong,
        torch.tensor(rouge_l_recall(generations, answers), dtype=torch.float64),
        kind=kind,
    )
    em = exact_match(generations, answers)
    return {
        **scores,
        "exact_match": float(np.mean(em)),
        "per_question": {**scores["per_question"], "exact_match": [float(x) for x in em]},
        "samples": [
            {"question": q, "answer": a, "generation": g}
            for q, a, g in list(zip(questions, answers, generations, strict=True))[
                : max(n_samples, 0)
            ]
        ],
    }


def evaluate_tofu(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    splits: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    reference_truth_ratios: Sequence[float] | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 48,
    max_length: int = 512,
    show_progress: bool = False,
    n_samples: int = 0,
) -> dict[str, Any]:
    """Full TOFU evaluation of ``model`` as one flat, JSON-serialisable dict.

    ``splits`` must contain ``forget``; ``retain``, ``real_authors`` and ``world_facts`` are
    optional: a missing (or empty) one is skipped, its keys are absent, and model utility is
    the harmonic mean over the {prob, rouge_l, truth_ratio} values of the splits that exist
    (``None`` when none of the three exists). Unknown split names raise ``ValueError``.

    Returns keys ``{split}_rouge_l``, ``{split}_exact_match``, ``{split}_prob``,
    ``{split}_truth_ratio`` for each evaluated split, ``forget_quality`` (KS p-value against
    ``reference_truth_ratios``, ``None`` when not given), ``model_utility`` and
    ``forget_truth_ratios`` (per-question list; the reference for another model's forget
    quality), ``scores``, ``score_sets`` and ``question_digests`` (every split metric's
    per-question values, their split and its questions' digest,
    :mod:`fedunlearn.evaluation.intervals`). With ``n_samples > 0`` also
    ``samples``: ``{split: [{question, answer, generation}, ...]}``.
    """
    unknown = set(splits) - set(SPLIT_KINDS)
    if unknown:
        raise ValueError(f"unknown TOFU split(s) {sorted(unknown)}; known: {list(SPLIT_KINDS)}")
    if not splits.get("forget"):
        raise ValueError("evaluate_tofu needs a non-empty 'forget' split")
    names = [name for name in SPLIT_KINDS if splits.get(name)]
    result: dict[str, Any] = {}
    scores: dict[str, Any] = {}  # the per-question values (record_scores)
    samples: dict[str, list[dict[str, str]]] = {}
    for name in tqdm(names, desc="TOFU eval", disable=not show_progress):
        split = evaluate_split(
            model,
            tokenizer,
            splits[name],
            kind=SPLIT_KINDS[name],
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            max_length=max_length,
            n_samples=n_samples,
        )
        for metric in ("rouge_l", "exact_match", "prob", "truth_ratio"):
            result[f"{name}_{metric}"] = split[metric]
            questions = [r["question"] for r in splits[name]]
            record_scores(
                scores, f"{name}_{metric}", split["per_question"][metric], name, questions
            )
        if name == "forget":
            result["forget_truth_ratios"] = split["truth_ratios"]
        if n_samples > 0:
            samples[name] = split["samples"]
    result["forget_quality"] = (
        None
        if reference_truth_ratios is None
        else forget_quality(result["forget_truth_ratios"], reference_truth_ratios)
    )
    utility_values = [
        result[f"{name}_{metric}"]
        for name in UTILITY_SPLITS
        if name in names
        for metric in _UTILITY_METRICS
    ]
    result["model_utility"] = model_utility(utility_values) if utility_values else None
    result.update(scores)
    if n_samples > 0:
        result["samples"] = samples
    return result


def aggregate_official_logs(
    model_log_dir: str | Path,
    retain_log_dir: str | Path,
    *,
    truncate: int | None = OFFICIAL_TRUNCATE,
    extra_truth_ratio_pass: str = "truth_ratio",
) -> dict[str, float]:
    """TOFU aggregates of a folder of official per-question logs, with this module's formulas.

    ``model_log_dir`` holds the four per-set logs of one model (see
    :mod:`fedunlearn.evaluation.tofu_logs`); ``retain_log_dir`` those of the retain-only
    reference model whose forget truth ratios define forget quality. Each split goes through
    :func:`split_scores` (``truncate`` first questions; the default reproduces the official
    logs, ``None`` uses every logged question as :func:`evaluate_tofu` does).

    Conventions, compared with the official aggregation script: the official per-question
    statistic is ``exp(mean perturbed loss - paraphrased loss)``, the inverse of this module's
    ``TR``; the reported scores are the same (``min(x, 1/x)`` is symmetric,
    ``max(0, 1 - 1/x) = max(0, 1 - TR)``) and so is the KS p-value (the test is invariant under
    the strictly monotone map ``x -> 1/x``). The extra sets' probability is normalised over the
    answer and its perturbed answers in both. Two differences, each a keyword here:

    * ``truncate``: the official logs cover the first 300 questions of each set (forget10 has
      400); :func:`evaluate_tofu` scores every question.
    * ``extra_truth_ratio_pass``: on the extra sets (real authors, world facts) the "correct"
      side of the truth ratio is the answer itself. The official code scores it twice, in the
      probability pass (``avg_gt_loss``) and again, batched with the perturbed answers, in the
      truth-ratio pass (``avg_paraphrased_loss``); batching makes the two differ by up to
      0.09 nats, and the official truth ratio uses the latter (``"truth_ratio"``, the
      default). :func:`evaluate_split` scores each answer once, which ``"probability"``
      mimics.

    Returns ``{split}_prob``, ``{split}_rouge_l``, ``{split}_truth_ratio`` for ``forget``,
    ``retain``, ``real_authors`` and ``world_facts``, ``model_utility`` (harmonic mean of the
    nine non-forget values) and ``forget_quality``.
    """
    if extra_truth_ratio_pass not in ("truth_ratio", "probability"):
        raise ValueError(
            "extra_truth_ratio_pass must be 'truth_ratio' or 'probability', "
            f"got {extra_truth_ratio_pass!r}"
        )
    model_logs = read_official_log_dir(Path(model_log_dir))
    reference_logs = read_official_log_dir(Path(retain_log_dir))
    result: dict[str, float] = {}
    forget_trs: list[float] = []
    for name, log in model_logs.items():
        kind = SPLIT_KINDS[name]
        scores = split_scores(
            log.nll_answer,
            log.nll_answer
            if kind == "extra" and extra_truth_ratio_pass == "probability"
            else log.nll_paraphrased,
            log.nll_perturbed,
            log.rouge_l_recall,
            kind=kind,
            truncate=truncate,
        )
        for metric in _UTILITY_METRICS:
            result[f"{name}_{metric}"] = scores[metric]
        if name == "forget":
            forget_trs = scores["truth_ratios"]
    reference = reference_logs["forget"]
    reference_trs = split_scores(
        reference.nll_answer,
        reference.nll_paraphrased,
        reference.nll_perturbed,
        reference.rouge_l_recall,
        kind="forget",
        truncate=truncate,
    )["truth_ratios"]
    result["forget_quality"] = forget_quality(forget_trs, reference_trs)
    result["model_utility"] = model_utility(
        [result[f"{name}_{metric}"] for name in UTILITY_SPLITS for metric in _UTILITY_METRICS]
    )
    return result
