"""How much Fisher must a client upload? Compact Fisher uploads against FIRM's dense merge.

FIRM (SPEC §2.3) keeps the top-α entries of every retain client's own F̂_k and of every forget
domain's pooled mean F̄_g = (1/n_g)·Σ_i F̂_i. A top-α' upload (``fedunlearn.upload_codec``) with
α' ≥ α is exact for the former and for a domain of one client; for n_g > 1 the server pools
the truncated uploads (dropped entries decode as 0), whose top-α is not the pooled mean's.

For every input and every Fisher form (dense, bf16, top-α' for α' ∈ {1, 1.25, 1.5, 2, 3, 5}·α
and 1) each client's Fisher is encoded and decoded as the server decodes it, and FIRM base
(ε = ∞) and FIRM with the projection (ε = ``EPSILON_FACTOR`` × the mean FIRM-base damage of the
dense uploads, so the budget is active) are merged. Reported per form:

* ``error``: e = ‖Δ_compact − Δ_dense‖ / ‖Δ_dense‖ over all tensors, and the worst tensor's;
* ``support_change``: Σ|S_c △ S_d| / Σ|S_d| over tensors and forget domains, S the entries
  kept of the pooled F̃_g;
* ``fisher_bytes_ratio``: Fisher bytes per client / dense float32 (4 bytes per entry); top-k
  costs 1 bit per entry plus 4 bytes per kept value;
* ``upload_ratio``: dense upload (task vector + Fisher, 8 bytes per entry) / compact upload
  (task vector as rank-r LoRA factors, r·(d_in + d_out) + 1 floats per weight, + the Fisher;
  r is the run's ``lora-rank``, for synthetic inputs the rank their task vectors are drawn at);
* real input only: the scenario's metrics of θ₀ + Δ (forgetting and utility).

Inputs: a real Flower run of the built-in tofu scenario (small substrate, 4 forget clients in
one domain, 2 retain clients, dense uploads saved), and synthetic uploads of
``simulations.bench_merge``'s kind with 1, 2, 4 and 8 forget clients per domain.
The recommended ``fisher-upload-fraction`` is the smallest α' of the grid whose e stays below
``--bound`` for both merges on every input.

    python -m simulations.fisher_upload [--reuse-run] [--bound 0.01]

Writes ``fisher_upload.json``, ``fisher_upload.md`` and ``fisher_upload.png`` into
``--output-dir`` (default ``outputs/fisher_upload``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from fedunlearn.merging import ClientUpdate, MergeResult, firm_merge  # noqa: E402
from fedunlearn.merging.firm import normalize_and_sparsify  # noqa: E402
from fedunlearn.upload_codec import DecodedTensors, encode_fisher, upload_bytes  # noqa: E402
from simulations import bench_merge, run_local  # noqa: E402
from simulations.sweep import point_metrics, run_and_load_uploads  # noqa: E402
from strategies.results import json_safe  # noqa: E402

ALPHA = bench_merge.ALPHA
EPS0 = bench_merge.EPS0
#: α' / α of the top-k grid (α' = 1 is added)
FRACTION_MULTIPLES = (1.0, 1.25, 1.5, 2.0, 3.0, 5.0)
EPSILON_FACTOR = 0.3
DEFAULT_BOUND = 0.01
#: the built-in tofu scenario at the small substrate (a Flower run of about 1.5 minutes on 2
#: cores): 2 forget authors over 4 forget clients in ONE domain, 2 retain clients; the Fisher
#: is uploaded dense so that the saved uploads are the raw F̂
RUN_CONFIG = (
    "substrate-hidden-size=128 substrate-layers=2 substrate-intermediate-size=256 "
    "substrate-background-documents=200 num-authors=20 forget-percent=10.0 retain-samples=80 "
    "eval-retain-samples=50 gamma=5.0 num-forget-clients=4 num-forget-domains=1 "
    "num-retain-clients=2 fisher-upload='dense'"
)
SYNTHETIC_PER_DOMAIN = (1, 2, 4, 8)
Evaluate = Callable[[str, dict[str, torch.Tensor]], dict[str, Any]]


@dataclass(frozen=True)
class FisherForm:
    """One way to upload F̂: ``form`` of the codec and, for ``topk``, the kept fraction α'."""

    form: str
    fraction: float = 1.0

    @property
    def label(self) -> str:
        return f"topk {self.fraction:g}" if self.form == "topk" else self.form


def fisher_forms(
    alpha: float = ALPHA, multiples: Sequence[float] = FRACTION_MULTIPLES
) -> list[FisherForm]:
    """dense, bf16 and top-α' for α' = m·α (m in ``multiples``, capped at 1) and α' = 1."""
    fractions = sorted({round(min(1.0, m * alpha), 12) for m in multiples} | {1.0})
    return [
        FisherForm("dense"),
        FisherForm("bf16"),
        *(FisherForm("topk", f) for f in fractions),
    ]


def recode(
    updates: Sequence[ClientUpdate], form: FisherForm
) -> tuple[list[ClientUpdate], list[int]]:
    """The updates with every Fisher encoded in ``form`` and decoded as the server decodes it,
    and each client's Fisher bytes on the wire."""
    out, sizes = [], []
    for u in updates:
        if u.fisher is None:
            raise ValueError(f"client {u.node_id!r} uploaded no Fisher diagonal")
        shapes = {k: tuple(v.shape) for k, v in u.fisher.items()}
        parts = encode_fisher(u.fisher, form.form, form.fraction)
        decoded = DecodedTensors.from_parts(parts, shapes)
        fisher = {k: decoded[k] for k in decoded}
        out.append(ClientUpdate(u.node_id, u.role, u.domain, u.num_examples, u.task_vector, fisher))
        sizes.append(upload_bytes(parts))
    return out, sizes


def relative_error(compact: MergeResult, dense: MergeResult) -> dict[str, Any]:
    """‖Δ_c − Δ_d‖ / ‖Δ_d‖ over all tensors (``error``) and the worst tensor's."""
    diff_sq = ref_sq = 0.0
    worst, worst_key = 0.0, None
    for key, ref in dense.delta.items():
        ref64 = ref.double()
        d_sq = float((compact.delta[key].double() - ref64).pow(2).sum())
        r_sq = float(ref64.pow(2).sum())
        diff_sq, ref_sq = diff_sq + d_sq, ref_sq + r_sq
        rel = math.sqrt(d_sq / r_sq) if r_sq > 0 else (0.0 if d_sq == 0 else math.inf)
        if rel > worst or worst_key is None:
            worst, worst_key = rel, key
    error = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0
    return {"error": error, "worst_error": worst, "worst_tensor": worst_key}


def pooled_supports(
    updates: Sequence[ClientUpdate], alpha: float = ALPHA, eps0: float = EPS0
) -> dict[tuple[str, str], torch.Tensor]:
    """FIRM's kept entries of each forget domain's pooled F̃_g, per (tensor, domain)."""
    domains: dict[str, list[ClientUpdate]] = {}
    for u in updates:
        if u.role == "forget":
            domains.setdefault(str(u.domain), []).append(u)
    out = {}
    for key in updates[0].task_vector:
        for domain, members in domains.items():
            pooled = torch.zeros_like(members[0].fisher[key], dtype=torch.float32)  # type: ignore[index]
            for u in members:  # summed then divided, in FIRM's order
                pooled.add_(u.fisher[key].float())  # type: ignore[index]
            out[key, domain] = normalize_and_sparsify(pooled.div_(len(members)), alpha, eps0) > 0
    return out


def support_change(
    compact: dict[tuple[str, str], torch.Tensor], dense: dict[tuple[str, str], torch.Tensor]
) -> float:
    """Σ|S_c △ S_d| / Σ|S_d| over tensors and forget domains."""
    changed = sum(int((compact[k] ^ s).sum()) for k, s in dense.items())
    return changed / sum(int(s.sum()) for s in dense.values())


def factor_bytes(shape: Sequence[int], rank: int) -> int:
    """Bytes of a weight's task vector as LoRA factors: B (d_out × r), A (r × d_in), s."""
    d_out, d_in = shape
    return 4 * (rank * (d_out + d_in) + 1)


def budget(dense_base: MergeResult, factor: float = EPSILON_FACTOR) -> float:
    """ε = ``factor`` × the mean FIRM-base damage over tensors and retain clients."""
    damages = [
        d for t in dense_base.report["tensors"].values() for d in t["damage_before"].values()
    ]
    return factor * statistics.fmean(damages)


def measure_input(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float,
    lora_rank: int,
    forms: Sequence[FisherForm] | None = None,
    alpha: float = ALPHA,
    evaluate: Evaluate | None = None,
) -> dict[str, Any]:
    """Every form's merge errors, support change and bytes on one input (see the module
    docstring); with ``evaluate`` also the merged models' metrics."""
    kwargs = {"gamma": gamma, "alpha": alpha, "eps0": EPS0}
    dense_base = firm_merge(updates, epsilon=math.inf, **kwargs)
    epsilon = budget(dense_base)
    dense_projected = firm_merge(updates, epsilon=epsilon, **kwargs)
    reference_support = pooled_supports(updates, alpha)
    shapes = [tuple(t.shape) for t in updates[0].task_vector.values()]
    entries = sum(math.prod(s) for s in shapes)
    tv_bytes = sum(factor_bytes(s, lora_rank) for s in shapes)
    rows = []
    for form in forms or fisher_forms(alpha):
        compact, sizes = recode(updates, form)
        base = firm_merge(compact, epsilon=math.inf, **kwargs)
        projected = firm_merge(compact, epsilon=epsilon, **kwargs)
        fisher_bytes = statistics.fmean(sizes)
        row = {
            "form": form.form,
            "fraction": form.fraction if form.form == "topk" else None,
            "label": form.label,
            "base": relative_error(base, dense_base),
            "projected": relative_error(projected, dense_projected),
            "support_change": support_change(pooled_supports(compact, alpha), reference_support),
            "fisher_bytes": fisher_bytes,
            "fisher_bytes_ratio": fisher_bytes / (4 * entries),
            "upload_ratio": 8 * entries / (tv_bytes + fisher_bytes),
        }
        if evaluate is not None:
            row["metrics"] = {
                "base": evaluate(f"{form.label} base", base.delta),
                "projected": evaluate(f"{form.label} projected", projected.delta),
            }
        rows.append(row)
    active = sum(t["projection"]["active"] for t in dense_projected.report["tensors"].values())
    return {
        "entries_per_client": entries,
        "clients": {
            "forget": sum(u.role == "forget" for u in updates),
            "retain": sum(u.role == "retain" for u in updates),
            "forget_domains": len({u.domain for u in updates if u.role == "forget"}),
        },
        "gamma": gamma,
        "lora_rank": lora_rank,
        "epsilon": epsilon,
        "projection_active_tensors": f"{active}/{len(shapes)}",
        "rows": rows,
    }


# ------------------------------------------------------------------------------------ inputs
def synthetic_updates(
    per_domain: int,
    *,
    domains: int = 2,
    tensors: int = 3,
    rows: int = 2048,
    cols: int = 512,
    seed: int = 0,
) -> list[ClientUpdate]:
    """``simulations.bench_merge``'s inputs in float32: ``per_domain`` forget clients in each
    of ``domains`` forget domains, one retain client."""
    cfg = bench_merge.BenchConfig(
        forget_clients=per_domain * domains,
        domains=domains,
        multi_retain=0,
        tensors=tensors,
        rows=rows,
        cols=cols,
        dtype="fp32",
        seed=seed,
    )
    return bench_merge.make_inputs(cfg)[0]


def real_input(run_config: str, output_dir: Path, *, reuse: bool) -> dict[str, Any]:
    """The Flower run's uploads measured, every merged model evaluated."""
    flower = run_and_load_uploads(f"{RUN_CONFIG} {run_config}".strip(), output_dir, reuse=reuse)
    position = {str(a["node_id"]): i for i, a in enumerate(flower.results["assignments"])}
    flower.updates.sort(key=lambda u: position[str(u.node_id)])
    names = point_metrics(flower.run_model)

    def evaluate(name: str, delta: dict[str, torch.Tensor]) -> dict[str, Any]:
        metrics = flower.evaluate(name, delta)
        return {k: metrics.get(k) for k in names}

    result = measure_input(
        flower.updates,
        gamma=flower.settings.gamma,
        lora_rank=flower.settings.lora_rank,
        evaluate=evaluate,
    )
    before = flower.results["metrics"]["before"]
    reference = flower.results["metrics"].get("reference") or {}
    result["before"] = {k: before.get(k) for k in names}
    result["reference"] = {k: reference.get(k) for k in names}
    result["flower_run"] = str(flower.results_path)
    return result


# ------------------------------------------------------------------------------ recommendation
def max_errors(inputs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per form label: the largest e over inputs and both merges."""
    out: dict[str, float] = {}
    for result in inputs.values():
        for row in result["rows"]:
            err = max(row["base"]["error"], row["projected"]["error"])
            out[row["label"]] = max(out.get(row["label"], 0.0), err)
    return out


def recommend(inputs: dict[str, dict[str, Any]], bound: float) -> dict[str, Any]:
    """The smallest top-k α' whose e < ``bound`` on every input (``None`` if there is none),
    with its bytes on the first input (the real run unless it was skipped)."""
    worst = max_errors(inputs)
    bytes_input, first = next((k, v["rows"]) for k, v in inputs.items())
    fractions = sorted(r["fraction"] for r in first if r["form"] == "topk")
    chosen = next((f for f in fractions if worst[f"topk {f:g}"] < bound), None)
    row = next((r for r in first if chosen is not None and r["fraction"] == chosen), None)
    return {
        "bound": bound,
        "fraction": chosen,
        "max_error_by_form": worst,
        "bytes_input": bytes_input,
        "fisher_bytes_ratio": None if row is None else row["fisher_bytes_ratio"],
        "upload_ratio": None if row is None else row["upload_ratio"],
    }


# ------------------------------------------------------------------------------------ report
def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| input | Fisher form | e base | worst tensor | e projected | worst tensor "
        "| support changed | Fisher bytes / dense | dense / compact upload |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in summary["inputs"].items():
        for r in result["rows"]:
            b, p = r["base"], r["projected"]
            lines.append(
                f"| {name} | {r['label']} | {b['error']:.2%} | {b['worst_error']:.2%} "
                f"| {p['error']:.2%} | {p['worst_error']:.2%} | {r['support_change']:.2%} "
                f"| {r['fisher_bytes_ratio']:.3f} | {r['upload_ratio']:.1f}x |"
            )
    real = summary["inputs"].get("tofu-run")
    if real is not None:
        lines += ["", _metrics_table(real)]
    rec = summary["recommendation"]
    lines += [
        "",
        "Largest e over inputs and merges: "
        + ", ".join(f"{k} {v:.2%}" for k, v in rec["max_error_by_form"].items()),
    ]
    if rec["fraction"] is None:
        lines.append(
            f"No top-k fraction of the grid keeps e below {rec['bound']:.2%} on every input."
        )
    else:
        lines.append(
            f"Recommended fisher-upload-fraction: {rec['fraction']:g} (e < {rec['bound']:.2%} on "
            f"every input); Fisher {rec['fisher_bytes_ratio']:.3f} of dense, upload "
            f"{rec['upload_ratio']:.1f}x smaller than dense on {rec['bytes_input']}"
        )
    return "\n".join(lines) + "\n"


def _metrics_table(real: dict[str, Any]) -> str:
    names = list(real["before"])
    lines = [
        "| model | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, metrics in (("before", real["before"]), ("reference", real["reference"])):
        lines.append(f"| {label} | " + " | ".join(_num(metrics.get(n)) for n in names) + " |")
    for r in real["rows"]:
        for merge in ("base", "projected"):
            m = r["metrics"][merge]
            lines.append(
                f"| {r['label']} {merge} | " + " | ".join(_num(m.get(n)) for n in names) + " |"
            )
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(summary: dict[str, Any], path: Path) -> Path:
    """e against α'/α per input, FIRM base and projected; bf16 dashed, the bound dotted."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    alpha = summary["alpha"]
    for ax, merge in zip(axes, ("base", "projected"), strict=True):
        for i, (name, result) in enumerate(summary["inputs"].items()):
            color = f"C{i}"
            topk = [r for r in result["rows"] if r["form"] == "topk"]
            xs = [r["fraction"] / alpha for r in topk]
            ax.plot(xs, [100 * r[merge]["error"] for r in topk], "o-", color=color, label=name)
            bf16 = next(r for r in result["rows"] if r["form"] == "bf16")
            ax.axhline(100 * bf16[merge]["error"], color=color, ls="--", lw=0.8)
        ax.axhline(100 * summary["recommendation"]["bound"], color="k", ls=":", label="bound")
        ax.set_xscale("log")
        ax.set_xlabel("top-k fraction α' / α")
        ax.set_title(f"FIRM {merge} (dashed: bf16)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("‖Δ_compact − Δ_dense‖ / ‖Δ_dense‖ (%)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- CLI
def study(args: argparse.Namespace) -> dict[str, Any]:
    """The real run (unless ``--skip-run``) and the synthetic inputs, the recommendation."""
    inputs: dict[str, dict[str, Any]] = {}
    if not args.skip_run:
        inputs["tofu-run"] = real_input(
            args.run_config, args.output_dir / "flower-run", reuse=args.reuse_run
        )
    shape = {"tensors": args.tensors, "rows": args.rows, "cols": args.cols, "seed": args.seed}
    for n in SYNTHETIC_PER_DOMAIN:
        updates = synthetic_updates(n, **shape)
        inputs[f"synthetic {n}/domain"] = measure_input(
            updates, gamma=1.0, lora_rank=bench_merge.RANK
        )
        del updates
    return {
        "alpha": ALPHA,
        "epsilon_factor": EPSILON_FACTOR,
        "synthetic": shape,
        "inputs": inputs,
        "recommendation": recommend(inputs, args.bound),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="", help="added to the study's run config")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--reuse-run", action="store_true", help="reuse an earlier Flower run")
    parser.add_argument("--skip-run", action="store_true", help="synthetic inputs only")
    parser.add_argument("--bound", type=float, default=DEFAULT_BOUND, help="bound on e")
    parser.add_argument("--tensors", type=int, default=3, help="synthetic tensors")
    parser.add_argument("--rows", type=int, default=2048, help="synthetic rows")
    parser.add_argument("--cols", type=int, default=512, help="synthetic columns")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("flwr").propagate = False
    args.output_dir = (
        args.output_dir or run_local.REPO_ROOT / "outputs" / "fisher_upload"
    ).resolve()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary = study(args)
    text = markdown(summary)
    (args.output_dir / "fisher_upload.json").write_text(json.dumps(json_safe(summary), indent=2))
    (args.output_dir / "fisher_upload.md").write_text(text)
    plot(summary, args.output_dir / "fisher_upload.png")
    print(text)
    print(f"written to {args.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
