"""Tables and plots of a γ sweep: the forgetting–utility frontier, matched forgetting."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def matched_forgetting(
    points: Sequence[dict[str, Any]],
    *,
    anchor: str = "firm",
    forget_metric: str = "forget_rouge_l",
    utility_metric: str = "model_utility",
) -> list[dict[str, Any]]:
    """For every ``anchor`` point, the nearest point of each other merge by forget metric.

    ``utility_diff`` = anchor utility − baseline utility (positive: the anchor keeps more at
    about the same forgetting); ``forget_gap`` = |difference of the forget metric|.
    """
    rows = []
    points = [
        p
        for p in points
        if p["metrics"].get(forget_metric) is not None
        and p["metrics"].get(utility_metric) is not None
    ]
    anchors = [p for p in points if p["strategy"] == anchor]
    others = sorted({p["strategy"] for p in points} - {anchor})
    for a in anchors:
        for name in others:
            candidates = [p for p in points if p["strategy"] == name]
            best = min(
                candidates,
                key=lambda p: (
                    abs(p["metrics"][forget_metric] - a["metrics"][forget_metric]),
                    p["gamma"],
                ),
            )
            rows.append(
                {
                    "anchor": anchor,
                    "anchor_gamma": a["gamma"],
                    "baseline": name,
                    "baseline_gamma": best["gamma"],
                    "forget_gap": abs(best["metrics"][forget_metric] - a["metrics"][forget_metric]),
                    "anchor_utility": a["metrics"][utility_metric],
                    "baseline_utility": best["metrics"][utility_metric],
                    "utility_diff": a["metrics"][utility_metric] - best["metrics"][utility_metric],
                    "retain_rouge_diff": (
                        a["metrics"]["retain_rouge_l"] - best["metrics"]["retain_rouge_l"]
                        if "retain_rouge_l" in a["metrics"]
                        else None
                    ),
                }
            )
    return rows


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{value:+.3f}"


def summary_markdown(summary: dict[str, Any]) -> str:
    """Markdown tables: every sweep point, then the matched-forgetting comparison."""
    cols = tuple(
        summary.get("metric_names")
        or (
            "forget_rouge_l",
            "forget_exact_match",
            "forget_quality",
            "model_utility",
            "retain_rouge_l",
            "real_authors_rouge_l",
            "world_facts_rouge_l",
        )
    )
    lines = [
        "| merge | γ | ‖Δ‖ | " + " | ".join(cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    for name, row in (("original", summary["before"]), ("reference", summary["reference"])):
        if row:
            lines.append(f"| {name} | – | – | " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    for p in summary["points"]:
        lines.append(
            f"| {p['strategy']} | {p['gamma']:g} | {_fmt(p['norm_final'])} | "
            + " | ".join(_fmt(p["metrics"].get(c)) for c in cols)
            + " |"
        )
    matched = summary.get("matched_forgetting") or []
    if matched:
        lines += [
            "",
            "Matched forgetting (nearest baseline point by "
            f"{summary.get('forget_metric', 'forget_rouge_l')}):",
            "",
            "| FIRM γ | baseline | its γ | forget gap | utility FIRM | utility baseline "
            "| Δ utility | Δ retain ROUGE-L |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in matched:
            lines.append(
                f"| {r['anchor_gamma']:g} | {r['baseline']} | {r['baseline_gamma']:g} | "
                f"{r['forget_gap']:.3f} | {r['anchor_utility']:.3f} | "
                f"{r['baseline_utility']:.3f} | {r['utility_diff']:+.3f} | "
                f"{_signed(r['retain_rouge_diff'])} |"
            )
    return "\n".join(lines) + "\n"


def plot_frontier(summary: dict[str, Any], path: Path) -> Path:
    """Two panels: the forget metric against the utility metric, and against a second
    retained-knowledge metric (TOFU: retain ROUGE-L)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    forget = summary.get("forget_metric", "forget_rouge_l")
    utility = summary.get("utility_metric", "model_utility")
    names = summary.get("metric_names") or ["retain_rouge_l"]
    second = "retain_rouge_l" if "retain_rouge_l" in names else names[-1]
    if second in (forget, utility):
        second = next((n for n in names if n not in (forget, utility)), utility)
    panels = ((forget, utility), (forget, second))
    strategies = sorted({p["strategy"] for p in summary["points"]})
    for ax, (x_key, y_key) in zip(axes, panels, strict=True):
        for name in strategies:
            pts = sorted(
                (p for p in summary["points"] if p["strategy"] == name), key=lambda p: p["gamma"]
            )
            xs = [p["metrics"][x_key] for p in pts]
            ys = [p["metrics"][y_key] for p in pts]
            ax.plot(xs, ys, marker="o", label=name)
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(
                    f"{p['gamma']:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
        for label, row, style in (
            ("original", summary["before"], "k*"),
            ("reference", summary["reference"], "g^"),
        ):
            if row:
                ax.plot([row[x_key]], [row[y_key]], style, markersize=11, label=label)
        ax.set_xlabel(f"{x_key} (lower = more forgetting)")
        ax.set_ylabel(f"{y_key} (higher = better)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Forgetting–utility frontier over the γ sweep (labels: γ)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
