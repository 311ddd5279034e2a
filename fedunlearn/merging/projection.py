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
  step on the dual is tried: a concave quadratic model of ``g`` (its Hessian, with the gradient
  taken from the linearisation of ``b_k^(-1/2)``, see :func:`_newton_acceleration`) is
  maximised exactly over ``λ ≥ 0`` (a small m × m active-set QP, which also decides which
  multipliers are zero) and the step is kept, after backtracking, only if it raises the dual
  (or, once the dual is flat to rounding, keeps it and reduces the KKT residual).  This turns
  the linear — with strongly overlapping retain Fisher masks, crawling — rate of coordinate
  ascent into a fast local one; the sweeps alone guarantee convergence.  Sweeps stop once no
  multiplier moves by more than a relative ``1e-10``.  If a tiny violation ``b_k > epsilon``
  is left at that point, a final feasibility pass raises only the violated multipliers
  (raising never violates another constraint; the damage it checks is computed exactly as in
  the root solves).  The result is the unique closest feasible point up to the solver
  accuracy.
* ``"increase-only"``: the paper's routine.  It sweeps the constraints and raises the
  multiplier of each violated one (bracket by doubling, then bisection until
  ``epsilon − τ ≤ b_k ≤ epsilon``), holding the others fixed, until all hold.  Raising a
  multiplier never violates a satisfied constraint, so the result is always feasible, but for
  m > 1 it is not necessarily the closest feasible point (its multipliers can overshoot and are
  never lowered again).

For m = 1 both names coincide mathematically and run the same code (the ``"exact"`` path: one
root solve, which is the projection).

All solver arithmetic is done in float64 on the coordinates where some ``F̃_k`` is positive and
``Δ_base`` is non-zero (elsewhere ``Δ = Δ_base``), gathered once per tensor (and once more per
constraint onto its own support: a coordinate step on ``λ_k`` only visits the support of
``F̃_k``, the other coordinates add exact zeros to its sums).  Every pass over these copies —
damages before and after, root and Newton evaluations (with one division per coordinate,
``u = 1/den``), the certificate — is taken slice by slice over the threads, so sums round like
a sum in another order would.  Both solvers end on a point with ``b_k ≤ epsilon`` in float64
(the exact solver aims at ``epsilon·(1 − 1e-12)`` so that this survives summing in another
order); the cast to the output dtype rounds toward zero, so it cannot increase any ``|Δ(j)|``
and feasibility survives the cast.

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

    ``f`` and ``w`` are ``F̃_k`` and ``w_k = F̃_k·Δ_base²`` there, and ``rest`` holds the other
    ``F̃_l`` (l ≠ k, ``(m − 1) × n_k``), all gathered once.  Sums of ``w_k`` terms over the
    support equal those over all solver coordinates (the others add exact zeros).
    """

    k: int
    rest: torch.Tensor
    f: torch.Tensor
    w: torch.Tensor

    @classmethod
    def of(cls, k: int, fs: torch.Tensor, weights: torch.Tensor) -> _Coordinate:
        if fs.shape[0] == 1:  # the solver coordinates are the support of F̃_1
            return cls(k, fs[:0], fs[0], weights[0])
        rest = [row for i, row in enumerate(fs) if i != k]
        cols = _gather([*rest, fs[k], weights[k]], _flat_nonzero(fs[k]))
        return cls(k, cols[:-2], cols[-2], cols[-1])

    def other(self, lam: torch.Tensor) -> torch.Tensor:
        """``1 + 2 Σ_{l≠k} λ_l F̃_l`` on the support (slice by slice, always in the same order)."""
        coef = [2.0 * float(x) for i, x in enumerate(lam) if i != self.k]
        out = torch.empty_like(self.f)

        def part(span: slice) -> None:
            o = out[span].fill_(1.0)
            for c, row in zip(coef, self.rest, strict=True):
                o.add_(row[span], alpha=c)

        map_spans(part, out.numel(), out.device)
        return out

    def phi(self, other: torch.Tensor, x: float, slope: bool = False) -> tuple[float, float]:
        """``(φ(x), φ'(x))`` with ``φ(x) = Σ w_k/(other + 2x·F̃_k)²`` (``φ' = 0`` unless ``slope``).

        With ``u = 1/(other + 2x·F̃_k)`` (one division per coordinate): ``φ = Σ w_k u²`` and
        ``φ' = −4 Σ w_k F̃_k u³``, slice by slice (cache-sized temporaries, over the threads).
        """

        def part(span: slice) -> tuple[float, float]:
            f, w = self.f[span], self.w[span]
            u = torch.add(other[span], f, alpha=2.0 * x).reciprocal_()
            u2 = u * u
            phi = float(torch.dot(w, u2))
            return phi, float(torch.dot(w, u2.mul_(u).mul_(f))) if slope else 0.0

        parts = map_spans(part, self.f.numel(), self.f.device)
        return sum(p[0] for p in parts), -4.0 * sum(p[1] for p in parts)

    def damage(self, lam: torch.Tensor) -> float:
        """``b_k(Δ(λ))`` exactly as the root solve computes it (so feasibility carries over)."""
        return self.phi(self.other(lam), float(lam[self.k]))[0]


def _coordinate_root(
    coord: _Coordinate,
    other: torch.Tensor,
    epsilon: float,
    x0: float,
    max_iter: int,
    floor: float,
) -> tuple[float, int]:
    """Smallest ``x ≥ floor`` (to rounding) with ``φ(x) = Σ_j w_k/(other + 2x·F̃_k)² ≤ epsilon``.

    ``ψ = φ^(-1/2)`` is the (scaled) power mean ``M_-2`` of the affine functions
    ``other + 2x·F̃_k`` and hence increasing and concave in ``x`` (exactly linear when a single
    coordinate is involved), so Newton's method on ``ψ(x) = epsilon^(-1/2)`` converges from any
    start ``x0 ≥ floor``: a step from the right of the root lands at or left of it (so its length
    bounds the distance to the root; clamped at ``floor``), and from the left the iterates
    increase monotonically to the root.  It stops at a feasible iterate that is ``floor`` or was
    reached from the left, or whose Newton step is below the relative ``_NEWTON_RTOL``;
    otherwise (a step below that from the left) the root is nudged up, by doubling steps from
    that last step, to the feasible side.  Returns ``(x, evaluations)``.
    """
    x = max(float(x0), floor)
    evals = 0
    been_left = feasible = False
    moved = 0.0
    for _ in range(max_iter):
        phi, dphi = coord.phi(other, x, slope=True)
        evals += 1
        feasible = phi <= epsilon
        if feasible and (been_left or x <= floor):
            return x, evals
        if not dphi < 0.0:
            break
        been_left = not feasible
        # 2φ(1 − √(φ/ε))/φ', with 1 − √r written as (1 − r)/(1 + √r) so that steps near the
        # root keep their precision (ε − φ is exact there).
        new = x + 2.0 * phi * (epsilon - phi) / (epsilon * (1.0 + math.sqrt(phi / epsilon)) * dphi)
        new = max(new, floor)
        moved = abs(new - x)
        if feasible and moved <= _NEWTON_RTOL * x:
            return x, evals  # from the right the step bounds the distance to the root
        x = new
        if moved <= _NEWTON_RTOL * x:
            break
    # Nudge to the feasible side (Newton from the left stops just short of the root, within the
    # rounding of φ), by doubling steps from the last Newton step (at least 2^-52 relative);
    # ``x`` itself is skipped if it was just found infeasible.
    step = max(moved, max(x, 1e-300) * 2.0**-52)
    stale = moved == 0.0 and not feasible
    for _ in range(_MAX_DOUBLINGS):
        if stale:
            x += step
            step *= 2.0
        if not math.isfinite(x):
            break
        evals += 1
        if coord.phi(other, x)[0] <= epsilon:
            return x, evals
        stale = True
    raise RuntimeError("projection: could not bracket the multiplier (damage too flat)")


def _coordinate_update(
    lam: torch.Tensor,
    coord: _Coordinate,
    epsilon: float,
    max_iter: int,
    raise_only: bool,
) -> int:
    """Maximise the dual over ``λ_k`` in place (``raise_only``: never below the current ``λ_k``).

    Exact: ``λ_k = 0`` if constraint k then holds, else the root of ``b_k = epsilon``; raising
    only: ``λ_k`` is kept if constraint k holds, else raised to that root.  Works on constraint
    k's own support; afterwards ``coord.damage(lam) ≤ epsilon``.  Returns the number of damage
    evaluations.
    """
    lam_k = float(lam[coord.k])
    floor = lam_k if raise_only else 0.0
    new, evals = _coordinate_root(coord, coord.other(lam), epsilon, lam_k, max_iter, floor)
    lam[coord.k] = new
    return evals


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
    lam: torch.Tensor, prob: _Restricted, hessian: bool = False
) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """``(½ Σ Δ_base²·s/(1 + s), b, H)`` at ``λ`` in one slice-by-slice pass (float64).

    ``b`` are the damages ``b_k(Δ(λ)) = Σ_j w_k u²`` with ``u = 1/(1 + s)``, ``s = 2 λ·F̃``, and
    ``H`` (with ``hessian``) the dual Hessian ``−4 Σ_j F̃_k F̃_l Δ_base² u³``, on the CPU.
    """
    lam2 = 2.0 * lam

    def part(span: slice) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        f, w = prob.fs[:, span], prob.weights[:, span]
        s = lam2 @ f
        u = (s + 1.0).reciprocal_()
        half = 0.5 * float(torch.dot(s.mul_(prob.base_sq[span]), u))
        u2 = u * u
        b = w @ u2
        h = (w * u2.mul_(u)) @ f.T if hessian else None
        return half, b, h

    parts = map_spans(part, prob.idx.numel(), lam.device)
    m = lam.numel()
    b = torch.zeros(m, dtype=torch.float64, device=lam.device)
    hess = torch.zeros((m, m), dtype=torch.float64, device=lam.device) if hessian else None
    for _, pb, ph in parts:
        b.add_(pb)
        if hess is not None:
            hess.add_(ph)  # type: ignore[arg-type]
    hess = None if hess is None else (-4.0 * hess).cpu()
    return sum(p[0] for p in parts), b, hess


def _newton_acceleration(lam: torch.Tensor, prob: _Restricted, epsilon: float) -> int:
    """Try one Newton (SQP) step on the dual, in place.

    The dual gradient is ``b − epsilon`` and its Hessian ``H_kl = ∂b_k/∂λ_l =
    −4 Σ_j F̃_k F̃_l Δ_base² / den³`` (m × m, negative semi-definite).  The concave quadratic
    model ``r·d + ½ dᵀHd`` is maximised exactly over ``λ + d ≥ 0`` (:func:`_box_qp`, so the
    model also chooses which multipliers are zero), with ``r_k = 2 b_k (√(b_k/epsilon) − 1)``
    (``= b_k − epsilon`` to first order): its optimality conditions are then those of the
    linearisation of ``ψ_k = b_k^(-1/2) ≥ epsilon^(-1/2)``, which is nearly linear in ``λ``
    (as in :func:`_coordinate_root`) and so gives much longer good steps than the
    linearisation of ``b_k`` itself.  Then ``λ + t·d`` is tried for
    ``t = 1, ½, …`` (at most ``_MAX_BACKTRACKS`` halvings).  A trial point is kept if it raises
    the dual beyond rounding or — once the dual is flat to rounding — keeps it and reduces the
    KKT residual.  Returns the number of trial points evaluated.
    """
    half, b, hess = _dual_pass(lam, prob, hessian=True)
    res0 = _kkt_residual(lam, b, epsilon)
    if res0 == 0.0:
        return 0
    g0 = half - epsilon * float(lam.sum())
    r = (2.0 * b * ((b / epsilon).sqrt() - 1.0)).cpu()
    lam_c = lam.cpu()
    target = _box_qp(-hess, hess @ lam_c - r, lam_c)  # type: ignore[operator]
    step = (target - lam_c).to(lam.device)
    if not bool(torch.isfinite(step).all()) or float(step.abs().max()) == 0.0:
        return 0
    slack = _DUAL_SLACK * 0.5 * prob.norm_sq
    t = 1.0
    for trial in range(1, _MAX_BACKTRACKS + 1):
        cand = (lam + t * step).clamp(min=0.0)
        half_c, b_c, _ = _dual_pass(cand, prob)
        g_c = half_c - epsilon * float(cand.sum())
        if g_c > g0 + slack or (g_c >= g0 - slack and _kkt_residual(cand, b_c, epsilon) < res0):
            lam.copy_(cand)
            return trial
        t *= 0.5
    return _MAX_BACKTRACKS


def _feasibility_pass(
    lam: torch.Tensor, coords: list[_Coordinate], epsilon: float, max_iter: int, fresh: int | None
) -> tuple[int, bool]:
    """Raise (only) the multipliers of violated constraints, cyclically, in place.

    ``fresh`` is a constraint known to hold at ``lam`` (its coordinate update was the last
    change).  Stops once every constraint has been seen to hold since the last raise (raising
    never violates another constraint, so normally after one round).  Returns ``(damage
    evaluations, some multiplier was raised)``.
    """
    m = len(coords)
    verified = 0 if fresh is None else 1
    k = 0 if fresh is None else (fresh + 1) % m
    evals = 0
    raised = False
    for _ in range(max_iter * m):
        if verified >= m:
            break
        before = float(lam[k])
        evals += _coordinate_update(lam, coords[k], epsilon, max_iter, True)
        verified = 1 if float(lam[k]) != before else verified + 1
        raised = raised or float(lam[k]) != before
        k = (k + 1) % m
    return evals, raised


def _exact(
    prob: _Restricted, epsilon: float, max_iter: int
) -> tuple[torch.Tensor, int, int, bool, bool]:
    """Dual maximisation.  Returns ``(λ, sweeps, iterations, stopped, feasibility_pass)``."""
    m = prob.fs.shape[0]
    coords = [_Coordinate.of(k, prob.fs, prob.weights) for k in range(m)]
    lam = torch.zeros(m, dtype=torch.float64, device=prob.fs.device)
    iterations = 0
    sweeps = 0
    stopped = False
    while sweeps < max_iter:
        sweeps += 1
        prev = lam.clone()
        for coord in coords:
            iterations += _coordinate_update(lam, coord, epsilon, max_iter, False)
        if m == 1:  # one exact coordinate maximisation solves the whole problem
            stopped = True
            break
        change = float((lam - prev).abs().max())
        if change <= _LAMBDA_RTOL * float(lam.max()):
            stopped = True
            break
        iterations += _newton_acceleration(lam, prob, epsilon)
    # The last coordinate update was the last change unless the sweeps ran out (after a step).
    evals, feasibility_pass = _feasibility_pass(
        lam, coords, epsilon, max_iter, m - 1 if stopped else None
    )
    return lam, sweeps, iterations + evals, stopped, feasibility_pass


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
        if not _finite_non_negative(f):
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


def _finite_non_negative(f: torch.Tensor) -> bool:
    """Whether every entry of ``f`` is finite and non-negative (one pass, slice by slice)."""
    flat = f.reshape(-1)

    def part(span: slice) -> bool:
        lo, hi = torch.aminmax(flat[span])  # NaN propagates into both and fails both tests
        return float(lo) >= 0.0 and float(hi) < math.inf

    return all(map_spans(part, flat.numel(), flat.device))


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


def _flat_nonzero(t: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the non-zero entries of the flat tensor ``t`` (int64)."""
    return _positions(lambda span: t[span] != 0, t.numel(), t.device)


def _gather(rows: Sequence[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """``row[idx]`` of every 1-D ``row``, as one float64 matrix (slice by slice over ``idx``)."""
    out = torch.empty((len(rows), idx.numel()), dtype=torch.float64, device=idx.device)

    def part(span: slice) -> None:
        pos = idx[span]
        for row, o in zip(rows, out, strict=True):
            o[span] = row.index_select(0, pos)

    map_spans(part, idx.numel(), idx.device)
    return out


def _solver_support(flat: torch.Tensor, fishers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Solver coordinates: in the support of some ``F̃_k``, with ``Δ_base(j) ≠ 0`` (ascending).

    One slice-by-slice pass over the flat ``Δ_base`` and ``F̃_k``.
    """

    def mask(span: slice) -> torch.Tensor:
        keep = torch.zeros(flat[span].shape, dtype=torch.bool, device=flat.device)
        for f in fishers:
            keep.logical_or_(f[span] != 0)
        return keep.logical_and_(flat[span] != 0)

    return _positions(mask, flat.numel() if fishers else 0, flat.device)


@dataclass
class _Restricted:
    """The problem on the solver coordinates ``idx``, gathered once and in float64.

    ``base`` is ``Δ_base`` there, ``fs`` the ``F̃_k`` (``m × n_s``), ``weights`` the
    ``w_k = F̃_k·Δ_base²``; ``damage`` holds ``b_k(Δ_base) = Σ_j w_k(j)`` and ``norm_sq``
    ``‖Δ_base‖²`` (both summed slice by slice).
    """

    idx: torch.Tensor
    base: torch.Tensor
    base_sq: torch.Tensor
    fs: torch.Tensor
    weights: torch.Tensor
    damage: list[float]
    norm_sq: float

    @classmethod
    def of(cls, flat: torch.Tensor, fishers: Sequence[torch.Tensor]) -> _Restricted:
        flat_f = [f.reshape(-1).to(flat.device) for f in fishers]
        idx = _solver_support(flat, flat_f)
        cols = _gather([flat, *flat_f], idx)
        base, fs = cols[0], cols[1:]
        base_sq, weights = torch.empty_like(base), torch.empty_like(fs)

        def part(span: slice) -> tuple[torch.Tensor, float]:
            sq = torch.mul(base[span], base[span], out=base_sq[span])
            w = torch.mul(fs[:, span], sq, out=weights[:, span])
            return w.sum(dim=1), float(sq.sum())

        parts = map_spans(part, idx.numel(), idx.device)
        damage = sum((p[0] for p in parts), fs.new_zeros(len(fishers)))
        norm_sq = sum(p[1] for p in parts)
        return cls(idx, base, base_sq, fs, weights, [float(x) for x in damage], norm_sq)

    def damages(self, values: torch.Tensor) -> list[float]:
        """``b_k = Σ_j F̃_k(j)·v(j)²`` of values ``v`` on the solver coordinates, for every k.

        Off them ``F̃_k = 0`` or the value is (a cast of) ``Δ_base = 0``, which adds nothing.
        """

        def part(span: slice) -> torch.Tensor:
            v = values[span].to(torch.float64)
            return self.fs[:, span] @ (v * v)

        parts = map_spans(part, values.numel(), values.device)
        return [float(x) for x in sum(parts, self.fs.new_zeros(self.fs.shape[0]))]


def _certificate(
    lam: torch.Tensor, prob: _Restricted, epsilon: float, out: torch.Tensor
) -> tuple[torch.Tensor, list[float], float]:
    """Write ``Δ*`` into the flat ``out`` at the solver coordinates, cast toward zero.

    Returns ``(b, b after the cast, duality gap)``, ``b`` and the gap those of the float64
    point ``Δ*`` before the cast, all in one slice-by-slice pass.
    """

    def part(span: slice) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        f, base = prob.fs[:, span], prob.base[span]
        den = _denominator(lam, f)
        p = base / den
        cast = cast_toward_zero(p, out.dtype)
        out.index_copy_(0, prob.idx[span], cast)
        c = cast.to(torch.float64)
        primal = 0.5 * float(((p - base) ** 2).sum())
        half = 0.5 * float((base * base * ((den - 1.0) / den)).sum())
        return f @ (p * p), f @ (c * c), primal, half

    parts = map_spans(part, prob.idx.numel(), prob.idx.device)
    zero = prob.fs.new_zeros(prob.fs.shape[0])
    b = sum((p[0] for p in parts), zero)
    after = sum((p[1] for p in parts), zero)
    primal = sum(p[2] for p in parts)
    dual = sum(p[3] for p in parts) - epsilon * float(lam.sum())
    return b, [float(x) for x in after], primal - dual


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

    Damages are summed over the solver coordinates only (they are zero elsewhere).
    """
    m = len(fishers)
    tau = max(1e-4 * epsilon, 1e-12) if tol is None else float(tol)
    flat = delta_base.reshape(-1)
    prob = _Restricted.of(flat, fishers)
    damage_before = prob.damage
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
            damage_after = prob.damages(result.reshape(-1).index_select(0, prob.idx))
    else:
        if solver == "exact" or m == 1:
            lam_t, sweeps, iterations, stopped, feasibility_pass = _exact(
                prob, epsilon * (1.0 - _SAFETY), max_iter
            )
        else:
            lam_t, sweeps, iterations, stopped = _increase_only(
                prob.fs, prob.weights, epsilon, tau, max_iter
            )
        lam = [float(x) for x in lam_t]
        # Off the solver coordinates Δ* = Δ_base: cast it straight from its own dtype (the same
        # value, so the same rounding as from float64); the certificate pass writes the rest.
        out = _cast_flat(flat, out_dtype)  # a new tensor: never writes into the caller's
        # KKT certificate of the float64 point (before the cast), and the damage after it.
        b, damage_after, gap = _certificate(lam_t, prob, epsilon, out)
        viol = b - epsilon
        primal_violation = float(viol.clamp(min=0.0).max())
        slackness = float((lam_t * viol).abs().max())
        converged = bool(stopped)
        if solver == "exact" or m == 1:
            converged = converged and _kkt_residual(lam_t, b, epsilon) <= tau
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
