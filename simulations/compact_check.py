r"""Compact streamed uploads against dense in-memory ones, on the same whole Flower run.

    python -m simulations.compact_check \
        --run-config "model.name='smollm2-135m' scenario.data-path='<tofu>'"

Runs the same scenario twice through :func:`simulations.run_local.run` (same seed, so the
clients train the same task vectors from the same θ₀):

* ``dense``: ``upload.task-vector='dense' upload.fisher='dense' upload.stream=false`` — every
  client uploads s·B@A and its Fisher diagonal in float32, and the server holds all uploads in
  memory;
* ``compact``: the run config as given (by default LoRA factors, the top-α' Fisher of
  ``upload.fisher-fraction`` and the streaming server).

Compared, from each run's ``results.json`` and its saved global weights
(``checkpoint/weights.safetensors``):

* the merged update: e = ‖Δ_compact − Δ_dense‖ / ‖Δ_dense‖ over all weights (Δ = θ_after − θ₀,
  θ₀ the run's initial model), and the worst weight's e;
* bytes per client (the reply's arrays and metadata, ``bytes_sent``), their task-vector and
  Fisher parts, and the ratio dense ÷ compact;
* the server's peak resident memory during the round (``merge.round_peak_rss_bytes``) and over
  the whole run (``server_peak_rss_mb``), the merge and round seconds;
* the scenario's summary metrics after unlearning.

Writes ``compact_check.json`` and ``compact_check.md`` into ``--output-dir`` (default
``outputs/compact_check``; the two runs in its ``dense/`` and ``compact/`` folders, which
``--reuse`` loads instead of running again).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from simulations import run_local
from strategies.checkpoint import CHECKPOINT_DIR, WEIGHTS_FILE
from strategies.results import json_safe
from strategies.run_setup import load_run_model
from strategies.settings import RunSettings

OUTPUT_DIR = run_local.REPO_ROOT / "outputs" / "compact_check"
DENSE_OVERRIDES = "upload.task-vector='dense' upload.fisher='dense' upload.stream=false"
FORMS = ("dense", "compact")
#: per-client report fields (``results.json`` → ``clients``) averaged in the table
BYTE_FIELDS = ("bytes_sent", "bytes_task_vector", "bytes_fisher", "bytes_dense")


def merged_update_error(
    initial: Mapping[str, torch.Tensor],
    dense: Mapping[str, torch.Tensor],
    compact: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """e = ‖Δ_c − Δ_d‖ / ‖Δ_d‖ with Δ = θ_after − θ₀ (float64), over the weights the dense run
    changed, plus the worst weight's e and ‖Δ_d‖. Weights missing from a run are an error."""
    missing = sorted((set(dense) ^ set(compact)) | (set(dense) - set(initial)))
    if missing:
        raise ValueError(f"the two runs' weights differ in their names: {missing[:3]}")
    num = den = 0.0
    worst_name, worst = "", 0.0
    changed = 0
    for name, after_dense in dense.items():
        theta0 = initial[name].double()
        delta_d = after_dense.double() - theta0
        delta_c = compact[name].double() - theta0
        d2 = float((delta_d**2).sum())
        e2 = float(((delta_c - delta_d) ** 2).sum())
        if d2 == 0.0 and e2 == 0.0:
            continue
        changed += 1
        num, den = num + e2, den + d2
        tensor_error = (e2 / d2) ** 0.5 if d2 > 0 else float("inf")
        if tensor_error > worst:
            worst_name, worst = name, tensor_error
    return {
        "error": (num / den) ** 0.5 if den > 0 else 0.0,
        "worst_tensor_error": worst,
        "worst_tensor": worst_name,
        "dense_update_norm": den**0.5,
        "changed_weights": changed,
    }


def run_summary(results: Mapping[str, Any]) -> dict[str, Any]:
    """What the comparison reads from one ``results.json``: bytes per client (mean over the
    clients that were merged), server memory and seconds, the metrics after unlearning."""
    clients = [c for c in results["clients"] if not c.get("excluded")]
    if not clients:
        raise ValueError("the run merged no client: nothing to compare")
    summary: dict[str, Any] = {
        f"{field}_per_client": round(statistics.fmean(float(c.get(field, 0)) for c in clients))
        for field in BYTE_FIELDS
    }
    merge = results.get("merge", {})
    summary.update(
        clients=len(clients),
        streamed=bool(merge.get("streamed")),
        round_peak_rss_bytes=merge.get("round_peak_rss_bytes"),
        server_peak_rss_mb=results.get("server_peak_rss_mb"),
        merge_seconds=merge.get("seconds"),
        round_seconds=results.get("seconds", {}).get("federated_round"),
        after=results["metrics"].get("after", {}),
    )
    return summary


def compare(runs: Mapping[str, Mapping[str, Any]], error: Mapping[str, Any]) -> dict[str, Any]:
    """The report: both runs' summaries, the merged-update error and the byte / memory ratios
    dense ÷ compact."""
    dense, compact = runs["dense"], runs["compact"]

    def ratio(key: str) -> float | None:
        d, c = dense.get(key), compact.get(key)
        return float(d) / float(c) if d and c else None

    return {
        "runs": dict(runs),
        "merged_update": dict(error),
        "bytes_ratio": ratio("bytes_sent_per_client"),
        "round_peak_rss_ratio": ratio("round_peak_rss_bytes"),
        "server_peak_rss_ratio": ratio("server_peak_rss_mb"),
    }


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report_markdown(report: Mapping[str, Any]) -> str:
    """The comparison as one markdown table plus the merged-update error."""
    runs = report["runs"]
    rows = [
        ("clients merged", "clients"),
        ("streaming server", "streamed"),
        ("bytes per client (sent)", "bytes_sent_per_client"),
        ("  task vector", "bytes_task_vector_per_client"),
        ("  Fisher", "bytes_fisher_per_client"),
        ("  dense equivalent", "bytes_dense_per_client"),
        ("server peak RSS during the round (bytes)", "round_peak_rss_bytes"),
        ("server peak RSS, whole run (MiB)", "server_peak_rss_mb"),
        ("merge s", "merge_seconds"),
        ("federated round s", "round_seconds"),
    ]
    lines = ["| | dense in memory | compact streaming |", "|---|---|---|"]
    for label, key in rows:
        lines.append(
            f"| {label} | {_number(runs['dense'][key])} | {_number(runs['compact'][key])} |"
        )
    metrics = sorted(set(runs["dense"]["after"]) & set(runs["compact"]["after"]))
    for name in metrics:
        d, c = runs["dense"]["after"][name], runs["compact"]["after"][name]
        if isinstance(d, int | float) and isinstance(c, int | float):
            lines.append(f"| after: {name} | {_number(float(d))} | {_number(float(c))} |")
    e = report["merged_update"]
    lines += [
        "",
        f"bytes per client dense ÷ compact: {_number(report['bytes_ratio'], 1)}×; "
        f"server round peak RSS dense ÷ compact: {_number(report['round_peak_rss_ratio'], 2)}×",
        f"merged update: e = {e['error']:.4g} over {e['changed_weights']} weights "
        f"(‖Δ_dense‖ = {e['dense_update_norm']:.4g}; worst weight {e['worst_tensor']}: "
        f"{e['worst_tensor_error']:.4g})",
    ]
    return "\n".join(lines) + "\n"


def run_forms(
    run_config: str, federation_config: str, output_dir: Path, *, reuse: bool
) -> dict[str, Path]:
    """Each form's ``results.json`` (run now unless ``reuse`` finds it)."""
    paths = {}
    for form in FORMS:
        folder = output_dir / form
        config = run_config
        if form == "dense":
            config = run_local.with_overrides(run_config, DENSE_OVERRIDES)
        results = folder / "results.json"
        if not (reuse and results.is_file()):
            print(f"compact_check: the {form} run ({folder})", flush=True)
            results = run_local.run(config.strip(), federation_config, output_dir=folder)
        paths[form] = results
    return paths


def check(run_config: str, federation_config: str, output_dir: Path, *, reuse: bool) -> dict:
    """Run (or reuse) both forms, compare them, write the JSON and markdown reports."""
    output_dir = output_dir.resolve()
    paths = run_forms(run_config, federation_config, output_dir, reuse=reuse)
    results = {form: json.loads(path.read_text()) for form, path in paths.items()}
    settings = RunSettings.from_run_config(results["dense"]["config"])
    model = load_run_model(settings, show_progress=False).model
    initial = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    after = {
        form: load_file(str(path.parent / CHECKPOINT_DIR / WEIGHTS_FILE))
        for form, path in paths.items()
    }
    error = merged_update_error(initial, after["dense"], after["compact"])
    report = compare({form: run_summary(r) for form, r in results.items()}, error)
    report["results"] = {form: str(path) for form, path in paths.items()}
    (output_dir / "compact_check.json").write_text(json.dumps(json_safe(report), indent=2))
    (output_dir / "compact_check.md").write_text(report_markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="", help="run-config overrides of both runs")
    parser.add_argument("--federation-config", default="", help="simulation overrides")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    parser.add_argument("--reuse", action="store_true", help="load runs already in output-dir")
    args = parser.parse_args(argv)
    report = check(args.run_config, args.federation_config, args.output_dir, reuse=args.reuse)
    print(report_markdown(report))
    print(f"written: {args.output_dir.resolve() / 'compact_check.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
