"""FULM: hierarchical federated unlearning merge (Zhong et al. 2025; docs/algorithms.md, "FULM
and FULM-mean").

1. cosine similarity ``S_ij`` between every pair of clients' task vectors, flattened over ALL
   tensors; computed by accumulating dot products and squared norms tensor by tensor (and in
   chunks inside a tensor, in float64), never by concatenating the model;
2. clients ``i, j`` are linked when ``S_ij >= threshold`` (``τ``, default 0.6); the clusters
   are the connected components, forget and retain clients alike, ordered by their first
   member's position in ``updates`` (members keep the input order);
3. the centroid of each cluster is the TIES combination (:func:`ties_combine`, trim / elect /
   disjoint mean) of its members with support fraction ``k`` (default 0.3); a singleton
   cluster's centroid is its member's task vector trimmed to its top-``k`` entries;
4. ``Δ = gamma · Σ_c centroid_c`` (``fulm``) or ``gamma · mean_c centroid_c`` (``fulm-mean``).

A client whose task vector is exactly zero has similarity 0 with every other client (and 1
with itself).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..options import FRACTION, Number, option, option_group
from ._chunks import map_spans
from ._common import as_real, check_gamma, check_k, compute_dtype, node_ids
from .base import ClientUpdate, MergeResult, delta_mapping, register_merge, validate_updates
from .firm import support_size
from .kernels import run_kernel, sq64, use_compiled_for
from .ties import ties_combine_kernel, trim_lowers

#: Default link threshold ``τ`` on the cosine similarity.
DEFAULT_THRESHOLD = 0.6
#: Default TIES support fraction inside a cluster.
DEFAULT_K = 0.3


@option_group("fulm")
@dataclass(frozen=True)
class FulmOptions:
    """FULM and FULM-mean (``[tool.flwr.app.config.fulm]``)."""

    threshold: float = option(
        DEFAULT_THRESHOLD, "cosine similarity above which clients share a cluster", Number(-1, 1)
    )
    k: float = option(DEFAULT_K, "kept fraction of the intra-cluster TIES", FRACTION)


#: Entries per block when accumulating the Gram matrix (n·block float64s, cache-sized).
_SIM_CHUNK = 1 << 16
#: Decimal places of the similarity matrix in the report.
_REPORT_DIGITS = 6


def _check_threshold(threshold: float) -> float:
    t = as_real("threshold", threshold)
    if not -1.0 <= t <= 1.0:  # also rejects NaN
        raise ValueError(
            f"threshold (cosine-similarity link threshold) must be in [-1, 1], got {t}"
        )
    return t


def _gram_part(flats: Sequence[torch.Tensor], span: slice) -> torch.Tensor:
    """``Σ_j x_a(j)·x_b(j)`` over ``span`` for every pair of clients (float64, CPU, ``n × n``).

    The span is converted into one reused ``n × _SIM_CHUNK`` float64 block at a time.
    """
    n, device = len(flats), flats[0].device
    width = min(_SIM_CHUNK, span.stop - span.start)
    block = torch.empty((n, width), dtype=torch.float64, device=device)
    gram = torch.zeros((n, n), dtype=torch.float64, device=device)
    for start in range(span.start, span.stop, width):
        stop = min(start + width, span.stop)
        rows = block[:, : stop - start]
        for row, f in zip(rows, flats, strict=True):
            row.copy_(f[start:stop])
        gram.add_(rows @ rows.T)
    return gram.cpu()


def client_similarity(
    updates: Sequence[ClientUpdate], keys: Sequence[str] | None = None
) -> torch.Tensor:
    """Cosine similarity (float64, CPU, ``n × n``) between the clients' flattened task vectors.

    The dot products and squared norms are accumulated tensor by tensor over ``keys`` (default:
    every tensor of the first update), in float64 chunks of at most ``_SIM_CHUNK`` entries, so
    the model is never concatenated.  Values are clipped to ``[-1, 1]``; a zero task vector has
    similarity 0 with the other clients; the diagonal is 1.
    """
    if keys is None:
        keys = validate_updates(updates)
    n = len(updates)
    gram = torch.zeros((n, n), dtype=torch.float64)
    for key in keys:
        flats = [u.task_vector[key].reshape(-1) for u in updates]
        device = flats[0].device
        for part in map_spans(partial(_gram_part, flats), flats[0].numel(), device):
            gram.add_(part)
        del flats
    sq = gram.diagonal().clone()
    norms = sq.sqrt()
    denom = norms[:, None] * norms[None, :]
    sim = torch.where(denom > 0, gram / denom.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    sim = sim.clamp(-1.0, 1.0)
    sim.fill_diagonal_(1.0)
    return sim


def cluster_clients(similarity: torch.Tensor, threshold: float) -> list[list[int]]:
    """Connected components of the graph linking ``i != j`` when ``similarity[i, j] >= threshold``.

    Returns lists of positions; each cluster is sorted, clusters are ordered by their smallest
    member.  Deterministic.
    """
    thr = _check_threshold(threshold)
    n = similarity.shape[0]
    if similarity.shape != (n, n):
        raise ValueError(f"similarity must be square, got shape {tuple(similarity.shape)}")
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    linked = (similarity >= thr).tolist()
    for i in range(n):
        for j in range(i + 1, n):
            if linked[i][j] or linked[j][i]:
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[max(ri, rj)] = min(ri, rj)
    clusters: dict[int, list[int]] = {}
    for i in range(n):
        clusters.setdefault(find(i), []).append(i)
    return sorted(clusters.values(), key=lambda c: c[0])


def _distinct(values: Sequence[str | None]) -> list[str]:
    out: list[str] = []
    for v in values:
        if v is not None and v not in out:
            out.append(v)
    return out


@dataclass
class _TensorSums:
    """Sums of one FULM merged weight: squared norms and TIES counts per cluster."""

    final_sq: float
    centroid_sq: list[float]
    present: list[float]
    agreeing: list[float]

    def agreement(self, c: int) -> float:
        return self.agreeing[c] / self.present[c] if self.present[c] else 1.0


def fulm_kernel(
    clusters: list[tuple[list[torch.Tensor], list[torch.Tensor], torch.dtype]],
    scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """``scale · Σ_c`` TIES centroid of cluster ``c``, in ``out_dtype`` (a kernel).

    ``clusters`` holds per cluster its members' flat task vectors, their trim lowers and the
    cluster's compute dtype; the centroids are added in ``scale``'s dtype.  Sums: ``‖result‖²``
    then per cluster ``‖centroid‖²``, present and agreeing counts.
    """
    acc: torch.Tensor | None = None
    sums = []
    for parts, lowers, member_dtype in clusters:
        centroid, present, agreeing = ties_combine_kernel(parts, lowers, member_dtype)
        sums += [sq64(centroid), present, agreeing]
        centroid = centroid.to(scale.dtype)
        acc = centroid if acc is None else acc + centroid
    assert acc is not None, "FULM merges at least one cluster"
    final = (acc * scale).to(out_dtype)
    return (final,), torch.stack([sq64(final), *sums])


def _fulm_tensor(
    tensors: Sequence[torch.Tensor],
    clusters: Sequence[Sequence[int]],
    k: float,
    scale: float,
    compiled: bool,
) -> tuple[torch.Tensor, _TensorSums]:
    """``scale · Σ_c`` TIES centroid of cluster ``c`` for one weight (:func:`fulm_kernel`)."""
    dtype = _promoted(tensors)
    ref = tensors[0]
    device, d = ref.device, ref.numel()
    kept = support_size(d, k) if d else 0
    flats = [t.reshape(-1).to(device) for t in tensors]
    plans = []
    for members in clusters:
        member_dtype = compute_dtype(_promoted([tensors[i] for i in members]))
        lowers = trim_lowers([tensors[i] for i in members], kept, member_dtype, compiled)
        plans.append(([flats[i] for i in members], lowers, member_dtype))
    scale_t = torch.tensor(scale, dtype=compute_dtype(dtype), device=device)
    (out,), totals = run_kernel(fulm_kernel, (plans, scale_t, dtype), d, device, compiled)
    t = totals.tolist()
    sums = _TensorSums(t[0], t[1::3], t[2::3], t[3::3])
    return out.view(ref.shape), sums


def _promoted(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _fulm(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float,
    threshold: float,
    k: float,
    combine: str,
    delta_out: MutableMapping[str, torch.Tensor] | None,
) -> MergeResult:
    g = check_gamma(gamma)
    thr = _check_threshold(threshold)
    kf = check_k(k)
    keys = validate_updates(updates)

    sim = client_similarity(updates, keys)
    clusters = cluster_clients(sim, thr)
    scale = g if combine == "sum" else g / len(clusters)

    delta = delta_mapping(delta_out)
    tensors_report: dict[str, dict] = {}
    total_sq = 0.0
    compiled = use_compiled_for(updates[0].task_vector, keys)
    for key in keys:
        tensors = [u.task_vector[key] for u in updates]
        final, sums = _fulm_tensor(tensors, clusters, kf, scale, compiled)
        del tensors
        total_sq += sums.final_sq
        tensors_report[key] = {
            "norm": math.sqrt(sums.final_sq),
            "centroid_norms": [math.sqrt(sq) for sq in sums.centroid_sq],
            "sign_agreement": [sums.agreement(c) for c in range(len(clusters))],
        }
        delta[key] = final

    ids = node_ids(updates)
    report = {
        "method": "fulm" if combine == "sum" else "fulm-mean",
        "params": {"gamma": g, "threshold": thr, "k": kf, "combine": combine},
        "clients": ids,
        "similarity": [[round(v, _REPORT_DIGITS) for v in row] for row in sim.tolist()],
        "clusters": [[ids[i] for i in members] for members in clusters],
        "cluster_roles": [_distinct([updates[i].role for i in members]) for members in clusters],
        "cluster_domains": [
            _distinct([updates[i].domain for i in members]) for members in clusters
        ],
        "num_clusters": len(clusters),
        "tensors": tensors_report,
        "norm_final": math.sqrt(total_sq),
    }
    return MergeResult(delta=delta, report=report)


@register_merge("fulm")
def fulm_merge(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float = 1.0,
    threshold: float = DEFAULT_THRESHOLD,
    k: float = DEFAULT_K,
    delta_out: MutableMapping[str, torch.Tensor] | None = None,
) -> MergeResult:
    """FULM merge: ``Δ = gamma · Σ_c`` TIES centroid of similarity cluster ``c``
    (docs/algorithms.md, "FULM and FULM-mean").

    Args:
        updates: client summaries, forget and retain alike (all are clustered and merged).
        gamma: global scale ``gamma``.
        threshold: link threshold ``τ`` in ``[-1, 1]`` on the cosine similarity (default 0.6).
        k: TIES support fraction inside a cluster, in ``(0, 1]`` (default 0.3).

    Returns:
        :class:`MergeResult` with ``delta`` in the task-vector dtype and a JSON-serialisable
        ``report``: ``method``, ``params``, ``clients`` (str node ids, the order of the
        similarity rows), ``similarity`` (list of lists, rounded to 6 decimals), ``clusters``
        (lists of str node ids), ``cluster_roles`` and ``cluster_domains`` (distinct roles /
        non-``None`` domains per cluster), ``num_clusters``, ``tensors`` (per key: ``norm``,
        ``centroid_norms`` and ``sign_agreement`` per cluster, centroids unscaled) and
        ``norm_final`` (global L2 norm of ``Δ``).
    """
    return _fulm(updates, gamma=gamma, threshold=threshold, k=k, combine="sum", delta_out=delta_out)


@register_merge("fulm-mean")
def fulm_mean_merge(
    updates: Sequence[ClientUpdate],
    *,
    gamma: float = 1.0,
    threshold: float = DEFAULT_THRESHOLD,
    k: float = DEFAULT_K,
    delta_out: MutableMapping[str, torch.Tensor] | None = None,
) -> MergeResult:
    """FULM-MEAN merge: ``Δ = gamma · mean_c`` of the cluster centroids (docs/algorithms.md,
    "FULM and FULM-mean").

    Same arguments and report as :func:`fulm_merge` (``method`` = ``"fulm-mean"``).
    """
    return _fulm(
        updates, gamma=gamma, threshold=threshold, k=k, combine="mean", delta_out=delta_out
    )
