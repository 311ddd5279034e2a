"""A γ sweep repeated over client-training seeds, and each point's metrics over the seeds.

``python -m simulations.sweep --seeds 0,1,2 ...`` runs :func:`simulations.sweep.sweep` once per
seed with ``training.seed=<s>`` (the clients' local training alone changes: data, model and
evaluation questions keep ``seed``), into ``seed-<s>/``, then writes ``seeds.json`` and
``seeds.md``: per point (merge, γ) and metric the mean over the seeds, the between-seed
standard deviation, every seed's value, and a 95 % interval that combines seeds and
questions — a two-level bootstrap: each resample draws the seeds with replacement and, for the
questions, the same bootstrap resample of the evaluation questions for every seed (the seeds
were scored on the same questions), and averages the drawn seeds' resampled metric.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedunlearn.evaluation.intervals import RESAMPLES, percentile_interval, resampled_metrics
from strategies.results import json_safe


def _point_files(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted((folder / "points").glob("*.json"))}


def _reference(folder: Path) -> dict[str, Any] | None:
    results = json.loads((folder / "flower-run" / "results.json").read_text())
    return results["metrics"].get("reference")


def seed_interval(
    per_seed: Sequence[Mapping[str, np.ndarray]], metric: str, resamples: int, seed: int = 0
) -> list[float]:
    """The two-level bootstrap interval of ``metric``'s mean over seeds: ``per_seed`` holds
    each seed's resampled metrics (the same question resamples for every seed)."""
    k = len(per_seed)
    drawn = np.stack([values[metric] for values in per_seed])  # [seeds, resamples]
    rng = np.random.default_rng(seed)
    chosen = rng.integers(0, k, size=(resamples, k))
    return percentile_interval(drawn[chosen, np.arange(resamples)[:, None]].mean(axis=1))


def combine_seeds(
    folders: Mapping[int, Path], metric_names: Sequence[str], resamples: int = RESAMPLES
) -> dict[str, Any]:
    """``{point: {metric: {mean, sd, per_seed, interval}}}`` over the sweeps in ``folders``
    (seed → sweep folder); only points every seed has."""
    files = {s: _point_files(f) for s, f in folders.items()}
    references = {s: _reference(f) for s, f in folders.items()}
    common = sorted(set.intersection(*(set(f) for f in files.values())))
    out: dict[str, Any] = {}
    for name in common:
        evaluations = {s: json.loads(files[s][name].read_text())["evaluation"] for s in files}
        drawn = [
            resampled_metrics(evaluations[s], references[s], resamples=resamples, seed=0)
            for s in files
        ]
        rows = {}
        for metric in metric_names:
            values = [evaluations[s].get(metric) for s in files]
            if any(v is None for v in values):
                continue
            array = np.asarray(values, dtype=np.float64)
            rows[metric] = {
                "mean": float(array.mean()),
                "sd": float(array.std(ddof=1)) if len(array) > 1 else 0.0,
                "per_seed": dict(zip([str(s) for s in files], array.tolist(), strict=True)),
                "interval": seed_interval(drawn, metric, resamples)
                if all(metric in d for d in drawn)
                else None,
            }
        out[name] = rows
    return out


def seeds_markdown(
    combined: Mapping[str, Any], seeds: Sequence[int], metrics: Sequence[str]
) -> str:
    """One row per point: each metric as mean ± between-seed sd [95 % interval]."""
    lines = [
        f"Seeds {', '.join(map(str, seeds))} (training.seed): mean ± between-seed sd "
        "[95 % interval over seeds and questions]",
        "",
        "| point | " + " | ".join(metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for point, rows in combined.items():
        cells = []
        for metric in metrics:
            row = rows.get(metric)
            if row is None:
                cells.append("")
                continue
            interval = row["interval"]
            shown = "" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"
            cells.append(f"{row['mean']:.3f} ± {row['sd']:.3f}{shown}")
        lines.append(f"| {point} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_seed_summary(
    output_dir: Path, folders: Mapping[int, Path], metric_names: Sequence[str]
) -> dict[str, Any]:
    """``seeds.json`` and ``seeds.md`` of the per-seed sweeps in ``folders``."""
    combined = combine_seeds(folders, metric_names)
    summary = {"seeds": list(folders), "metrics": list(metric_names), "points": combined}
    (output_dir / "seeds.json").write_text(json.dumps(json_safe(summary), indent=2))
    (output_dir / "seeds.md").write_text(seeds_markdown(combined, list(folders), metric_names))
    return summary
