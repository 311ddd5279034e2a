"""``report.html``: one self-contained page per run, next to ``results.json``.

What it shows, all read from the run's results (the same dictionary ``results.json`` holds):

* the run: scenario, strategy, model, rounds, the merge's parameters, wall time per phase;
* before / after / reference bars for the scenario's summary metrics (those in [0, 1]; the
  others, e.g. PrivLeak in per cent, are in the table under the plot);
* one row per client: role, domain, objective, bytes up (task vector, Fisher, metadata) and
  down, what the dense upload would have been, seconds, task-vector norm, and the reason a
  client was excluded;
* merge diagnostics per weight tensor: norms before and after the projection, the damage per
  retain client before and after, the multipliers, the support; FULM's clusters; and a plot
  of the damages;
* sample generations before and after unlearning.

Plots are PNGs embedded as base64 (matplotlib, Agg backend): the file needs nothing else.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

from fedunlearn.files import write_file_atomic

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

from strategies.report_images import img, png  # noqa: E402
from strategies.report_requests import requests_section  # noqa: E402

MODELS = ("before", "after", "reference")
MODEL_LABELS = {"before": "original", "after": "unlearned", "reference": "reference"}
COLORS = {"before": "#6c757d", "after": "#d9480f", "reference": "#2b8a3e"}
#: Samples shown per split and model.
SAMPLES_SHOWN = 3

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.88em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
.bad { color: #c92a2a; } .note { color: #555; font-size: 0.9em; }
img { max-width: 100%; }
"""


def write_report(results: Mapping[str, Any], names: Sequence[str], path: Path) -> Path:
    """Render the run's page and write it to ``path`` atomically; returns ``path``.

    ``names`` are the scenario's summary metrics (plotted and tabled first).
    """
    write_file_atomic(path, render_report(results, names).encode("utf-8"))
    return path


def render_report(results: Mapping[str, Any], names: Sequence[str]) -> str:
    """The page as one HTML string (no external resources)."""
    config = results.get("config", {})
    title = f"fedunlearn run: {config.get('scenario.name', '?')} / {_strategy(config)}"
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{_e(title)}</h1>",
        _run_section(results),
        _metrics_section(results.get("metrics") or {}, names, results.get("metrics_ci") or {}),
        _clients_section(results.get("clients") or []),
        _merge_section(results.get("merge") or {}),
        _samples_section(results.get("metrics") or {}),
        requests_section(results),
        "</body></html>",
    ]
    return "\n".join(parts)


def _strategy(config: Mapping[str, Any]) -> str:
    """``dp2u``, ``mpu + <merge>`` or the merge, from a results.json ``config``."""
    if config.get("pipeline") == "dp2u":
        return "dp2u"
    merge = str(config.get("merge", "?"))
    return f"mpu + {merge}" if config.get("wrapper") == "mpu" else merge


# ------------------------------------------------------------------------------------ sections
def _run_section(results: Mapping[str, Any]) -> str:
    config = results.get("config", {})
    keys = (
        "scenario.name",
        "pipeline",
        "merge",
        "wrapper",
        "model.name",
        "num-rounds",
        "gamma",
        "firm.alpha",
        "firm.epsilon",
        "seed",
    )
    rows = [(k, config[k]) for k in keys if k in config]
    seconds = results.get("seconds") or {}
    rows += [(f"seconds: {k}", v) for k, v in seconds.items() if k != "server_peak_rss_bytes"]
    if "server_peak_rss_bytes" in seconds:
        rows.append(("server peak RSS", _bytes(seconds["server_peak_rss_bytes"])))
    body = "".join(f"<tr><th class='text'>{_e(k)}</th><td>{_cell(v)}</td></tr>" for k, v in rows)
    return f"<h2>Run</h2><table>{body}</table>"


def _metrics_section(
    metrics: Mapping[str, Mapping[str, Any]],
    names: Sequence[str],
    intervals: Mapping[str, Mapping[str, Sequence[float]]],
) -> str:
    if not metrics:
        return "<h2>Metrics</h2><p class='note'>Not evaluated (evaluate=false).</p>"
    models = [m for m in MODELS if m in metrics]
    listed = [n for n in names if any(_number(metrics[m].get(n)) is not None for m in models)]
    head = "".join(f"<th>{_e(MODEL_LABELS[m])}</th>" for m in models)

    def cell(model: str, name: str) -> str:
        interval = intervals.get(model, {}).get(name)
        shown = _cell(metrics[model].get(name))
        if interval is None or not shown:
            return shown
        return f"{shown} <span class='note'>[{interval[0]:.3g}, {interval[1]:.3g}]</span>"

    rows = "".join(
        f"<tr><td class='text'>{_e(n)}</td>"
        + "".join(f"<td>{cell(m, n)}</td>" for m in models)
        + "</tr>"
        for n in listed
    )
    plot = _metrics_plot(metrics, models, listed, intervals)
    note = (
        "<p class='note'>Brackets and error bars: 95 % percentile-bootstrap intervals over the "
        "evaluated questions (results.json <code>metrics_ci</code>, per-question values in "
        "scores.json).</p>"
        if intervals
        else ""
    )
    return (
        "<h2>Metrics</h2>"
        + (img(plot, "before / after / reference per metric") if plot else "")
        + f"<table><tr><th class='text'>metric</th>{head}</tr>{rows}</table>"
        + note
    )


def _clients_section(clients: Sequence[Mapping[str, Any]]) -> str:
    if not clients:
        return ""
    columns = [
        ("node", lambda c: c.get("node_id")),
        ("role", lambda c: c.get("role")),
        ("domain", lambda c: c.get("domain")),
        ("objective", lambda c: c.get("objective")),
        ("task vector", lambda c: _bytes(c.get("bytes_task_vector"))),
        ("Fisher", lambda c: _bytes(c.get("bytes_fisher"))),
        ("metadata", lambda c: _bytes(c.get("bytes_metadata"))),
        ("dense upload", lambda c: _bytes(c.get("bytes_dense"))),
        ("received", lambda c: _bytes(c.get("bytes_received"))),
        ("seconds", lambda c: c.get("seconds")),
        ("‖Δθ‖", lambda c: c.get("task_vector_norm")),
        ("loss first → last", _losses),
        ("excluded", lambda c: c.get("excluded")),
    ]
    head = "".join(f"<th class='text'>{_e(name)}</th>" for name, _ in columns)
    rows = []
    for c in clients:
        cls = " class='bad'" if c.get("excluded") else ""
        cells = "".join(f"<td>{_cell(get(c))}</td>" for _, get in columns)
        rows.append(f"<tr{cls}>{cells}</tr>")
    return f"<h2>Clients</h2><table><tr>{head}</tr>{''.join(rows)}</table>"


def _merge_section(merge: Mapping[str, Any]) -> str:
    if not merge:
        return ""
    params = merge.get("params") or {}
    summary = ", ".join(f"{k}={'none' if v is None else _cell(v)}" for k, v in params.items())
    lines = [f"<h2>Merge: {_e(merge.get('method', '?'))}</h2>", f"<p>{summary}</p>"]
    for key in ("norm_base", "norm_final", "update_ratio", "applied_relative_error", "seconds"):
        if key in merge:
            lines.append(f"<p>{_e(key)}: {_cell(merge[key])}</p>")
    if merge.get("clusters"):
        clusters = "".join(f"<li>{_cell(c)}</li>" for c in merge["clusters"])
        lines.append(f"<p>clusters:</p><ul>{clusters}</ul>")
    tensors = merge.get("tensors") or {}
    if tensors:
        plot = _damage_plot(tensors)
        if plot:
            lines.append(img(plot, "damage per retain client and tensor, before / after"))
        lines.append(_tensor_table(tensors))
    return "\n".join(lines)


def _samples_section(metrics: Mapping[str, Mapping[str, Any]]) -> str:
    before = (metrics.get("before") or {}).get("samples") or {}
    after = (metrics.get("after") or {}).get("samples") or {}
    if not before and not after:
        return ""
    out = ["<h2>Sample generations</h2>"]
    for split in dict.fromkeys([*before, *after]):
        pairs = zip(_as_list(before.get(split)), _as_list(after.get(split)), strict=False)
        rows = []
        for b, a in list(pairs)[:SAMPLES_SHOWN]:
            prompt = b.get("question") or b.get("prompt") or ""
            rows.append(
                f"<tr><td class='text'>{_e(prompt)}</td><td class='text'>{_e(_answer(b))}</td>"
                f"<td class='text'>{_e(_generated(b))}</td>"
                f"<td class='text'>{_e(_generated(a))}</td></tr>"
            )
        out.append(
            f"<h3>{_e(split)}</h3><table><tr><th class='text'>prompt</th>"
            "<th class='text'>answer</th><th class='text'>original</th>"
            f"<th class='text'>unlearned</th></tr>{''.join(rows)}</table>"
        )
    return "\n".join(out)


# -------------------------------------------------------------------------------------- tables
def _tensor_table(tensors: Mapping[str, Mapping[str, Any]]) -> str:
    fields = ("norm_base", "norm_final", "norm", "support_fraction", "sign_agreement")
    shown = [f for f in fields if any(f in t for t in tensors.values())]
    retain = sorted({k for t in tensors.values() for k in (t.get("damage_before") or {})})
    head = "".join(f"<th>{_e(f)}</th>" for f in shown)
    head += "".join(
        f"<th>damage {_e(r)} before → after</th><th>multiplier {_e(r)}</th>" for r in retain
    )
    rows = []
    for name, t in tensors.items():
        cells = "".join(f"<td>{_cell(t.get(f))}</td>" for f in shown)
        for r in retain:
            before = (t.get("damage_before") or {}).get(r)
            after = (t.get("damage_after") or {}).get(r)
            mult = (t.get("multipliers") or {}).get(r)
            cells += f"<td>{_cell(before)} → {_cell(after)}</td><td>{_cell(mult)}</td>"
        rows.append(f"<tr><td class='text'>{_e(name)}</td>{cells}</tr>")
    return f"<table><tr><th class='text'>tensor</th>{head}</tr>{''.join(rows)}</table>"


# ---------------------------------------------------------------------------------------- plots
def _metrics_plot(
    metrics: Mapping[str, Mapping[str, Any]],
    models: Sequence[str],
    names: Sequence[str],
    intervals: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
) -> bytes | None:
    """Grouped bars of the metrics whose values all lie in [0, 1], with their 95 % intervals
    as error bars where ``intervals`` has them."""
    intervals = intervals or {}
    unit = [
        n
        for n in names
        if all((v := _number(metrics[m].get(n))) is None or 0.0 <= v <= 1.0 for m in models)
    ]
    if not unit:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(unit) + 2), 3.6))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        values = [_number(metrics[m].get(n)) for n in unit]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(unit))]
        shown = [(x, v, n) for x, v, n in zip(xs, values, unit, strict=True) if v is not None]
        ax.bar(
            [x for x, _, _ in shown],
            [v for _, v, _ in shown],
            width,
            label=MODEL_LABELS[m],
            color=COLORS[m],
        )
        bars = [(x, v, ci) for x, v, n in shown if (ci := intervals.get(m, {}).get(n)) is not None]
        if bars:
            ax.errorbar(
                [x for x, _, _ in bars],
                [v for _, v, _ in bars],
                yerr=[
                    [max(0.0, v - ci[0]) for _, v, ci in bars],
                    [max(0.0, ci[1] - v) for _, v, ci in bars],
                ],
                fmt="none",
                ecolor="#222",
                capsize=2,
                linewidth=0.8,
            )
    ax.set_xticks(range(len(unit)), unit, rotation=25, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def _damage_plot(tensors: Mapping[str, Mapping[str, Any]]) -> bytes | None:
    """Per tensor, each retain client's Fisher-proxy damage before and after the projection."""
    retain = sorted({k for t in tensors.values() for k in (t.get("damage_before") or {})})
    if not retain:
        return None
    names = list(tensors)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(names) + 2), 3.6))
    for r in retain:
        before = [_nan((tensors[n].get("damage_before") or {}).get(r)) for n in names]
        after = [_nan((tensors[n].get("damage_after") or {}).get(r)) for n in names]
        ax.plot(range(len(names)), before, "o--", label=f"{r[:12]} before", alpha=0.7)
        ax.plot(range(len(names)), after, "s-", label=f"{r[:12]} after", alpha=0.7)
    ax.set_xticks(range(len(names)), [_short(n) for n in names], rotation=60, ha="right")
    ax.tick_params(axis="x", labelsize=6)
    ax.set_ylabel("damage Σ F̃·Δ²")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return png(fig)


# -------------------------------------------------------------------------------------- values
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _nan(value: Any) -> float:
    """A plotted value; NaN (a gap in the line) where there is no number."""
    number = _number(value)
    return math.nan if number is None else number


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return _e(f"{value:.4g}")
    if isinstance(value, list | tuple):
        return _e(", ".join(str(v) for v in value))
    if isinstance(value, Mapping):
        return _e("; ".join(f"{k}: {v}" for k, v in value.items()))
    return _e(value)


def _bytes(n: Any) -> str | None:
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _losses(client: Mapping[str, Any]) -> str | None:
    first, last = _number(client.get("loss_first")), _number(client.get("loss_last"))
    if first is None or last is None:
        return None
    return f"{first:.3g} → {last:.3g}"


def _short(name: str) -> str:
    return name.removeprefix("model.").removesuffix(".weight")


def _as_list(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _answer(sample: Mapping[str, Any]) -> str:
    for key in ("answer", "gt", "correct"):  # QA answer, MUSE continuation, right choice
        if sample.get(key):
            return str(sample[key])
    return ""


def _generated(sample: Mapping[str, Any]) -> str:
    for key in ("generation", "chosen"):  # generated text, or the choice the model picked
        if key in sample:
            return str(sample[key])
    return ""
