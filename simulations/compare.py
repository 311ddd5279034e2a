"""Paired comparison of runs scored on the same questions, with bootstrap intervals.

    python -m simulations.compare RUN_A RUN_B [RUN_C ...]

A RUN is a run's output folder (or its ``results.json``; ``scores.json`` must lie beside it)
or a γ sweep's folder (``python -m simulations.sweep``: every ``points/*.json`` is a point of
its merge's γ curve). Runs must have scored the same questions in the same order (the
``question_digests`` their evaluations recorded); otherwise the comparison is refused, naming
the run and the question set.

* **Paired differences.** For the first point and every other point: each metric of the
  unlearned model ("after"), ``A − B`` and its 95 % interval from a paired bootstrap: every
  resample of a question set is applied to both points (the same seeded draws,
  :func:`fedunlearn.evaluation.intervals.resampled_metrics`), derived metrics (model utility,
  forget quality) recomputed per resample.
* **Matched forgetting.** Where a merge has several points (a γ curve): its utility
  interpolated linearly at a common forget level along the curve sorted by the forget metric,
  per resample; FIRM's utility (else the first curve's) minus each other curve's, with the
  interval over the resamples that reach the level on both curves. The level is
  ``--forget-level`` or the middle of the range every curve spans as measured.
* **Over seeds.** A ``sweep --seeds`` folder (``seeds.json`` and ``seed-<s>/``): matched
  forgetting per seed, then the mean difference over the seeds, its between-seed standard
  deviation and the interval of a two-level bootstrap (seeds drawn with replacement, the same
  resample of the questions for every seed).

Prints the tables and writes ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedunlearn.evaluation.intervals import (
    QUESTIONS_KEY,
    RESAMPLES,
    SCORE_SETS_KEY,
    SCORES_KEY,
    percentile_interval,
    resampled_metrics,
)


class CompareError(ValueError):
    """Runs that cannot be compared (named, with the reason)."""


@dataclass
class Point:
    """One evaluated model: its label, merge and γ, the stage's metrics with their
    per-question scores, and the reference's metrics (forget quality)."""

    label: str
    merge: str
    gamma: float | None
    metrics: dict[str, Any]
    reference: dict[str, Any] | None
    source: Path


def _run_point(results_path: Path) -> Point:
    """The "after" stage of one run, with the scores of its scores.json."""
    scores_path = results_path.parent / "scores.json"
    if not scores_path.is_file():
        raise CompareError(
            f"{results_path.parent}: no scores.json beside results.json (a run before "
            "per-question scores were saved, or one with evaluate=false)"
        )
    results = json.loads(results_path.read_text())
    scores = json.loads(scores_path.read_text())
    if "after" not in results.get("metrics", {}) or "after" not in scores:
        raise CompareError(f"{results_path}: no metrics of the unlearned model")
    config = results["config"]
    metrics = {
        **results["metrics"]["after"],
        SCORES_KEY: scores["after"],
        SCORE_SETS_KEY: scores.get("question_sets", {}),
        QUESTIONS_KEY: scores.get("question_digests", {}),
    }
    merge = str(config.get("merge"))
    gamma = config.get("gamma")
    return Point(
        f"{merge} γ={gamma:g} ({results_path.parent.name})",
        merge,
        gamma,
        metrics,
        results["metrics"].get("reference"),
        results_path,
    )


def _sweep_points(folder: Path) -> list[Point]:
    """Every point of a γ sweep, with the reference of its Flower run."""
    run = folder / "flower-run" / "results.json"
    reference = json.loads(run.read_text())["metrics"].get("reference") if run.is_file() else None
    points = []
    for path in sorted((folder / "points").glob("*.json")):
        point = json.loads(path.read_text())
        if "evaluation" not in point:
            raise CompareError(f"{path}: a sweep point without per-question scores")
        label = f"{point['strategy']} γ={point['gamma']:g}"
        points.append(
            Point(label, point["strategy"], point["gamma"], point["evaluation"], reference, path)
        )
    if not points:
        raise CompareError(f"{folder}: no points/*.json")
    return points


def load_points(path: Path) -> list[Point]:
    """The points of a run folder, a results.json or a sweep folder."""
    path = Path(path)
    if path.is_dir() and (path / "points").is_dir():
        return _sweep_points(path)
    results = path / "results.json" if path.is_dir() else path
    if not results.is_file():
        raise CompareError(f"{path}: neither a run folder, a results.json nor a sweep folder")
    return [_run_point(results)]


def check_same_questions(points: list[Point]) -> None:
    """Refuse points whose evaluations scored other questions than the first one's."""
    first = points[0]
    digests = first.metrics.get(QUESTIONS_KEY) or {}
    if not digests:
        raise CompareError(f"{first.source}: its scores name no question digests")
    for point in points[1:]:
        other = point.metrics.get(QUESTIONS_KEY) or {}
        for name, digest in digests.items():
            if name not in other:
                raise CompareError(f"{point.source} has no scores of question set {name!r}")
            if other[name] != digest:
                raise CompareError(
                    f"{point.source} was scored on other {name!r} questions than "
                    f"{first.source} (sha256 {other[name][:12]}… vs {digest[:12]}…): a "
                    "paired comparison needs the same questions in the same order"
                )


def paired_differences(a: Point, b: Point, resamples: int, seed: int) -> dict[str, dict[str, Any]]:
    """Per metric both points have: A, B, A − B and the paired bootstrap interval."""
    drawn_a = resampled_metrics(a.metrics, a.reference, resamples=resamples, seed=seed)
    drawn_b = resampled_metrics(b.metrics, b.reference, resamples=resamples, seed=seed)
    out = {}
    for name in sorted(set(drawn_a) & set(drawn_b)):
        value_a, value_b = float(a.metrics[name]), float(b.metrics[name])
        out[name] = {
            "a": value_a,
            "b": value_b,
            "difference": value_a - value_b,
            "interval": percentile_interval(drawn_a[name] - drawn_b[name]),
        }
    return out


def _interpolate(level: float, forget: np.ndarray, utility: np.ndarray) -> np.ndarray:
    """Per resample (rows), the utility at ``level`` along the points (columns) sorted by
    forget value; NaN where the level lies outside the resample's forget range."""
    out = np.full(forget.shape[0], np.nan)
    for r in range(forget.shape[0]):
        order = np.argsort(forget[r], kind="stable")
        xs, ys = forget[r][order], utility[r][order]
        if xs[0] <= level <= xs[-1]:
            out[r] = np.interp(level, xs, ys)
    return out


def _measured_at(level: float, forget: list[float], utility: list[float]) -> float:
    """The measured curve's utility at ``level`` (linear between the points by forget)."""
    order = np.argsort(forget, kind="stable")
    return float(np.interp(level, np.asarray(forget)[order], np.asarray(utility)[order]))


ANCHOR = "firm"  # the merge the others are compared with, where it has a curve


def _anchor_first(merges: list[str]) -> tuple[str, list[str]]:
    """FIRM (else the first merge) and the others, in their order."""
    anchor = ANCHOR if ANCHOR in merges else merges[0]
    return anchor, [m for m in merges if m != anchor]


def gamma_curves(points: list[Point]) -> dict[str, list[Point]]:
    """The points of every merge that has several (a γ curve), by merge, in their order."""
    curves: dict[str, list[Point]] = {}
    for point in points:
        curves.setdefault(point.merge, []).append(point)
    return {merge: members for merge, members in curves.items() if len(members) >= 2}


def _curves_at(
    curves: dict[str, list[Point]],
    forget_metric: str,
    utility_metric: str,
    resamples: int,
    seed: int,
    level: float,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Per merge: its utility at ``level`` on every resample (NaN where the resample's curve
    does not reach it) and on the measured curve."""
    at_level, point_at = {}, {}
    for merge, points in curves.items():
        per_point = [
            resampled_metrics(p.metrics, p.reference, resamples=resamples, seed=seed)
            for p in points
        ]
        for point, values in zip(points, per_point, strict=True):
            for name in (forget_metric, utility_metric):
                if name not in values:
                    raise CompareError(f"{point.source}: no per-question {name} to resample")
        forget = np.stack([v[forget_metric] for v in per_point], axis=1)
        utility = np.stack([v[utility_metric] for v in per_point], axis=1)
        at_level[merge] = _interpolate(level, forget, utility)
        point_at[merge] = _measured_at(
            level,
            [float(p.metrics[forget_metric]) for p in points],
            [float(p.metrics[utility_metric]) for p in points],
        )
    return at_level, point_at


def _common_level(curve_sets: list[dict[str, list[Point]]], forget_metric: str) -> float:
    """The middle of the forget range that every measured curve spans."""
    ranges = [
        [float(p.metrics[forget_metric]) for p in points]
        for curves in curve_sets
        for points in curves.values()
    ]
    low, high = max(min(r) for r in ranges), min(max(r) for r in ranges)
    if low > high:
        raise CompareError(
            f"the curves' {forget_metric} ranges do not overlap: pass --forget-level"
        )
    return (low + high) / 2


def matched_forgetting(
    curves: dict[str, list[Point]],
    forget_metric: str,
    utility_metric: str,
    resamples: int,
    seed: int,
    level: float | None = None,
) -> dict[str, Any]:
    """FIRM's (else the first curve's) utility minus every other curve's at one forget level,
    with the interval over the resamples that reach it on both curves."""
    level = _common_level([curves], forget_metric) if level is None else level
    at_level, point_at = _curves_at(curves, forget_metric, utility_metric, resamples, seed, level)
    anchor, others = _anchor_first(list(curves))
    rows = {}
    for merge in others:
        diff = at_level[anchor] - at_level[merge]
        used = int(np.isfinite(diff).sum())
        rows[merge] = {
            "anchor_utility": point_at[anchor],
            "utility": point_at[merge],
            "difference": point_at[anchor] - point_at[merge],
            "interval": percentile_interval(diff) if used else None,
            "resamples_used": used,
        }
    return {
        "anchor": anchor,
        "forget_metric": forget_metric,
        "utility_metric": utility_metric,
        "forget_level": level,
        "differences": rows,
    }


def matched_forgetting_over_seeds(
    seed_curves: dict[int, dict[str, list[Point]]],
    forget_metric: str,
    utility_metric: str,
    resamples: int,
    seed: int,
    level: float | None = None,
) -> dict[str, Any]:
    """:func:`matched_forgetting` per client-training seed, combined: the mean over seeds of
    the measured difference, its between-seed sd, and the interval of a two-level bootstrap
    (seeds drawn with replacement; per resample the same resample of the questions for every
    seed, the seeds were scored on the same questions)."""
    sets = list(seed_curves.values())
    level = _common_level(sets, forget_metric) if level is None else level
    per_seed = [
        _curves_at(curves, forget_metric, utility_metric, resamples, seed, level) for curves in sets
    ]
    anchor, others = _anchor_first(list(sets[0]))
    rng = np.random.default_rng(seed)
    chosen = rng.integers(0, len(sets), size=(resamples, len(sets)))
    rows = {}
    for merge in others:
        diffs = np.stack([at[anchor] - at[merge] for at, _ in per_seed])  # [seeds, resamples]
        with warnings.catch_warnings():  # a resample whose drawn seeds all miss the level
            warnings.simplefilter("ignore", RuntimeWarning)
            combined = np.nanmean(diffs[chosen, np.arange(resamples)[:, None]], axis=1)
        measured = [at[anchor] - at[merge] for _, at in per_seed]
        used = int(np.isfinite(combined).sum())
        rows[merge] = {
            "difference": float(np.mean(measured)),
            "per_seed": [float(d) for d in measured],
            "sd": float(np.std(measured, ddof=1)) if len(measured) > 1 else 0.0,
            "interval": percentile_interval(combined) if used else None,
            "resamples_used": used,
        }
    return {
        "anchor": anchor,
        "forget_metric": forget_metric,
        "utility_metric": utility_metric,
        "forget_level": level,
        "seeds": list(seed_curves),
        "differences": rows,
    }


def _seed_experiment(folder: Path) -> dict[int, list[Point]] | None:
    """The points of a ``sweep --seeds`` folder by seed (None: not one)."""
    if not (folder / "seeds.json").is_file():
        return None
    seeds = json.loads((folder / "seeds.json").read_text())["seeds"]
    return {int(s): _sweep_points(folder / f"seed-{s}") for s in seeds}


def compare(
    paths: list[Path],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    forget_metric: str = "forget_rouge_l",
    utility_metric: str = "model_utility",
    forget_level: float | None = None,
) -> dict[str, Any]:
    """The comparison of the module docstring, as one JSON-ready dict."""
    experiments = [_seed_experiment(Path(p)) for p in paths]
    if len(paths) == 1 and experiments[0] is not None:
        return _compare_seeds(
            experiments[0], resamples, seed, forget_metric, utility_metric, forget_level
        )
    if len(paths) < 2 and not any((Path(p) / "points").is_dir() for p in paths):
        raise CompareError("give at least two runs (or a sweep folder) to compare")
    points = [point for path in paths for point in load_points(path)]
    check_same_questions(points)
    first = points[0]
    out: dict[str, Any] = {
        "points": [p.label for p in points],
        "resamples": resamples,
        "seed": seed,
        "paired": {p.label: paired_differences(first, p, resamples, seed) for p in points[1:]},
        "reference_point": first.label,
    }
    curves = gamma_curves(points)
    if len(curves) >= 2:
        out["matched_forgetting"] = matched_forgetting(
            curves, forget_metric, utility_metric, resamples, seed, forget_level
        )
    return out


def _compare_seeds(
    experiment: dict[int, list[Point]],
    resamples: int,
    seed: int,
    forget_metric: str,
    utility_metric: str,
    forget_level: float | None,
) -> dict[str, Any]:
    """Matched forgetting of a ``sweep --seeds`` folder, over its seeds."""
    check_same_questions([p for points in experiment.values() for p in points])
    seed_curves = {s: gamma_curves(points) for s, points in experiment.items()}
    for s in experiment:
        if len(seed_curves[s]) < 2:
            raise CompareError(f"seed {s}: fewer than two merges with a γ curve")
    return {
        "points": [p.label for p in next(iter(experiment.values()))],
        "resamples": resamples,
        "seed": seed,
        "paired": {},
        "reference_point": "(seeds)",
        "matched_forgetting": matched_forgetting_over_seeds(
            seed_curves, forget_metric, utility_metric, resamples, seed, forget_level
        ),
    }


def format_comparison(result: dict[str, Any]) -> str:
    """The tables of :func:`compare` as text."""
    lines = [f"A = {result['reference_point']}; 95 % paired bootstrap intervals"]
    for label, metrics in result["paired"].items():
        lines += ["", f"B = {label}", f"{'metric':<24}{'A':>9}{'B':>9}{'A - B':>9}  interval"]
        for name, row in metrics.items():
            low, high = row["interval"]
            mark = "" if low <= 0 <= high else "  *"
            lines.append(
                f"{name:<24}{row['a']:>9.4f}{row['b']:>9.4f}{row['difference']:>+9.4f}"
                f"  [{low:+.4f}, {high:+.4f}]{mark}"
            )
    matched = result.get("matched_forgetting")
    if matched:
        lines += [
            "",
            f"matched forgetting: {matched['utility_metric']} at {matched['forget_metric']} = "
            f"{matched['forget_level']:.4f}, {matched['anchor']} minus each",
        ]
        for merge, row in matched["differences"].items():
            interval = row["interval"]
            shown = "n/a" if interval is None else f"[{interval[0]:+.4f}, {interval[1]:+.4f}]"
            seeds = f", seeds {matched['seeds']}: sd {row['sd']:.4f}" if "seeds" in matched else ""
            lines.append(
                f"  {merge:<12} d = {row['difference']:+.4f} {shown} "
                f"({row['resamples_used']} resamples reach the level{seeds})"
            )
    lines.append("(* : the interval excludes 0)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, results.json, sweeps")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forget-metric", default="forget_rouge_l")
    parser.add_argument("--utility-metric", default="model_utility")
    parser.add_argument("--forget-level", type=float, default=None)
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    try:
        result = compare(
            args.runs,
            resamples=args.resamples,
            seed=args.seed,
            forget_metric=args.forget_metric,
            utility_metric=args.utility_metric,
            forget_level=args.forget_level,
        )
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
        print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
