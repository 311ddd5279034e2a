"""What ONE malicious forget client does to FIRM and FULM, with and without the robust options.

The attacker is one forget client that uploads its honest task vector ×1000 or its honest
Fisher diagonal ×1e6 (FIRM paper, open problems). Every (attack, merge, robust off/on) is
merged offline from the same uploads — no Flower run — and compared with the honest merge
(all clients honest, robust off):

* ``‖Δ‖ / ‖Δ_honest‖`` — how much the attacker inflates the update;
* ``cos(Δ, Δ_honest)`` and ``‖Δ − Δ_honest‖ / ‖Δ_honest‖`` — how far it turns it;
* gain on the honest clients' directions: the mean over the honest forget clients i of
  ``⟨Δ, τ_i⟩ / ⟨Δ_honest, τ_i⟩`` (1 = their unlearning is applied as in the honest merge);
* the clients the robust options touched (``clipped`` / ``Fisher-capped``);
* with ``--evaluate`` (the default tofu uploads only; ~10 s per row): forget ROUGE-L and model
  utility of θ₀ + Δ.

Uploads: ``--uploads auto`` takes the saved uploads of the default tofu sweep
(``outputs/sweep-default/flower-run/uploads``, 5 forget + 1 retain, one forget domain) and of
the wmdp sweep (``outputs/sweep-wmdp/flower-run/uploads``, 2 forget domains × 3 + 1 retain)
when they exist (``fedunlearn.uploads.load_uploads``), otherwise synthetic ``ClientUpdate``\\ s
with the shapes of the built-in model (hidden 192, 4 layers, intermediate 512, all seven
projections; rank-16 task vectors, heavy-tailed Fisher); the table says which.

    python -m simulations.attack_table --norm-bound 2 --fisher-cap 20 [--evaluate]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fedunlearn.merging import ClientUpdate, MergeResult, firm_merge, fulm_merge
from fedunlearn.merging.robust import apply_robust
from fedunlearn.uploads import load_uploads

DEFAULT_SOURCES = (
    Path("outputs/sweep-default/flower-run/uploads"),
    Path("outputs/sweep-wmdp/flower-run/uploads"),
)
ATTACKS = ("none", "task vector ×1000", "Fisher ×1e6")
DEFAULT_GAMMAS = {"firm": 8.0, "fulm": 0.5}  # comparable forgetting on the default tofu run


def synthetic_updates(seed: int = 0) -> list[ClientUpdate]:
    """5 forget clients (one domain) + 1 retain client with the built-in model's shapes."""
    hidden, inter, layers, kv = 192, 512, 4, 96
    shapes = {}
    for layer in range(layers):
        base = f"model.layers.{layer}."
        shapes.update(
            {
                base + "self_attn.q_proj.weight": (hidden, hidden),
                base + "self_attn.k_proj.weight": (kv, hidden),
                base + "self_attn.v_proj.weight": (kv, hidden),
                base + "self_attn.o_proj.weight": (hidden, hidden),
                base + "mlp.gate_proj.weight": (inter, hidden),
                base + "mlp.up_proj.weight": (inter, hidden),
                base + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    gen = torch.Generator().manual_seed(seed)
    shared = {k: _low_rank(s, gen) for k, s in shapes.items()}  # what forgetting has in common
    updates = []
    for i in range(6):
        role = "forget" if i < 5 else "retain"
        tv, fisher = {}, {}
        for k, s in shapes.items():
            own = _low_rank(s, gen)
            tv[k] = own if role == "retain" else 0.7 * shared[k] + 0.3 * own
            # squared gradients: heavy tailed, tiny (1e-10..1e-6), client-specific scale
            scale = 1e-8 * math.exp(0.7 * float(torch.randn((), generator=gen)))
            fisher[k] = scale * torch.randn(s, generator=gen).pow(2) * torch.rand(s, generator=gen)
        domain = "synthetic-forget" if role == "forget" else "retain"
        updates.append(ClientUpdate(f"c{i}", role, domain, 4, tv, fisher))
    return updates


def _low_rank(shape: tuple[int, int], gen: torch.Generator, rank: int = 16) -> torch.Tensor:
    b = torch.randn(shape[0], rank, generator=gen) * 0.01
    a = torch.randn(rank, shape[1], generator=gen) * 0.01
    return 2.0 * b @ a  # s·B@A with s = α/r = 2


def attacked(updates: Sequence[ClientUpdate], attack: str, victim: int) -> list[ClientUpdate]:
    """``updates`` with client ``victim`` replaced by its manipulated upload."""
    out = list(updates)
    u = out[victim]
    if attack == "task vector ×1000":
        out[victim] = dataclasses.replace(
            u, task_vector={k: v * 1000.0 for k, v in u.task_vector.items()}
        )
    elif attack == "Fisher ×1e6":
        out[victim] = dataclasses.replace(u, fisher={k: v * 1e6 for k, v in u.fisher.items()})
    elif attack != "none":
        raise ValueError(f"unknown attack {attack!r}")
    return out


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k].double() * b[k].double()).sum()) for k in a)


def compare(
    delta: dict[str, torch.Tensor],
    honest: dict[str, torch.Tensor],
    directions: Sequence[dict[str, torch.Tensor]],
) -> dict[str, float]:
    """Norm ratio, cosine, relative error and mean gain on ``directions`` of ``delta`` vs
    ``honest``."""
    hh, dd, dh = _dot(honest, honest), _dot(delta, delta), _dot(delta, honest)
    diff = {k: delta[k].double() - honest[k].double() for k in honest}
    gains = [_dot(delta, t) / _dot(honest, t) for t in directions if _dot(honest, t) != 0]
    return {
        "norm_ratio": math.sqrt(dd / hh),
        "cosine": dh / math.sqrt(dd * hh) if dd > 0 else 0.0,
        "relative_error": math.sqrt(_dot(diff, diff) / hh),
        "honest_gain": sum(gains) / len(gains) if gains else math.nan,
    }


def merge(name: str, updates: Sequence[ClientUpdate], gamma: float) -> MergeResult:
    if name == "firm":
        return firm_merge(updates, gamma=gamma, alpha=0.1, eps0=1e-8)
    if name == "fulm":
        return fulm_merge(updates, gamma=gamma, threshold=0.6, k=0.3)
    raise ValueError(f"unknown merge {name!r}")


def table_rows(
    updates: list[ClientUpdate],
    *,
    norm_bound: float,
    fisher_cap: float,
    gammas: dict[str, float],
    evaluate: Any = None,
) -> list[dict[str, Any]]:
    """One row per (attack, merge, robust off/on); ``evaluate(label, delta)`` → metrics."""
    forget = [i for i, u in enumerate(updates) if u.role == "forget"]
    victim = forget[0]
    directions = [updates[i].task_vector for i in forget if i != victim]
    rows = []
    for name, gamma in gammas.items():
        honest = merge(name, updates, gamma).delta
        for attack in ATTACKS:
            bad = attacked(updates, attack, victim)
            for robust in (False, True):
                merged, report = bad, {}
                if robust:
                    merged, report = apply_robust(bad, norm_bound=norm_bound, fisher_cap=fisher_cap)
                delta = merge(name, merged, gamma).delta
                row = {
                    "attack": attack,
                    "merge": f"{name} γ={gamma:g}",
                    "robust": "on" if robust else "off",
                    **compare(delta, honest, directions),
                    "clipped": sum(r.get("norm_scale", 1.0) < 1.0 for r in report.values()),
                    "capped": sum(r.get("fisher_scaled_tensors", 0) > 0 for r in report.values()),
                    "identical": all(torch.equal(delta[k], honest[k]) for k in honest),
                }
                if evaluate is not None:
                    row.update(evaluate(f"{attack} {name} robust {row['robust']}", delta))
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    extra = [k for k in ("forget_rouge_l", "model_utility") if k in rows[0]]
    head = [
        "attack",
        "merge",
        "robust",
        "‖Δ‖ / ‖Δ_honest‖",
        "cos to honest",
        "‖Δ−Δ_honest‖ / ‖Δ_honest‖",
        "gain on honest clients' directions",
        "clients clipped / Fisher-capped",
        *extra,
    ]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["attack"],
            r["merge"],
            r["robust"],
            f"{r['norm_ratio']:.3g}",
            f"{r['cosine']:.3f}",
            "0 (bit-identical)" if r["identical"] else f"{r['relative_error']:.3g}",
            f"{r['honest_gain']:.3g}",
            f"{r['clipped']} / {r['capped']}",
            *(f"{r[k]:.3f}" for k in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _evaluator(uploads: Path):
    """θ₀ + Δ evaluated like the sweep does (needs the run's results.json and substrate)."""
    from simulations.sweep import run_and_load_uploads  # Flower-free when reuse hits

    flower = run_and_load_uploads("", uploads.parent, reuse=True)

    def evaluate(label: str, delta: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics = flower.evaluate(label, delta)
        return {k: float(metrics[k]) for k in ("forget_rouge_l", "model_utility") if k in metrics}

    return evaluate


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uploads", nargs="*", default=["auto"], help="saved-uploads folders")
    parser.add_argument(
        "--norm-bound", type=float, default=2.0, help="server.robust-norm-bound when on"
    )
    parser.add_argument("--fisher-cap", type=float, default=20.0, help="server.fisher-cap when on")
    parser.add_argument("--gammas", default="firm=8 fulm=0.5", help="'merge=γ ...'")
    parser.add_argument("--evaluate", action="store_true", help="also evaluate (tofu uploads)")
    parser.add_argument("--out", type=Path, default=Path("outputs/attack-table.md"))
    args = parser.parse_args(argv)
    gammas = {k: float(v) for k, v in (item.split("=") for item in args.gammas.split())}
    sources: list[Path | None] = []
    for item in args.uploads:
        if item == "auto":
            sources += [p for p in DEFAULT_SOURCES if (p / "uploads.json").is_file()]
        else:
            sources.append(Path(item))
    if not sources:
        sources = [None]
    text = (
        f"Robust options when on: server.robust-norm-bound={args.norm_bound:g}, "
        f"server.fisher-cap={args.fisher_cap:g}. The attacker is the first forget client; "
        "'honest' = the same merge of the unmodified uploads with robust off.\n\n"
    )
    for source in sources:
        if source is None:
            updates, title = synthetic_updates(), "synthetic uploads (built-in model shapes)"
        else:
            updates, title = load_uploads(source), f"saved uploads {source}"
        roles = [u.role for u in updates]
        domains = sorted({str(u.domain) for u in updates if u.role == "forget"})
        title += (
            f" — {roles.count('forget')} forget ({', '.join(domains)}) + "
            f"{roles.count('retain')} retain"
        )
        evaluate = None
        if args.evaluate and source is not None and "tofu" in domains[0]:
            evaluate = _evaluator(source)
        rows = table_rows(
            updates,
            norm_bound=args.norm_bound,
            fisher_cap=args.fisher_cap,
            gammas=gammas,
            evaluate=evaluate,
        )
        text += markdown(rows, title) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
