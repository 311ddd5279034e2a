"""DP2Unlearning on tofu (paper Table 3 style): methods × forget splits, then an ε sweep.

    python -m simulations.dp2u_study [--forget 1,5,10] [--methods ...] [--epsilons ...]
        [--dp-lr-by-epsilon 1:0.05,10:0.2,100:0.4]

Every cell is one real Flower simulation with ``pipeline=dp2u``; stages shared between cells
(the DP base per ε, the deployed models, RFS-R per forget split) are trained once and cached
by the server. Writes ``dp2u_study.json``, ``dp2u_study.md`` and ``dp2u_study.png`` (model
utility against forget quality per split, and both against ε) into the output folder; every
run's ``results.json`` stays under ``runs/``. Forget quality is the KS p-value against
RFS-R's forget truth ratios (RFS-R itself: 1 by definition); the distances are those of the
unlearned model's forget truth-ratio histogram to RFS-R's; the cost columns are stage C's (or
the unlearning round's) epochs and client seconds as ratios to RFS-R's, measured in the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from simulations import run_local  # noqa: E402

METHODS = ("rfs-r", "ga", "graddiff", "kl", "idk", "dp2u-sgd", "dp2u-mlm")
DP_METHODS = ("dp2u-sgd", "dp2u-mlm")


def _cell(run_config: str, output_dir: Path) -> dict[str, Any]:
    path = output_dir / "results.json"
    if not path.is_file():
        path = run_local.run(run_config=run_config, output_dir=output_dir)
    results = json.loads(path.read_text())
    after, dp = results["metrics"]["after"], results["dp2u"]
    privacy = dp["privacy"]
    spent = privacy.get("epsilon_spent_per_client") or [None]
    return {
        "model_utility": after["model_utility"],
        # RFS-R is the reference itself: its KS p-value against itself is 1
        "forget_quality": 1.0 if dp["method"] == "rfs-r" else after["forget_quality"],
        "forget_rouge_l": after["forget_rouge_l"],
        "forget_truth_ratio": after["forget_truth_ratio"],
        "deployed_model_utility": results["metrics"]["before"]["model_utility"],
        "deployed_forget_rouge_l": results["metrics"]["before"]["forget_rouge_l"],
        "base_model_utility": results["metrics"].get("base", {}).get("model_utility"),
        "dp_lr": results["config"].get("dp2u.dp-lr") if dp["method"] == "dp2u-sgd" else None,
        "epsilon_spent_max": max((e for e in spent if e is not None), default=None),
        **{k: v for k, v in dp["forget_truth_ratio_distances"].items() if k != "ks_pvalue"},
        **dp["cost_vs_rfs_r"],
        "trained_on_retained_only": all(c["trained_on_retained_only"] for c in dp["data_check"]),
        "results": str(path),
    }


def _lr_override(method: str, eps: float, dp_lr_by_epsilon: dict[float, float]) -> tuple[str, str]:
    """(run-config addition, folder suffix) of the DP-SGD learning rate tuned for ``eps``."""
    if method != "dp2u-sgd" or eps not in dp_lr_by_epsilon:
        return "", ""
    lr = dp_lr_by_epsilon[eps]
    return f" dp2u.dp-lr={lr}", f"-lr{lr:g}"


def study(
    output_dir: Path,
    *,
    forget: tuple[float, ...] = (1.0, 5.0, 10.0),
    methods: tuple[str, ...] = METHODS,
    epsilons: tuple[float, ...] = (0.5, 1.0, 10.0, 25.0, 100.0),
    sweep_forget: float = 5.0,
    run_config: str = "",
    dp_lr_by_epsilon: dict[float, float] | None = None,
) -> dict[str, Any]:
    """The method table at ε = 1 for every forget split, then the ε sweep of the DP methods."""
    output_dir.mkdir(parents=True, exist_ok=True)
    base = f"pipeline='dp2u' {run_config}".strip()
    lrs = dp_lr_by_epsilon or {}
    table = []
    for percent in forget:
        for method in methods:
            extra, suffix = _lr_override(method, 1.0, lrs)
            name = f"forget{percent:g}-{method}{suffix}"
            config = (
                f"{base} scenario.forget-percent={percent} dp2u.method='{method}' "
                f"dp2u.epsilon=1.0{extra}"
            )
            cell = _cell(config, output_dir / "runs" / name)
            table.append({"forget_percent": percent, "method": method, **cell})
    sweep = []
    for method in (m for m in methods if m in DP_METHODS):
        for eps in epsilons:
            extra, suffix = _lr_override(method, eps, lrs)
            name = f"forget{sweep_forget:g}-{method}-eps{eps:g}{suffix}"
            config = (
                f"{base} scenario.forget-percent={sweep_forget} dp2u.method='{method}' "
                f"dp2u.epsilon={eps}{extra}"
            )
            cell = _cell(config, output_dir / "runs" / name)
            sweep.append({"method": method, "epsilon": eps, **cell})
    summary = {"run_config": run_config, "table": table, "sweep": sweep}
    (output_dir / "dp2u_study.json").write_text(json.dumps(summary, indent=2))
    (output_dir / "dp2u_study.md").write_text(study_markdown(summary))
    plot_study(summary, output_dir / "dp2u_study.png")
    return summary


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.3f}"
    return "–" if value is None else str(value)


COLUMNS = (
    "model_utility",
    "base_model_utility",
    "forget_quality",
    "forget_rouge_l",
    "js_divergence",
    "wasserstein",
    "entropy_difference",
    "epsilon_spent_max",
    "dp_lr",
    "epochs_ratio",
    "client_seconds_ratio",
    "trained_on_retained_only",
)


def study_markdown(summary: dict[str, Any]) -> str:
    """The method table per forget split, then the ε sweep."""
    head = " | ".join(COLUMNS)
    lines = [f"| forget % | method | {head} |", "|---|---|" + "---|" * len(COLUMNS)]
    for r in summary["table"]:
        cells = " | ".join(_fmt(r.get(k)) for k in COLUMNS)
        lines.append(f"| {r['forget_percent']:g} | {r['method']} | {cells} |")
    if summary["sweep"]:
        lines += ["", f"| method | ε | {head} |", "|---|---|" + "---|" * len(COLUMNS)]
        for r in summary["sweep"]:
            cells = " | ".join(_fmt(r.get(k)) for k in COLUMNS)
            lines.append(f"| {r['method']} | {r['epsilon']:g} | {cells} |")
    return "\n".join(lines) + "\n"


def plot_study(summary: dict[str, Any], path: Path) -> Path:
    """Left: model utility vs forget quality (log) per method and split; right: the ε sweep."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    markers = {1.0: "o", 5.0: "s", 10.0: "^"}
    for r in summary["table"]:
        fq = max(float(r["forget_quality"] or 0.0), 1e-12)
        ax.scatter(fq, r["model_utility"], marker=markers.get(r["forget_percent"], "x"))
        ax.annotate(f"{r['method']} {r['forget_percent']:g}%", (fq, r["model_utility"]), fontsize=6)
    ax.set_xscale("log")
    ax.axvline(0.05, color="k", lw=0.7, ls="--")
    ax.set_xlabel("forget quality (KS p-value vs RFS-R, log)")
    ax.set_ylabel("model utility")
    ax.set_title("methods at ε = 1")
    ax.grid(alpha=0.3)
    ax = axes[1]
    for method in dict.fromkeys(r["method"] for r in summary["sweep"]):
        rows = sorted(
            (r for r in summary["sweep"] if r["method"] == method), key=lambda r: r["epsilon"]
        )
        xs = [r["epsilon"] for r in rows]
        ax.plot(xs, [r["model_utility"] for r in rows], marker="o", label=f"{method} utility")
        ax.plot(
            xs,
            [max(float(r["forget_quality"] or 0.0), 1e-12) for r in rows],
            marker="s",
            ls="--",
            label=f"{method} forget quality",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ε")
    ax.set_title("ε sweep")
    ax.grid(alpha=0.3)
    if summary["sweep"]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _lr_map(text: str) -> dict[float, float]:
    """``"1:0.05,10:0.2"`` → {1.0: 0.05, 10.0: 0.2}."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        out = {float(eps): float(lr) for eps, lr in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ε:lr pairs like 1:0.05,10:0.2, got {text!r}"
        ) from None
    if any(not (math.isfinite(v) and v > 0) for kv in out.items() for v in kv):
        raise argparse.ArgumentTypeError(f"ε and lr must be positive, got {text!r}")
    return out


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forget", type=_floats, default=(1.0, 5.0, 10.0))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--epsilons", type=_floats, default=(0.5, 1.0, 10.0, 25.0, 100.0))
    parser.add_argument(
        "--sweep-forget", type=float, default=5.0, help="forget %% of the ε sweep (1 %% = 10 QA)"
    )
    parser.add_argument("--run-config", default="", help="extra run-config overrides")
    parser.add_argument(
        "--dp-lr-by-epsilon", type=_lr_map, default=None, help="ε:dp2u.dp-lr pairs (dp2u-sgd)"
    )
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    logging.getLogger("flwr").propagate = False
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = (args.output_dir or run_local.REPO_ROOT / "outputs" / f"dp2u-{stamp}").resolve()
    summary = study(
        output_dir,
        forget=args.forget,
        methods=methods,
        epsilons=args.epsilons,
        sweep_forget=args.sweep_forget,
        run_config=args.run_config,
        dp_lr_by_epsilon=args.dp_lr_by_epsilon,
    )
    print(study_markdown(summary))
    print(f"written to {output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
