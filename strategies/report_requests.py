"""report.html's section of a run with a schedule of deletion requests: the sustainability
curve (utility and every request's forget ROUGE-L after each round, against the requests served
so far, with 95 % intervals) and the per-round table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

from strategies.report_images import img, png  # noqa: E402


def requests_section(results: Mapping[str, Any]) -> str:
    """The section, or "" for a run without a schedule (or not evaluated)."""
    requests: Sequence[Mapping[str, Any]] = results.get("requests") or []
    rounds: Sequence[Mapping[str, Any]] = results.get("rounds") or []
    if not requests or not rounds:
        return ""
    head = "".join(
        f"<th>request {i + 1}<br><span class='note'>round {q['round']}, client {q['client']}"
        "</span></th>"
        for i, q in enumerate(requests)
    )
    rows = []
    for r in rounds:
        cells = []
        for q in requests:
            value = q["metrics_by_round"].get(str(r["round"]), {}).get("forget_rouge_l")
            ci = q["metrics_ci_by_round"].get(str(r["round"]), {}).get("forget_rouge_l")
            cells.append(_value(value, ci))
        rows.append(
            f"<tr><td>{r['round']}</td><td>{r['requests_served']}</td>"
            f"<td>{_value(r.get('model_utility'))}</td>"
            f"<td>{_value(r.get('retain_rouge_l'))}</td>" + "".join(cells) + "</tr>"
        )
    if all("reference" in q for q in requests):
        reference = "".join(
            "<td>"
            + _value(q["reference"].get("forget_rouge_l"), q["reference_ci"].get("forget_rouge_l"))
            + "</td>"
            for q in requests
        )
        rows.append(f"<tr><td>reference</td><td></td><td></td><td></td>{reference}</tr>")
    plot = sustainability_plot(requests, rounds)
    return (
        "<h2>Deletion requests</h2>"
        + (img(plot, "utility and forget ROUGE-L per request vs requests served") if plot else "")
        + "<table><tr><th>round</th><th>served</th><th>model utility</th>"
        + f"<th>retain ROUGE-L</th>{head}</tr>"
        + "".join(rows)
        + "</table><p class='note'>Request columns: forget ROUGE-L on that request's questions "
        "after each round [95 % bootstrap interval]; a request is served in its round.</p>"
    )


def sustainability_plot(
    requests: Sequence[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]]
) -> bytes | None:
    """Model utility, retain ROUGE-L and each request's forget ROUGE-L (error bars: its
    interval) against the requests served after each round."""
    served = [r["requests_served"] for r in rounds]
    if not served:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot(served, [_nan(r.get("model_utility")) for r in rounds], "k-o", label="model utility")
    ax.plot(served, [_nan(r.get("retain_rouge_l")) for r in rounds], "k--s", label="retain ROUGE-L")
    for i, q in enumerate(requests):
        values = [q["metrics_by_round"].get(str(r["round"]), {}) for r in rounds]
        cis = [q["metrics_ci_by_round"].get(str(r["round"]), {}) for r in rounds]
        ys = [_nan(v.get("forget_rouge_l")) for v in values]
        low = [
            max(0.0, y - c["forget_rouge_l"][0]) if "forget_rouge_l" in c else 0.0
            for y, c in zip(ys, cis, strict=True)
        ]
        high = [
            max(0.0, c["forget_rouge_l"][1] - y) if "forget_rouge_l" in c else 0.0
            for y, c in zip(ys, cis, strict=True)
        ]
        ax.errorbar(
            [s + 0.04 * (i + 1) for s in served],
            ys,
            yerr=[low, high],
            fmt=":^",
            capsize=2,
            label=f"forget ROUGE-L, request {i + 1} (round {q['round']})",
        )
    ax.set_xlabel("requests served")
    ax.set_xticks(sorted(set(served)))
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png(fig)


def _value(value: Any, interval: Sequence[float] | None = None) -> str:
    if not isinstance(value, int | float):
        return ""
    text = f"{value:.3f}"
    if interval:
        text += f" <span class='note'>[{interval[0]:.3f}, {interval[1]:.3f}]</span>"
    return text


def _nan(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")
