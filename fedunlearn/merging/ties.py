"""TIES merging (Yadav et al. 2023) over the forget task vectors (docs/algorithms.md, "TIES, AVG
and SUM").

Per weight tensor, for the task vectors ``τ_1..τ_n`` (each with ``d`` entries):

1. trim: keep the entries of ``τ_i`` with ``|τ_i(j)| >=`` its k-th largest magnitude,
   ``k_t = max(1, ⌊k·d⌋)`` (same rounding as FIRM's ``support_size``); ties at the threshold
   are all kept, every other entry is set to 0 → ``τ̂_i``;
2. elect a sign per entry: ``s(j) = sign(Σ_i τ̂_i(j))``;
3. disjoint mean: ``τ_m(j)`` = mean of the non-zero ``τ̂_i(j)`` whose sign equals ``s(j)``;
   entries with no such value (all trimmed values zero, or ``s(j) = 0`` because they cancel
   exactly) get 0;
4. ``Δ = gamma · τ_m``.

The default ``k = 0.2`` keeps the top 20 % of every task vector, the value the TIES paper uses
and the one used for the TIES baseline of the FIRM study.  (Unlike the reference TIES code,
an exact tie ``s(j) = 0`` is not broken by a global majority sign; the entry gets 0.)

Computation: the trim thresholds come from :func:`~fedunlearn.merging.selection.kth_largest`
(one counting pass per task vector, by the fused bracket kernel when compiled); steps 1–4 are
one kernel (:func:`ties_kernel`, see :mod:`~fedunlearn.merging.kernels`), compiled on whole
tensors or run eagerly slice by slice, with the same element-wise arithmetic either way.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

import torch

from ..options import FRACTION, option, option_group
from ._chunks import below
from ._common import check_gamma, check_k, compute_dtype, forget_clients, node_ids, out_dtype
from .base import ClientUpdate, MergeResult, delta_mapping, register_merge, validate_updates
from .firm import support_size
from .kernels import (
    bracket_counts,
    nonzero64,
    run_kernel,
    sq64,
    use_compiled,
    use_compiled_for,
)
from .selection import SMALL, StreamedKthLargest, kth_largest, sample_positions

#: Default TIES support fraction (top 20 % of every task vector).
DEFAULT_K = 0.2


@option_group("ties")
@dataclass(frozen=True)
class TiesOptions:
    """TIES (``[tool.flwr.app.config.ties]``)."""

    k: float = option(DEFAULT_K, "kept fraction of each task vector (trim to the top-k)", FRACTION)


def trim_lowers(
    tensors: Sequence[torch.Tensor], kept: int, dtype: torch.dtype, compiled: bool
) -> list[torch.Tensor]:
    """Per tensor, the largest ``dtype`` value below its ``kept``-th largest magnitude (0-d).

    ``|x| > lower`` is then ``|x| >=`` that threshold; ``-inf`` (``kept >= d``) keeps every
    entry.  The threshold is selected on the tensor as it is (widening it to ``dtype`` is exact);
    with ``compiled``, large CPU tensors are counted by the fused bracket kernel.
    """
    lowers = []
    for t in tensors:
        if kept >= t.numel():
            lower = -math.inf
        else:
            lower = below(_kth_magnitude(t.reshape(-1), kept, compiled).to(dtype))
        lowers.append(torch.tensor(lower, dtype=dtype, device=t.device))
    return lowers


def _kth_magnitude(flat: torch.Tensor, kept: int, compiled: bool) -> torch.Tensor:
    """The ``kept``-th largest ``|flat|`` (``kth_largest``; compiled, float32 by a fused count)."""
    d = flat.numel()
    if not (compiled and flat.dtype == torch.float32 and d > SMALL and flat.device.type == "cpu"):
        return kth_largest(flat, kept, magnitude=True)
    selector = StreamedKthLargest(flat[sample_positions(d)], kept, d, magnitude=True)
    _, above, candidates = bracket_counts([flat], True, selector.key_bounds())
    return selector.result_of_keys(lambda: flat, above, candidates)


def ties_combine_kernel(
    parts: Sequence[torch.Tensor], lowers: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TIES steps 1–3 on flat task vectors (or slices of them), in the compute ``dtype``.

    Returns ``(τ_m, present, agreeing)``: the disjoint mean, the number of entries with some
    non-zero trimmed value, and the number of those whose non-zero trimmed values all have the
    elected sign (0-d float64).  Masks are exact 0/1 floats: ``a_i = relu(sign(τ̂_i)·s)`` marks
    the trimmed values that agree with the elected sign ``s``.
    """
    trimmed = []
    for x, lower in zip(parts, lowers, strict=True):
        x = x.to(dtype)
        trimmed.append(torch.where(x.abs() > lower, x, 0.0))
    total = trimmed[0]
    for x in trimmed[1:]:
        total = total + x
    sign = torch.sign(total)
    signs = [torch.sign(x) for x in trimmed]
    agree = [torch.relu(s * sign) for s in signs]
    num, count, present = trimmed[0] * agree[0], agree[0], signs[0].abs()
    for x, s, a in zip(trimmed[1:], signs[1:], agree[1:], strict=True):
        num, count, present = num + x * a, count + a, present + s.abs()
    conflicting = (present - count).clamp(max=1.0)  # ≥ 1 non-zero value against the sign
    n_present = present.clamp(max=1.0).sum(dtype=torch.float64)
    n_agree = n_present - conflicting.sum(dtype=torch.float64)
    return num / count.clamp(min=1.0), n_present, n_agree


def ties_kernel(
    parts: list[torch.Tensor],
    lowers: list[torch.Tensor],
    gamma: torch.Tensor,
    work_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """``(gamma·τ_m in out_dtype,), [present, agreeing, #non-zero, ‖result‖²]`` (a kernel)."""
    merged, present, agreeing = ties_combine_kernel(parts, lowers, work_dtype)
    final = (merged * gamma).to(out_dtype)
    return (final,), torch.stack([present, agreeing, nonzero64(final), sq64(final)])


def _check_inputs(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """Validate same-shape floating inputs; return the compute dtype."""
    if len(tensors) == 0:
        raise ValueError("ties_combine needs at least one tensor")
    ref = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"ties_combine: input {i} is not a floating-point tensor")
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"ties_combine: input {i} has shape {tuple(t.shape)} but input 0 has "
                f"shape {tuple(ref.shape)}"
            )
    dtype = ref.dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return compute_dtype(dtype)


def _ties_tensor(
    tensors: Sequence[torch.Tensor],
    k: float,
    gamma: float,
    dtype: torch.dtype | None,
    compiled: bool,
) -> tuple[torch.Tensor, dict, float]:
    """``(gamma·τ_m cast to dtype, stats, ‖result‖²)``; ``dtype=None`` keeps the compute dtype.

    ``stats`` are those of :func:`ties_combine`, with ``support_fraction`` of the result.
    """
    kf = check_k(k)
    work_dtype = _check_inputs(tensors)
    ref = tensors[0]
    device, d = ref.device, ref.numel()
    kept = support_size(d, kf) if d else 0
    lowers = trim_lowers(tensors, kept, work_dtype, compiled)
    flats = [t.reshape(-1).to(device) for t in tensors]
    g = torch.tensor(gamma, dtype=work_dtype, device=device)
    args = (flats, lowers, g, work_dtype, work_dtype if dtype is None else dtype)
    (out,), totals = run_kernel(ties_kernel, args, d, device, compiled)
    present, agreeing, nonzero, sq = totals.tolist()
    stats = {
        "kept_per_vector": int(kept),
        "support_fraction": round(nonzero) / d if d else 0.0,
        "sign_agreement": agreeing / present if present else 1.0,
        "num_vectors": len(tensors),
    }
    return out.view(ref.shape), stats, sq


def ties_combine(tensors: Sequence[torch.Tensor], k: float) -> tuple[torch.Tensor, dict]:
    """TIES steps 1–3 (trim, elect sign, disjoint mean) on same-shape tensors.

    Args:
        tensors: one tensor per task vector (same shape; devices follow the first tensor).
        k: support fraction in ``(0, 1]`` kept by the trim step (``max(1, ⌊k·d⌋)`` entries).

    Returns:
        ``(merged, stats)``: ``merged`` has the shape of the inputs and dtype at least float32
        (float64 if any input is float64), unscaled; ``stats`` is JSON-serialisable:

        * ``kept_per_vector``: entries kept by the trim step (before counting ties);
        * ``support_fraction``: fraction of non-zero entries of ``merged``;
        * ``sign_agreement``: among the entries where at least one trimmed value is non-zero,
          the share where every non-zero trimmed value has the elected sign (1.0 when there is
          no such entry);
        * ``num_vectors``.

    Memory: the output, and one slice of every input with its temporaries, at a time.
    """
    merged, stats, _ = _ties_tensor(tensors, k, 1.0, None, use_compiled(tensors[:1]))
    return merged, stats


@register_merge("ties")
def ties_merge(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float = 1.0,
    k: float = DEFAULT_K,
    delta_out: MutableMapping[str, torch.Tensor] | None = None,
) -> MergeResult:
    """TIES merge of the FORGET task vectors: ``Δ = gamma · ties_combine(τ, k)``
    (docs/algorithms.md, "TIES, AVG and SUM").

    Args:
        updates: client summaries; at least one forget client (``ValueError`` otherwise).
            Retain clients are ignored.
        gamma: global scale ``gamma``.
        k: support fraction kept by the trim step, in ``(0, 1]`` (default 0.2, as in the TIES
            paper and the FIRM study's TIES baseline).

    Returns:
        :class:`MergeResult` with ``delta`` in the task-vector dtype and a JSON-serialisable
        ``report``: ``method`` (``"ties"``), ``params``, ``clients`` (merged forget clients),
        ``ignored_clients``, ``tensors`` (per key: ``norm``, ``sign_agreement``,
        ``support_fraction``, ``kept_per_vector``) and ``norm_final`` (global L2 norm).
    """
    g = check_gamma(gamma)
    kf = check_k(k)
    keys = validate_updates(updates)
    forget = forget_clients(updates, "TIES")
    delta = delta_mapping(delta_out)
    tensors_report: dict[str, dict] = {}
    total_sq = 0.0
    compiled = use_compiled_for(forget[0].task_vector, keys)
    for key in keys:
        tensors = [u.task_vector[key] for u in forget]
        final, stats, sq = _ties_tensor(tensors, kf, g, out_dtype(updates, key), compiled)
        del tensors
        total_sq += sq
        tensors_report[key] = {
            "norm": math.sqrt(sq),
            "sign_agreement": stats["sign_agreement"],
            "support_fraction": stats["support_fraction"],
            "kept_per_vector": stats["kept_per_vector"],
        }
        delta[key] = final
    report = {
        "method": "ties",
        "params": {"gamma": g, "k": kf},
        "clients": node_ids(forget),
        "ignored_clients": node_ids([u for u in updates if u.role != "forget"]),
        "tensors": tensors_report,
        "norm_final": math.sqrt(total_sq),
    }
    return MergeResult(delta=delta, report=report)
