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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._common import check_gamma, check_k, compute_dtype, forget_clients, l2, node_ids, out_dtype
from .base import ClientUpdate, MergeResult, register_merge, validate_updates
from .firm import support_size

#: Default TIES support fraction (top 20 % of every task vector).
DEFAULT_K = 0.2


def _trim_threshold(flat: torch.Tensor, kept: int) -> torch.Tensor:
    """The ``kept``-th largest ``|flat|`` (entries ``>=`` it are kept); 0 keeps everything."""
    d = flat.numel()
    if kept >= d:
        return torch.zeros((), dtype=flat.dtype, device=flat.device)
    # kept-th largest == (d - kept + 1)-th smallest.
    return torch.kthvalue(flat.abs(), d - kept + 1).values


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

    Memory: only the running sums and one converted input are held at a time (the trim
    thresholds are kept as scalars and the trimmed vectors are recomputed in the second pass).
    """
    kf = check_k(k)
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
    dtype = compute_dtype(dtype)
    device = ref.device
    d = ref.numel()
    kept = support_size(d, kf)
    if d == 0:
        stats = {
            "kept_per_vector": 0,
            "support_fraction": 0.0,
            "sign_agreement": 1.0,
            "num_vectors": len(tensors),
        }
        return torch.zeros(ref.shape, dtype=dtype, device=device), stats

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).reshape(-1)

    def trimmed(x: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
        return torch.where(x.abs() >= thr, x, torch.zeros_like(x))

    # Pass 1: trim thresholds and the elected sign.
    thresholds = []
    total = torch.zeros(d, dtype=dtype, device=device)
    for t in tensors:
        x = flat(t)
        thr = _trim_threshold(x, kept)
        thresholds.append(thr)
        total.add_(trimmed(x, thr))
    sign = torch.sign(total)
    del total

    # Pass 2: disjoint mean over the trimmed values that agree with the elected sign.
    num = torch.zeros(d, dtype=dtype, device=device)
    count = torch.zeros(d, dtype=dtype, device=device)
    nonzero = torch.zeros(d, dtype=torch.bool, device=device)
    conflict = torch.zeros(d, dtype=torch.bool, device=device)
    for t, thr in zip(tensors, thresholds, strict=True):
        x = trimmed(flat(t), thr)
        s = torch.sign(x)
        present = s != 0
        agree = present & (s == sign)
        num.add_(torch.where(agree, x, torch.zeros_like(x)))
        count.add_(agree.to(dtype))
        nonzero |= present
        conflict |= present & ~agree
    merged = torch.where(count > 0, num / count.clamp_min(1.0), torch.zeros_like(num))
    n_present = int(nonzero.sum())
    n_agree = int((nonzero & ~conflict).sum())
    stats = {
        "kept_per_vector": int(kept),
        "support_fraction": float((merged != 0).sum()) / d,
        "sign_agreement": n_agree / n_present if n_present else 1.0,
        "num_vectors": len(tensors),
    }
    return merged.reshape(ref.shape), stats


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
        merged, stats = ties_combine([u.task_vector[key] for u in forget], kf)
        final = merged.mul_(g).to(out_dtype(updates, key))
        del merged
        norm = l2(final)
        total_sq += norm**2
        tensors_report[key] = {
            "norm": norm,
            "sign_agreement": stats["sign_agreement"],
            "support_fraction": float((final != 0).sum()) / final.numel() if final.numel() else 0.0,
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
