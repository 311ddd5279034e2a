"""AVG and SUM baseline merges (docs/algorithms.md, "TIES, AVG and SUM").

* AVG: ``Δ = gamma · mean_i Δθ_i`` over ALL clients (forget and retain), unweighted
  (``num_examples`` is ignored).
* SUM: ``Δ = gamma · Σ_i Δθ_i`` over the FORGET clients only; retain clients are ignored.  Its
  norm grows with the number of forget clients ("magnitude explosion"), which FIRM avoids.

Both work tensor by tensor, accumulate in at least float32 and return the task-vector dtype.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence

import torch

from ._common import check_gamma, compute_dtype, forget_clients, l2, node_ids, out_dtype
from .base import ClientUpdate, MergeResult, delta_mapping, register_merge, validate_updates


def _scaled_sum(
    updates: Sequence[ClientUpdate],
    members: Sequence[ClientUpdate],
    keys: Sequence[str],
    scale: float,
    delta: MutableMapping[str, torch.Tensor],
) -> tuple[dict[str, dict], float]:
    """``scale · Σ_{i∈members} Δθ_i`` per tensor, cast to the dtype promoted over ``updates``,
    written into ``delta``."""
    tensors_report: dict[str, dict] = {}
    total_sq = 0.0
    for key in keys:
        ref = members[0].task_vector[key]
        dtype = out_dtype(updates, key)
        acc = torch.zeros_like(ref, dtype=compute_dtype(dtype))
        for u in members:
            acc.add_(u.task_vector[key].to(device=acc.device, dtype=acc.dtype))
        final = acc.mul_(scale).to(dtype)
        norm = l2(final)
        total_sq += norm**2
        tensors_report[key] = {"norm": norm}
        delta[key] = final
    return tensors_report, math.sqrt(total_sq)


@register_merge("avg")
def avg_merge(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float = 1.0,
    delta_out: MutableMapping[str, torch.Tensor] | None = None,
) -> MergeResult:
    """AVG merge: ``Δ = gamma · mean`` of ALL task vectors, forget and retain (docs/algorithms.md,
    "TIES, AVG and SUM").

    Args:
        updates: client summaries (any roles; Fisher diagonals are not used).
        gamma: global scale ``gamma``.

    Returns:
        :class:`MergeResult` with ``delta`` in the task-vector dtype and a JSON-serialisable
        ``report``: ``method`` (``"avg"``), ``params``, ``clients`` (str node ids),
        ``forget_clients``, ``retain_clients``, ``tensors`` (per key: ``norm``) and
        ``norm_final`` (global L2 norm of ``Δ``).
    """
    g = check_gamma(gamma)
    keys = validate_updates(updates)
    delta = delta_mapping(delta_out)
    tensors_report, norm_final = _scaled_sum(updates, updates, keys, g / len(updates), delta)
    report = {
        "method": "avg",
        "params": {"gamma": g},
        "clients": node_ids(updates),
        "forget_clients": node_ids([u for u in updates if u.role == "forget"]),
        "retain_clients": node_ids([u for u in updates if u.role == "retain"]),
        "tensors": tensors_report,
        "norm_final": norm_final,
    }
    return MergeResult(delta=delta, report=report)


@register_merge("sum")
def sum_merge(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float = 1.0,
    delta_out: MutableMapping[str, torch.Tensor] | None = None,
) -> MergeResult:
    """SUM merge: ``Δ = gamma · Σ`` of the FORGET task vectors, retain ignored (docs/algorithms.md,
    "TIES, AVG and SUM").

    Args:
        updates: client summaries; at least one forget client (``ValueError`` otherwise).
        gamma: global scale ``gamma``.

    Returns:
        :class:`MergeResult` as for :func:`avg_merge`, with ``method`` = ``"sum"``; ``clients``
        lists the summed (forget) clients and ``ignored_clients`` the retain ones.
    """
    g = check_gamma(gamma)
    keys = validate_updates(updates)
    forget = forget_clients(updates, "SUM")
    delta = delta_mapping(delta_out)
    tensors_report, norm_final = _scaled_sum(updates, forget, keys, g, delta)
    report = {
        "method": "sum",
        "params": {"gamma": g},
        "clients": node_ids(forget),
        "ignored_clients": node_ids([u for u in updates if u.role != "forget"]),
        "tensors": tensors_report,
        "norm_final": norm_final,
    }
    return MergeResult(delta=delta, report=report)
