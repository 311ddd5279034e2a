"""How much Fisher must a client upload? Compact Fisher uploads against FIRM's dense merge.

FIRM (docs/algorithms.md, "FIRM base merge") keeps the top-α entries of every retain client's
own F̂_k and of every forget domain's pooled mean F̄_g = (1/n_g)·Σ_i F̂_i. A top-α' upload
(``fedunlearn.upload_codec``) with α' ≥ α is exact for the former and for a domain of one
client; for n_g > 1 the server pools the truncated uploads (dropped entries decode as 0), whose
top-α is not the pooled mean's.

For every input and every Fisher form (dense, bf16, top-α' for α' ∈ {1, 1.25, 1.5, 2, 3, 5}·α
and 1) each client's Fisher is encoded and decoded as the server decodes it, and FIRM base
(ε = ∞) and FIRM with the projection (ε = ``EPSILON_FACTOR`` × the mean FIRM-base damage of the
dense uploads, so the budget is active) are merged. Reported per form:

* ``error``: e = ‖Δ_compact − Δ_dense‖ / ‖Δ_dense‖ over all tensors, and the worst tensor's;
* ``support_change``: Σ|S_c △ S_d| / Σ|S_d| over tensors and forget domains, S the entries
  kept of the pooled F̃_g;
* ``fisher_bytes_ratio``: Fisher bytes per client / dense float32 (4 bytes per entry); top-k
  costs its deflated mask (under 1 bit per entry) plus 4 bytes per kept value;
* ``upload_ratio``: dense upload (task vector + Fisher, 8 bytes per entry) / compact upload
  (task vector as rank-r LoRA factors, r·(d_in + d_out) + 1 floats per weight, + the Fisher;
  r is the run's ``lora.rank``, for synthetic inputs the rank their task vectors are drawn at);
* real input only: the scenario's metrics of θ₀ + Δ (forgetting and utility).

F̂ is itself an estimate from N = ``training.fisher-batches`` batches of one sequence of the client's
shard. The yardstick is therefore the ``resampling`` rows: the same e, dense Fishers estimated
again from R = ``--redraws`` other draws of N batches of the same data, the same task vectors and
ε; redrawn for every client, and for the forget clients only (the retain clients keep the
uploaded F̂, which a top-α' upload with α' ≥ α sends exactly). On the real run each client's F̂
is recomputed at θ₀ (the weights the clients received in the run's one round; recomputing the
run's own batches must give the uploaded F̂, on CPU bit for bit): redraw r uses the r-th block of N
examples after the N the run used where the shard holds (R+1)·N examples (disjoint batches),
otherwise N examples drawn with replacement from the shard (the run's forget shards are
smaller than N, so their F̂ was the shard mean). A synthetic input's redraw multiplies every F̂
entrywise by exp(σz − σ²/2), z ~ N(0, 1), σ² = ln(1 + ρ²), which keeps its mean and moves it by
ρ in relative norm, ρ the role's relative spread measured between two real redraws
(``--fisher-spread`` without the run).

Recommendation: the resampling bound b is the smallest, over inputs and both merges, median
over redraws of the resampling e (every client's F̂ redrawn); the recommended
``upload.fisher-fraction`` is the smallest α' of the grid whose worst e (over inputs, FIRM base
and projected) is at most b, printed with its bytes per client. Also reported: the α' under b
with only the forget clients' F̂ redrawn, and the α' that keeps e ≤ ``--bound`` (a fixed 1 %).

Inputs: a real Flower run of the built-in tofu scenario (small substrate, 4 forget clients in
one domain, 2 retain clients, dense uploads saved), and synthetic uploads of
``simulations.bench_merge``'s kind with 1, 2, 4 and 8 forget clients per domain.

    python -m simulations.fisher_upload [--reuse-run] [--bound 0.01] [--redraws 3]

Writes ``fisher_upload.json``, ``fisher_upload.md`` and ``fisher_upload.png`` into
``--output-dir`` (default ``outputs/fisher_upload``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from fedunlearn.fisher import empirical_fisher_diagonal  # noqa: E402
from fedunlearn.merging import ClientUpdate, MergeResult, firm_merge  # noqa: E402
from fedunlearn.merging.firm import normalize_and_sparsify  # noqa: E402
from fedunlearn.qa_format import encode_record  # noqa: E402
from fedunlearn.upload_codec import DecodedTensors, encode_fisher, upload_bytes  # noqa: E402
from simulations import bench_merge, run_local  # noqa: E402
from simulations.sweep import FlowerUploads, point_metrics, run_and_load_uploads  # noqa: E402
from strategies.results import json_safe  # noqa: E402

ALPHA = bench_merge.ALPHA
EPS0 = bench_merge.EPS0
#: α' / α of the top-k grid (α' = 1 is added)
FRACTION_MULTIPLES = (1.0, 1.25, 1.5, 2.0, 3.0, 5.0)
EPSILON_FACTOR = 0.3
DEFAULT_BOUND = 0.01
#: R, the redraws of every client's Fisher
REDRAWS = 3
#: the run's batches recomputed at θ₀ must give the uploaded F̂ to this relative difference
REPRODUCTION_TOLERANCE = 1e-5
#: ρ of the synthetic redraws without a real run (the forget clients' on the tofu run; the
#: retain clients' was larger, 1.15)
DEFAULT_SPREAD = 0.35
#: the built-in tofu scenario at the small substrate (a Flower run of about 1.5 minutes on 2
#: cores): 2 forget authors over 4 forget clients in ONE domain, 2 retain clients; the Fisher
#: is uploaded dense so that the saved uploads are the raw F̂
RUN_CONFIG = (
    "substrate.hidden-size=128 substrate.layers=2 substrate.intermediate-size=256 "
    "substrate.background-documents=200 scenario.num-authors=20 scenario.forget-percent=10.0 "
    "scenario.retain-samples=80 eval.retain-samples=50 gamma=5.0 "
    "scenario.num-forget-clients=4 scenario.num-forget-domains=1 "
    "scenario.num-retain-clients=2 upload.fisher='dense'"
)
SYNTHETIC_PER_DOMAIN = (1, 2, 4, 8)
MERGES = ("base", "projected")
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
        out.append(dataclasses.replace(u, fisher={k: decoded[k] for k in decoded}))
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


@dataclass
class DenseReference:
    """FIRM base and projected on the dense uploads, the budget ε and the pooled supports."""

    base: MergeResult
    projected: MergeResult
    epsilon: float
    support: dict[tuple[str, str], torch.Tensor]
    merge_kwargs: dict[str, float]

    def compare(
        self, updates: Sequence[ClientUpdate], name: str, evaluate: Evaluate | None
    ) -> dict[str, Any]:
        """e of both merges of ``updates`` against the dense ones (same ε), the support
        change and, with ``evaluate``, the merged models' metrics."""
        base = firm_merge(updates, epsilon=math.inf, **self.merge_kwargs)
        projected = firm_merge(updates, epsilon=self.epsilon, **self.merge_kwargs)
        alpha = self.merge_kwargs["alpha"]
        row: dict[str, Any] = {
            "base": relative_error(base, self.base),
            "projected": relative_error(projected, self.projected),
            "support_change": support_change(pooled_supports(updates, alpha), self.support),
        }
        if evaluate is not None:
            row["metrics"] = {
                "base": evaluate(f"{name} base", base.delta),
                "projected": evaluate(f"{name} projected", projected.delta),
            }
        return row


def dense_reference(updates: Sequence[ClientUpdate], gamma: float, alpha: float) -> DenseReference:
    """The dense merges every other merge of ``updates`` is measured against."""
    kwargs = {"gamma": gamma, "alpha": alpha, "eps0": EPS0}
    base = firm_merge(updates, epsilon=math.inf, **kwargs)
    epsilon = budget(base)
    projected = firm_merge(updates, epsilon=epsilon, **kwargs)
    return DenseReference(base, projected, epsilon, pooled_supports(updates, alpha), kwargs)


#: the resampling rows: every client's F̂ redrawn, or only the forget clients' (the retain
#: clients keep the uploaded F̂, which a top-α' upload with α' ≥ α sends exactly)
REDRAWN = ("all", "forget")
REDRAWN_TEXT = {"all": "all clients", "forget": "forget clients only"}


def resampling(
    reference: DenseReference,
    updates: Sequence[ClientUpdate],
    redraws: Iterable[Sequence[ClientUpdate]],
    evaluate: Evaluate | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``resampling`` rows (:data:`REDRAWN`): every redraw's e against the dense merge
    of ``updates``, and per merge the min / median / max over redraws (support change:
    median); empty without redraws."""
    draws: dict[str, list[dict[str, Any]]] = {k: [] for k in REDRAWN}
    for r, redraw in enumerate(redraws, start=1):
        draws["all"].append(reference.compare(redraw, f"resample {r}", evaluate))
        forget = [d if u.role == "forget" else u for u, d in zip(updates, redraw, strict=True)]
        draws["forget"].append(reference.compare(forget, f"resample {r} forget", evaluate))
    return {k: _over_draws(v) for k, v in draws.items() if v}


def _over_draws(draws: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"draws": draws}
    for merge in MERGES:
        errors = [d[merge]["error"] for d in draws]
        out[merge] = {"min": min(errors), "median": statistics.median(errors), "max": max(errors)}
    out["support_change"] = statistics.median(d["support_change"] for d in draws)
    return out


def measure_input(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float,
    lora_rank: int,
    forms: Sequence[FisherForm] | None = None,
    alpha: float = ALPHA,
    evaluate: Evaluate | None = None,
    redraws: Iterable[Sequence[ClientUpdate]] = (),
) -> dict[str, Any]:
    """Every form's merge errors, support change and bytes on one input (see the module
    docstring), the ``resampling`` rows of the ``redraws`` (the same clients with F̂ estimated
    again; none: no rows); with ``evaluate`` also the merged models' metrics."""
    reference = dense_reference(updates, gamma, alpha)
    shapes = [tuple(t.shape) for t in updates[0].task_vector.values()]
    entries = sum(math.prod(s) for s in shapes)
    tv_bytes = sum(factor_bytes(s, lora_rank) for s in shapes)
    rows = []
    for form in forms or fisher_forms(alpha):
        compact, sizes = recode(updates, form)
        fisher_bytes = statistics.fmean(sizes)
        rows.append(
            {
                "form": form.form,
                "fraction": form.fraction if form.form == "topk" else None,
                "label": form.label,
                **reference.compare(compact, form.label, evaluate),
                "fisher_bytes": fisher_bytes,
                "fisher_bytes_ratio": fisher_bytes / (4 * entries),
                "upload_bytes": tv_bytes + fisher_bytes,
                "upload_ratio": 8 * entries / (tv_bytes + fisher_bytes),
            }
        )
    tensors = reference.projected.report["tensors"].values()
    active = sum(t["projection"]["active"] for t in tensors)
    result = {
        "entries_per_client": entries,
        "clients": {
            "forget": sum(u.role == "forget" for u in updates),
            "retain": sum(u.role == "retain" for u in updates),
            "forget_domains": len({u.domain for u in updates if u.role == "forget"}),
        },
        "gamma": gamma,
        "lora_rank": lora_rank,
        "epsilon": reference.epsilon,
        "projection_active_tensors": f"{active}/{len(shapes)}",
        "rows": rows,
    }
    resampled = resampling(reference, updates, redraws, evaluate)
    if resampled:
        result["resampling"] = resampled
    return result


# -------------------------------------------------------------------------- Fisher redraws
def redraw_batches(
    num_examples: int, num_batches: int, redraw: int, *, redraws: int = REDRAWS, seed: int = 0
) -> list[int]:
    """Shard positions of the N = ``num_batches`` one-sequence batches of redraw r ≥ 1: the
    r-th block of N after the N the run used (disjoint from them and from the other redraws)
    where the shard holds (R+1)·N examples, else N draws with replacement (seeded)."""
    if not 1 <= redraw <= redraws:
        raise ValueError(f"redraw must be in 1..{redraws}, got {redraw}")
    if num_examples >= (redraws + 1) * num_batches:
        return list(range(redraw * num_batches, (redraw + 1) * num_batches))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(num_examples, (num_batches,), generator=generator).tolist()


def refit_fishers(
    flower: FlowerUploads, choose: Callable[[int, int], Sequence[int]]
) -> list[ClientUpdate]:
    """The run's uploads with every F̂ recomputed at θ₀ from the shard positions
    ``choose(client position, shard size)`` (one batch each, in that order)."""
    records = flower.run_model.scenario.records()
    shards = {str(a["node_id"]): a["indices"] for a in flower.results["assignments"]}
    tokenizer, model = flower.run_model.tokenizer, flower.run_model.model
    out = []
    for position, u in enumerate(flower.updates):
        shard = [records[i] for i in shards[str(u.node_id)]]
        chosen = [encode_record(tokenizer, shard[i]) for i in choose(position, len(shard))]
        fisher = empirical_fisher_diagonal(
            model,
            chosen,
            list(u.task_vector),
            pad_token_id=tokenizer.pad_token_id,
            num_batches=len(chosen),
        )
        out.append(dataclasses.replace(u, fisher=fisher))
    return out


def max_relative_difference(a: Sequence[ClientUpdate], b: Sequence[ClientUpdate]) -> float:
    """max over clients and tensors of max|F̂ᵃ − F̂ᵇ| / max|F̂ᵇ|."""
    return max(
        float((_fisher(ua)[k].float() - f.float()).abs().max()) / float(f.float().abs().max())
        for ua, ub in zip(a, b, strict=True)
        for k, f in _fisher(ub).items()
    )


def _fisher(u: ClientUpdate) -> Mapping[str, torch.Tensor]:
    if u.fisher is None:
        raise ValueError(f"client {u.node_id!r} has no Fisher diagonal")
    return u.fisher


def real_redraws(flower: FlowerUploads, redraws: int) -> tuple[list[list[ClientUpdate]], float]:
    """R redraws of every client's F̂ at θ₀ (:func:`redraw_batches`), and how far the run's
    own batches recomputed are from the uploaded F̂ (max relative difference; above
    ``REPRODUCTION_TOLERANCE`` θ₀ or the shards are not the clients', an error)."""
    if flower.results["config"].get("num-rounds") != 1:
        raise ValueError("Fisher redraws need a one-round run: θ₀ is the weights before it")
    n_batches, seed = flower.settings.training.fisher_batches, flower.settings.seed
    rerun = refit_fishers(flower, lambda _, n: [b % n for b in range(n_batches)])
    reproduction = max_relative_difference(rerun, flower.updates)
    if reproduction > REPRODUCTION_TOLERANCE:
        raise ValueError(
            f"recomputing the run's Fisher batches is {reproduction:.2e} from the uploaded F̂"
        )
    draws = [
        refit_fishers(
            flower,
            lambda position, n, r=r: redraw_batches(
                n, n_batches, r, redraws=redraws, seed=seed * 10_000 + 100 * position + r
            ),
        )
        for r in range(1, redraws + 1)
    ]
    return draws, reproduction


def relative_spread(
    a: Sequence[ClientUpdate], b: Sequence[ClientUpdate], uploaded: Sequence[ClientUpdate]
) -> dict[str, float]:
    """ρ per role: the median over its clients of ‖F̂ᵃ − F̂ᵇ‖ / (√2·‖F̂‖) over all tensors,
    F̂ the uploaded Fisher: one redraw's relative deviation if two redraws are independent
    (their difference has twice one draw's variance)."""
    spreads: dict[str, list[float]] = {}
    for ua, ub, u in zip(a, b, uploaded, strict=True):
        fa, fb, f = _fisher(ua), _fisher(ub), _fisher(u)
        diff = sum(float((fa[k] - fb[k]).double().pow(2).sum()) for k in f)
        ref = sum(float(v.double().pow(2).sum()) for v in f.values())
        spreads.setdefault(u.role, []).append(math.sqrt(diff / (2 * ref)))
    return {role: statistics.median(v) for role, v in spreads.items()}


def perturbed(
    updates: Sequence[ClientUpdate], spread: dict[str, float], seed: int
) -> list[ClientUpdate]:
    """A synthetic redraw: every F̂ times exp(σz − σ²/2) entrywise, z ~ N(0, 1) i.i.d.,
    σ² = ln(1 + ρ²), ρ = ``spread[role]``: E F̂' = F̂ and E‖F̂' − F̂‖² = ρ²‖F̂‖²."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for u in updates:
        sigma = math.sqrt(math.log1p(spread[u.role] ** 2))
        fisher = {}
        for k, f in _fisher(u).items():
            z = torch.randn(f.shape, generator=generator, dtype=torch.float32)
            fisher[k] = f.float() * z.mul_(sigma).sub_(sigma**2 / 2).exp_()
        out.append(dataclasses.replace(u, fisher=fisher))
    return out


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


def synthetic_input(
    per_domain: int, spread: dict[str, float], redraws: int, shape: dict[str, int]
) -> dict[str, Any]:
    """A synthetic input measured, with ``redraws`` :func:`perturbed` redraws."""
    updates = synthetic_updates(per_domain, **shape)
    draws = (perturbed(updates, spread, 1000 * shape["seed"] + r) for r in range(1, redraws + 1))
    return measure_input(updates, gamma=1.0, lora_rank=bench_merge.RANK, redraws=draws)


def real_input(
    run_config: str, output_dir: Path, *, reuse: bool, redraws: int, evaluated: bool = True
) -> tuple[dict[str, Any], dict[str, float]]:
    """The Flower run's uploads measured with their real Fisher redraws, every merged model
    evaluated (unless not ``evaluated``); and ρ per role between the first two redraws.
    ``run_config`` replaces the keys of :data:`RUN_CONFIG` it names."""
    config = run_local.with_overrides(RUN_CONFIG, run_config)
    flower = run_and_load_uploads(config, output_dir, reuse=reuse)
    position = {str(a["node_id"]): i for i, a in enumerate(flower.results["assignments"])}
    flower.updates.sort(key=lambda u: position[str(u.node_id)])
    names = point_metrics(flower.run_model)

    def evaluate(name: str, delta: dict[str, torch.Tensor]) -> dict[str, Any]:
        metrics = flower.evaluate(name, delta)
        return {k: metrics.get(k) for k in names}

    draws, reproduction = real_redraws(flower, redraws)
    spread = relative_spread(draws[0], draws[1], flower.updates)
    result = measure_input(
        flower.updates,
        gamma=flower.settings.gamma,
        lora_rank=flower.settings.lora.rank,
        evaluate=evaluate if evaluated else None,
        redraws=draws,
    )
    before = flower.results["metrics"]["before"]
    reference = flower.results["metrics"].get("reference") or {}
    result["before"] = {k: before.get(k) for k in names}
    result["reference"] = {k: reference.get(k) for k in names}
    result["flower_run"] = str(flower.results_path)
    result["fisher_batches"] = flower.settings.training.fisher_batches
    result["fisher_reproduction_max_rel_diff"] = reproduction
    result["shard_sizes"] = [
        {"role": a["role"], "examples": len(a["indices"])} for a in flower.results["assignments"]
    ]
    result["fisher_spread"] = spread
    return result, spread


# ------------------------------------------------------------------------------ recommendation
def max_errors(inputs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per form label: the largest e over inputs and both merges."""
    out: dict[str, float] = {}
    for result in inputs.values():
        for row in result["rows"]:
            err = max(row["base"]["error"], row["projected"]["error"])
            out[row["label"]] = max(out.get(row["label"], 0.0), err)
    return out


def resampling_bound(inputs: dict[str, dict[str, Any]], redrawn: str = "all") -> float | None:
    """b: the smallest, over inputs with redraws and both merges, median over redraws of the
    resampling e with ``redrawn`` clients' F̂ redrawn (``None`` without redraws)."""
    medians = [
        result["resampling"][redrawn][merge]["median"]
        for result in inputs.values()
        if "resampling" in result
        for merge in MERGES
    ]
    return min(medians) if medians else None


def smallest_fraction(inputs: dict[str, dict[str, Any]], bound: float) -> dict[str, Any]:
    """The smallest top-k α' whose e ≤ ``bound`` on every input and both merges (``None`` if
    there is none), with its bytes per client on the first input (the real run unless it was
    skipped)."""
    worst = max_errors(inputs)
    bytes_input, first = next((k, v["rows"]) for k, v in inputs.items())
    fractions = sorted(r["fraction"] for r in first if r["form"] == "topk")
    chosen = next((f for f in fractions if worst[f"topk {f:g}"] <= bound), None)
    row = next((r for r in first if chosen is not None and r["fraction"] == chosen), {})
    return {
        "bound": bound,
        "fraction": chosen,
        "bytes_input": bytes_input,
        **{k: row.get(k) for k in ("fisher_bytes", "fisher_bytes_ratio", "upload_bytes")},
        "upload_ratio": row.get("upload_ratio"),
    }


def recommend(inputs: dict[str, dict[str, Any]], fixed_bound: float) -> dict[str, Any]:
    """The recommendation (α' under the resampling bound b, every client's F̂ redrawn), the α'
    under b with only the forget clients' F̂ redrawn, and the fixed-bound rule's α'."""
    out: dict[str, Any] = {"max_error_by_form": max_errors(inputs)}
    for redrawn in REDRAWN:
        bound = resampling_bound(inputs, redrawn)
        out[f"resampling_{redrawn}"] = None if bound is None else smallest_fraction(inputs, bound)
    out["fixed"] = smallest_fraction(inputs, fixed_bound)
    return out


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
        for redrawn, s in result.get("resampling", {}).items():
            lines.append(
                f"| {name} | Fisher resampling, {REDRAWN_TEXT[redrawn]} ({len(s['draws'])} "
                f"redraws, min / median) | {_range(s['base'])} | - | {_range(s['projected'])} "
                f"| - | {s['support_change']:.2%} | 1.000 (dense) | - |"
            )
    lines += ["", _by_fraction_table(summary)]
    real = summary["inputs"].get("tofu-run")
    if real is not None:
        lines += ["", _redraw_note(real)]
        if all("metrics" in r for r in real["rows"]):
            lines += ["", _metrics_table(real)]
    lines += ["", *_recommendation_lines(summary["recommendation"])]
    return "\n".join(lines) + "\n"


def _range(stats: dict[str, float]) -> str:
    return f"{stats['min']:.2%} / {stats['median']:.2%}"


def _by_fraction_table(summary: dict[str, Any]) -> str:
    """Per form: e on the real run and the worst synthetic input, and its bytes."""
    inputs = summary["inputs"]
    real = inputs.get("tofu-run")
    synthetic = [v for k, v in inputs.items() if k != "tofu-run"]
    first = next(iter(inputs.values()))
    lines = [
        "| Fisher form | e base real | e projected real | e base synthetic worst "
        "| e projected synthetic worst | Fisher bytes / dense | Fisher bytes per client |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(first["rows"]):
        cells = ["-" if real is None else f"{real['rows'][i][m]['error']:.2%}" for m in MERGES] + [
            "-" if not synthetic else f"{max(v['rows'][i][m]['error'] for v in synthetic):.2%}"
            for m in MERGES
        ]
        lines.append(
            f"| {row['label']} | "
            + " | ".join(cells)
            + f" | {row['fisher_bytes_ratio']:.3f} | {row['fisher_bytes']:,.0f} |"
        )
    for name, result in inputs.items():
        for redrawn, s in result.get("resampling", {}).items():
            lines.append(
                f"| resampling median, {name}, {REDRAWN_TEXT[redrawn]} "
                f"| {s['base']['median']:.2%} | {s['projected']['median']:.2%} | | | 1.000 | |"
            )
    return "\n".join(lines)


def _redraw_note(real: dict[str, Any]) -> str:
    sizes = sorted({(s["role"], s["examples"]) for s in real["shard_sizes"]})
    return (
        f"Real redraws: F̂ recomputed at θ₀ from N = {real['fisher_batches']} batches (the run's "
        f"batches give the uploaded F̂ to {real['fisher_reproduction_max_rel_diff']:.1e}, "
        "max relative difference); shards "
        + ", ".join(f"{role} {n}" for role, n in sizes)
        + " examples (disjoint blocks where a shard holds (R+1)·N, else drawn with "
        "replacement). Relative spread ρ of one redraw: "
        + ", ".join(f"{role} {v:.3f}" for role, v in real["fisher_spread"].items())
    )


def _recommendation_lines(rec: dict[str, Any]) -> list[str]:
    lines = [
        "Largest e over inputs and merges: "
        + ", ".join(f"{k} {v:.2%}" for k, v in rec["max_error_by_form"].items()),
    ]
    rules = [
        (
            f"resampling_{redrawn}",
            f"the resampling bound b ({REDRAWN_TEXT[redrawn]}: smallest median resampling e "
            "over inputs and merges)",
        )
        for redrawn in REDRAWN
    ]
    for key, rule in [*rules, ("fixed", "the fixed bound")]:
        r = rec[key]
        if r is None:
            lines.append(f"No redraws: {rule} is undefined.")
        elif r["fraction"] is None:
            lines.append(
                f"Under {rule} = {r['bound']:.2%}: no top-k fraction of the grid keeps the "
                "worst e within it."
            )
        else:
            lines.append(
                f"Under {rule} = {r['bound']:.2%}: upload.fisher-fraction {r['fraction']:g}; "
                f"on {r['bytes_input']} {r['fisher_bytes']:,.0f} Fisher bytes per client "
                f"({r['fisher_bytes_ratio']:.3f} of dense), {r['upload_bytes']:,.0f} bytes "
                f"per upload, {r['upload_ratio']:.1f}x smaller than dense"
            )
    return lines


def _metrics_table(real: dict[str, Any]) -> str:
    names = list(real["before"])
    lines = [
        "| model | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, metrics in (("before", real["before"]), ("reference", real["reference"])):
        lines.append(f"| {label} | " + " | ".join(_num(metrics.get(n)) for n in names) + " |")
    labelled = [(r["label"], r) for r in real["rows"]] + [
        (f"resample {i} ({REDRAWN_TEXT[redrawn]})", d)
        for redrawn, s in real["resampling"].items()
        for i, d in enumerate(s["draws"], start=1)
    ]
    for label, r in labelled:
        for merge in MERGES:
            m = r["metrics"][merge]
            lines.append(f"| {label} {merge} | " + " | ".join(_num(m.get(n)) for n in names) + " |")
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(summary: dict[str, Any], path: Path) -> Path:
    """e against α'/α per input, FIRM base and projected; bf16 dashed, each input's median
    resampling e dash-dotted (forget clients only: dotted), the fixed bound black."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    alpha = summary["alpha"]
    for ax, merge in zip(axes, MERGES, strict=True):
        for i, (name, result) in enumerate(summary["inputs"].items()):
            color = f"C{i}"
            topk = [r for r in result["rows"] if r["form"] == "topk"]
            xs = [r["fraction"] / alpha for r in topk]
            ax.plot(xs, [100 * r[merge]["error"] for r in topk], "o-", color=color, label=name)
            bf16 = next(r for r in result["rows"] if r["form"] == "bf16")
            ax.axhline(100 * bf16[merge]["error"], color=color, ls="--", lw=0.8)
            for redrawn, s in result.get("resampling", {}).items():
                ls = "-." if redrawn == "all" else (0, (1, 3))
                ax.axhline(100 * s[merge]["median"], color=color, ls=ls, lw=1.2)
        ax.axhline(100 * summary["recommendation"]["fixed"]["bound"], color="k", ls="-")
        ax.set_xscale("log")
        ax.set_xlabel("top-k fraction α' / α")
        ax.set_title(f"FIRM {merge}: bf16 --, resampling median -. (forget only ··)")
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
    spread = {"forget": args.fisher_spread, "retain": args.fisher_spread}
    if not args.skip_run:
        inputs["tofu-run"], spread = real_input(
            args.run_config,
            args.output_dir / "flower-run",
            reuse=args.reuse_run,
            redraws=args.redraws,
            evaluated=not args.no_evaluate,
        )
    shape = {"tensors": args.tensors, "rows": args.rows, "cols": args.cols, "seed": args.seed}
    for n in SYNTHETIC_PER_DOMAIN:
        inputs[f"synthetic {n}/domain"] = synthetic_input(n, spread, args.redraws, shape)
    return {
        "alpha": ALPHA,
        "epsilon_factor": EPSILON_FACTOR,
        "synthetic": {**shape, "fisher_spread": spread},
        "inputs": inputs,
        "recommendation": recommend(inputs, args.bound),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run-config", default="", help="replaces or adds keys of the study's run config"
    )
    parser.add_argument(
        "--no-evaluate", action="store_true", help="do not evaluate the real run's merges"
    )
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--reuse-run", action="store_true", help="reuse an earlier Flower run")
    parser.add_argument("--skip-run", action="store_true", help="synthetic inputs only")
    parser.add_argument("--bound", type=float, default=DEFAULT_BOUND, help="fixed bound on e")
    parser.add_argument("--redraws", type=int, default=REDRAWS, help="Fisher redraws (R ≥ 2)")
    parser.add_argument(
        "--fisher-spread",
        type=float,
        default=DEFAULT_SPREAD,
        help="ρ of the synthetic redraws with --skip-run (else measured on the run)",
    )
    parser.add_argument("--tensors", type=int, default=3, help="synthetic tensors")
    parser.add_argument("--rows", type=int, default=2048, help="synthetic rows")
    parser.add_argument("--cols", type=int, default=512, help="synthetic columns")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.redraws < 2:
        parser.error("--redraws must be at least 2 (ρ is measured between two redraws)")
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
