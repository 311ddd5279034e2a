"""Solvers of the retention projection's dual (see :mod:`.projection` for the problem).

Both work on a :class:`~._projection_problem.Restricted` problem, whose one fused pass gives
the dual, every damage ``b_k`` and (optionally) the dual Hessian at given multipliers ``λ``.

* :func:`exact` maximises the concave dual.  Each iteration takes a Newton (SQP) step: the
  concave quadratic model of the dual (its Hessian, with the gradient taken from the
  linearisation of ``b_k^(-1/2)``, see :func:`newton_step`) is maximised exactly over
  ``λ ≥ 0``, and the step is kept, after backtracking, if it raises the dual (or, once the dual
  is flat to rounding, keeps it and reduces the KKT residual).  Where no step is kept, one sweep
  of exact coordinate maximisations follows (:func:`coordinate_root` per multiplier, which may
  lower it); those sweeps alone guarantee convergence, the Newton steps make it fast (six to
  eight passes from ``λ = 0`` at the benchmark's three overlapping constraints).  The
  iterations aim at ``epsilon·(1 − 1e-12)`` and stop once the KKT residual is at most
  ``1e-13`` of that, or no multiplier moves by more than a relative ``1e-10``; a violation
  ``b_k > epsilon`` left then is removed by raising only the violated multipliers (which never
  violates another constraint).
* :func:`increase_only` is the paper's routine: sweep the constraints and raise the multiplier
  of each violated one (doubling, then bisection until ``epsilon − τ ≤ b_k ≤ epsilon``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._projection_problem import DualPoint, Restricted

_MAX_DOUBLINGS = 2000
# Iterations of the exact solver stop once no multiplier moves by more than this (relative),
# or once the KKT residual is at most _KKT_RTOL times the budget they aim at, which is
# epsilon·(1 − _AIM): then the last point is feasible without a feasibility pass.
_LAMBDA_RTOL = 1e-10
_KKT_RTOL = 1e-13
_AIM = 1e-12
# Newton iterations of a coordinate root stop once the step is below this (relative).
_NEWTON_RTOL = 2.0**-46
# Relative slack on the dual when accepting a Newton step (rounding only).
_DUAL_SLACK = 1e-13
_MAX_BACKTRACKS = 20
# Relative ridge added to the dual Hessian model in the Newton (SQP) step.
_QP_RIDGE = 1e-14


def kkt_residual(lam: torch.Tensor, b: torch.Tensor, epsilon: float) -> float:
    """Projected dual gradient: ``|b_k − epsilon|`` where ``λ_k > 0``, ``(b_k − epsilon)₊``."""
    r = b - epsilon
    res = torch.where(lam > 0, r.abs(), r.clamp(min=0.0))
    return float(res.max()) if res.numel() else 0.0


def _with(lam: torch.Tensor, k: int, x: float) -> torch.Tensor:
    out = lam.clone()
    out[k] = x
    return out


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


def increase_only(
    prob: Restricted, epsilon: float, tau: float, max_iter: int
) -> tuple[torch.Tensor, int, int, bool]:
    """The paper's routine.  Returns ``(λ, sweeps, iterations, stopped_by_itself)``."""
    fmax = [float(f.max()) if f.numel() else 0.0 for f in prob.fs]
    point = prob.start
    iterations = sweeps = 0
    finished = False
    while sweeps < max_iter:
        sweeps += 1
        changed = False
        for k in range(prob.m):
            b_k = float(point.b[k])
            if b_k <= epsilon:
                continue
            lam = point.lam
            seen: dict[float, DualPoint] = {}

            def damage(x: float, k: int = k, lam: torch.Tensor = lam, seen: dict = seen) -> float:
                seen[x] = prob.evaluate(_with(lam, k, x))
                return float(seen[x].b[k])

            new_lam, it = _solve_one(damage, float(lam[k]), b_k, fmax[k], epsilon, tau, max_iter)
            point = seen[new_lam]  # the feasible end was evaluated
            iterations += it + 1
            changed = True
        if not changed:
            finished = True
            break
    return point.lam, sweeps, iterations, finished


# ------------------------------------------------------------------------------ exact solver
def coordinate_root(
    prob: Restricted,
    point: DualPoint,
    k: int,
    epsilon: float,
    max_iter: int,
    floor: float,
) -> tuple[DualPoint, int]:
    """Smallest ``x ≥ floor`` (to rounding) with ``φ(x) = b_k(λ with λ_k = x) ≤ epsilon``.

    ``ψ = φ^(-1/2)`` is the (scaled) power mean ``M_-2`` of the affine functions
    ``1 + 2 Σ_{l≠k} λ_l F̃_l + 2x·F̃_k`` and hence increasing and concave in ``x`` (exactly
    linear when a single coordinate is involved), so Newton's method on
    ``ψ(x) = epsilon^(-1/2)`` converges from any start ``x ≥ floor``: a step from the right of
    the root lands at or left of it (so its length bounds the distance to the root; clamped at
    ``floor``), and from the left the iterates increase monotonically to the root.  It starts at
    ``max(λ_k, floor)`` and stops at a feasible iterate that is ``floor`` or was reached from
    the left, or whose Newton step is below the relative ``_NEWTON_RTOL``; otherwise (a step
    below that from the left) the root is nudged up, by doubling steps from that last step, to
    the feasible side.  Returns ``(the point at x, evaluations)``: its damages are the ones the
    feasibility test saw.
    """
    x = max(float(point.lam[k]), floor)
    evals = 0
    been_left = feasible = False
    moved = 0.0
    for _ in range(max_iter):
        here = prob.evaluate(_with(point.lam, k, x), hessian=True)
        evals += 1
        phi, dphi = float(here.b[k]), float(here.hess[k, k])  # type: ignore[index]
        feasible = phi <= epsilon
        if feasible and (been_left or x <= floor):
            return here, evals
        if not dphi < 0.0:
            break
        been_left = not feasible
        # 2φ(1 − √(φ/ε))/φ', with 1 − √r written as (1 − r)/(1 + √r) so that steps near the
        # root keep their precision (ε − φ is exact there).
        new = x + 2.0 * phi * (epsilon - phi) / (epsilon * (1.0 + math.sqrt(phi / epsilon)) * dphi)
        new = max(new, floor)
        moved = abs(new - x)
        if feasible and moved <= _NEWTON_RTOL * x:
            return here, evals  # from the right the step bounds the distance to the root
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
        here = prob.evaluate(_with(point.lam, k, x))
        if float(here.b[k]) <= epsilon:
            return here, evals
        stale = True
    raise RuntimeError("projection: could not bracket the multiplier (damage too flat)")


def box_qp(q: torch.Tensor, c: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
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


def newton_step(point: DualPoint, prob: Restricted, epsilon: float) -> tuple[DualPoint | None, int]:
    """One Newton (SQP) step on the dual from ``point`` (which carries the Hessian).

    The dual gradient is ``b − epsilon`` and its Hessian ``H_kl = ∂b_k/∂λ_l`` (negative
    semi-definite).  The concave quadratic model ``r·d + ½ dᵀHd`` is maximised exactly over
    ``λ + d ≥ 0`` (:func:`box_qp`, so the model also chooses which multipliers are zero), with
    ``r_k = 2 b_k (√(b_k/epsilon) − 1)`` (``= b_k − epsilon`` to first order): its optimality
    conditions are then those of the linearisation of ``ψ_k = b_k^(-1/2) ≥ epsilon^(-1/2)``,
    which is nearly linear in ``λ`` (as in :func:`coordinate_root`) and so gives much longer
    good steps than the linearisation of ``b_k`` itself.  Then ``λ + t·d`` is tried for
    ``t = 1, ½, …`` (at most ``_MAX_BACKTRACKS`` halvings).  A trial point is kept if it raises
    the dual beyond rounding or — once the dual is flat to rounding — keeps it and reduces the
    KKT residual.  Returns ``(the kept point, with its Hessian, or None; trial points)``.
    """
    lam, b, hess = point.lam, point.b, point.hess
    assert hess is not None
    res0 = kkt_residual(lam, b, epsilon)
    if res0 == 0.0:
        return None, 0
    g0 = point.dual(epsilon)
    r = 2.0 * b * ((b / epsilon).sqrt() - 1.0)
    step = box_qp(-hess, hess @ lam - r, lam) - lam
    if not bool(torch.isfinite(step).all()) or float(step.abs().max()) == 0.0:
        return None, 0
    slack = _DUAL_SLACK * 0.5 * prob.norm_sq
    t = 1.0
    for trial in range(1, _MAX_BACKTRACKS + 1):
        cand = prob.evaluate((lam + t * step).clamp(min=0.0), hessian=True)
        g_c = cand.dual(epsilon)
        if g_c > g0 + slack or (
            g_c >= g0 - slack and kkt_residual(cand.lam, cand.b, epsilon) < res0
        ):
            return cand, trial
        t *= 0.5
    return None, _MAX_BACKTRACKS


def _sweep(
    prob: Restricted, point: DualPoint, epsilon: float, max_iter: int
) -> tuple[DualPoint, int]:
    """One cycle of exact coordinate maximisations (``λ_k`` may decrease), ending with the
    Hessian at the new point."""
    evals = 0
    for k in range(prob.m):
        point, e = coordinate_root(prob, point, k, epsilon, max_iter, 0.0)
        evals += e
    if point.hess is None:
        point, evals = prob.evaluate(point.lam, hessian=True), evals + 1
    return point, evals


def _feasibility_pass(
    prob: Restricted, point: DualPoint, epsilon: float, max_iter: int
) -> tuple[DualPoint, int, bool]:
    """Raise (only) the multipliers of violated constraints until every ``b_k ≤ epsilon``.

    Raising a multiplier lowers every damage, so one round normally suffices.  Returns
    ``(point, damage evaluations, some multiplier was raised)``.
    """
    evals = 0
    raised = False
    for _ in range(max_iter):
        violated = [k for k in range(prob.m) if float(point.b[k]) > epsilon]
        if not violated:
            break
        for k in violated:
            if float(point.b[k]) > epsilon:
                floor = float(point.lam[k])
                point, e = coordinate_root(prob, point, k, epsilon, max_iter, floor)
                evals += e
                raised = True
    return point, evals, raised


def exact(
    prob: Restricted, epsilon: float, max_iter: int
) -> tuple[torch.Tensor, int, int, bool, bool]:
    """Dual maximisation.  Returns ``(λ, sweeps, iterations, stopped, feasibility_pass)``.

    ``sweeps`` counts the iterations (a Newton step, or a coordinate sweep where no step was
    kept), ``iterations`` the passes after the start point.
    """
    point = prob.start
    if prob.m == 1:  # one exact coordinate maximisation solves the whole problem
        point, evals = coordinate_root(prob, point, 0, epsilon, max_iter, 0.0)
        return point.lam, 1, evals, True, False
    aim = epsilon * (1.0 - _AIM)
    evals = sweeps = 0
    stopped = False
    while sweeps < max_iter:
        if kkt_residual(point.lam, point.b, aim) <= _KKT_RTOL * aim:
            stopped = True
            break
        sweeps += 1
        new, trials = newton_step(point, prob, aim)
        evals += trials
        if new is None:
            new, e = _sweep(prob, point, aim, max_iter)
            evals += e
        change = float((new.lam - point.lam).abs().max())
        point = new
        if change <= _LAMBDA_RTOL * float(point.lam.max()):
            stopped = True
            break
    point, e, feasibility_pass = _feasibility_pass(prob, point, epsilon, max_iter)
    return point.lam, sweeps, evals + e, stopped, feasibility_pass
