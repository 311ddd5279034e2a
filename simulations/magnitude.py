"""Magnitude explosion (FIRM paper, Table 9): 1–4 heterogeneous forget domains.

One real Flower simulation runs four forget clients, each the only client of its own forget
domain (a different pair of fictitious authors), plus one retain client, and saves their
uploads. For n = 1..4 the first n forget uploads and the retain upload are merged with SUM,
FULM and FIRM at a FIXED γ per method; the table reports the norm of the merged update, the
forgetting of the n targeted domains and the utility. SUM and FULM add one centroid per
domain, so their update grows with n; FIRM's Fisher-normalised average does not.

    python -m simulations.magnitude --gammas "sum=2 fulm=2 firm=8"
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedunlearn.merging import get_merge  # noqa: E402
from simulations import run_local  # noqa: E402
from simulations.sweep import run_and_load_uploads  # noqa: E402
from strategies.results import json_safe  # noqa: E402

SCENARIO = (
    "scenario.forget-percent=2.0 scenario.num-forget-clients=4 scenario.num-forget-domains=4 "
    "scenario.num-retain-clients=1"
)
DEFAULT_GAMMAS = {"sum": 2.0, "fulm": 2.0, "firm": 8.0}


def study(run_config: str, gammas: dict[str, float], output_dir: Path) -> dict[str, Any]:
    output_dir.mkdir(parents=True, exist_ok=True)
    flower = run_and_load_uploads(f"{SCENARIO} {run_config}".strip(), output_dir / "flower-run")
    if flower.run_model.scenario.name != "tofu":
        raise ValueError("the magnitude study is defined on the tofu scenario (author domains)")
    position = {str(a["node_id"]): i for i, a in enumerate(flower.results["assignments"])}
    flower.updates.sort(key=lambda u: position[str(u.node_id)])  # domain 0, 1, 2, 3
    forget = [u for u in flower.updates if u.role == "forget"]
    retain = [u for u in flower.updates if u.role == "retain"]
    records = flower.run_model.scenario.records()
    indices = {str(a["node_id"]): a["indices"] for a in flower.results["assignments"]}
    rows = []
    for n in range(1, len(forget) + 1):
        targeted = [records[i] for u in forget[:n] for i in indices[str(u.node_id)]]
        splits = {**flower.run_model.scenario.evaluation_splits(), "forget": targeted}
        for method, gamma in gammas.items():
            result = get_merge(method)(forget[:n] + retain, gamma=gamma)
            metrics = flower.evaluate(f"n={n} {method}", result.delta, splits, with_reference=False)
            rows.append(
                {
                    "n_domains": n,
                    "method": method,
                    "gamma": gamma,
                    "norm": result.report["norm_final"],
                    "forget_rouge_l": metrics["forget_rouge_l"],
                    "forget_exact_match": metrics["forget_exact_match"],
                    "model_utility": metrics["model_utility"],
                    "retain_rouge_l": metrics["retain_rouge_l"],
                }
            )
    summary = {
        "flower_run": str(flower.results_path),
        "gammas": gammas,
        "before": flower.results["metrics"]["before"],
        "rows": rows,
    }
    (output_dir / "magnitude.json").write_text(json.dumps(json_safe(summary), indent=2))
    (output_dir / "magnitude.md").write_text(markdown(rows))
    plot(rows, output_dir / "magnitude.png")
    return summary


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| domains | method | γ | ‖Δ‖ | forget ROUGE-L | forget EM | utility | retain ROUGE-L |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n_domains']} | {r['method']} | {r['gamma']:g} | {r['norm']:.3f} | "
            f"{r['forget_rouge_l']:.3f} | {r['forget_exact_match']:.3f} | "
            f"{r['model_utility']:.3f} | {r['retain_rouge_l']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in sorted({r["method"] for r in rows}):
        pts = [r for r in rows if r["method"] == method]
        ns = [r["n_domains"] for r in pts]
        axes[0].plot(ns, [r["norm"] for r in pts], marker="o", label=method)
        axes[1].plot(ns, [r["model_utility"] for r in pts], marker="o", label=method)
    axes[0].set_ylabel("‖Δ‖ of the merged update")
    axes[1].set_ylabel("model utility")
    for ax in axes:
        ax.set_xlabel("number of forget domains")
        ax.set_xticks(sorted({r["n_domains"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Magnitude explosion: fixed γ per method")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="")
    parser.add_argument("--gammas", default="", help='e.g. "sum=2 fulm=2 firm=8"')
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("flwr").propagate = False  # one copy of each log line
    gammas = dict(DEFAULT_GAMMAS)
    for part in args.gammas.split():
        name, _, value = part.partition("=")
        gammas[name] = float(value)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (args.output_dir or run_local.REPO_ROOT / "outputs" / f"magnitude-{stamp}").resolve()
    print(markdown(study(args.run_config, gammas, out)["rows"]))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
