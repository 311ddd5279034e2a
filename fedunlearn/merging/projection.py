"""FIRM retention-constrained projection for one weight tensor (SPEC §2.4, "FIRM-QP").

Given the base merge ``Δ_base`` of one tensor and the sparsified, normalised Fisher diagonals
``F̃_k`` of the m retain clients, solve

    minimise   ½‖Δ − Δ_base‖²
    subject to b_k(Δ) = Σ_j F̃_k(j)·Δ(j)² ≤ epsilon        (k = 1..m)

For multipliers ``λ ≥ 0`` the minimiser is the coordinate-wise shrinkage
``Δ(λ)(j) = Δ_base(j) / (1 + 2 Σ_k λ_k F̃_k(j))``, and every ``b_k(Δ(λ))`` is decreasing in
every ``λ_l``.  The ``"increase-only"`` solver (the paper's routine) sweeps the constraints and
raises the multiplier of each violated one, holding the others fixed, until it holds; since
raising a multiplier never violates a satisfied constraint, the result is always feasible.  For
m = 1 this is the exact projection (bracket by doubling, then bisection); for m > 1 it is
feasible but not necessarily the closest feasible point.

All solver arithmetic is done in float64 on the coordinates where some ``F̃_k`` is positive and
``Δ_base`` is non-zero (elsewhere ``Δ = Δ_base``).  The solver returns the upper end of its
bracket, so ``b_k ≤ epsilon`` holds in float64; the cast to the output dtype rounds toward zero,
so it cannot increase any ``|Δ(j)|`` and feasibility survives the cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

SOLVERS: tuple[str, ...] = ("increase-only",)
PLANNED_SOLVERS: tuple[str, ...] = ("exact",)

_MAX_DOUBLINGS = 2000


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
    y = x.to(dtype)
    if dtype == x.dtype or not dtype.is_floating_point:
        return y
    wide = torch.promote_types(dtype, x.dtype)
    over = y.to(wide).abs() > x.to(wide).abs()
    if bool(over.any()):
        y = torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y)
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


def project_retention(
    delta_base: torch.Tensor,
    retain_fishers: Sequence[torch.Tensor],
    epsilon: float,
    *,
    solver: str = "increase-only",
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
        solver: ``"increase-only"`` (the paper's routine; exact for m = 1).
        max_iter: cap on bisection steps per multiplier update and on constraint sweeps.
        tol: tolerance ``τ`` on the active constraint, default ``max(1e-4·epsilon, 1e-12)``;
            the solver stops once ``epsilon − τ ≤ b_k ≤ epsilon``.
        out_dtype: dtype of the returned tensor (default ``delta_base.dtype``); the cast rounds
            toward zero and ``damage_after`` / ``max_violation`` are computed after it.

    Returns:
        ``(Δ*, report)`` with report keys ``multipliers`` (λ_k), ``damage_before``
        (b_k(Δ_base)), ``damage_after`` (b_k(Δ*)), ``iterations``, ``max_violation``
        (max_k (b_k(Δ*) − epsilon)₊) and ``active`` (some λ_k > 0).
    """
    check_solver(solver)
    epsilon = float(epsilon)
    if math.isnan(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be > 0 (or inf to disable), got {epsilon}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if not delta_base.is_floating_point():
        raise TypeError(f"delta_base must be a floating tensor, got {delta_base.dtype}")
    out_dtype = delta_base.dtype if out_dtype is None else out_dtype
    fishers = list(retain_fishers)
    for k, f in enumerate(fishers):
        if tuple(f.shape) != tuple(delta_base.shape):
            raise ValueError(
                f"retain Fisher #{k} has shape {tuple(f.shape)}, "
                f"delta_base has {tuple(delta_base.shape)}"
            )
        if not bool(torch.isfinite(f).all()) or bool((f < 0).any()):
            raise ValueError(f"retain Fisher #{k} must be finite and non-negative")
    m = len(fishers)
    damage_before = [fisher_damage(delta_base, f) for f in fishers]
    lam = [0.0] * m
    iterations = 0

    if m == 0 or math.isinf(epsilon) or all(b <= epsilon for b in damage_before):
        # Nothing to shrink.  With a finite budget, still round toward zero so that a point that
        # is feasible before the cast stays feasible after it.
        if m and math.isfinite(epsilon):
            result = cast_toward_zero(delta_base, out_dtype)
        else:
            result = delta_base.to(out_dtype)
    else:
        tau = max(1e-4 * epsilon, 1e-12) if tol is None else float(tol)
        flat = delta_base.reshape(-1)
        fsum = torch.zeros_like(flat, dtype=torch.float32)
        for f in fishers:
            fsum += f.reshape(-1).to(device=flat.device, dtype=torch.float32)
        idx = torch.nonzero((fsum > 0) & (flat != 0)).squeeze(1)
        del fsum
        base_s = flat[idx].to(torch.float64)
        fs = torch.stack([f.reshape(-1)[idx].to(torch.float64) for f in fishers])  # (m, n_s)
        weights = fs * (base_s * base_s)  # F̃_k(j)·Δ_base(j)²
        fmax = [float(fs[k].max()) if fs.shape[1] else 0.0 for k in range(m)]
        lam_t = torch.zeros(m, dtype=torch.float64, device=flat.device)

        def denom() -> torch.Tensor:
            return 1.0 + 2.0 * (lam_t @ fs)

        sweeps = 0
        while sweeps < max_iter:
            sweeps += 1
            changed = False
            for k in range(m):
                den = denom()
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

                new_lam, it = _solve_one(
                    damage, float(lam_t[k]), b_k, fmax[k], epsilon, tau, max_iter
                )
                lam_t[k] = new_lam
                iterations += it
                changed = True
            if not changed:
                break
        lam = [float(x) for x in lam_t]
        proj_s = base_s / denom()
        out = flat.to(torch.float64).clone()
        out[idx] = proj_s
        result = cast_toward_zero(out, out_dtype).reshape(delta_base.shape)

    damage_after = [fisher_damage(result, f) for f in fishers]
    max_violation = 0.0
    if math.isfinite(epsilon):
        max_violation = max([max(b - epsilon, 0.0) for b in damage_after], default=0.0)
    report = {
        "multipliers": lam,
        "damage_before": damage_before,
        "damage_after": damage_after,
        "iterations": int(iterations),
        "max_violation": float(max_violation),
        "active": any(x > 0 for x in lam),
    }
    return result, report
