"""TIES merging (Yadav et al. 2023; SPEC §2.1) over the forget task vectors.

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
(one counting pass per task vector); steps 1–4 then run fused, slice by slice
(:func:`combine_chunk`), with the same element-wise arithmetic as the whole-tensor formulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._chunks import below, map_spans, nonzeros, sum_sq, trim_magnitude
from ._common import check_gamma, check_k, compute_dtype, forget_clients, node_ids, out_dtype
from .base import ClientUpdate, MergeResult, register_merge, validate_updates
from .firm import support_size
from .selection import kth_largest

#: Default TIES support fraction (top 20 % of every task vector).
DEFAULT_K = 0.2


def trim_lowers(tensors: Sequence[torch.Tensor], kept: int, dtype: torch.dtype) -> list[float]:
    """Per tensor, the largest ``dtype`` value below its ``kept``-th largest magnitude.

    ``|x| > lower`` is then ``|x| >=`` that threshold; ``-inf`` (``kept >= d``) keeps every
    entry.  The threshold is selected on the tensor as it is (widening it to ``dtype`` is exact).
    """
    lowers = []
    for t in tensors:
        if kept >= t.numel():
            lowers.append(-math.inf)
        else:
            lowers.append(below(kth_largest(t, kept, magnitude=True).to(dtype)))
    return lowers


def combine_chunk(
    parts: Sequence[torch.Tensor], lowers: Sequence[float]
) -> tuple[torch.Tensor, float, float]:
    """TIES steps 1–3 on one slice of every task vector (already in the compute dtype).

    Returns ``(τ_m, present, agreeing)``: the disjoint mean, the number of entries with some
    non-zero trimmed value, and the number of those whose non-zero trimmed values all have the
    elected sign.  Masks are exact 0/1 floats: ``a_i = relu(sign(τ̂_i)·s)`` marks the trimmed
    values that agree with the elected sign ``s``.  The inputs are not modified.
    """
    trimmed = [trim_magnitude(x, lo) for x, lo in zip(parts, lowers, strict=True)]
    total = trimmed[0]
    for x in trimmed[1:]:
        total = total + x
    sign = torch.sign(total)
    del total
    num = count = present = torch.empty(0)
    for i, x in enumerate(trimmed):
        s = torch.sign(x)
        agree = torch.relu_(s * sign)
        term = x * agree
        s.abs_()
        if i == 0:
            num, count, present = term, agree, s
        else:
            num.add_(term)
            count.add_(agree)
            present.add_(s)
    conflicting = (present - count).clamp_(max=1.0)  # ≥ 1 non-zero value against the sign
    n_present = float(present.clamp_(max=1.0).sum(dtype=torch.float64))
    n_agree = n_present - float(conflicting.sum(dtype=torch.float64))
    return num.div_(count.clamp(min=1.0)), n_present, n_agree


@dataclass
class _Counts:
    """Per-slice counts and sums of a fused TIES merge."""

    present: float
    agreeing: float
    nonzero: int
    sq: float


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
    tensors: Sequence[torch.Tensor], k: float, gamma: float, dtype: torch.dtype | None
) -> tuple[torch.Tensor, dict, float]:
    """``(gamma·τ_m cast to dtype, stats, ‖result‖²)``; ``dtype=None`` keeps the compute dtype.

    ``stats`` are those of :func:`ties_combine`, with ``support_fraction`` of the result.
    """
    kf = check_k(k)
    work_dtype = _check_inputs(tensors)
    ref = tensors[0]
    device, d = ref.device, ref.numel()
    out = torch.empty(d, dtype=work_dtype if dtype is None else dtype, device=device)
    kept = support_size(d, kf) if d else 0
    lowers = trim_lowers(tensors, kept, work_dtype)
    flats = [t.reshape(-1) for t in tensors]

    def work(span: slice) -> _Counts:
        parts = [f[span].to(device=device, dtype=work_dtype) for f in flats]
        merged, present, agreeing = combine_chunk(parts, lowers)
        if gamma != 1.0:
            merged.mul_(gamma)
        out[span] = merged
        final = out[span]
        return _Counts(present, agreeing, nonzeros(final), sum_sq(final))

    counts = map_spans(work, d, device)
    present = sum(c.present for c in counts)
    stats = {
        "kept_per_vector": int(kept),
        "support_fraction": sum(c.nonzero for c in counts) / d if d else 0.0,
        "sign_agreement": sum(c.agreeing for c in counts) / present if present else 1.0,
        "num_vectors": len(tensors),
    }
    return out.view(ref.shape), stats, sum(c.sq for c in counts)


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
    merged, stats, _ = _ties_tensor(tensors, k, 1.0, None)
    return merged, stats


@register_merge("ties")
def ties_merge(
    updates: Sequence[ClientUpdate], *, gamma: float = 1.0, k: float = DEFAULT_K
) -> MergeResult:
    """TIES merge (SPEC §2.1) of the FORGET task vectors: ``Δ = gamma · ties_combine(τ, k)``.

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
    delta: dict[str, torch.Tensor] = {}
    tensors_report: dict[str, dict] = {}
    total_sq = 0.0
    for key in keys:
        tensors = [u.task_vector[key] for u in forget]
        final, stats, sq = _ties_tensor(tensors, kf, g, out_dtype(updates, key))
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
