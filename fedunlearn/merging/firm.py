"""FIRM: Fisher-Informed Retention Merging (SPEC §2.3 base merge, §2.4 projection).

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
from collections.abc import Sequence

import torch

from .base import ClientUpdate, MergeResult, register_merge, validate_updates
from .projection import DEFAULT_SOLVER, _project_checked, check_solver

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
)


def support_size(numel: int, alpha: float) -> int:
    """Number of kept Fisher entries ``k = max(1, ⌊alpha·d_t⌋)`` (capped at ``d_t``).

    A relative slack of 1e-9 absorbs binary rounding of ``alpha`` (so 0.29·100 gives 29).
    """
    return min(numel, max(1, math.floor(alpha * numel * (1.0 + 1e-9))))


def normalize_and_sparsify(fisher: torch.Tensor, alpha: float, eps0: float) -> torch.Tensor:
    """Return ``F̃``: ``fisher / (max(fisher) + eps0)`` keeping only its top-``alpha`` entries.

    The threshold is the k-th largest normalised value (``k`` from :func:`support_size`); every
    entry ``>=`` the threshold is kept, so ties at the threshold are all kept, and all other
    entries are set to 0.  Computed in float32; the input must be a non-negative raw (or pooled)
    Fisher diagonal.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not eps0 > 0.0:
        raise ValueError(f"eps0 must be > 0, got {eps0}")
    f = fisher.to(torch.float32)
    d = f.numel()
    if d == 0:
        return f.clone()
    normed = f / (f.max() + eps0)
    k = support_size(d, alpha)
    if k >= d:
        return normed
    # k-th largest value == (d - k + 1)-th smallest value.
    threshold = torch.kthvalue(normed.reshape(-1), d - k + 1).values
    return torch.where(normed >= threshold, normed, torch.zeros_like(normed))


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


def _weighted_average(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], eps0: float
) -> torch.Tensor:
    """``Σ F̃ ⊙ Δ / (Σ F̃ + eps0)`` over the (non-empty) ``(F̃, Δ)`` pairs, in float32."""
    num = torch.zeros_like(pairs[0][1], dtype=torch.float32)
    den = torch.zeros_like(num)
    for ft, delta in pairs:
        num.add_(ft * delta)
        den.add_(ft)
    return num.div_(den.add_(eps0))


def _mean(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    acc = torch.zeros_like(tensors[0], dtype=torch.float32, device=device)
    for t in tensors:
        acc.add_(t.to(device=device, dtype=torch.float32))
    return acc.div_(len(tensors))


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.to(torch.float64)))


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
) -> MergeResult:
    """FIRM merge (SPEC §2.3) with the optional retention projection (SPEC §2.4).

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
        ``duality_gap`` of :func:`project_retention`), and totals ``norm_base`` and
        ``norm_final``.  All reported damages and norms of the final update are computed after
        the dtype cast (the KKT certificate before it).
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

    delta: dict[str, torch.Tensor] = {}
    tensors_report: dict[str, dict] = {}
    total_base_sq = 0.0
    total_final_sq = 0.0
    for key in keys:
        ref = updates[0].task_vector[key]
        device = ref.device
        out_dtype = ref.dtype
        for u in updates[1:]:
            out_dtype = torch.promote_types(out_dtype, u.task_vector[key].dtype)

        # Forget side: pool raw Fisher and task vectors per domain, then normalise/sparsify.
        forget_pairs = []
        for members in domains.values():
            f_bar = _mean([u.fisher[key] for u in members], device)  # type: ignore[index]
            d_bar = _mean([u.task_vector[key] for u in members], device)
            forget_pairs.append((normalize_and_sparsify(f_bar, alpha, eps0), d_bar))
            del f_bar
        forget_term = _weighted_average(forget_pairs, eps0).mul_(gamma_f)
        del forget_pairs

        # Retain side: every client keeps its own (Δθ_k, F̃_k).
        retain_ft = [
            normalize_and_sparsify(u.fisher[key].to(device), alpha, eps0)  # type: ignore[index]
            for u in retain
        ]
        if retain:
            retain_pairs = [
                (ft, u.task_vector[key].to(device=device, dtype=torch.float32))
                for ft, u in zip(retain_ft, retain, strict=True)
            ]
            retain_term = _weighted_average(retain_pairs, eps0).mul_(gamma_r)
            del retain_pairs
        else:
            retain_term = torch.zeros_like(forget_term)

        base = forget_term + retain_term
        norm_forget, norm_retain = _norm(forget_term), _norm(retain_term)
        del forget_term, retain_term

        # With an infinite budget (or no retain client) this only casts and reports damages.
        # The F̃_k are finite and non-negative by construction (ClientUpdate validates the raw
        # Fishers), so project_retention's argument checks are skipped.
        final, proj = _project_checked(
            base,
            retain_ft,
            epsilon if project else math.inf,
            solver=solver,
            max_iter=max_iter,
            tol=tol,
            out_dtype=out_dtype,
        )
        del retain_ft

        norm_base = _norm(base)
        norm_final = norm_base if final is base else _norm(final)
        total_base_sq += norm_base**2
        total_final_sq += norm_final**2
        numel = final.numel()
        tensors_report[key] = {
            "norm_base": norm_base,
            "norm_final": norm_final,
            "norm_forget_term": norm_forget,
            "norm_retain_term": norm_retain,
            "support_fraction": int(torch.count_nonzero(final)) / numel if numel else 0.0,
            "damage_before": dict(zip(retain_ids, proj["damage_before"], strict=True)),
            "damage_after": dict(zip(retain_ids, proj["damage_after"], strict=True)),
            "multipliers": dict(zip(retain_ids, proj["multipliers"], strict=True)),
            "projection": {key_: proj[key_] for key_ in _PROJECTION_KEYS},
        }
        delta[key] = final
        del base

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
        "norm_base": math.sqrt(total_base_sq),
        "norm_final": math.sqrt(total_final_sq),
    }
    return MergeResult(delta=delta, report=report)
