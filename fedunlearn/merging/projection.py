"""FIRM retention-constrained projection ("FIRM-QP") for one weight tensor (docs/algorithms.md,
"FIRM retention-constrained projection").

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
from collections.abc import Sequence

import torch

from . import _projection_solvers as solvers
from ._chunks import map_spans
from ._projection_problem import Restricted

SOLVERS: tuple[str, ...] = ("exact", "increase-only")
PLANNED_SOLVERS: tuple[str, ...] = ()
DEFAULT_SOLVER = "exact"

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
    """Project one tensor's base merge onto the retention budget (docs/algorithms.md, "FIRM
    retention-constrained projection").

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
          epsilon)|) and ``duality_gap`` (½‖Δ* − Δ_base‖² − g(λ));
        * ``backend``: ``"compiled"`` or ``"eager"``, how the solver's passes ran (their float64
          sums are added in different orders, so the two agree to rounding, not bit for bit).
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
    return _project_checked(
        delta_base,
        fishers,
        epsilon,
        solver=solver,
        max_iter=max_iter,
        tol=tol,
        out_dtype=delta_base.dtype if out_dtype is None else out_dtype,
        check_fishers=True,
    )


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
    check_fishers: bool = False,
) -> tuple[torch.Tensor, dict]:
    """:func:`project_retention` on validated arguments (``out_dtype`` resolved).

    ``check_fishers``: refuse an ``F̃_k`` that is not finite and non-negative first (checked
    in the pass that gathers the solver coordinates, where that pass is the C one).  Damages
    are summed over the solver coordinates only (they are zero elsewhere).
    """
    m = len(fishers)
    tau = max(1e-4 * epsilon, 1e-12) if tol is None else float(tol)
    flat = delta_base.reshape(-1)
    prob = Restricted.of(flat, fishers, check=check_fishers)
    damage_before = [float(x) for x in prob.start.b]
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
            lam_t, sweeps, iterations, stopped, feasibility_pass = solvers.exact(
                prob, epsilon * (1.0 - _SAFETY), max_iter
            )
        else:
            lam_t, sweeps, iterations, stopped = solvers.increase_only(prob, epsilon, tau, max_iter)
        lam = [float(x) for x in lam_t]
        # Off the solver coordinates Δ* = Δ_base: cast it straight from its own dtype (the same
        # value, so the same rounding as from float64); the certificate pass writes the rest.
        out = _cast_flat(flat, out_dtype)  # a new tensor: never writes into the caller's
        # KKT certificate of the float64 point (before the cast), and the damage after it.
        b, damage_after, primal, half = prob.certify(lam_t, out)
        gap = primal - (half - epsilon * float(lam_t.sum()))
        viol = b - epsilon
        primal_violation = float(viol.clamp(min=0.0).max())
        slackness = float((lam_t * viol).abs().max())
        converged = bool(stopped)
        if solver == "exact" or m == 1:
            converged = converged and solvers.kkt_residual(lam_t, b, epsilon) <= tau
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
        # how the passes ran: compiled and eager sums differ by rounding (so may λ and Δ*)
        "backend": "compiled" if prob.compiled else "eager",
    }
    return result, report
