"""FIRM retention-constrained projection for one weight tensor (SPEC §2.4, "FIRM-QP").

Given the base merge ``Δ_base`` of one tensor and the sparsified, normalised Fisher diagonals
``F̃_k`` of the m retain clients, solve

    minimise   ½‖Δ − Δ_base‖²
    subject to b_k(Δ) = Σ_j F̃_k(j)·Δ(j)² ≤ epsilon        (k = 1..m)

For multipliers ``λ ≥ 0`` the minimiser of the Lagrangian is the coordinate-wise shrinkage
``Δ(λ)(j) = Δ_base(j) / (1 + 2 Σ_k λ_k F̃_k(j))``, and every ``b_k(Δ(λ))`` is decreasing in
every ``λ_l``.  The dual ``g(λ) = ½‖Δ(λ) − Δ_base‖² + Σ_k λ_k (b_k(Δ(λ)) − epsilon)``
simplifies to ``½ Σ_j Δ_base(j)²·s_j/(1 + s_j) − epsilon·Σ_k λ_k`` with
``s_j = 2 Σ_k λ_k F̃_k(j)``; it is concave with ``∂g/∂λ_k = b_k(Δ(λ)) − epsilon``.

Solvers:

* ``"exact"`` (default): maximises the dual.  Cyclic exact coordinate ascent — for each k,
  holding the others, ``λ_k = 0`` if constraint k then holds, else the root of
  ``b_k = epsilon`` in ``λ_k`` (found by a safeguarded Newton iteration, see
  :func:`_coordinate_root`) — so multipliers may DECREASE.  After every sweep one Newton (SQP)
  step on the dual is tried: the concave quadratic model of ``g`` is maximised exactly over
  ``λ ≥ 0`` (a small m × m active-set QP, which also decides which multipliers are zero) and the
  step is kept, after backtracking, only if it raises the dual (or, once the dual is flat to
  rounding, keeps it and reduces the KKT residual).  This turns the linear — with strongly
  overlapping retain Fisher masks, crawling — rate of coordinate ascent into a fast local one;
  the sweeps alone guarantee convergence.  Sweeps stop once no multiplier moves by more than a
  relative ``1e-10``.  If a tiny violation ``b_k > epsilon`` is left at that point, a final
  feasibility pass raises only the violated multipliers (raising never violates another
  constraint).  The result is the unique closest feasible point up to the solver accuracy.
* ``"increase-only"``: the paper's routine.  It sweeps the constraints and raises the
  multiplier of each violated one (bracket by doubling, then bisection until
  ``epsilon − τ ≤ b_k ≤ epsilon``), holding the others fixed, until all hold.  Raising a
  multiplier never violates a satisfied constraint, so the result is always feasible, but for
  m > 1 it is not necessarily the closest feasible point (its multipliers can overshoot and are
  never lowered again).

For m = 1 both names coincide mathematically and run the same code (the ``"exact"`` path: one
root solve, which is the projection).

All solver arithmetic is done in float64 on the coordinates where some ``F̃_k`` is positive and
``Δ_base`` is non-zero (elsewhere ``Δ = Δ_base``); a coordinate step on ``λ_k`` only visits the
support of ``F̃_k`` (the other coordinates add exact zeros to its sums), and the sums are taken
slice by slice over the threads, so they round like a sum in another order would.  Both solvers
end on a point with ``b_k ≤ epsilon`` in float64 (the exact solver aims at
``epsilon·(1 − 1e-12)`` so that this survives summing in another order); the cast to the output
dtype rounds toward zero, so it cannot increase any ``|Δ(j)|`` and feasibility survives the
cast.

Every call reports a KKT certificate for the float64 point before the cast: the largest primal
violation ``max_k (b_k − epsilon)₊``, the largest complementary slackness
``max_k |λ_k (b_k − epsilon)|`` and the duality gap ``½‖Δ* − Δ_base‖² − g(λ)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._chunks import map_spans

SOLVERS: tuple[str, ...] = ("exact", "increase-only")
PLANNED_SOLVERS: tuple[str, ...] = ()
DEFAULT_SOLVER = "exact"

_MAX_DOUBLINGS = 2000
# Sweeps of the exact solver stop once no multiplier moves by more than this (relative).
_LAMBDA_RTOL = 1e-10
# Newton iterations of a coordinate root stop once the step is below this (relative).
_NEWTON_RTOL = 2.0**-46
# Relative slack on the dual when accepting an accelerated Newton step (rounding only).
_DUAL_SLACK = 1e-13
_MAX_BACKTRACKS = 20
# Relative ridge added to the dual Hessian model in the Newton (SQP) step.
_QP_RIDGE = 1e-14
# The exact solver targets epsilon·(1 − _SAFETY): summing the damage of the result in another
# order (e.g. over the whole tensor, as ``fisher_damage`` does) can differ by a few ulps, and
# ``b_k ≤ epsilon`` must still hold then.  The effect on optimality is of relative order 1e-12.
_SAFETY = 1e-12


def fisher_damage(delta: torch.Tensor, fisher_sparse: torch.Tensor) -> float:
    """Retention damage ``b(Δ) = Σ_j F̃(j)·Δ(j)²`` (accumulated in float64)."""
    if tuple(delta.shape) != tuple(fisher_sparse.shape):
        raise ValueError(
            f"fisher_damage: delta shape {tuple(delta.shape)} != Fisher shape "
            f"{tuple(fisher_sparse.shape)}"
        )
    d = delta.to(torch.float64)
    f = fisher_sparse.to(device=d.device, dtype=torch.float64)
    return float((f * d * d).sum())


def cast_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``x`` to ``dtype`` rounding toward zero, so that ``|result(j)| ≤ |x(j)|``."""
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        # bfloat16 is float32 without the low 16 mantissa bits (same sign and exponent bits),
        # so clearing those bits rounds toward zero, after which the cast is exact.  (Infinities
        # and quiet NaNs keep their class; only a signalling NaN whose payload lies entirely in
        # the cleared bits would become an infinity.)
        return (x.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)
    y = x.to(dtype)
    if dtype == x.dtype or not dtype.is_floating_point:
        return y
    wide = torch.promote_types(dtype, x.dtype)
    over = y.to(wide).abs() > x.to(wide).abs()
    if bool(over.any()):
        y = torch.where(over, torch.nextafter(y, y.new_zeros(())), y)
    return y


def check_solver(solver: str) -> None:
    """Raise ``NotImplementedError`` (planned solver) or ``ValueError`` (unknown name)."""
    if solver in SOLVERS:
        return
    if solver in PLANNED_SOLVERS:
        raise NotImplementedError(
            f"projection solver {solver!r} is not implemented yet; available: {list(SOLVERS)}"
        )
    raise ValueError(f"unknown projection solver {solver!r}; available: {list(SOLVERS)}")


# --------------------------------------------------------------------------- shared helpers
def _denominator(lam: torch.Tensor, fs: torch.Tensor) -> torch.Tensor:
    """``1 + 2 Σ_k λ_k F̃_k(j)`` on the support."""
    return 1.0 + 2.0 * (lam @ fs)


def _kkt_residual(lam: torch.Tensor, b: torch.Tensor, epsilon: float) -> float:
    """Projected dual gradient: ``|b_k − epsilon|`` where ``λ_k > 0``, ``(b_k − epsilon)₊``."""
    r = b - epsilon
    res = torch.where(lam > 0, r.abs(), r.clamp(min=0.0))
    return float(res.max()) if res.numel() else 0.0


# --------------------------------------------------------------------- increase-only (paper)
def _solve_one(
    damage: Callable[[float], float],
    lam0: float,
    b0: float,
    fmax: float,
    epsilon: float,
    tau: float,
    max_iter: int,
) -> tuple[float, int]:
    """Find ``λ ≥ lam0`` with ``epsilon − tau ≤ damage(λ) ≤ epsilon`` (``damage`` decreasing).

    ``b0 = damage(lam0) > epsilon``.  Because every denominator ``1 + 2Σλ F̃`` is at least 1,
    ``damage(lam0 + δ) ≥ b0 / (1 + 2δ·fmax)²``, which gives a starting point that is still
    infeasible; from there the step is doubled until feasible, then the bracket is bisected.
    The returned λ is always the feasible (upper) end.  Returns ``(λ, iterations)``.
    """
    iters = 0
    delta0 = (math.sqrt(b0 / epsilon) - 1.0) / (2.0 * fmax)
    lo = lam0 + max(delta0, 0.0)
    step = max(delta0, 1e-12 * (1.0 + lam0))
    hi = lo + step
    b_hi = damage(hi)
    doublings = 0
    while b_hi > epsilon:
        lo = hi
        step *= 2.0
        hi = lo + step
        b_hi = damage(hi)
        iters += 1
        doublings += 1
        if doublings > _MAX_DOUBLINGS or not math.isfinite(hi):
            raise RuntimeError("projection: could not bracket the multiplier (damage too flat)")
    bisections = 0
    while b_hi < epsilon - tau and bisections < max_iter and hi - lo > 1e-15 * hi:
        mid = 0.5 * (lo + hi)
        b_mid = damage(mid)
        if b_mid <= epsilon:
            hi, b_hi = mid, b_mid
        else:
            lo = mid
        bisections += 1
    return hi, iters + bisections


def _increase_only(
    fs: torch.Tensor, weights: torch.Tensor, epsilon: float, tau: float, max_iter: int
) -> tuple[torch.Tensor, int, int, bool]:
    """The paper's routine.  Returns ``(λ, sweeps, iterations, stopped_by_itself)``."""
    m = fs.shape[0]
    fmax = [float(fs[k].max()) if fs.shape[1] else 0.0 for k in range(m)]
    lam_t = torch.zeros(m, dtype=torch.float64, device=fs.device)
    iterations = 0
    sweeps = 0
    finished = False
    while sweeps < max_iter:
        sweeps += 1
        changed = False
        for k in range(m):
            den = _denominator(lam_t, fs)
            b_k = float((weights[k] / (den * den)).sum())
            if b_k <= epsilon:
                continue
            other = den - 2.0 * lam_t[k] * fs[k]
            wk, fk = weights[k], fs[k]

            def damage(
                x: float,
                wk: torch.Tensor = wk,
                fk: torch.Tensor = fk,
                other: torch.Tensor = other,
            ) -> float:
                dd = other + 2.0 * x * fk
                return float((wk / (dd * dd)).sum())

            new_lam, it = _solve_one(damage, float(lam_t[k]), b_k, fmax[k], epsilon, tau, max_iter)
            lam_t[k] = new_lam
            iterations += it
            changed = True
        if not changed:
            finished = True
            break
    return lam_t, sweeps, iterations, finished


# ------------------------------------------------------------------------------ exact solver
@dataclass
class _Coordinate:
    """Constraint k restricted to its own support (where ``F̃_k > 0``; ``w_k`` is 0 elsewhere).

    ``cols`` holds every ``F̃_l`` there (``m × n_k``), so ``1 + 2 λ·cols`` is the denominator
    on that support; ``f`` and ``w`` are ``F̃_k`` and ``w_k = F̃_k·Δ_base²``.  Sums of ``w_k``
    terms over the support equal those over all solver coordinates (the others add exact zeros).
    """

    cols: torch.Tensor
    f: torch.Tensor
    w: torch.Tensor

    @classmethod
    def of(cls, k: int, fs: torch.Tensor, weights: torch.Tensor) -> _Coordinate:
        if fs.shape[0] == 1:
            return cls(fs, fs[0], weights[0])
        idx = _flat_nonzero(fs[k])
        cols = fs.new_empty((fs.shape[0], idx.numel()))
        for row, out in zip(fs, cols, strict=True):
            torch.index_select(row, 0, idx, out=out)
        return cls(cols, cols[k], weights[k].index_select(0, idx))

    def damage(self, lam: torch.Tensor) -> float:
        """``b_k(Δ(λ))`` as the solver computes it (chunked float64 sum)."""
        return _phi(self.w, self.f, _denominator(lam, self.cols), 0.0)[0]


def _phi(
    wk: torch.Tensor, fk: torch.Tensor, other: torch.Tensor, x: float, slope: bool = False
) -> tuple[float, float]:
    """``(φ(x), φ'(x))`` with ``φ(x) = Σ wk/(other + 2x·fk)²`` (``φ' = 0`` unless ``slope``).

    Evaluated slice by slice (cache-sized temporaries, slices spread over the threads).
    """

    def part(span: slice) -> tuple[float, float]:
        den = fk[span] * (2.0 * x)
        den.add_(other[span])
        q = wk[span] / (den * den)
        phi = float(q.sum())
        if not slope:
            return phi, 0.0
        return phi, float(q.mul_(fk[span]).div_(den).sum())

    parts = map_spans(part, wk.numel(), wk.device)
    return sum(p[0] for p in parts), -4.0 * sum(p[1] for p in parts)


def _coordinate_root(
    coord: _Coordinate,
    other: torch.Tensor,
    epsilon: float,
    x0: float,
    max_iter: int,
) -> tuple[float, int]:
    """Smallest ``x ≥ 0`` (to rounding) with ``φ(x) = Σ_j wk/(other + 2x·fk)² ≤ epsilon``.

    Requires ``φ(0) > epsilon``.  ``ψ = φ^(-1/2)`` is the (scaled) power mean ``M_-2`` of the
    affine functions ``other + 2x·fk`` and hence increasing and concave in ``x`` (exactly linear
    when a single coordinate is involved), so Newton's method on ``ψ(x) = epsilon^(-1/2)``
    converges from any start: a step from the right of the root lands at or left of it (clamped
    at 0, where ``φ > epsilon``), and from the left the iterates increase monotonically to the
    root.  The iteration starts at the warm start ``x0``.  The root is finally nudged up, by
    doubling steps of relative size ``2^-52``, to the feasible side.  Returns
    ``(x, evaluations)``.
    """
    wk, fk = coord.w, coord.f
    x = max(float(x0), 0.0)
    evals = 0
    been_left = False
    for _ in range(max_iter):
        phi, dphi = _phi(wk, fk, other, x, slope=True)
        evals += 1
        if phi <= epsilon and been_left:
            return x, evals  # crossed the root from the left: only rounding is left
        if phi == epsilon or not dphi < 0.0:
            break
        been_left = phi > epsilon
        new = max(x + 2.0 * phi * (1.0 - math.sqrt(phi / epsilon)) / dphi, 0.0)
        moved = abs(new - x)
        x = new
        if moved <= _NEWTON_RTOL * x:
            break
    # Nudge to the feasible side (Newton from the left stops just short of the root).
    step = max(x, 1e-300) * 2.0**-52
    doublings = 0
    while True:
        evals += 1
        if _phi(wk, fk, other, x)[0] <= epsilon:
            return x, evals
        x += step
        step *= 2.0
        doublings += 1
        if doublings > _MAX_DOUBLINGS or not math.isfinite(x):
            raise RuntimeError("projection: could not bracket the multiplier (damage too flat)")


def _coordinate_update(
    lam: torch.Tensor,
    k: int,
    coord: _Coordinate,
    epsilon: float,
    max_iter: int,
    raise_only: bool,
) -> int:
    """Maximise the dual over ``λ_k`` in place (``raise_only``: only if ``b_k > epsilon``).

    Works on constraint k's own support.  Returns the number of damage evaluations.
    """
    den = _denominator(lam, coord.cols)
    lam_k = float(lam[k])
    other = den - 2.0 * lam_k * coord.f
    if raise_only:
        if _phi(coord.w, coord.f, den, 0.0)[0] <= epsilon:
            return 1
        new, evals = _coordinate_root(coord, other, epsilon, lam_k, max_iter)
        lam[k] = max(new, lam_k)
        # ``other + 2x·f_k`` and ``1 + 2 λ·F̃`` may round differently: nudge until ``b_k`` as
        # the caller computes it is within the budget too.
        step = max(float(lam[k]), 1e-300) * 2.0**-52
        for _ in range(_MAX_DOUBLINGS):
            evals += 1
            if coord.damage(lam) <= epsilon:
                return evals + 1
            lam[k] += step
            step *= 2.0
        raise RuntimeError("projection: could not bracket the multiplier (damage too flat)")
    if _phi(coord.w, coord.f, other, 0.0)[0] <= epsilon:
        lam[k] = 0.0
        return 1
    new, evals = _coordinate_root(coord, other, epsilon, lam_k, max_iter)
    lam[k] = new
    return evals + 1


def _box_qp(q: torch.Tensor, c: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Minimise ``½ xᵀ q x + cᵀ x`` over ``x ≥ 0`` (``q`` PSD, small) by an active-set method.

    ``q`` is first regularised by ``_QP_RIDGE·max(diag q)·I``: retain Fishers that are (nearly)
    proportional make ``q`` singular up to rounding, and the ridge turns a direction in which
    the model is flat into a long step that runs into the bound (instead of an arbitrary point
    decided by rounding).  Then a Lawson–Hanson style primal active set, started from the
    feasible ``x0``: solve the equality-constrained problem on the free set, step back to the
    boundary if that leaves the orthant, free the variable with the most negative gradient when
    optimal on the face; capped at ``10·m + 10`` iterations.  Returns the last iterate (``≥ 0``).
    """
    m = q.shape[0]
    top = float(q.diagonal().max())
    x = x0.clone()
    if not top > 0.0:
        return x
    q = q + _QP_RIDGE * top * torch.eye(m, dtype=q.dtype, device=q.device)
    free = x > 0
    for _ in range(10 * m + 10):
        idx = torch.nonzero(free).squeeze(1)
        z = torch.zeros_like(x)
        if idx.numel():
            try:
                z[idx] = torch.linalg.solve(q[idx][:, idx], -c[idx])
            except RuntimeError:
                return x
        if not bool(torch.isfinite(z).all()):
            return x
        neg = free & (z < 0)
        if bool(neg.any()):
            ratios = x[neg] / (x[neg] - z[neg])
            alpha = float(ratios.min().clamp(0.0, 1.0))
            x = (x + alpha * (z - x)).clamp(min=0.0)
            free = free & (x > 0)
            continue
        x = z
        grad = q @ x + c
        cand = (~free) & (grad < 0)
        if not bool(cand.any()):
            return x
        k = int(torch.argmin(torch.where(cand, grad, torch.zeros_like(grad))))
        free[k] = True
    return x


def _dual_pass(
    lam: torch.Tensor,
    base_sq: torch.Tensor,
    fs: torch.Tensor,
    weights: torch.Tensor,
    hessian: bool = False,
) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """``(½ Σ Δ_base²·s/(1 + s), b, H)`` at ``λ`` in one slice-by-slice pass (float64).

    ``b`` are the damages ``b_k(Δ(λ))`` and ``H`` (with ``hessian``) the dual Hessian
    ``−4 Σ_j F̃_k F̃_l Δ_base² / den³``, on the CPU.
    """

    def part(span: slice) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        f = fs[:, span]
        den = _denominator(lam, f)
        half = 0.5 * float((base_sq[span] * ((den - 1.0) / den)).sum())
        w = weights[:, span] / (den * den)
        b = w.sum(dim=1)
        h = (w.div_(den) @ f.T) if hessian else None
        return half, b, h

    parts = map_spans(part, base_sq.numel(), base_sq.device)
    m = fs.shape[0]
    b = torch.zeros(m, dtype=torch.float64, device=fs.device)
    hess = torch.zeros((m, m), dtype=torch.float64, device=fs.device) if hessian else None
    for _, pb, ph in parts:
        b.add_(pb)
        if hess is not None:
            hess.add_(ph)  # type: ignore[arg-type]
    hess = None if hess is None else (-4.0 * hess).cpu()
    return sum(p[0] for p in parts), b, hess


def _newton_acceleration(
    lam: torch.Tensor,
    base_sq: torch.Tensor,
    fs: torch.Tensor,
    weights: torch.Tensor,
    epsilon: float,
) -> int:
    """Try one Newton (SQP) step on the dual, in place.

    The dual gradient is ``r = b − epsilon`` and its Hessian ``H_kl = ∂b_k/∂λ_l =
    −4 Σ_j F̃_k F̃_l Δ_base² / den³`` (m × m, negative semi-definite).  The concave quadratic
    model ``r·d + ½ dᵀHd`` is maximised exactly over ``λ + d ≥ 0`` (:func:`_box_qp`, so the
    model also chooses which multipliers are zero), then ``λ + t·d`` is tried for
    ``t = 1, ½, …`` (at most ``_MAX_BACKTRACKS`` halvings).  A trial point is kept if it raises
    the dual beyond rounding or — once the dual is flat to rounding — keeps it and reduces the
    KKT residual.  Returns the number of trial points evaluated.
    """
    half, b, hess = _dual_pass(lam, base_sq, fs, weights, hessian=True)
    res0 = _kkt_residual(lam, b, epsilon)
    if res0 == 0.0:
        return 0
    g0 = half - epsilon * float(lam.sum())
    r = (b - epsilon).cpu()
    lam_c = lam.cpu()
    target = _box_qp(-hess, hess @ lam_c - r, lam_c)  # type: ignore[operator]
    step = (target - lam_c).to(lam.device)
    if not bool(torch.isfinite(step).all()) or float(step.abs().max()) == 0.0:
        return 0
    slack = _DUAL_SLACK * 0.5 * float(base_sq.sum())
    t = 1.0
    for trial in range(1, _MAX_BACKTRACKS + 1):
        cand = (lam + t * step).clamp(min=0.0)
        half_c, b_c, _ = _dual_pass(cand, base_sq, fs, weights)
        g_c = half_c - epsilon * float(cand.sum())
        if g_c > g0 + slack or (g_c >= g0 - slack and _kkt_residual(cand, b_c, epsilon) < res0):
            lam.copy_(cand)
            return trial
        t *= 0.5
    return _MAX_BACKTRACKS


def _exact(
    base_sq: torch.Tensor,
    fs: torch.Tensor,
    weights: torch.Tensor,
    epsilon: float,
    max_iter: int,
) -> tuple[torch.Tensor, int, int, bool, bool]:
    """Dual maximisation.  Returns ``(λ, sweeps, iterations, stopped, feasibility_pass)``."""
    m = fs.shape[0]
    coords = [_Coordinate.of(k, fs, weights) for k in range(m)]
    lam = torch.zeros(m, dtype=torch.float64, device=fs.device)
    iterations = 0
    sweeps = 0
    stopped = False
    while sweeps < max_iter:
        sweeps += 1
        prev = lam.clone()
        for k in range(m):
            iterations += _coordinate_update(lam, k, coords[k], epsilon, max_iter, False)
        if m == 1:  # one exact coordinate maximisation solves the whole problem
            stopped = True
            break
        change = float((lam - prev).abs().max())
        if change <= _LAMBDA_RTOL * float(lam.max()):
            stopped = True
            break
        iterations += _newton_acceleration(lam, base_sq, fs, weights, epsilon)

    # Feasibility pass: raise (only) the multipliers of constraints that are still violated.
    feasibility_pass = False
    for _ in range(max_iter):
        violated = [k for k in range(m) if coords[k].damage(lam) > epsilon]
        if not violated:
            break
        feasibility_pass = True
        for k in violated:
            iterations += _coordinate_update(lam, k, coords[k], epsilon, max_iter, True)
    return lam, sweeps, iterations, stopped, feasibility_pass


# ------------------------------------------------------------------------------- front end
def project_retention(
    delta_base: torch.Tensor,
    retain_fishers: Sequence[torch.Tensor],
    epsilon: float,
    *,
    solver: str = DEFAULT_SOLVER,
    max_iter: int = 500,
    tol: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict]:
    """Project one tensor's base merge onto the retention budget (SPEC §2.4).

    Args:
        delta_base: ``Δ_base`` of one weight tensor.
        retain_fishers: the m retain clients' normalised, sparsified Fisher ``F̃_k`` (same shape,
            non-negative).  With m = 0 nothing is projected.
        epsilon: retention budget ``epsilon`` per client per tensor (> 0; ``inf`` disables).
        solver: ``"exact"`` (default; maximises the dual, multipliers may decrease, returns the
            closest feasible point) or ``"increase-only"`` (the paper's routine: certifies
            feasibility but not optimality for m > 1).  For m = 1 both run the same code.
        max_iter: cap on constraint sweeps and on the inner iterations of each multiplier
            update (bisection steps, resp. Newton steps).
        tol: tolerance ``τ``, default ``max(1e-4·epsilon, 1e-12)``.  ``"increase-only"`` stops
            raising a multiplier once ``epsilon − τ ≤ b_k ≤ epsilon``; ``"exact"`` solves every
            coordinate to rounding accuracy and reports ``converged`` only if its sweeps stopped
            moving and the KKT residual is at most ``τ`` (``b_k ≤ epsilon + τ`` for all k and
            ``|b_k − epsilon| ≤ τ`` where ``λ_k > 0``); for ``"increase-only"`` (m > 1)
            ``converged`` only means that the routine ended with every constraint satisfied
            before ``max_iter`` sweeps (see the certificate for its optimality).
        out_dtype: dtype of the returned tensor (default ``delta_base.dtype``); the cast rounds
            toward zero and ``damage_after`` / ``max_violation`` are computed after it.

    Returns:
        ``(Δ*, report)`` with report keys

        * ``multipliers`` (λ_k), ``damage_before`` (b_k(Δ_base)), ``damage_after`` (b_k(Δ*)
          after the cast), ``max_violation`` (max_k (b_k(Δ*) − epsilon)₊ after the cast),
          ``active`` (some λ_k > 0);
        * ``iterations`` (inner damage evaluations), ``sweeps`` (constraint sweeps),
          ``converged`` (bool), ``feasibility_pass`` (the exact solver had to raise violated
          multipliers after its sweeps);
        * the KKT certificate of the float64 point before the cast: ``max_primal_violation``
          (max_k (b_k − epsilon)₊), ``max_complementary_slackness`` (max_k |λ_k (b_k −
          epsilon)|) and ``duality_gap`` (½‖Δ* − Δ_base‖² − g(λ)).
    """
    check_solver(solver)
    epsilon = float(epsilon)
    if math.isnan(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be > 0 (or inf to disable), got {epsilon}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if not delta_base.is_floating_point():
        raise TypeError(f"delta_base must be a floating tensor, got {delta_base.dtype}")
    fishers = list(retain_fishers)
    for k, f in enumerate(fishers):
        if tuple(f.shape) != tuple(delta_base.shape):
            raise ValueError(
                f"retain Fisher #{k} has shape {tuple(f.shape)}, "
                f"delta_base has {tuple(delta_base.shape)}"
            )
        if f.numel():
            # One pass: NaN propagates into min/max and fails both comparisons.
            lo, hi = torch.aminmax(f)
            if not (float(lo) >= 0.0 and float(hi) < math.inf):
                raise ValueError(f"retain Fisher #{k} must be finite and non-negative")
    return _project_checked(
        delta_base,
        fishers,
        epsilon,
        solver=solver,
        max_iter=max_iter,
        tol=tol,
        out_dtype=delta_base.dtype if out_dtype is None else out_dtype,
    )


def _flat_nonzero(t: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the non-zero entries of the flat tensor ``t`` (int64).

    On the CPU through numpy, slice by slice over the threads (``torch.nonzero`` is several
    times slower there); elsewhere ``torch.nonzero``.
    """
    if t.device.type != "cpu" or t.dtype not in (torch.bool, torch.float32, torch.float64):
        return torch.nonzero(t).squeeze(1)
    arr = t.numpy()

    def part(span: slice) -> np.ndarray:
        chunk = arr[span]
        return np.flatnonzero(chunk if chunk.dtype == np.bool_ else chunk != 0) + span.start

    parts = map_spans(part, arr.size, t.device)
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


class _SparseFisher:
    """A Fisher diagonal kept as its non-zero entries: flat indices and float64 values."""

    def __init__(self, fisher: torch.Tensor, device: torch.device) -> None:
        flat = fisher.reshape(-1).to(device)
        self.idx = _flat_nonzero(flat)
        self.values = flat.index_select(0, self.idx).to(torch.float64)

    def damage(self, delta_flat: torch.Tensor) -> float:
        """``Σ_j F̃(j)·Δ(j)²`` over the support (where ``F̃`` is zero nothing is added)."""
        d = delta_flat.index_select(0, self.idx).to(torch.float64)
        return float((self.values * d * d).sum())


def _solver_support(flat: torch.Tensor, sparse: Sequence[_SparseFisher]) -> torch.Tensor:
    """Solver coordinates: in the support of some ``F̃_k``, with ``Δ_base(j) ≠ 0`` (ascending)."""
    if len(sparse) == 1:
        idx = sparse[0].idx
        return idx[flat.index_select(0, idx) != 0]
    in_support = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    for sf in sparse:
        in_support[sf.idx] = True
    in_support &= flat != 0
    return _flat_nonzero(in_support)


def _certificate(
    lam: torch.Tensor, base_s: torch.Tensor, fs: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(Δ*, b, duality gap)`` on the solver coordinates, in one slice-by-slice pass."""
    proj = torch.empty_like(base_s)

    def part(span: slice) -> tuple[torch.Tensor, float, float]:
        f, base = fs[:, span], base_s[span]
        den = _denominator(lam, f)
        p = base / den
        proj[span] = p
        b = (f * (p * p)).sum(dim=1)
        primal = 0.5 * float(((p - base) ** 2).sum())
        half = 0.5 * float((base * base * ((den - 1.0) / den)).sum())
        return b, primal, half

    parts = map_spans(part, base_s.numel(), base_s.device)
    b = torch.zeros(fs.shape[0], dtype=torch.float64, device=fs.device)
    for pb, _, _ in parts:
        b.add_(pb)
    primal = sum(p[1] for p in parts)
    dual = sum(p[2] for p in parts) - epsilon * float(lam.sum())
    return proj, b, primal - dual


def _cast_flat(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new flat tensor: :func:`cast_toward_zero` of ``flat``, slice by slice."""
    out = torch.empty(flat.shape, dtype=dtype, device=flat.device)

    def part(span: slice) -> None:
        out[span] = cast_toward_zero(flat[span], dtype)

    map_spans(part, flat.numel(), flat.device)
    return out


def _project_checked(
    delta_base: torch.Tensor,
    fishers: list[torch.Tensor],
    epsilon: float,
    *,
    solver: str,
    max_iter: int,
    tol: float | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, dict]:
    """:func:`project_retention` on validated arguments (``out_dtype`` resolved).

    Damages are summed over the support of each ``F̃_k`` only (they are zero elsewhere).
    """
    m = len(fishers)
    tau = max(1e-4 * epsilon, 1e-12) if tol is None else float(tol)
    flat = delta_base.reshape(-1)
    sparse = [_SparseFisher(f, flat.device) for f in fishers]
    damage_before = [sf.damage(flat) for sf in sparse]
    lam = [0.0] * m
    iterations = 0
    sweeps = 0
    converged = True
    feasibility_pass = False
    # Certificate at Δ* = Δ_base, λ = 0: the primal objective and the dual are both 0.
    primal_violation = 0.0
    if math.isfinite(epsilon):
        primal_violation = max([max(b - epsilon, 0.0) for b in damage_before], default=0.0)
    slackness = 0.0
    gap = 0.0

    if m == 0 or math.isinf(epsilon) or all(b <= epsilon for b in damage_before):
        # Nothing to shrink.  With a finite budget, still round toward zero so that a point that
        # is feasible before the cast stays feasible after it.
        if m and math.isfinite(epsilon):
            result = cast_toward_zero(delta_base, out_dtype)
        else:
            result = delta_base.to(out_dtype)
        if out_dtype == delta_base.dtype:
            damage_after = list(damage_before)  # the cast changed nothing
        else:
            damage_after = [sf.damage(result.reshape(-1)) for sf in sparse]
    else:
        idx = _solver_support(flat, sparse)
        base_s = flat.index_select(0, idx).to(torch.float64)
        fs = base_s.new_empty((m, idx.numel()))  # (m, n_s)
        for f, row in zip(fishers, fs, strict=True):
            row.copy_(f.reshape(-1).to(flat.device).index_select(0, idx))
        base_sq = base_s * base_s
        weights = fs * base_sq  # F̃_k(j)·Δ_base(j)²

        if solver == "exact" or m == 1:
            lam_t, sweeps, iterations, stopped, feasibility_pass = _exact(
                base_sq, fs, weights, epsilon * (1.0 - _SAFETY), max_iter
            )
        else:
            lam_t, sweeps, iterations, stopped = _increase_only(fs, weights, epsilon, tau, max_iter)
        lam = [float(x) for x in lam_t]
        del weights, base_sq
        # KKT certificate of the float64 point (before the cast).
        proj_s, b, gap = _certificate(lam_t, base_s, fs, epsilon)
        viol = b - epsilon
        primal_violation = float(viol.clamp(min=0.0).max())
        slackness = float((lam_t * viol).abs().max())
        converged = bool(stopped)
        if solver == "exact" or m == 1:
            converged = converged and _kkt_residual(lam_t, b, epsilon) <= tau

        # Off the solver support Δ* = Δ_base: cast it straight from its own dtype (the same
        # value, so the same rounding as from float64), then write the projected entries.
        out = _cast_flat(flat, out_dtype)  # a new tensor: never writes into the caller's
        out.index_copy_(0, idx, cast_toward_zero(proj_s, out_dtype))
        damage_after = [sf.damage(out) for sf in sparse]
        result = out.reshape(delta_base.shape)

    max_violation = 0.0
    if math.isfinite(epsilon):
        max_violation = max([max(b - epsilon, 0.0) for b in damage_after], default=0.0)
    report = {
        "multipliers": lam,
        "damage_before": damage_before,
        "damage_after": damage_after,
        "iterations": int(iterations),
        "sweeps": int(sweeps),
        "converged": bool(converged),
        "feasibility_pass": bool(feasibility_pass),
        "max_violation": float(max_violation),
        "active": any(x > 0 for x in lam),
        "max_primal_violation": float(primal_violation),
        "max_complementary_slackness": float(slackness),
        "duality_gap": float(gap),
    }
    return result, report
