"""MPU on tofu (MPU paper Table 1 style): Clean, Noised, MPU, MPU + shared noise, then κ, m.

    python -m simulations.mpu_study [--objectives ga,graddiff,npo,simnpo] [--run-config "..."]

Every cell is one real Flower simulation with ``wrapper=mpu`` (the baselines run through the
same code path: ``mpu.mode=clean`` sends one exact copy, ``noised`` one noisy copy without
reparameterisation or denoising). Writes ``mpu_study.json``, ``mpu_study.md``,
``mpu_table.png`` (Clean / Noised / MPU per objective) and ``mpu_study.png`` (forget quality
and utility per κ and m) into the output folder; every run's ``results.json`` stays under
``runs/``. Randomised cells run with ``--replicates`` fixed study secrets (fresh noise and
reparameterisation keys each, mean ± std reported) so the study is reproducible; a plain
run's default is a fresh random secret. The overhead columns are measured in the same runs:
server pre-/post-processing time ÷ the wrapped merge's time on the same updates, bytes sent
to each client per round, and the forget clients' compute ÷ that of the Clean run.
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

from simulations import run_local  # noqa: E402
from strategies.secret_files import (  # noqa: E402
    make_private_dir,
    read_secret_file,
    write_private_file,
)

METRICS = ("forget_quality", "forget_truth_ratio", "forget_rouge_l", "model_utility", "privleak")
STUDY_SECRET = "fedunlearn-mpu-study"
#: the table's modes: the baselines, MPU as published (no shared noise), and MPU as it runs by
#: default, with noise shared by a client's copies (κ_η = 1.5·κ: the defense the threat-model
#: study, ``simulations.mpu_attack``, found to hold)
MODES = {
    "clean": "mpu.mode='clean'",
    "noised": "mpu.mode='noised' mpu.kappa=0.01",
    "mpu": "mpu.mode='mpu' mpu.copies=2 mpu.kappa=0.01 mpu.shared-kappa=0",
    "mpu-shared": "mpu.mode='mpu' mpu.copies=2 mpu.kappa=0.01",
}


def _cell(run_config: str, output_dir: Path) -> dict[str, Any]:
    path = output_dir / "results.json"
    if not path.is_file():
        path = run_local.run(run_config=run_config, output_dir=output_dir)
    results = json.loads(path.read_text())
    forget = [c for c in results["clients"] if c.get("role") == "forget"]
    mpu = results["mpu"]
    merge_seconds = max(float(results["merge"]["seconds"]), 1e-9)
    return {
        "metrics": {k: results["metrics"]["after"].get(k) for k in METRICS},
        "forget_client_train_seconds": sum(c["train_seconds"] for c in forget) / len(forget),
        "bytes_to_client": max(mpu["bytes_to_client_last_round"].values()),
        "bytes_from_client": max(c["bytes_sent"] for c in results["clients"]),
        "publish_over_merge": mpu["server_seconds"]["publish"] / merge_seconds,
        "map_back_over_merge": mpu["server_seconds"]["map_back"] / merge_seconds,
        "results": str(path),
        "before": {k: results["metrics"]["before"].get(k) for k in METRICS},
        "reference": {k: results["metrics"].get("reference", {}).get(k) for k in METRICS},
    }


def _replicated(
    run_config: str, output_dir: Path, name: str, replicates: int, randomised: bool
) -> dict[str, Any]:
    """One cell, run with ``replicates`` study secrets (fresh noise and reparameterisation
    keys each; Clean has no server randomness and runs once). Metrics are the mean over
    replicates, ``metrics_std`` their standard deviation, ``replicates`` every run's numbers."""
    runs = []
    for r in range(replicates if randomised else 1):
        secret = ""
        if "mpu.secret-file=" not in run_config:
            secret = f" mpu.secret-file='{study_secret_file(output_dir, r)}'"
        suffix = f"-r{r}" if randomised else ""
        runs.append(_cell(run_config + secret, output_dir / "runs" / f"{name}{suffix}"))
    cell = dict(runs[0])
    for key in ("metrics",):
        values = {k: [run[key][k] for run in runs] for k in METRICS}
        cell[key] = {k: _mean(v) for k, v in values.items()}
        cell["metrics_std"] = {k: _std(v) for k, v in values.items()}
    for key in ("forget_client_train_seconds", "publish_over_merge", "map_back_over_merge"):
        cell[key] = _mean([run[key] for run in runs])
    cell["replicates"] = [run["metrics"] for run in runs]
    cell["results"] = [run["results"] for run in runs]
    return cell


def study_secret_file(output_dir: Path, replicate: int) -> Path:
    """The 0600 file holding replicate ``replicate``'s fixed study secret (made once), for
    ``mpu.secret-file``: a secret never goes into a run config (command lines, run records)."""
    folder = make_private_dir(output_dir / "secrets")
    path = folder / f"study-secret-{replicate}"
    secret = f"{STUDY_SECRET}-{replicate}"
    if not path.exists():
        write_private_file(path, secret.encode())
    elif read_secret_file(path) != secret:
        raise ValueError(f"{path} holds another secret than replicate {replicate}'s; remove it")
    return path


def _mean(values: list[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    return sum(numbers) / len(numbers) if numbers else None


def _std(values: list[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    if len(numbers) < 2:
        return None
    mean = sum(numbers) / len(numbers)
    return (sum((x - mean) ** 2 for x in numbers) / (len(numbers) - 1)) ** 0.5


def study(
    objectives: list[str],
    run_config: str,
    output_dir: Path,
    *,
    kappas: tuple[float, ...] = (0.01, 0.05, 0.1),
    copies: tuple[int, ...] = (2, 3, 4),
    replicates: int = 1,
    modes: tuple[str, ...] = tuple(MODES),
    sweep_cells: bool = True,
) -> dict[str, Any]:
    """Table 1 (objective × ``modes``: Clean / Noised / MPU m=2 κ=0.01 / MPU with shared
    noise κ_η=0.01), then (``sweep_cells``) κ and m sweeps on GA, each randomised cell over
    ``replicates`` study secrets."""
    output_dir.mkdir(parents=True, exist_ok=True)
    base = f"wrapper='mpu' {run_config}".strip()
    table: list[dict[str, Any]] = []
    for objective in objectives:
        for mode in modes:
            extra = MODES[mode]
            cell = _replicated(
                f"{base} objective.name='{objective}' {extra}",
                output_dir,
                f"{objective}-{mode}",
                replicates,
                randomised=mode != "clean",
            )
            table.append({"objective": objective, "mode": mode, **cell})
    sweep: list[dict[str, Any]] = []
    for kappa in kappas if sweep_cells else ():
        for m in copies:
            if kappa != 0.01 and m != 2:
                continue  # κ varies at m = 2, m varies at κ = 0.01
            name = f"ga-mpu-k{kappa:g}-m{m}"
            config = f"{base} objective.name='ga' mpu.mode='mpu' mpu.copies={m} mpu.kappa={kappa}"
            cell = _replicated(config, output_dir, name, replicates, randomised=True)
            sweep.append({"kappa": kappa, "m": m, **cell})
    clean = {r["objective"]: r for r in table if r["mode"] == "clean"}
    for row in table + sweep:
        ref = clean.get(row.get("objective", "ga"))
        if ref:
            row["client_compute_over_clean"] = (
                row["forget_client_train_seconds"] / ref["forget_client_train_seconds"]
            )
    summary = {"run_config": run_config, "replicates": replicates, "table": table, "sweep": sweep}
    (output_dir / "mpu_study.json").write_text(json.dumps(summary, indent=2))
    (output_dir / "mpu_study.md").write_text(study_markdown(summary))
    plot_sweep(summary, output_dir / "mpu_study.png")
    plot_table(summary, output_dir / "mpu_table.png")
    return summary


def _fmt(value: Any, std: Any = None) -> str:
    if not isinstance(value, float):
        return "–" if value is None else str(value)
    return f"{value:.3f} ± {std:.3f}" if isinstance(std, float) else f"{value:.3f}"


def study_markdown(summary: dict[str, Any]) -> str:
    """Table 1 and the κ / m sweep, with the overhead columns."""
    head = " | ".join(METRICS)
    overhead = "publish ÷ merge | map-back ÷ merge | MB to client | client compute ÷ clean"
    lines = [
        f"| objective | mode | {head} | {overhead} |",
        "|---|---|" + "---|" * (len(METRICS) + 4),
    ]
    rows = summary["table"]
    if rows:
        lines.append(
            "| before | – | "
            + " | ".join(_fmt(rows[0]["before"][k]) for k in METRICS)
            + " | | | | |"
        )
        lines.append(
            "| reference | – | "
            + " | ".join(_fmt(rows[0]["reference"][k]) for k in METRICS)
            + " | | | | |"
        )
    for r in rows:
        lines.append(_row(f"{r['objective']} | {r['mode']}", r))
    lines += ["", f"| κ | m | {head} | {overhead} |", "|---|---|" + "---|" * (len(METRICS) + 4)]
    for r in summary["sweep"]:
        lines.append(_row(f"{r['kappa']:g} | {r['m']}", r))
    return "\n".join(lines) + "\n"


def _row(label: str, r: dict[str, Any]) -> str:
    return (
        f"| {label} | "
        + " | ".join(_fmt(r["metrics"][k], r.get("metrics_std", {}).get(k)) for k in METRICS)
        + f" | {_fmt(r['publish_over_merge'])} | {_fmt(r['map_back_over_merge'])} | "
        f"{r['bytes_to_client'] / 1e6:.1f} | {_fmt(r.get('client_compute_over_clean'))} |"
    )


def plot_sweep(summary: dict[str, Any], path: Path) -> Path:
    """Forget quality and model utility against κ (m = 2) and against m (κ = 0.01)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, fixed_key, fixed) in zip(
        axes, (("kappa", "m", 2), ("m", "kappa", 0.01)), strict=True
    ):
        rows = sorted((r for r in summary["sweep"] if r[fixed_key] == fixed), key=lambda r: r[key])
        xs = [r[key] for r in rows]
        for metric in ("forget_quality", "model_utility"):
            ax.plot(xs, [r["metrics"][metric] for r in rows], marker="o", label=metric)
        ax.set_xlabel(key)
        ax.set_title(f"MPU with GA, {fixed_key} = {fixed:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_table(summary: dict[str, Any], path: Path) -> Path:
    """Clean / Noised / MPU per objective: one panel per metric, bars with ± std."""
    rows = summary["table"]
    objectives = list(dict.fromkeys(r["objective"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    shown = [m for m in METRICS if any(r["metrics"][m] is not None for r in rows)]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.6 * len(shown), 3.8), squeeze=False)
    width = 0.8 / len(modes)
    for ax, metric in zip(axes[0], shown, strict=True):
        for j, mode in enumerate(modes):
            cells = [
                next((r for r in rows if r["objective"] == o and r["mode"] == mode), None)
                for o in objectives
            ]
            values = [(c["metrics"][metric] or 0.0) if c else 0.0 for c in cells]
            errors = [(c.get("metrics_std", {}).get(metric) or 0.0) if c else 0.0 for c in cells]
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(objectives))]
            ax.bar(xs, values, width, yerr=errors, capsize=2, label=mode)
        reference = rows[0]["reference"].get(metric) if rows else None
        if isinstance(reference, float):
            ax.axhline(reference, color="k", lw=0.8, ls="--", label="reference")
        ax.set_xticks(range(len(objectives)), objectives)
        ax.set_title(metric, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", default="ga,graddiff,npo,simnpo")
    parser.add_argument("--run-config", default="", help="extra run-config overrides")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument(
        "--replicates", type=int, default=1, help="study secrets per randomised cell"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"table modes, from {', '.join(MODES)}"
    )
    parser.add_argument("--no-sweep", action="store_true", help="only the table, no κ / m sweep")
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    logging.getLogger("flwr").propagate = False
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = (args.output_dir or run_local.REPO_ROOT / "outputs" / f"mpu-{stamp}").resolve()
    summary = study(
        [o for o in args.objectives.split(",") if o],
        args.run_config,
        output_dir,
        replicates=args.replicates,
        modes=modes,
        sweep_cells=not args.no_sweep,
    )
    print(study_markdown(summary))
    print(f"written to {output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
