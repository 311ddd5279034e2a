"""Turning run results into JSON and a short human-readable table."""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from fedunlearn.evaluation.intervals import (
    QUESTIONS_KEY,
    SCORE_SETS_KEY,
    SCORES_KEY,
    metric_intervals,
)


def json_safe(value: Any, *, non_finite_as_null: bool = False) -> Any:
    """Recursively convert tensors, numpy scalars and non-finite floats for ``json.dumps``:
    a non-finite float becomes its name (``"inf"``, ``"nan"``: results.json keeps what the run
    was configured with, e.g. ``epsilon = inf``), or ``None`` with ``non_finite_as_null`` (for
    tables of measurements, where it means "not measured")."""
    if isinstance(value, Mapping):
        return {
            str(k): json_safe(v, non_finite_as_null=non_finite_as_null) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [json_safe(v, non_finite_as_null=non_finite_as_null) for v in value]
    if isinstance(value, torch.Tensor):
        return json_safe(value.tolist(), non_finite_as_null=non_finite_as_null)
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if non_finite_as_null else str(value)
    return value


def summary_names(metrics: Mapping[str, Mapping[str, Any]], scenario: Any) -> tuple[str, ...]:
    """The scenario's summary metrics, plus MMLU accuracy when a real model was scored on it."""
    extra = ("mmlu_accuracy",) if "mmlu_accuracy" in metrics.get("before", {}) else ()
    return (*scenario.summary_metrics, *extra)


def format_summary_table(
    metrics: Mapping[str, Mapping[str, Any]],
    names: Sequence[str],
    intervals: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
) -> str:
    """A fixed-width table: one row per metric, one column per evaluated model, each value with
    its 95 % interval where ``intervals`` (results.json ``metrics_ci``) has one."""
    columns = [c for c in ("before", "after", "reference") if c in metrics]
    intervals = intervals or {}
    cell = 26 if any(intervals.get(c) for c in columns) else 12
    width = max(len(n) for n in names) + 2
    lines = [f"{'metric':<{width}}" + "".join(f"{c:>{cell}}" for c in columns)]
    for name in names:
        cells = []
        for column in columns:
            value = metrics[column].get(name)
            text = f"{value:.4f}" if isinstance(value, int | float) else "-"
            interval = intervals.get(column, {}).get(name)
            if interval is not None and text != "-":
                text += f" [{interval[0]:.3f}, {interval[1]:.3f}]"
            cells.append(f"{text:>{cell}}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)


def take_scores(
    metrics: MutableMapping[str, Any], seed: int
) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]]]:
    """``(scores.json, metrics_ci)`` of a run's ``metrics``, whose per-question ``scores`` and
    ``score_sets`` are taken out of every stage (results.json keeps the aggregates): scores.json
    is ``{stage: {metric: [one value per question]}}`` plus ``question_sets`` (``{metric:
    question set}``, lists of one set score the same questions in the same order) and
    ``question_digests`` (``{question set: sha256 of its questions}``);
    ``metrics_ci`` is ``{stage: {metric: [low, high]}}`` (:func:`metric_intervals`, seeded
    by ``seed``; forget quality against the reference's forget truth ratios)."""
    stages = {k: v for k, v in metrics.items() if isinstance(v, MutableMapping)}
    reference = stages.get("reference")
    intervals = {
        stage: metric_intervals(values, None if stage == "reference" else reference, seed=seed)
        for stage, values in stages.items()
    }
    scores: dict[str, Any] = {}
    sets: dict[str, str] = {}
    digests: dict[str, str] = {}
    for stage, values in stages.items():
        scores[stage] = values.pop(SCORES_KEY, {})
        sets.update(values.pop(SCORE_SETS_KEY, {}))
        digests.update(values.pop(QUESTIONS_KEY, {}))
    return {**scores, "question_sets": sets, "question_digests": digests}, intervals
