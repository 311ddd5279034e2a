"""Forget / utility of every forget objective on one scenario: one real Flower run each.

    python -m simulations.objectives_table [--objectives ga,npo,...] [--run-config "..."]

Every objective trains the same forget clients (same shards, seeds, steps, learning rate and
merge) so rows differ only in the objective. Writes ``objectives.json`` and
``objectives.md`` (a table of the scenario's summary metrics, before and after, per objective)
into the output folder; each run's own ``results.json`` stays in ``runs/<objective>/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from fedunlearn.objectives import OBJECTIVES
from fedunlearn.scenarios import get_scenario
from simulations import run_local


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else ("–" if value is None else str(value))


def objectives_markdown(summary: dict[str, Any]) -> str:
    """One row per objective (plus the original and the reference model)."""
    cols = summary.get("metrics", [])
    lines = [
        "| objective | " + " | ".join(cols) + " | ‖Δ‖ | forget-client s |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for name in ("before", "reference"):
        row = summary.get(name)
        if row:
            lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c)) for c in cols) + " | – | – |")
    for row in summary["rows"]:
        if "error" in row:
            lines.append(f"| {row['objective']} | not run: {row['error']} |")
            continue
        lines.append(
            f"| {row['objective']} | "
            + " | ".join(_fmt(row["after"].get(c)) for c in cols)
            + f" | {_fmt(row['update_norm'])} | {_fmt(row['forget_client_seconds'])} |"
        )
    return "\n".join(lines) + "\n"


def study(objectives: list[str], run_config: str, output_dir: Path) -> dict[str, Any]:
    """Run the scenario once per objective and collect the summary metrics."""
    output_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"run_config": run_config, "rows": rows}
    for objective in objectives:
        config = f"{run_config} objective.name='{objective}'".strip()
        try:
            run_local.run_settings(run_local.parse_config_pairs(config))  # refused up front?
            path = run_local.run(run_config=config, output_dir=output_dir / "runs" / objective)
        except (ValueError, RuntimeError) as err:
            rows.append({"objective": objective, "error": str(err)})
            continue
        results = json.loads(path.read_text())
        scenario = get_scenario(results["config"]["scenario.name"])
        metrics = list(scenario.summary_metrics)
        forget = [c for c in results["clients"] if c.get("role") == "forget"]
        summary.update(
            scenario=scenario.name,
            metrics=metrics,
            before={k: results["metrics"]["before"].get(k) for k in metrics},
            reference=(
                {k: results["metrics"]["reference"].get(k) for k in metrics}
                if "reference" in results["metrics"]
                else None
            ),
        )
        rows.append(
            {
                "objective": objective,
                "after": {k: results["metrics"]["after"].get(k) for k in metrics},
                "update_norm": results["merge"].get("norm_final"),
                "forget_client_seconds": max((c.get("seconds", 0.0) for c in forget), default=0),
                "results": str(path),
            }
        )
        (output_dir / "objectives.json").write_text(json.dumps(summary, indent=2))
    (output_dir / "objectives.md").write_text(objectives_markdown(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--objectives",
        default=",".join(sorted(set(OBJECTIVES) - {"nll"})),
        help="comma-separated objective names (default: every forget objective)",
    )
    parser.add_argument("--run-config", default="", help="run-config overrides")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("flwr").propagate = False
    objectives = [o for o in args.objectives.split(",") if o]
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown:
        parser.error(f"unknown objectives {unknown}; available: {sorted(OBJECTIVES)}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = args.output_dir or run_local.REPO_ROOT / "outputs" / f"objectives-{stamp}"
    summary = study(objectives, args.run_config, output_dir.resolve())
    print(objectives_markdown(summary))
    print(f"written to {output_dir.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
