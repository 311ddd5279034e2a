r"""Resources of a real architecture's shapes in a whole Flower run, extrapolated to full depth.

    python -m simulations.scale_check --shape llama-2-7b --layers 1,2 --dtype bfloat16

For each layer count L of ``--layers`` it builds a randomly initialised model with the shapes
and vocabulary of ``--shape`` (the published config.json values in
``fedunlearn.models.shapes``; nothing is downloaded) but only L decoder layers, seeded, as a
local checkpoint in ``<cache>/random-models/`` (built once), and runs one real Flower
simulation of it through :func:`simulations.run_local.run`: the generated TOFU scenario, 5
forget + 1 retain clients, FIRM (or MPU around it, ``--wrapper mpu``), LoRA on all seven
projections, ``evaluate=false`` and a few short local steps (``--steps``, ``--batch-size``):
the run measures resources, not forgetting.

From each run's ``results.json`` it reads, per client and round, the model bytes the server
sent (down: ``bytes_received_model_by_round``) and the bytes the client's reply carried (up:
``bytes_sent``, of which ``bytes_task_vector`` and ``bytes_fisher``), each client's peak
resident memory (``peak_rss_mb``), the server's (``server_peak_rss_mb``, and during the round
``merge.round_peak_rss_bytes``), the merge seconds and the federated round's seconds. Every
figure y is then fitted as y(L) = a + b·L over the layer counts run (least squares; with two
counts b is their difference quotient) and extrapolated to the architecture's full depth N:
y(N) = a + b·N. Per client figures are the largest client's. GB and MB are 10⁹ and 10⁶ bytes.

Writes ``scale_check.json`` and ``scale_check.md`` into ``--output-dir`` (default
``outputs/scale_check/<shape>-<dtype>-<wrapper>-<time>``; each run in its ``L<L>/`` folder,
always started afresh). The last line printed is ``scale-check: <shape> full depth: server
<GB>, client <GB>, down <MB>, up <MB>, merge <s>``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedunlearn.models.shapes import (
    DTYPE_BYTES,
    SHAPES,
    ensure_random_checkpoint,
    get_shape,
    parameter_count,
    shrunk,
)
from simulations import run_local

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
FORGET_CLIENTS, RETAIN_CLIENTS = 5, 1
#: the figures fitted over L and extrapolated (key, label, unit)
FIGURES = (
    ("server_peak_bytes", "server peak RSS", "GB"),
    ("server_round_peak_bytes", "server peak RSS during the round", "GB"),
    ("client_peak_bytes", "client peak RSS (largest client)", "GB"),
    ("down_bytes", "model bytes down per client (largest, all rounds)", "MB"),
    ("up_bytes", "bytes up per client (largest, all rounds)", "MB"),
    ("merge_seconds", "merge s", "s"),
    ("round_seconds", "federated round s", "s"),
    ("model_bytes", "model weights", "GB"),
)
UNITS = {"GB": 1e9, "MB": 1e6, "s": 1.0}
FORMULA = (
    "y(L) = a + b·L fitted by least squares over the layer counts run "
    "(b = Σ(Lᵢ − L̄)(yᵢ − ȳ) / Σ(Lᵢ − L̄)², a = ȳ − b·L̄; with two counts L₁ < L₂: "
    "b = (y(L₂) − y(L₁)) / (L₂ − L₁)); full depth N: y(N) = a + b·N"
)


def run_config(folder: Path, args: argparse.Namespace) -> str:
    """The run config of one simulation of the checkpoint in ``folder``."""
    config = (
        f"model.path='{folder}' model.dtype='{args.dtype}' wrapper='{args.wrapper}' "
        "merge='firm' evaluate=false resume=false scenario.name='tofu' "
        f"scenario.num-forget-clients={FORGET_CLIENTS} "
        f"scenario.num-retain-clients={RETAIN_CLIENTS} scenario.num-authors=20 "
        "scenario.forget-percent=10.0 scenario.retain-samples=16 "
        f"lora.targets='{LORA_TARGETS}' lora.layers='auto' "
        f"training.forget-steps={args.steps} training.retain-steps={args.steps} "
        f"training.fisher-batches={args.steps} training.batch-size={args.batch_size}"
    )
    return run_local.with_overrides(config, args.run_config) if args.run_config else config


def client_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per client: role, model bytes down per round, bytes up and its parts, peak RSS."""
    rows = []
    for client in results["clients"]:
        down = client.get("bytes_received_model_by_round")
        if down is None:  # a strategy that reports only the last round's total
            down = [client.get("bytes_received_model", client.get("bytes_received", 0))]
        rows.append(
            {
                "node_id": client.get("node_id"),
                "role": client.get("role"),
                "excluded": bool(client.get("excluded")),
                "down_bytes_by_round": [int(b) for b in down],
                "up_bytes": int(client.get("bytes_sent", 0)),
                "up_task_vector_bytes": int(client.get("bytes_task_vector", 0)),
                "up_fisher_bytes": int(client.get("bytes_fisher", 0)),
                "peak_rss_bytes": float(client.get("peak_rss_mb", 0.0)) * 2**20,
            }
        )
    return rows


def run_figures(results: Mapping[str, Any], model_bytes: int) -> dict[str, Any]:
    """The figures of one run's ``results.json`` (bytes, seconds) and its clients' rows."""
    clients = client_rows(results)
    if not clients or any(c["excluded"] for c in clients):
        raise RuntimeError("a client was excluded or none replied: the run measured nothing")
    merge = results.get("merge", {})
    return {
        "server_peak_bytes": float(results["server_peak_rss_mb"]) * 2**20,
        "server_round_peak_bytes": float(merge.get("round_peak_rss_bytes") or 0),
        "client_peak_bytes": max(c["peak_rss_bytes"] for c in clients),
        "down_bytes": max(sum(c["down_bytes_by_round"]) for c in clients),
        "up_bytes": max(c["up_bytes"] for c in clients),
        "merge_seconds": float(merge["seconds"]),
        "round_seconds": float(results["seconds"]["federated_round"]),
        "model_bytes": model_bytes,
        "clients": clients,
    }


def fit_line(layers: Sequence[int], values: Sequence[float]) -> tuple[float, float]:
    """(a, b) of y = a + b·L by least squares."""
    mean_l, mean_y = statistics.fmean(layers), statistics.fmean(values)
    spread = sum((n - mean_l) ** 2 for n in layers)
    if spread == 0:
        raise ValueError("a slope needs at least two different layer counts")
    b = sum((n - mean_l) * (y - mean_y) for n, y in zip(layers, values, strict=True)) / spread
    return mean_y - b * mean_l, b


def extrapolate(runs: Mapping[int, Mapping[str, Any]], full_depth: int) -> dict[str, Any]:
    """Per figure: intercept a, per-layer slope b and y(full_depth) = a + b·full_depth."""
    layers = sorted(runs)
    out: dict[str, Any] = {}
    for key, _, _ in FIGURES:
        a, b = fit_line(layers, [float(runs[n][key]) for n in layers])
        out[key] = {"intercept": a, "per_layer": b, "full_depth": a + b * full_depth}
    return out


def _value(value: float, unit: str) -> str:
    """``value`` in ``unit`` with three significant digits (at least one decimal)."""
    scaled = value / UNITS[unit]
    if scaled == 0:
        return "0"
    decimals = min(4, max(1, 2 - math.floor(math.log10(abs(scaled)))))
    return f"{scaled:,.{decimals}f}"


def report_markdown(report: Mapping[str, Any]) -> str:
    """The tables: per client and run, then each figure per L with slope and extrapolation."""
    runs, layers = report["runs"], [int(n) for n in report["runs"]]
    n = report["full_depth"]
    lines = [
        f"### {report['shape']} ({report['source']}), {report['dtype']}, wrapper "
        f"{report['wrapper']}, {report['forget_clients']} forget + {report['retain_clients']} "
        f"retain clients, FIRM, LoRA on all seven projections",
        "",
        "| L | client | role | down MB by round | up MB | of which task vector / Fisher MB "
        "| peak RSS GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for layer in layers:
        for c in runs[str(layer)]["clients"]:
            down = " / ".join(_value(b, "MB") for b in c["down_bytes_by_round"])
            lines.append(
                f"| {layer} | {c['node_id']} | {c['role']} | {down} | "
                f"{_value(c['up_bytes'], 'MB')} | {_value(c['up_task_vector_bytes'], 'MB')} / "
                f"{_value(c['up_fisher_bytes'], 'MB')} | {_value(c['peak_rss_bytes'], 'GB')} |"
            )
    head = " | ".join(f"L = {layer}" for layer in layers)
    extrapolated = report.get("extrapolation")
    tail = f" per layer (b) | full depth N = {n} |" if extrapolated else ""
    lines += ["", f"| figure | unit | {head} |{tail}", "|---|---|" + "---|" * len(layers)]
    lines[-1] += "---|---|" if extrapolated else ""
    for key, label, unit in FIGURES:
        cells = " | ".join(_value(runs[str(layer)][key], unit) for layer in layers)
        row = f"| {label} | {unit} | {cells} |"
        if extrapolated:
            fit = extrapolated[key]
            row += f" {_value(fit['per_layer'], unit)} | {_value(fit['full_depth'], unit)} |"
        lines.append(row)
    if extrapolated:
        target = report["target_bytes"]
        lines += [
            "",
            f"Extrapolation: {FORMULA}, with N = {n} ({report['shape']}'s num_hidden_layers).",
            f"Full model: {report['full_model_bytes'] / 1e9:.2f} GB of weights in "
            f"{report['dtype']}; issue 35's bound 2 × model + 2 GB = {target / 1e9:.2f} GB: "
            f"server {_verdict(extrapolated['server_peak_bytes']['full_depth'], target)}, "
            f"client {_verdict(extrapolated['client_peak_bytes']['full_depth'], target)}.",
        ]
    lines += [
        "",
        f"Code: {report['code']}. Wall time of the check: {report['wall_seconds']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def _verdict(value: float, bound: float) -> str:
    return f"{value / 1e9:.2f} GB ({'within' if value <= bound else 'ABOVE'})"


def final_line(report: Mapping[str, Any]) -> str:
    """``scale-check: <shape> full depth: ...`` (or the one layer count's figures)."""
    if report.get("extrapolation"):
        values = {k: v["full_depth"] for k, v in report["extrapolation"].items()}
        where = "full depth"
    else:
        (layer,) = report["runs"]
        values, where = report["runs"][layer], f"{layer} layer(s), no extrapolation"
    return (
        f"scale-check: {report['shape']} {where}: server "
        f"{values['server_peak_bytes'] / 1e9:.2f} GB, client "
        f"{values['client_peak_bytes'] / 1e9:.2f} GB, down {values['down_bytes'] / 1e6:.1f} MB, "
        f"up {values['up_bytes'] / 1e6:.1f} MB, merge {values['merge_seconds']:.1f} s"
    )


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Build, run and measure every layer count; write and return the report."""
    started = time.perf_counter()
    shape = shrunk(get_shape(args.shape), args.shrink)
    layers = sorted(set(args.layers))
    output_dir = args.output_dir.resolve()
    shrunk_note = f", shrunk {args.shrink}x" if args.shrink > 1 else ""
    print(
        f"scale-check: {args.shape} ({shape.source}{shrunk_note}), {shape.num_hidden_layers} "
        f"layers at full depth, {args.dtype}, wrapper {args.wrapper}; runs at "
        f"L = {', '.join(map(str, layers))} into {output_dir}",
        flush=True,
    )
    runs: dict[str, dict[str, Any]] = {}
    for layer in layers:
        model_bytes = parameter_count(shape, layer) * DTYPE_BYTES[args.dtype]
        t0 = time.perf_counter()
        folder = ensure_random_checkpoint(
            args.shape, layer, args.dtype, args.cache_dir.resolve(), shrink=args.shrink
        )
        print(
            f"[L={layer}] random checkpoint: {parameter_count(shape, layer) / 1e6:.1f} M "
            f"parameters, {model_bytes / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s): {folder}",
            flush=True,
        )
        print(
            f"[L={layer}] Flower simulation: {FORGET_CLIENTS} forget + {RETAIN_CLIENTS} retain "
            f"clients, {args.steps} steps of batch {args.batch_size} each",
            flush=True,
        )
        t0 = time.perf_counter()
        results = run_local.run(
            run_config(folder, args), args.federation_config, output_dir=output_dir / f"L{layer}"
        )
        figures = run_figures(json.loads(results.read_text()), model_bytes)
        figures["wall_seconds"] = time.perf_counter() - t0
        runs[str(layer)] = figures
        print(
            f"[L={layer}] done in {figures['wall_seconds']:.0f} s: server peak "
            f"{figures['server_peak_bytes'] / 1e9:.2f} GB, client peak "
            f"{figures['client_peak_bytes'] / 1e9:.2f} GB, down "
            f"{figures['down_bytes'] / 1e6:.1f} MB, up {figures['up_bytes'] / 1e6:.1f} MB, "
            f"merge {figures['merge_seconds']:.1f} s, round {figures['round_seconds']:.1f} s",
            flush=True,
        )
    full_model = parameter_count(shape, shape.num_hidden_layers) * DTYPE_BYTES[args.dtype]
    report: dict[str, Any] = {
        "shape": args.shape,
        "source": shape.source,
        "shrink": args.shrink,
        "dtype": args.dtype,
        "wrapper": args.wrapper,
        "forget_clients": FORGET_CLIENTS,
        "retain_clients": RETAIN_CLIENTS,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "full_depth": shape.num_hidden_layers,
        "full_model_bytes": full_model,
        "target_bytes": 2 * full_model + 2e9,
        "formula": FORMULA,
        "code": code_version(),
        "runs": runs,
    }
    if len(layers) > 1:
        report["extrapolation"] = extrapolate(
            {int(k): v for k, v in runs.items()}, shape.num_hidden_layers
        )
    report["wall_seconds"] = time.perf_counter() - started
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "scale_check.json").write_text(json.dumps(report, indent=2))
    (output_dir / "scale_check.md").write_text(report_markdown(report))
    return report


def code_version() -> str:
    """The commit the runs used, with ``+ uncommitted changes`` when the working tree had some
    (the Flower app is staged from the working tree)."""

    def git(*command: str) -> str:
        done = subprocess.run(
            ["git", *command], cwd=run_local.REPO_ROOT, capture_output=True, text=True
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return commit + (" + uncommitted changes" if git("status", "--porcelain") else "")


def layer_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--layers wants counts >= 1 such as 1,2, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-2-7b")
    parser.add_argument(
        "--layers", type=layer_counts, default=[1, 2], help="decoder layer counts (default 1,2)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--wrapper", choices=("none", "mpu"), default="none")
    parser.add_argument("--steps", type=int, default=2, help="local steps and Fisher batches")
    parser.add_argument("--batch-size", type=int, default=4, help="local batch size")
    parser.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="divide hidden size, MLP width and vocabulary by this (a test-size variant that "
        "keeps the head counts, RoPE, biases and tied embeddings)",
    )
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=run_local.default_cache_dir(),
        help="where the random checkpoints are built (default $FEDUNLEARN_CACHE_DIR or .cache/)",
    )
    parser.add_argument("--run-config", default="", help="run-config overrides of every run")
    parser.add_argument("--federation-config", default="", help="simulation overrides")
    args = parser.parse_args(argv)
    if args.output_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{args.shape}-{args.dtype}-{args.wrapper}-{stamp}"
        args.output_dir = run_local.REPO_ROOT / "outputs" / "scale_check" / name
    report = check(args)
    print(report_markdown(report))
    print(f"written: {args.output_dir.resolve() / 'scale_check.md'}")
    print(final_line(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
