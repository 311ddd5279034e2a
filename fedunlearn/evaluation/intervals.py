"""95 % intervals of the evaluation metrics: a percentile bootstrap over questions.

Every metric that is a mean over questions or items comes with its per-question values: a
stage's metrics hold ``scores`` (``{metric: [one value per question]}``, the metric being the
list's mean) and ``score_sets`` (``{metric: question set}``: the lists of one set score the same
questions in the same order, e.g. TOFU's forget ROUGE-L, probability, truth ratio and exact
match). :func:`metric_intervals` draws, per question set, ``resamples`` resamples of its
questions with replacement (seeded per set, so an interval does not depend on which other
metrics exist) and takes the 2.5th and 97.5th percentiles of each metric over them:

* a mean metric: the mean of its resampled list;
* a derived metric, recomputed per resample from its resampled inputs (:data:`DERIVED`):
  TOFU's model utility (the harmonic mean of its nine split means, each split resampled on its
  own), forget quality (the KS p-value of the resampled forget truth ratios against the
  reference's, which stay as measured), WMDP's forget accuracy (the mean of the forget
  domains' accuracies).

A metric without per-question values (e.g. PrivLeak, from one AUC) gets no interval.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

SCORES_KEY = "scores"  # a stage's metrics: {metric: [one value per question or item]}
SCORE_SETS_KEY = "score_sets"  # {metric: the question set its list scores}
QUESTIONS_KEY = "question_digests"  # {question set: question_digest of its questions}
RESAMPLES = 1000
LEVEL = 0.95


def question_digest(texts: Iterable[str]) -> str:
    """sha256 of a question set's texts in order: two runs scored the same questions in the
    same order exactly when their digests agree."""
    return hashlib.sha256(json.dumps([str(t) for t in texts]).encode()).hexdigest()


def record_scores(
    metrics: dict[str, Any], name: str, values: Sequence[float], question_set: str, texts: Any
) -> None:
    """Add metric ``name``'s per-question ``values`` to ``metrics`` (``scores``,
    ``score_sets`` and the set's ``question_digests`` from its question ``texts``)."""
    metrics.setdefault(SCORES_KEY, {})[name] = [float(v) for v in values]
    metrics.setdefault(SCORE_SETS_KEY, {})[name] = question_set
    metrics.setdefault(QUESTIONS_KEY, {})[question_set] = question_digest(texts)


class Resampler:
    """Resampled per-question arrays of one stage (``[resamples, n]``), the same resample of a
    question set for every list of that set."""

    def __init__(self, metrics: Mapping[str, Any], resamples: int, seed: int) -> None:
        self.metrics = metrics
        self.scores: Mapping[str, Sequence[float]] = metrics.get(SCORES_KEY) or {}
        self.sets: Mapping[str, str] = metrics.get(SCORE_SETS_KEY) or {}
        self.resamples = resamples
        self.seed = seed
        self._indices: dict[str, np.ndarray] = {}

    def indices(self, question_set: str, n: int) -> np.ndarray:
        """``[resamples, n]`` question indices of ``question_set`` (seeded by its name)."""
        if question_set not in self._indices:
            rng = np.random.default_rng([self.seed, zlib.crc32(question_set.encode())])
            self._indices[question_set] = rng.integers(0, n, size=(self.resamples, n))
        drawn = self._indices[question_set]
        if drawn.shape[1] != n:
            raise ValueError(
                f"question set {question_set!r} has lists of {drawn.shape[1]} and {n} questions"
            )
        return drawn

    def values(self, name: str, question_set: str | None = None) -> np.ndarray:
        """List ``name`` (a score list, or a per-question list of the metrics themselves, e.g.
        ``forget_truth_ratios``, of ``question_set``) resampled: ``[resamples, n]``."""
        raw = self.scores[name] if name in self.scores else self.metrics[name]
        values = np.asarray(raw, dtype=np.float64)
        return values[self.indices(question_set or self.sets[name], values.size)]


@dataclass(frozen=True)
class DerivedMetric:
    """A metric recomputed per resample: ``needs`` names what must exist (score lists or
    metrics of the stage; ``reference`` ones of the reference's metrics), ``compute`` returns
    the ``[resamples]`` values."""

    needs: tuple[str, ...]
    compute: Callable[[Resampler, Mapping[str, Any] | None], np.ndarray]
    reference: tuple[str, ...] = ()


_TOFU_UTILITY = [
    f"{split}_{metric}"
    for split in ("retain", "real_authors", "world_facts")
    for metric in ("prob", "rouge_l", "truth_ratio")
]


def _tofu_utility(resampler: Resampler, _: Mapping[str, Any] | None) -> np.ndarray:
    """The harmonic mean of the resampled split means (0 where one of them is 0)."""
    names = [n for n in _TOFU_UTILITY if n in resampler.scores]
    means = np.stack([resampler.values(n).mean(axis=1) for n in names], axis=1)
    out = np.zeros(means.shape[0])
    positive = (means > 0).all(axis=1)
    out[positive] = stats.hmean(means[positive], axis=1)
    return out


def _forget_quality(resampler: Resampler, reference: Mapping[str, Any] | None) -> np.ndarray:
    """The KS p-value of each resample of the forget truth ratios against the reference's."""
    assert reference is not None
    ratios = resampler.values("forget_truth_ratios", "forget")
    fixed = np.asarray(reference["forget_truth_ratios"], dtype=np.float64)
    return np.array([stats.ks_2samp(row, fixed).pvalue for row in ratios])


def _wmdp_forget_accuracy(resampler: Resampler, _: Mapping[str, Any] | None) -> np.ndarray:
    """The mean of the resampled forget domains' accuracies."""
    domains = resampler.metrics["forget_domains"]
    return np.mean([resampler.values(f"accuracy_{d}").mean(axis=1) for d in domains], axis=0)


#: Derived metrics by name (computed where their inputs exist).
DERIVED: dict[str, DerivedMetric] = {
    "model_utility": DerivedMetric(("retain_prob", "retain_rouge_l"), _tofu_utility),
    "forget_quality": DerivedMetric(
        ("forget_truth_ratios", "forget_rouge_l"), _forget_quality, ("forget_truth_ratios",)
    ),
    "forget_accuracy": DerivedMetric(("forget_domains",), _wmdp_forget_accuracy),
}


def resampled_metrics(
    metrics: Mapping[str, Any],
    reference: Mapping[str, Any] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """``{metric: [resamples] values}``: every metric of one stage's ``metrics`` that has
    per-question scores or is derived from them, on each bootstrap resample of its questions
    (``reference``: the reference model's metrics, for forget quality). Two stages or runs
    resampled with the same ``seed`` see the same resamples of a question set of the same
    size: their differences per resample are paired."""
    if resamples < 1:
        raise ValueError(f"need resamples >= 1, got {resamples}")
    resampler = Resampler(metrics, resamples, seed)
    out: dict[str, np.ndarray] = {}
    for name in resampler.scores:
        if name in metrics and name not in DERIVED:
            out[name] = resampler.values(name).mean(axis=1)
    for name, derived in DERIVED.items():
        present = all(n in resampler.scores or n in metrics for n in derived.needs)
        has_reference = all(reference and reference.get(n) for n in derived.reference)
        if name in metrics and metrics[name] is not None and present and has_reference:
            out[name] = derived.compute(resampler, reference)
    return out


def percentile_interval(values: np.ndarray, level: float = LEVEL) -> list[float]:
    """``[low, high]``: the central ``level`` percentile interval of ``values`` (NaNs,
    resamples where a value is undefined, left out)."""
    if not 0 < level < 1:
        raise ValueError(f"need 0 < level < 1, got {level}")
    tails = [50 * (1 - level), 100 - 50 * (1 - level)]
    return [float(v) for v in np.nanpercentile(values, tails)]


def metric_intervals(
    metrics: Mapping[str, Any],
    reference: Mapping[str, Any] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> dict[str, list[float]]:
    """``{metric: [low, high]}``: the percentile-bootstrap ``level`` interval of every metric
    of :func:`resampled_metrics`."""
    if not 0 < level < 1:
        raise ValueError(f"need 0 < level < 1, got {level}")
    drawn = resampled_metrics(metrics, reference, resamples=resamples, seed=seed)
    return {name: percentile_interval(values, level) for name, values in drawn.items()}
