"""The retention projection on its solver coordinates: gathered once, evaluated by fused passes.

The solvers of :mod:`.projection` only ever need, at multipliers ``λ``, the sums

* ``½ Σ_j Δ_base(j)²·s_j/(1 + s_j)`` (the dual without its linear term), with
  ``s_j = 2 Σ_k λ_k F̃_k(j)``;
* the damages ``b_k = Σ_j F̃_k(j)·Δ_base(j)²·u_j²`` with ``u_j = 1/(1 + s_j)``;
* optionally the dual Hessian ``H_kl = ∂b_k/∂λ_l = −4 Σ_j F̃_k F̃_l Δ_base² u³``.

:func:`dual_kernel` computes all of them in one pass over the solver coordinates (where some
``F̃_k`` is positive and ``Δ_base`` is non-zero; elsewhere every term is zero), and
:func:`certificate_kernel` the projected values with their certificate sums in one more.  Both
run through :func:`~.kernels.run_kernel`: compiled (one fused loop, about 8 ms for 3.2 M
coordinates and three constraints on two threads) or eagerly slice by slice.  The two add the
float64 sums in different orders, so their multipliers agree to rounding, not bit for bit.

The gathered copies keep the inputs' values exactly: float32 when every input is a float of
at most 32 bits, float64 otherwise; the kernels widen them to float64 before any arithmetic,
so every product (``F̃_k·Δ_base²`` included) is the one a float64 copy would give.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._chunks import map_spans
from .kernels import run_kernel, use_compiled
from .native import gather_support

#: ``auto`` compiles the projection's passes for tensors of at least this many entries (a solve
#: makes tens of passes over the solver coordinates, so compiling pays off well below the
#: one-pass merges' threshold).
COMPILE_MIN_ENTRIES = 1 << 20

_NARROW = (torch.float16, torch.bfloat16, torch.float32)


def _denominator_terms(
    fs: list[torch.Tensor], base: torch.Tensor, lam2: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(F̃_k, Δ_base, s)`` in float64, ``s = Σ_k (2λ_k)·F̃_k`` added in constraint order."""
    f = [x.to(torch.float64) for x in fs]
    s = lam2[0] * f[0]
    for coef, row in zip(lam2[1:], f[1:], strict=True):
        s = s + coef * row
    return f, base.to(torch.float64), s


def dual_kernel(
    fs: list[torch.Tensor], base: torch.Tensor, lam2: list[torch.Tensor], hessian: bool
) -> tuple[tuple[()], torch.Tensor]:
    """``[Σ Δ²s/(1+s), Σ Δ², b_1..b_m, (Σ F̃_k F̃_l Δ² u³ for k ≤ l if hessian)]`` (float64).

    ``lam2`` holds the 0-d ``2λ_k``; ``b_k = Σ (F̃_k·Δ²)·u²`` with ``u = 1/(1 + s)``.
    """
    f, b0, s = _denominator_terms(fs, base, lam2)
    bsq = b0 * b0
    u = (s + 1.0).reciprocal()
    u2 = u * u
    sums = [(s * bsq * u).sum(), bsq.sum()]
    sums += [((row * bsq) * u2).sum() for row in f]
    if hessian:
        t = bsq * u2 * u
        sums += [(t * f[k] * f[k2]).sum() for k in range(len(f)) for k2 in range(k, len(f))]
    return (), torch.stack(sums)


def _toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` cast to ``dtype`` rounding toward zero, in kernel-friendly steps.

    First to float32 toward zero (round to nearest, then one step back, by the bit pattern,
    where that rounded away from zero), then, since every narrower float is also a float32,
    toward zero from there: by clearing the low bits for bfloat16, else round to nearest and
    step back.  (Not :func:`~.projection.cast_toward_zero`: that one branches on the data,
    and without the branch its ``nextafter`` on bfloat16, compiled, gave other casts than
    eagerly for thousands of entries in ``test_compiled_passes_match_eager``.)
    """
    if dtype == torch.float64:
        return x
    y = x.to(torch.float32)
    away = y.to(torch.float64).abs() > x.abs()
    y = (y.view(torch.int32) - away.to(torch.int32)).view(torch.float32)
    if dtype == torch.float32:
        return y
    if dtype == torch.bfloat16:
        return (y.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)
    z = y.to(dtype)
    away = z.to(torch.float32).abs() > y.abs()
    return torch.where(away, torch.nextafter(z, torch.zeros_like(z)), z)


def certificate_kernel(
    fs: list[torch.Tensor], base: torch.Tensor, lam2: list[torch.Tensor], dtype: torch.dtype
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """``((Δ* cast toward zero,), [b_k(Δ*)…, b_k(cast)…, Σ (Δ* − Δ_base)², Σ Δ²s/(1+s)])``.

    ``Δ* = Δ_base/(1 + s)`` in float64; the sums are those of the point before the cast, except
    the damages after it.
    """
    f, b0, s = _denominator_terms(fs, base, lam2)
    den = s + 1.0
    p = b0 / den
    cast = _toward_zero(p, dtype)
    c = cast.to(torch.float64)
    p2, c2 = p * p, c * c
    sums = [(row * p2).sum() for row in f] + [(row * c2).sum() for row in f]
    sums += [((p - b0) * (p - b0)).sum(), (b0 * b0 * s / den).sum()]
    return (cast,), torch.stack(sums)


@dataclass(frozen=True)
class DualPoint:
    """Multipliers ``λ`` and the sums there (see :func:`dual_kernel`), on the CPU.

    ``half`` is ``½ Σ Δ_base²·s/(1 + s)`` (the dual is ``half − epsilon·Σλ``), ``b`` the damages
    and ``hess`` the dual Hessian ``∂b_k/∂λ_l`` (``None`` unless asked for).
    """

    lam: torch.Tensor
    half: float
    b: torch.Tensor
    hess: torch.Tensor | None

    def dual(self, epsilon: float) -> float:
        """``g(λ) = ½ Σ Δ_base²·s/(1 + s) − epsilon·Σ_k λ_k``."""
        return self.half - epsilon * float(self.lam.sum())


def _positions(
    mask: Callable[[slice], torch.Tensor], numel: int, device: torch.device
) -> torch.Tensor:
    """Ascending positions ``j < numel`` where the boolean ``mask(span)`` holds (int64).

    On the CPU through numpy, slice by slice over the threads (``torch.nonzero`` is several
    times slower there); elsewhere ``torch.nonzero`` on the whole mask.
    """
    if device.type != "cpu":
        return torch.nonzero(mask(slice(0, numel))).squeeze(1)

    def part(span: slice) -> np.ndarray:
        return np.flatnonzero(mask(span).numpy()) + span.start

    parts = map_spans(part, numel, device)
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


def finite_non_negative(f: torch.Tensor) -> bool:
    """Whether every entry of ``f`` is finite and non-negative (one pass, slice by slice)."""
    flat = f.reshape(-1)

    def part(span: slice) -> bool:
        lo, hi = torch.aminmax(flat[span])  # NaN propagates into both and fails both tests
        return float(lo) >= 0.0 and float(hi) < math.inf

    return all(map_spans(part, flat.numel(), flat.device))


def _check_fishers(fishers: Sequence[torch.Tensor], suspects: Iterable[int]) -> None:
    """Refuse the first ``F̃_k`` among ``suspects`` that is not finite and non-negative."""
    for k in suspects:
        if not finite_non_negative(fishers[k]):
            raise ValueError(f"retain Fisher #{k} must be finite and non-negative")


def _solver_support(flat: torch.Tensor, fishers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Solver coordinates: in the support of some ``F̃_k``, with ``Δ_base(j) ≠ 0`` (ascending).

    The ``F̃_k`` are non-negative, so some is positive where their sum is.
    """

    def mask(span: slice) -> torch.Tensor:
        total = fishers[0][span].clone()
        for f in fishers[1:]:
            total.add_(f[span])
        return (total != 0).logical_and_(flat[span] != 0)

    return _positions(mask, flat.numel() if fishers else 0, flat.device)


def _run(
    kernel: Callable,
    fs: list[torch.Tensor],
    base: torch.Tensor,
    lam: torch.Tensor,
    flag: object,
    compiled: bool,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``kernel(fs, base, [2λ_k, 0-d float64], flag)`` over the coordinates; sums on the CPU."""
    lam2 = [torch.tensor(2.0 * float(x), dtype=torch.float64) for x in lam]
    outs, sums = run_kernel(kernel, (fs, base, lam2, flag), base.numel(), base.device, compiled)
    return outs, sums.cpu()


def gather_kernel(
    rows: list[torch.Tensor], idx: torch.Tensor, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``row[idx]`` of every row, in ``dtype`` (for :func:`~.kernels.run_kernel`; no sums)."""
    return tuple(row[idx].to(dtype) for row in rows), torch.zeros(0, dtype=torch.float64)


def _gather(
    rows: Sequence[torch.Tensor], idx: torch.Tensor, dtype: torch.dtype, compiled: bool
) -> list[torch.Tensor]:
    """``row[idx]`` of every 1-D ``row``, in ``dtype``: compiled, or slice by slice over ``idx``."""
    if compiled:
        cols, _ = run_kernel(gather_kernel, (list(rows), idx, dtype), idx.numel(), idx.device, True)
        return list(cols)
    out = torch.empty((len(rows), idx.numel()), dtype=dtype, device=idx.device)

    def part(span: slice) -> None:
        pos = idx[span]
        for row, o in zip(rows, out, strict=True):
            o[span] = row.index_select(0, pos)

    map_spans(part, idx.numel(), idx.device)
    return list(out)


@dataclass
class Restricted:
    """The problem on the solver coordinates ``idx``: ``Δ_base`` and the ``F̃_k`` gathered once.

    ``start`` is the point ``λ = 0`` (its ``b`` are the damages ``b_k(Δ_base)``, with the
    Hessian when m > 1); ``norm_sq`` is ``‖Δ_base‖²``; ``compiled`` says how the passes run.
    """

    idx: torch.Tensor
    base: torch.Tensor
    fs: list[torch.Tensor]
    compiled: bool
    start: DualPoint
    norm_sq: float

    @classmethod
    def of(
        cls, flat: torch.Tensor, fishers: Sequence[torch.Tensor], check: bool = False
    ) -> Restricted:
        """The problem of the flat ``Δ_base`` under ``fishers``; ``check``: first refuse an
        ``F̃_k`` that is not finite and non-negative (``ValueError`` naming ``k``)."""
        flat_f = [f.reshape(-1).to(flat.device) for f in fishers]
        compiled = use_compiled([flat], COMPILE_MIN_ENTRIES)
        gathered = gather_support(flat, flat_f) if compiled else None
        if gathered is None:
            if check:
                _check_fishers(flat_f, range(len(flat_f)))
            idx = _solver_support(flat, flat_f)
            narrow = all(t.dtype in _NARROW for t in [flat, *flat_f])
            dtype = torch.float32 if narrow else torch.float64
            cols = _gather([flat, *flat_f], idx, dtype, compiled)
            base, fs = cols[0], cols[1:]
        else:
            idx, base, fs, bad = gathered
            if check:
                _check_fishers(flat_f, bad)
        m = len(fs)
        lam = torch.zeros(m, dtype=torch.float64)
        sums = (
            _run(dual_kernel, fs, base, lam, m > 1, compiled)[1]
            if m
            else torch.zeros(2, dtype=torch.float64)
        )
        start = _point(lam, sums, m > 1)
        return cls(idx, base, fs, compiled, start, float(sums[1]) if m else 0.0)

    @property
    def m(self) -> int:
        return len(self.fs)

    def evaluate(self, lam: torch.Tensor, hessian: bool = False) -> DualPoint:
        """The sums at ``λ`` (a float64 CPU vector) in one pass."""
        _, sums = _run(dual_kernel, self.fs, self.base, lam, hessian, self.compiled)
        return _point(lam, sums, hessian)

    def damages(self, values: torch.Tensor) -> list[float]:
        """``b_k = Σ_j F̃_k(j)·v(j)²`` of values ``v`` on the solver coordinates, for every k.

        Off them ``F̃_k = 0`` or the value is (a cast of) ``Δ_base = 0``, which adds nothing.
        """
        if not self.fs:
            return []
        lam = torch.zeros(self.m, dtype=torch.float64)
        _, sums = _run(dual_kernel, self.fs, values, lam, False, self.compiled)
        return [float(x) for x in sums[2:]]

    def certify(
        self, lam: torch.Tensor, out: torch.Tensor
    ) -> tuple[torch.Tensor, list[float], float, float]:
        """Write ``Δ*`` at ``λ`` into the flat ``out`` at the solver coordinates, cast toward zero.

        Returns ``(b, b after the cast, ½‖Δ* − Δ_base‖², ½ Σ Δ_base²·s/(1 + s))``, ``b`` of the
        float64 point before the cast.
        """
        (cast,), sums = _run(certificate_kernel, self.fs, self.base, lam, out.dtype, self.compiled)
        n, dev = self.idx.numel(), self.idx.device

        def write(span: slice) -> None:
            out.index_copy_(0, self.idx[span], cast[span])

        map_spans(write, n, dev)
        m = self.m
        after = [float(x) for x in sums[m : 2 * m]]
        return sums[:m].clone(), after, 0.5 * float(sums[2 * m]), 0.5 * float(sums[2 * m + 1])


def _point(lam: torch.Tensor, sums: torch.Tensor, hessian: bool) -> DualPoint:
    """The :class:`DualPoint` at ``λ`` from :func:`dual_kernel`'s sums (Hessian: −4 × them)."""
    m = lam.numel()
    hess = None
    if hessian:
        upper = iter((-4.0 * sums[2 + m :]).tolist())
        hess = torch.zeros((m, m), dtype=torch.float64)
        for k in range(m):
            for k2 in range(k, m):
                hess[k, k2] = hess[k2, k] = next(upper)
    return DualPoint(lam.clone(), 0.5 * float(sums[0]), sums[2 : 2 + m].clone(), hess)
