"""How exact is a top-k Fisher upload under MPU? Truncation in secret coordinates, measured.

Without MPU a top-α' Fisher upload with α' ≥ α is exact for a client whose own top-α FIRM
keeps (a retain client, the only forget client of its domain; ``fedunlearn.upload_codec``).
Under MPU (``wrapper=mpu``) that does not hold: each of a client's m copies is a different
noisy, reparameterised model, the client uploads the top-α' of *each copy's* Fisher in that
copy's secret coordinates, and the server maps every truncated diagonal back with T_k⁻¹ (the
squared inverse maps: RoPE-plane rotations and the per-head orthogonal v/o maps mix entries,
the MLP permutation does not) and averages the m of them. The top-α of that average is not the
top-α of the average of the dense diagonals — the same kind of error as pooling several
forget clients' truncated uploads, here within one client.

This script measures it as ``simulations.fisher_upload`` measures the pooled case:
e = ‖Δ_compact − Δ_dense‖ / ‖Δ_dense‖ of FIRM base (ε = ∞) over all adapted weights, where the
two merges differ only in the Fisher uploads (the same task vectors: seeded rank-``--rank``
updates per client, so that e isolates the Fisher). Every client's Fisher diagonals are real:
:func:`fedunlearn.fisher.empirical_fisher_diagonal` over ``--batches`` one-sequence batches of
its shard, on each copy the strategy (:class:`strategies.mpu_strategy.MpuStrategy`, its own
publishing) sends it, and mapped back and averaged by the server's own code
(:class:`fedunlearn.mpu.HarmonicUpload`). Two client sets on the built-in substrate model
(``--substrate-*``; the small one of ``simulations.fisher_upload``): ``single`` — one forget
client and one retain client (exact without MPU) — and ``pooled`` — two forget clients sharing
one domain and one retain client; each without MPU (the clients' Fisher at θ) and with MPU,
for α' ∈ {1, 2, 5}·α and 1. Per projection kind (q, k, v, o, gate, up, down) it also reports
the relative error of the mapped-back Fisher and the change of FIRM's kept entries of one
client's Fisher (``support_change`` of ``simulations.fisher_upload``).

    python -m simulations.mpu_fisher_upload [--copies 2] [--kappa 0.01] [--batches 4]

Writes ``mpu_fisher_upload.json`` and ``.md`` into ``--output-dir`` (default
``outputs/mpu_fisher_upload``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedunlearn.fisher import empirical_fisher_diagonal
from fedunlearn.merging import ClientUpdate, firm_merge
from fedunlearn.merging.firm import normalize_and_sparsify
from fedunlearn.models.substrate import SubstrateConfig, load_substrate
from fedunlearn.mpu import HarmonicUpload, UploadParts, parse_target
from fedunlearn.qa_format import encode_record
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.upload_codec import encode_fisher
from simulations import bench_merge
from simulations.fisher_upload import relative_error
from strategies.mpu_strategy import MpuStrategy
from strategies.results import json_safe

REPO_ROOT = Path(__file__).resolve().parents[1]
ALPHA = bench_merge.ALPHA
EPS0 = bench_merge.EPS0
GAMMA = 5.0
FRACTION_MULTIPLES = (1.0, 2.0, 5.0)
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
SECRET = b"mpu-fisher-upload-study-secret"
#: client sets: the roles of their clients (forget clients share one domain)
CLIENT_SETS = {"single": ("forget", "retain"), "pooled": ("forget", "forget", "retain")}


@dataclass(frozen=True)
class StudyConfig:
    """The model, the MPU settings and the Fisher estimate."""

    copies: int = 2
    kappa: float = 0.01
    batches: int = 4
    rank: int = 4
    seed: int = 0
    substrate_hidden_size: int = 128
    substrate_layers: int = 2
    substrate_intermediate_size: int = 256
    substrate_background_documents: int = 200
    substrate_authors: int = 20
    forget_percent: float = 10.0
    cache_dir: str = str(REPO_ROOT / ".cache")


def fractions(alpha: float = ALPHA) -> list[float]:
    """α' of the top-k uploads: the multiples of α, and 1."""
    return sorted({round(min(1.0, m * alpha), 12) for m in FRACTION_MULTIPLES} | {1.0})


def client_fishers(
    model: torch.nn.Module,
    copies: Sequence[Mapping[str, torch.Tensor]],
    examples: list,
    names: list[str],
    batches: int,
    pad_id: int,
) -> list[dict[str, torch.Tensor]]:
    """One client's empirical Fisher diagonal of ``names`` on each copy (its coordinates)."""
    out = []
    for copy in copies:
        model.load_state_dict(dict(copy), strict=False)
        out.append(
            empirical_fisher_diagonal(
                model, examples, names, pad_token_id=pad_id, num_batches=batches
            )
        )
    return out


def mapped_fisher(
    fishers: Sequence[Mapping[str, torch.Tensor]],
    strategy: MpuStrategy | None,
    position: int,
    fraction: float | None,
) -> dict[str, torch.Tensor]:
    """The server's Fisher of one client: each copy's diagonal uploaded dense (``fraction``
    None) or as its top-``fraction``, decoded, mapped back with T_k⁻¹ and averaged, by
    :class:`fedunlearn.mpu.HarmonicUpload`; without ``strategy`` the one diagonal at θ."""
    shapes = {k: tuple(v.shape) for k, v in fishers[0].items()}
    form = ("dense", 1.0) if fraction is None else ("topk", fraction)
    uploads = []
    for fisher in fishers:
        parts = encode_fisher(fisher, *form)
        uploads.append(UploadParts(list(parts), parts.__getitem__, shapes))
    transforms = None
    alphas = [1.0] * len(fishers)
    if strategy is not None:
        alphas = list(strategy.alphas)
        transforms = [strategy.copy_transforms(1, position, k) for k in range(len(fishers))]
    view = HarmonicUpload(uploads, alphas, transforms, fisher=True)
    return {key: view[key].clone() for key in view}


def task_vectors(
    shapes: Mapping[str, tuple[int, ...]], clients: int, rank: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """Seeded rank-``rank`` task vectors, one per client (the same for every Fisher form)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(clients):
        out.append(
            {
                k: torch.randn(s[0], rank, generator=gen) @ torch.randn(rank, s[1], generator=gen)
                for k, s in shapes.items()
            }
        )
    return out


def merge_error(
    roles: Sequence[str],
    deltas: Sequence[Mapping[str, torch.Tensor]],
    dense: Sequence[Mapping[str, torch.Tensor]],
    compact: Sequence[Mapping[str, torch.Tensor]],
) -> float:
    """e of FIRM base between the clients' dense and compact Fishers (same task vectors)."""

    def updates(fishers: Sequence[Mapping[str, torch.Tensor]]) -> list[ClientUpdate]:
        return [
            ClientUpdate(i, role, "d" if role == "forget" else None, 1, dict(d), dict(f))
            for i, (role, d, f) in enumerate(zip(roles, deltas, fishers, strict=True))
        ]

    kwargs = {"gamma": GAMMA, "alpha": ALPHA, "eps0": EPS0, "epsilon": math.inf}
    return relative_error(
        firm_merge(updates(compact), **kwargs), firm_merge(updates(dense), **kwargs)
    )["error"]


def per_kind(
    dense: Mapping[str, torch.Tensor], compact: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, float]]:
    """Per projection kind: ‖F_c − F_d‖ / ‖F_d‖ and Σ|S_c △ S_d| / Σ|S_d| of FIRM's kept
    entries (top-α of one client's Fisher)."""
    out = {}
    for kind in TARGETS:
        keys = [k for k in dense if (parse_target(k) or (0, ""))[1] == kind]
        diff = sum(float((compact[k].double() - dense[k].double()).pow(2).sum()) for k in keys)
        ref = sum(float(dense[k].double().pow(2).sum()) for k in keys)
        kept = [(normalize_and_sparsify(dense[k].clone(), ALPHA, EPS0) > 0) for k in keys]
        kept_c = [(normalize_and_sparsify(compact[k].clone(), ALPHA, EPS0) > 0) for k in keys]
        changed = sum(int((a ^ b).sum()) for a, b in zip(kept, kept_c, strict=True))
        out[kind] = {
            "fisher_error": math.sqrt(diff / ref) if ref > 0 else 0.0,
            "support_change": changed / max(1, sum(int(s.sum()) for s in kept)),
        }
    return out


def run_study(cfg: StudyConfig) -> dict[str, Any]:
    """Every measurement of the module docstring."""
    torch.manual_seed(cfg.seed)
    sub = load_substrate(
        SubstrateConfig(
            hidden_size=cfg.substrate_hidden_size,
            num_hidden_layers=cfg.substrate_layers,
            intermediate_size=cfg.substrate_intermediate_size,
            background_documents=cfg.substrate_background_documents,
            num_authors=cfg.substrate_authors,
        ),
        Path(cfg.cache_dir),
        show_progress=False,
    )
    model, tokenizer, data = sub.model, sub.tokenizer, sub.data
    forget = data.forget_split(cfg.forget_percent)
    retain = data.retain_split(cfg.forget_percent)
    shards = {
        "forget": [forget[0::2], forget[1::2]],
        "retain": [retain[: max(len(forget), cfg.batches)]],
    }
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = [k for k in state if (parse_target(k) or (0, ""))[1] in TARGETS]
    shapes = {k: tuple(state[k].shape) for k in names}
    results: dict[str, Any] = {"config": asdict(cfg), "weights": len(names), "sets": {}}
    for set_name, roles in CLIENT_SETS.items():
        used = {"forget": 0, "retain": 0}
        examples = []
        for role in roles:
            examples.append([encode_record(tokenizer, r) for r in shards[role][used[role]]])
            used[role] += 1
        strategy = MpuStrategy(
            merge="firm",
            model_config=model.config,
            secret=SECRET,
            copies=cfg.copies,
            kappa=cfg.kappa,
            shared_kappa=0.0,  # the mapping's own error, without the default's shared noise
            assignments=[ClientAssignment(r, "d", (i,)) for i, r in enumerate(roles)],
        )
        strategy.node_assignment = {100 + i: a for i, a in enumerate(strategy.assignments)}
        arrays = ArrayRecord(state)
        fishers: dict[str, list[list[dict[str, torch.Tensor]]]] = {"none": [], "mpu": []}
        for position, shard in enumerate(examples):
            content = strategy.node_content(1, position, arrays, ConfigRecord())
            copies = [content[f"arrays-{k}"].to_torch_state_dict() for k in range(strategy.copies)]
            pad = tokenizer.pad_token_id
            fishers["mpu"].append(client_fishers(model, copies, shard, names, cfg.batches, pad))
            fishers["none"].append(client_fishers(model, [state], shard, names, cfg.batches, pad))
        model.load_state_dict(state)
        deltas = task_vectors(shapes, len(roles), cfg.rank, cfg.seed)
        rows: dict[str, Any] = {}
        for wrapper, strat in (("none", None), ("mpu", strategy)):
            dense = [mapped_fisher(f, strat, p, None) for p, f in enumerate(fishers[wrapper])]
            rows[wrapper] = {}
            for fraction in fractions():
                compact = [
                    mapped_fisher(f, strat, p, fraction) for p, f in enumerate(fishers[wrapper])
                ]
                rows[wrapper][f"{fraction:g}"] = {
                    "error": merge_error(roles, deltas, dense, compact),
                    "per_kind_client_0": per_kind(dense[0], compact[0]),
                }
        results["sets"][set_name] = {"roles": list(roles), "rows": rows}
    return json_safe(results)


def markdown(results: dict[str, Any]) -> str:
    """The e table and the per-kind table at α' = α (single client set, MPU)."""
    cfg = results["config"]
    lines = [
        f"FIRM base e of top-α' Fisher uploads against dense ones (α = {ALPHA:g}; MPU m = "
        f"{cfg['copies']}, κ = {cfg['kappa']:g}; {cfg['batches']} Fisher batches; "
        f"{results['weights']} adapted weights)",
        "",
        "| client set | wrapper | " + " | ".join(f"α' = {f:g}" for f in fractions()) + " |",
        "|---|---|" + "---|" * len(fractions()),
    ]
    for set_name, entry in results["sets"].items():
        for wrapper, rows in entry["rows"].items():
            cells = " | ".join(f"{rows[f'{f:g}']['error']:.3g}" for f in fractions())
            lines.append(f"| {set_name} | {wrapper} | {cells} |")
    rows = results["sets"]["single"]["rows"]["mpu"][f"{ALPHA:g}"]["per_kind_client_0"]
    lines += [
        "",
        "single, MPU, α' = α, the forget client's mapped-back Fisher per projection kind:",
        "",
        "| kind | " + " | ".join(TARGETS) + " |",
        "|---|" + "---|" * len(TARGETS),
        "| Fisher error | " + " | ".join(f"{rows[k]['fisher_error']:.3g}" for k in TARGETS) + " |",
        "| kept entries changed | "
        + " | ".join(f"{rows[k]['support_change']:.3g}" for k in TARGETS)
        + " |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = StudyConfig()
    for name in ("copies", "batches", "rank", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--kappa", type=float, default=defaults.kappa)
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--output-dir", type=Path, default=REPO_ROOT / "outputs/mpu_fisher_upload")
    args = parser.parse_args(argv)
    cfg = StudyConfig(
        copies=args.copies,
        kappa=args.kappa,
        batches=args.batches,
        rank=args.rank,
        seed=args.seed,
        cache_dir=args.cache_dir,
    )
    results = run_study(cfg)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "mpu_fisher_upload.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (args.output_dir / "mpu_fisher_upload.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
