"""FIRM: Fisher-Informed Retention Merging (docs/algorithms.md, "FIRM base merge", "FIRM
retention-constrained projection").

Per weight tensor t (processed one at a time, never concatenated):

1. pool the forget clients of each domain g: ``Δ̄_g`` = mean task vector, ``F̄_g`` = mean RAW
   Fisher (pooling comes before normalisation; the two do not commute);
2. normalise and sparsify every pooled forget Fisher and every retain client's Fisher:
   ``F̃ = F / (max F + eps0)``, keep the entries ≥ the k-th largest, ``k = max(1, ⌊alpha·d_t⌋)``;
3. ``Δ_F = Σ_g F̃_g ⊙ Δ̄_g / (Σ_g F̃_g + eps0)``, ``Δ_R = Σ_k F̃_k ⊙ Δθ_k / (Σ_k F̃_k + eps0)``,
   ``Δ_base = gamma_F·Δ_F + gamma_R·Δ_R`` (both default to ``gamma``);
4. if ``epsilon`` is finite and there are retain clients, project ``Δ_base`` onto
   ``b_k(Δ) = Σ_j F̃_k(j)·Δ(j)² ≤ epsilon`` for every retain client k (see ``projection.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..options import FRACTION, POSITIVE, Number, OneOf, option, option_group
from ._chunks import below, map_spans
from .base import (
    ClientUpdate,
    MergeResult,
    delta_mapping,
    described,
    register_merge,
    validate_updates,
)
from .kernels import (
    bracket_counts,
    fusable,
    kept_above,
    mean_of,
    nonzero64,
    run_kernel,
    sq64,
    use_compiled_for,
)
from .lazy import Flat, FlatSlices, flat_source
from .native import pooled_bracket_counts
from .pooled_topk import pooled_topk
from .projection import DEFAULT_SOLVER, SOLVERS, _project_checked, check_solver
from .selection import (
    SMALL,
    StreamedKthLargest,
    histogrammed,
    kth_largest,
    kth_of_histogram,
    magnitude_histogram,
    sample_positions,
)


@option_group("firm")
@dataclass(frozen=True)
class FirmOptions:
    """FIRM's merge and projection (``[tool.flwr.app.config.firm]``; docs/algorithms.md, "FIRM
    base merge", "FIRM retention-constrained projection")."""

    alpha: float = option(0.1, "kept Fisher fraction α per tensor (top-α sparsity)", FRACTION)
    eps0: float = option(1e-8, "stabiliser ε₀ of the normalisation and the averages", POSITIVE)
    epsilon: float = option(
        math.inf,
        "retention budget ε of the projection per retain client and tensor; inf = FIRM-base",
        Number(low=0, low_open=True, inf_ok=True),
    )
    solver: str = option(
        "exact",
        "projection solver for several retain clients: exact (Newton steps on the dual with a "
        "KKT certificate) or increase-only (the paper's routine)",
        OneOf(lambda: SOLVERS),
    )


# Solver summary and KKT certificate copied from project_retention's report, per tensor.
_PROJECTION_KEYS: tuple[str, ...] = (
    "iterations",
    "sweeps",
    "converged",
    "feasibility_pass",
    "max_violation",
    "active",
    "max_primal_violation",
    "max_complementary_slackness",
    "duality_gap",
    "backend",
)


def support_size(numel: int, alpha: float) -> int:
    """Number of kept Fisher entries ``k = max(1, ⌊alpha·d_t⌋)`` (capped at ``d_t``).

    A relative slack of 1e-9 absorbs binary rounding of ``alpha`` (so 0.29·100 gives 29).
    """
    return min(numel, max(1, math.floor(alpha * numel * (1.0 + 1e-9))))


@dataclass
class _SparsifiedFisher:
    """``F̃ = F / (max F + eps0)`` kept where ``F̃ >=`` its k-th largest value.

    ``sources`` are the flat raw Fishers whose float32 mean is ``F`` (a domain's ``F̄_g``,
    formed slice by slice inside the merge kernel, never as a whole tensor), or one flat raw
    or pooled Fisher; ``scale`` is the 0-d float32 ``max F + eps0`` and ``lower`` the 0-d
    float32 largest value below the threshold (``-inf`` keeps every entry).
    """

    sources: list[Flat]
    scale: torch.Tensor
    lower: torch.Tensor

    @classmethod
    def of(cls, sources: Sequence[Flat], scale: torch.Tensor, lower: float) -> _SparsifiedFisher:
        """With ``lower`` as a 0-d float32 tensor."""
        return cls(list(sources), scale, torch.tensor(lower, dtype=torch.float32))

    def kernel_args(self) -> tuple[list[Flat], torch.Tensor, torch.Tensor]:
        """``(sources, scale, lower)`` as :func:`firm_kernel` takes them."""
        return self.sources, self.scale, self.lower


def _sparsifier(flat: torch.Tensor, alpha: float, eps0: float) -> _SparsifiedFisher:
    """Scale and threshold of ``F̃`` for the flat non-negative Fisher ``flat`` (any float dtype).

    The threshold is found on the raw values: dividing by ``scale`` is monotone, so the k-th
    largest normalised value is the k-th largest raw value divided by ``scale`` (the same
    float32 division the whole tensor gets).
    """
    d = flat.numel()
    if d == 0:
        return _SparsifiedFisher.of([flat], torch.ones((), device=flat.device), -math.inf)
    # a large 16-bit Fisher: its maximum and k-th value from one histogram pass
    histogram = magnitude_histogram(flat) if histogrammed(flat) else None
    top = flat.max() if histogram is None else kth_of_histogram(histogram, 1, flat.dtype)
    scale = top.to(torch.float32) + eps0
    k = support_size(d, alpha)
    if k >= d:
        return _SparsifiedFisher.of([flat], scale, -math.inf)
    if histogram is None:
        kth = kth_largest(flat, k, nonnegative=True)
    else:
        kth = kth_of_histogram(histogram, k, flat.dtype)
    return _SparsifiedFisher.of([flat], scale, below(kth.to(torch.float32) / scale))


def normalize_and_sparsify(fisher: torch.Tensor, alpha: float, eps0: float) -> torch.Tensor:
    """Return ``F̃``: ``fisher / (max(fisher) + eps0)`` keeping only its top-``alpha`` entries.

    The threshold is the k-th largest normalised value (``k`` from :func:`support_size`,
    found by :func:`~fedunlearn.merging.selection.kth_largest`); every entry ``>=`` the
    threshold is kept, so ties at the threshold are all kept, and all other entries are set
    to 0.  Computed in float32; the input must be a non-negative raw (or pooled) Fisher
    diagonal.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not eps0 > 0.0:
        raise ValueError(f"eps0 must be > 0, got {eps0}")
    f = fisher.to(torch.float32)
    if f.numel() == 0:
        return f.clone()
    sp = _sparsifier(f.reshape(-1), alpha, eps0)
    return kept_above(f / sp.scale, sp.lower)


def _check_params(
    gamma_f: float, gamma_r: float, alpha: float, eps0: float, epsilon: float, max_iter: int
) -> None:
    for name, val in (("gamma_forget", gamma_f), ("gamma_retain", gamma_r)):
        if not math.isfinite(val):
            raise ValueError(f"{name} must be finite, got {val}")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not (math.isfinite(eps0) and eps0 > 0.0):
        raise ValueError(f"eps0 must be a finite positive number, got {eps0}")
    if math.isnan(epsilon) or epsilon <= 0.0:
        raise ValueError(f"epsilon must be > 0 (math.inf disables the projection), got {epsilon}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")


def _group(
    updates: Sequence[ClientUpdate],
) -> tuple[dict[str, list[ClientUpdate]], list[ClientUpdate]]:
    """Split into ``{forget domain: clients}`` (first-seen order) and the retain clients."""
    for u in updates:
        if u.fisher is None:
            raise ValueError(
                f"FIRM needs a Fisher diagonal from every client; client {u.node_id!r} "
                f"({u.role}) sent none"
            )
    domains: dict[str, list[ClientUpdate]] = {}
    retain: list[ClientUpdate] = []
    for u in updates:
        if u.role == "retain":
            retain.append(u)
        elif u.domain is None:
            raise ValueError(
                f"forget client {u.node_id!r} has no domain; FIRM pools forget clients by domain"
            )
        else:
            domains.setdefault(u.domain, []).append(u)
    if not domains:
        raise ValueError(
            "FIRM needs at least one forget client; got only retain clients "
            f"{[u.node_id for u in retain]}"
        )
    return domains, retain


def _kept_sparsifier(
    sources: list[Flat], kept: torch.Tensor, alpha: float, eps0: float
) -> _SparsifiedFisher:
    """:func:`_sparsifier` of the float32 mean ``F`` of flat Fishers whose non-zero entries
    are all among ``kept`` (a top-k upload's values, or a pooled domain's values at the union
    of its members' masks; every other entry 0), from ``kept`` alone.

    The same scale and threshold: the entries are ``kept`` and zeros, all ``>= 0``, so the
    maximum is ``kept``'s (0 if none) and the k-th largest is ``kept``'s k-th largest when
    ``kept`` has k entries, else 0; the same float32 arithmetic follows.
    """
    sources = [f.reshape(-1) for f in sources]
    d, n = sources[0].numel(), kept.numel()
    zero = torch.zeros((), dtype=torch.float32, device=sources[0].device)
    top = kept.max().to(torch.float32) if n else zero
    scale = top + eps0
    k = support_size(d, alpha) if d else 0
    if k >= d:
        return _SparsifiedFisher.of(sources, scale, -math.inf)
    if k > n:
        kth = zero
    elif k == n:  # no ties at the client's threshold (the usual case): the smallest kept value
        kth = kept.min().to(torch.float32)
    else:
        kth = _kth_of_kept(kept, k)
    return _SparsifiedFisher.of(sources, scale, below(kth / scale))


def _kth_of_kept(kept: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest of the non-negative float32 ``kept`` (``k <`` its size), its candidates
    counted by the C loop in one pass where it runs (:func:`kth_largest`'s numpy pass costs
    several), else by :func:`kth_largest`."""
    n = kept.numel()
    if n > SMALL and kept.device.type == "cpu" and kept.dtype == torch.float32:
        selector = StreamedKthLargest(kept[sample_positions(n)], k, n, nonnegative=True)
        counted = pooled_bracket_counts([kept], False, selector.key_bounds())
        if counted is not None:
            _, above, candidates = counted
            return selector.result_of_keys(lambda: kept, above, candidates).to(torch.float32)
    return kth_largest(kept, k, nonnegative=True).to(torch.float32)


def _pooled_sparsifier(
    fishers: Sequence[Flat],
    device: torch.device,
    alpha: float,
    eps0: float,
    compiled: bool = False,
) -> _SparsifiedFisher:
    """``F̃`` of the float32 mean ``F`` of ``fishers``, pooled, maxed and counted in one pass.

    The same scale and threshold as ``_sparsifier(_pooled(fishers))``: the pooled values at
    the selector's sample positions are computed first (the same float32 arithmetic), then
    every slice of ``F`` is pooled (``compiled``: by the fused counting kernel), maxed and
    counted for the threshold, and dropped: the merge kernel pools it again slice by slice
    (reading the raw Fishers once more costs less memory traffic than writing and re-reading a
    float32 ``F``; compact uploads' Fishers, :class:`FlatSlices`, are decoded slice by slice
    for each pass).  Without ``compiled``, a lone Fisher goes to :func:`_sparsifier`; with it,
    through the same counting pass (the C function of
    :mod:`~fedunlearn.merging.native` reads a lone 16-bit Fisher in less time than its
    histogram takes).
    """
    flats = [f.reshape(-1) for f in fishers]
    d = flats[0].numel()
    k = support_size(d, alpha) if d else 0
    compiled = compiled and all(fusable(f.dtype) for f in flats)
    lone = len(flats) == 1 and not compiled
    if lone or device.type != "cpu" or d <= SMALL or k >= d:
        return _sparsifier(_pooled(fishers, device), alpha, eps0)
    positions = sample_positions(d)
    pooled_sample = mean_of([f[positions] for f in flats])
    selector = StreamedKthLargest(pooled_sample, k, d, nonnegative=True)
    if compiled:
        top, above, candidates = bracket_counts(flats, False, selector.key_bounds())
        scale = top + eps0
        kth = selector.result_of_keys(
            lambda: _pooled(flats, device).to(torch.float32), above, candidates
        )
        return _SparsifiedFisher.of(flats, scale, below(kth / scale))

    def work(span: slice) -> tuple[torch.Tensor, tuple[int, np.ndarray]]:
        chunk = mean_of([f[span] for f in flats])
        return chunk.max(), selector.count(chunk)

    parts = map_spans(work, d, device)
    scale = torch.stack([m for m, _ in parts]).max() + eps0
    threshold = selector.result(lambda: _pooled(flats, device), [c for _, c in parts]) / scale
    return _SparsifiedFisher.of(flats, scale, below(threshold))


def _pooled(fishers: Sequence[Flat], device: torch.device) -> torch.Tensor:
    """``F̄_g``: the flat mean of a domain's raw Fishers in float32 (a lone Fisher as it is,
    a lone :class:`FlatSlices` decoded)."""
    flats = [f.reshape(-1) for f in fishers]
    if len(flats) == 1 and not isinstance(flats[0], FlatSlices):
        return flats[0].to(device)
    out = torch.empty(flats[0].numel(), dtype=torch.float32, device=device)

    def work(span: slice) -> None:
        out[span] = mean_of([f[span].to(device) for f in flats])

    map_spans(work, out.numel(), device)
    return out


def _weighted_average(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], eps0: torch.Tensor
) -> torch.Tensor:
    """``Σ F̃ ⊙ Δ / (Σ F̃ + eps0)`` over the (non-empty) ``(F̃, Δ)`` pairs, in float32."""
    num, den = pairs[0][0] * pairs[0][1], pairs[0][0]
    for ft, delta in pairs[1:]:
        num = num + ft * delta
        den = den + ft
    return num / (den + eps0)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.to(torch.float64)))


@dataclass
class _Sums:
    """Float64 sums behind one tensor's report, accumulated slice by slice."""

    forget_sq: float = 0.0
    retain_sq: float = 0.0
    base_sq: float = 0.0
    final_sq: float = 0.0
    nonzero: int = 0
    damage_before: list[float] = field(default_factory=list)
    damage_after: list[float] = field(default_factory=list)


@dataclass
class _TensorInputs:
    """One weight's sparsified Fishers and flat task vectors, by side (steps 1–2 of
    docs/algorithms.md, "FIRM base merge")."""

    forget: list[tuple[_SparsifiedFisher, list[Flat]]]
    retain: list[tuple[_SparsifiedFisher, Flat]]
    numel: int
    device: torch.device


def _tensor_inputs(
    tvs: Sequence[Flat],
    fishers: Sequence[Flat],
    domains: Sequence[Sequence[int]],
    retain: Sequence[int],
    params: tuple[float, float],
    compiled: bool,
    kept: Sequence[torch.Tensor | None] = (),
) -> _TensorInputs:
    """Pool every forget domain's Fisher and find every threshold (one pass per Fisher; none
    for a lone Fisher whose ``kept`` values are known, nor for a domain of top-k uploads,
    pooled at the union of their masks: see :func:`_kept_sparsifier`)."""
    alpha, eps0 = params
    device = tvs[0].device
    flat_tv = [t.reshape(-1) for t in tvs]

    def sparsifier(sources: list[Flat], lone: int | None) -> _SparsifiedFisher:
        values = kept[lone] if lone is not None and lone < len(kept) else None
        pooled = pooled_topk(sources) if lone is None and device.type == "cpu" else None
        if pooled is not None:  # the kernel reads F̄_g decoded in one pass, not each member
            values, sources = pooled.kept, [pooled.slices]
        if values is not None and sources[0].device == device:
            return _kept_sparsifier(sources, values.to(device), alpha, eps0)
        return _pooled_sparsifier(sources, device, alpha, eps0, compiled)

    forget = [
        (
            sparsifier([fishers[i] for i in members], members[0] if len(members) == 1 else None),
            [flat_tv[i] for i in members],
        )
        for members in domains
    ]
    retained = [(sparsifier([fishers[i].to(device)], i), flat_tv[i]) for i in retain]
    return _TensorInputs(forget, retained, flat_tv[0].numel(), device)


def _kept_values(fisher: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The values of weight ``key``'s Fisher that can be non-zero, every other entry being 0,
    where ``fisher`` tells them without decoding (a ``kept_values(key)`` method, as
    ``fedunlearn.upload_codec.DecodedTensors`` has for a top-k upload); else None."""
    kept_values = getattr(fisher, "kept_values", None)
    return kept_values(key) if callable(kept_values) else None


#: Positions in :func:`firm_kernel`'s sums (then ``m`` damages before, ``m`` after).
_FORGET_SQ, _RETAIN_SQ, _BASE_SQ, _FINAL_SQ, _NONZERO, _DAMAGES = range(6)

_ForgetArgs = list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]]
_RetainArgs = list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]]


def firm_kernel(
    forget: _ForgetArgs,
    retain: _RetainArgs,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    keep_dense: bool,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """FIRM base merge of one weight's flat inputs, with its report sums (steps 1–3 of
    docs/algorithms.md, "FIRM base merge").

    ``forget``: per domain ``g`` ``(Fisher sources, scale, lower, task vectors)``: ``F̃_g`` is
    the sources' mean divided by ``scale``, kept above ``lower``, and ``Δ̄_g`` the task vectors'
    mean; ``retain``: per retain client ``k`` the same with its one task vector ``Δθ_k``;
    ``params`` = ``(gamma_F, gamma_R, eps0)`` (0-d float32).  Returns ``((Δ_base cast to
    out_dtype,), sums)``, or with ``keep_dense`` ``((Δ_base in float32, F̃_1, …, F̃_m), sums)``
    for the projection.  ``sums`` (float64): ‖gamma_F·Δ_F‖², ‖gamma_R·Δ_R‖², ‖Δ_base‖², ‖out‖²,
    the non-zero entries of ``out``, then ``Σ F̃_k·Δ_base²`` and ``Σ F̃_k·out²`` per ``k``
    (only the first three with ``keep_dense``; the rest are 0).
    """
    gamma_f, gamma_r, eps0 = params
    pairs = [
        (kept_above(mean_of(fs) / scale, lower), mean_of(tvs)) for fs, scale, lower, tvs in forget
    ]
    forget_term = _weighted_average(pairs, eps0) * gamma_f
    fts = [kept_above(mean_of(fs) / scale, lower) for fs, scale, lower, _ in retain]
    base, retain_sq = forget_term, torch.zeros((), dtype=torch.float64, device=eps0.device)
    if fts:
        deltas = [t.to(torch.float32) for *_, t in retain]
        retain_term = _weighted_average(list(zip(fts, deltas, strict=True)), eps0) * gamma_r
        base, retain_sq = forget_term + retain_term, sq64(retain_term)
    base_sq = sq64(base)
    if keep_dense:
        zero = torch.zeros_like(base_sq)
        sums = [sq64(forget_term), retain_sq, base_sq, zero, zero] + [zero] * (2 * len(fts))
        return (base, *fts), torch.stack(sums)
    final = base.to(out_dtype)
    narrowing = out_dtype not in (torch.float32, torch.float64)
    base64_sq = base.to(torch.float64) ** 2
    final64_sq = final.to(torch.float64) ** 2 if narrowing else base64_sq
    before = [(ft.to(torch.float64) * base64_sq).sum() for ft in fts]
    after = [(ft.to(torch.float64) * final64_sq).sum() for ft in fts] if narrowing else before
    final_sq = sq64(final) if narrowing else base_sq
    head = [sq64(forget_term), retain_sq, base_sq, final_sq, nonzero64(final)]
    return (final,), torch.stack(head + before + after)


def _merge_tensor(
    inp: _TensorInputs,
    params: tuple[float, float, float],
    out_dtype: torch.dtype,
    keep_dense: bool,
    compiled: bool,
) -> tuple[torch.Tensor, list[torch.Tensor], _Sums]:
    """Fused FIRM base merge of one weight (:func:`firm_kernel`, compiled or slice by slice).

    Returns ``(out, fts, sums)``: with ``keep_dense`` the float32 ``Δ_base`` and the dense
    ``F̃_k`` (for the projection); otherwise ``Δ_base`` cast to ``out_dtype``, no ``F̃_k``, and
    the damages, norm and support of the cast result in ``sums``.
    """
    m = len(inp.retain)
    forget = [(*sp.kernel_args(), members) for sp, members in inp.forget]
    retain = [(*sp.kernel_args(), t) for sp, t in inp.retain]
    scalars = tuple(torch.tensor(p, dtype=torch.float32, device=inp.device) for p in params)
    args = (forget, retain, scalars, out_dtype, keep_dense)
    outs, totals = run_kernel(firm_kernel, args, inp.numel, inp.device, compiled)
    t = totals.tolist()
    damages = t[_DAMAGES:]
    sums = _Sums(
        forget_sq=t[_FORGET_SQ],
        retain_sq=t[_RETAIN_SQ],
        base_sq=t[_BASE_SQ],
        final_sq=t[_FINAL_SQ],
        nonzero=round(t[_NONZERO]),
        damage_before=damages[:m],
        damage_after=damages[m:],
    )
    return outs[0], list(outs[1:]), sums


def _backend(backends: Iterable[str | None]) -> str | None:
    """The projection's backend over the tensors: ``compiled``, ``eager``, ``mixed`` (some
    tensors each: ``auto`` compiles only large tensors) or None (no projection ran)."""
    ran = {b for b in backends if b is not None}
    return None if not ran else ran.pop() if len(ran) == 1 else "mixed"


def _unprojected_report(sums: _Sums) -> dict:
    """The projection fields of a tensor left as it is (``epsilon = inf`` or no retain client)."""
    m = len(sums.damage_before)
    return {
        "multipliers": [0.0] * m,
        "damage_before": sums.damage_before,
        "damage_after": sums.damage_after,
        "iterations": 0,
        "sweeps": 0,
        "converged": True,
        "feasibility_pass": False,
        "max_violation": 0.0,
        "active": False,
        "max_primal_violation": 0.0,
        "max_complementary_slackness": 0.0,
        "duality_gap": 0.0,
        "backend": None,  # no projection ran
    }


@register_merge("firm")
def firm_merge(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float = 1.0,
    alpha: float = 0.1,
    eps0: float = 1e-8,
    epsilon: float = math.inf,
    gamma_forget: float | None = None,
    gamma_retain: float | None = None,
    max_iter: int = 500,
    solver: str = DEFAULT_SOLVER,
    tol: float | None = None,
    delta_out: MutableMapping[str, torch.Tensor] | None = None,
) -> MergeResult:
    """FIRM merge with the optional retention projection (docs/algorithms.md, "FIRM base merge",
    "FIRM retention-constrained projection").

    Args:
        updates: client summaries; at least one forget client (with a domain); every client must
            carry a Fisher diagonal.  Retain clients are optional (then ``Δ_R = 0``).
        gamma: global scale ``gamma``; default for ``gamma_forget`` and ``gamma_retain``.
        alpha: kept Fisher fraction ``alpha`` per tensor (top-``alpha`` sparsification).
        eps0: stabiliser ``eps0`` in the normalisation and the Fisher-weighted averages.
        epsilon: retention budget ``epsilon`` per retain client per tensor; ``math.inf`` skips
            the projection ("FIRM-base").
        gamma_forget, gamma_retain: separate scales ``gamma_F``, ``gamma_R`` of ``Δ_F``, ``Δ_R``.
        max_iter: solver iteration cap (see :func:`project_retention`).
        solver: projection solver, ``"exact"`` (default: the closest feasible point, with a
            KKT certificate) or ``"increase-only"`` (the paper's routine: feasible, but for
            more than one retain client not necessarily optimal); see
            :func:`project_retention`.
        tol: projection tolerance ``τ`` (default ``max(1e-4·epsilon, 1e-12)``).

    Returns:
        :class:`MergeResult` whose ``delta`` has the task-vector dtype (promoted across clients
        if they differ) and whose ``report`` is JSON-serialisable: ``method``, ``params``
        (``epsilon`` is ``None`` when infinite), ``domains``, ``retain_clients``, ``tensors``
        (per key: ``norm_base``, ``norm_final``, ``norm_forget_term`` = ‖gamma_F·Δ_F‖,
        ``norm_retain_term`` = ‖gamma_R·Δ_R‖, ``support_fraction`` = fraction of non-zero
        entries of the final update, ``damage_before`` / ``damage_after`` / ``multipliers`` per
        retain client, ``projection`` = the solver summary ``iterations``, ``sweeps``,
        ``converged``, ``feasibility_pass``, ``max_violation``, ``active`` and the KKT
        certificate ``max_primal_violation``, ``max_complementary_slackness``,
        ``duality_gap`` and the ``backend`` of :func:`project_retention`), totals
        ``norm_base`` and ``norm_final``, and ``projection_backend``: ``"compiled"``,
        ``"eager"``, ``"mixed"`` (some tensors each) or None when nothing was projected.  All
        reported damages and norms of the final update are computed after the dtype cast (the
        KKT certificate before it).
    """
    gamma_f = float(gamma if gamma_forget is None else gamma_forget)
    gamma_r = float(gamma if gamma_retain is None else gamma_retain)
    epsilon = float(epsilon)
    _check_params(gamma_f, gamma_r, alpha, eps0, epsilon, max_iter)
    check_solver(solver)
    keys = validate_updates(updates)
    domains, retain = _group(updates)
    project = math.isfinite(epsilon) and bool(retain)
    retain_ids = [str(u.node_id) for u in retain]

    delta = delta_mapping(delta_out)
    tensors_report: dict[str, dict] = {}
    total_base_sq = 0.0
    total_final_sq = 0.0
    position = {id(u): i for i, u in enumerate(updates)}
    domain_idx = [[position[id(u)] for u in members] for members in domains.values()]
    retain_idx = [position[id(u)] for u in retain]
    compiled = use_compiled_for(updates[0].task_vector, keys)
    for key in keys:
        # compact uploads come as slices decoded inside the merge's loop (fedunlearn.merging.lazy)
        tvs = [flat_source(u.task_vector, key) for u in updates]
        fishers = [flat_source(u.fisher, key) for u in updates]  # type: ignore[arg-type]
        kept = [_kept_values(u.fisher, key) for u in updates]  # type: ignore[arg-type]
        inp = _tensor_inputs(tvs, fishers, domain_idx, retain_idx, (alpha, eps0), compiled, kept)
        out_dtype = tvs[0].dtype
        for t in tvs[1:]:
            out_dtype = torch.promote_types(out_dtype, t.dtype)
        shape = described(updates[0].task_vector, key)[0]
        del tvs, fishers, kept
        params = (gamma_f, gamma_r, eps0)
        out, fts, sums = _merge_tensor(inp, params, out_dtype, project, compiled)
        del inp
        norm_base = math.sqrt(sums.base_sq)
        if project:
            # The F̃_k are finite and non-negative by construction (ClientUpdate validates the
            # raw Fishers), so project_retention's argument checks are skipped.
            base = out.view(shape)
            final, proj = _project_checked(
                base,
                [f.view(shape) for f in fts],
                epsilon,
                solver=solver,
                max_iter=max_iter,
                tol=tol,
                out_dtype=out_dtype,
            )
            norm_final = norm_base if final is base else _norm(final)
            del fts, out, base
            support = int(torch.count_nonzero(final))
        else:
            final, proj = out.view(shape), _unprojected_report(sums)
            norm_final = math.sqrt(sums.final_sq)
            support = sums.nonzero
        total_base_sq += norm_base**2
        total_final_sq += norm_final**2
        numel = final.numel()
        tensors_report[key] = {
            "norm_base": norm_base,
            "norm_final": norm_final,
            "norm_forget_term": math.sqrt(sums.forget_sq),
            "norm_retain_term": math.sqrt(sums.retain_sq),
            "support_fraction": support / numel if numel else 0.0,
            "damage_before": dict(zip(retain_ids, proj["damage_before"], strict=True)),
            "damage_after": dict(zip(retain_ids, proj["damage_after"], strict=True)),
            "multipliers": dict(zip(retain_ids, proj["multipliers"], strict=True)),
            "projection": {key_: proj[key_] for key_ in _PROJECTION_KEYS},
        }
        delta[key] = final

    report = {
        "method": "firm",
        "params": {
            "gamma": float(gamma),
            "gamma_forget": gamma_f,
            "gamma_retain": gamma_r,
            "alpha": float(alpha),
            "eps0": float(eps0),
            "epsilon": epsilon if math.isfinite(epsilon) else None,
            "projection": project,
            "solver": solver,
            "max_iter": int(max_iter),
            "tol": None if tol is None else float(tol),
        },
        "domains": {g: [u.node_id for u in members] for g, members in domains.items()},
        "retain_clients": [u.node_id for u in retain],
        "tensors": tensors_report,
        "projection_backend": _backend(t["projection"]["backend"] for t in tensors_report.values()),
        "norm_base": math.sqrt(total_base_sq),
        "norm_final": math.sqrt(total_final_sq),
    }
    return MergeResult(delta=delta, report=report)
