"""Turning run results into JSON and a short human-readable table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch


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


def format_summary_table(metrics: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> str:
    """A fixed-width table: one row per metric, one column per evaluated model."""
    columns = [c for c in ("before", "after", "reference") if c in metrics]
    width = max(len(n) for n in names) + 2
    lines = [f"{'metric':<{width}}" + "".join(f"{c:>12}" for c in columns)]
    for name in names:
        cells = []
        for column in columns:
            value = metrics[column].get(name)
            cells.append(f"{value:>12.4f}" if isinstance(value, int | float) else f"{'-':>12}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)
