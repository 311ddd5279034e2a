"""What a client holding all m copies of a round can rebuild: aligning MPU's copies.

A forget client receives C_k = T_k(θ + α_k ε⁰_k), k = 1..m. Each T_k hides the coordinates, but
the copies are noisy versions of the *same* weights, so the client can estimate
A_k ≈ T_1 ∘ T_k⁻¹ from the weights themselves and bring every copy into copy 1's coordinates
(:func:`align_copy`), per decoder layer ℓ:

1. MLP channels: the channel c of a copy is the triple [gate row c, up row c, down column c];
   the permutation is the assignment (Hungarian, :func:`scipy.optimize.linear_sum_assignment`)
   that maximises the cosine similarity of the triples. With ``estimate_scales`` a per-channel
   factor r_c (up row · r_c, down column / r_c: what SwiGLU leaves unchanged) is fitted by least
   squares as well.
2. KV groups: matched by the circuits every map of T leaves unchanged, Σ_h W_o,h W_v,g (OV) and
   Σ_h W_q,hᵀ W_k,g (QK) over the group's query heads h — invariant under the v/o basis change
   (orthogonal or not) and under the RoPE-plane rotations.
3. v/o basis of each group: orthogonal Procrustes on [W_v,g | W_o,hᵀ …] (or, with
   ``general_vo``, a least-squares map M on v and M⁻¹ on o, which keeps every OV product).
4. RoPE planes: in every plane (i, i + d_h/2) of a group the rotation angle that best maps the
   copy's [W_k,g | W_q,h …] rows onto the anchor's (a 2 × 2 Procrustes in closed form).

Then the aligned copies are combined so that the noise cancels: with the published scales,
Σ_k α_k⁻¹ A_k(C_k) / Σ_k α_k⁻¹ (:func:`harmonic_combination`, exactly T_1(θ) where the alignment
is exact, since Σ_k ε⁰_k = 0); without them, the affine combination of smallest norm per layer
(:func:`min_norm_combination`): the noise is nearly orthogonal to θ, so the shortest point on
the copies' affine span is close to θ too. Against v/o maps that a least-squares fit pins down
poorly (general invertible ones), :func:`ov_combination` averages what attention computes, the
products W_o,h W_v,g, instead of the factors, and factors the mean again. This module is the
attack of the threat-model study (``python -m simulations.mpu_attack``); it never touches the
server's secret.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from .aggregate import HarmonicAggregator
from .noise import layer_groups
from .support import ReparamDims

__all__ = [
    "align_copy",
    "harmonic_combination",
    "min_norm_combination",
    "ov_combination",
    "projection_name",
]


def projection_name(layer: int, kind: str) -> str:
    """State-dict name of projection ``kind`` (q/k/v/o/gate/up/down) of decoder layer ``layer``."""
    block = "mlp" if kind in ("gate", "up", "down") else "self_attn"
    return f"model.layers.{layer}.{block}.{kind}_proj.weight"


def _projections(
    copy: Mapping[str, Tensor], anchor: Mapping[str, Tensor], layer: int, kinds: Sequence[str]
) -> tuple[dict[str, str], dict[str, Tensor], dict[str, Tensor]]:
    """Per kind: the name, the anchor's weight and the copy's weight (float64)."""
    names: dict[str, str] = {}
    ours: dict[str, Tensor] = {}
    theirs: dict[str, Tensor] = {}
    for kind in kinds:
        names[kind] = projection_name(layer, kind)
        for state, out in ((anchor, ours), (copy, theirs)):
            if names[kind] not in state:
                raise KeyError(f"alignment needs {names[kind]!r}, which is not in the copy")
            out[kind] = state[names[kind]].detach().to(torch.float64)
    return names, ours, theirs


def align_copy(
    copy: Mapping[str, Tensor],
    anchor: Mapping[str, Tensor],
    dims: ReparamDims,
    num_layers: int,
    *,
    estimate_scales: bool = False,
    general_vo: bool = False,
) -> dict[str, Tensor]:
    """``copy`` brought into ``anchor``'s coordinates by an estimated function-preserving map
    (steps 1–4 of the module docstring), layer by layer; tensors outside the decoder layers are
    returned as they are. MLP biases follow their rows; q/k/v biases are refused."""
    out = dict(copy)
    for layer in range(num_layers):
        out.update(_align_mlp(copy, anchor, dims, layer, estimate_scales))
        out.update(_align_attention(copy, anchor, dims, layer, general_vo))
    return {name: out[name] for name in copy}


def _unit_rows(x: Tensor) -> Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)


def _align_mlp(
    copy: Mapping[str, Tensor],
    anchor: Mapping[str, Tensor],
    dims: ReparamDims,
    layer: int,
    estimate_scales: bool,
) -> dict[str, Tensor]:
    names, ours, theirs = _projections(copy, anchor, layer, ("gate", "up", "down"))
    # the gate row alone is unchanged by SwiGLU's per-channel scaling: match on it and the
    # directions of the up row and down column (scale-free)
    features = [
        torch.cat([_unit_rows(s["gate"]), _unit_rows(s["up"]), _unit_rows(s["down"].T)], dim=1)
        for s in (ours, theirs)
    ]
    similarity = (features[0] @ features[1].T).numpy()
    _, match = linear_sum_assignment(-similarity)  # anchor channel c ↔ copy channel match[c]
    perm = torch.as_tensor(match, dtype=torch.long)
    gate, up, down = theirs["gate"][perm], theirs["up"][perm], theirs["down"][:, perm]
    if estimate_scales:  # up·r and down/r: fit r per channel to both by least squares
        r_up = (up * ours["up"]).sum(1) / (up * up).sum(1).clamp_min(1e-30)
        r_down = (down * ours["down"]).sum(0) / (down * down).sum(0).clamp_min(1e-30)
        ratio = torch.sqrt((r_up / r_down.clamp_min(1e-30)).clamp_min(1e-30))
        up, down = up * ratio[:, None], down / ratio[None, :]
    aligned = {names["gate"]: gate, names["up"]: up, names["down"]: down}
    for kind in ("gate", "up"):
        bias = names[kind].removesuffix("weight") + "bias"
        if bias in copy:
            aligned[bias] = copy[bias].detach().to(torch.float64)[perm]
    return {name: value.to(copy[name].dtype) for name, value in aligned.items()}


def _heads(w: Tensor, count: int) -> Tensor:
    """(count, d_h, in) blocks of a row-stacked projection."""
    return w.reshape(count, -1, w.shape[-1])


def _group_signatures(w: dict[str, Tensor], dims: ReparamDims) -> Tensor:
    """Per KV group g the flattened [Σ_h W_o,h W_v,g, Σ_h W_q,hᵀ W_k,g], each normalised."""
    h_kv, r, d_h = dims.num_key_value_heads, dims.group_size, dims.head_dim
    q = _heads(w["q"], h_kv * r).reshape(h_kv, r, d_h, -1)
    k, v = _heads(w["k"], h_kv), _heads(w["v"], h_kv)
    o = w["o"].reshape(w["o"].shape[0], h_kv, r, d_h)  # (hidden, g, r, d_h)
    ov = torch.einsum("xgrd,gdy->gxy", o, v).flatten(1)
    qk = torch.einsum("grdx,gdy->gxy", q, k).flatten(1)
    return torch.cat([_unit_rows(ov), _unit_rows(qk)], dim=1)


def _align_attention(
    copy: Mapping[str, Tensor],
    anchor: Mapping[str, Tensor],
    dims: ReparamDims,
    layer: int,
    general_vo: bool,
) -> dict[str, Tensor]:
    if any(projection_name(layer, k).removesuffix("weight") + "bias" in copy for k in "qkv"):
        raise ValueError(f"layer {layer}: alignment of q/k/v biases is not implemented")
    names, ours, theirs = _projections(copy, anchor, layer, ("q", "k", "v", "o"))
    h_kv, r, d_h = dims.num_key_value_heads, dims.group_size, dims.head_dim
    similarity = (_group_signatures(ours, dims) @ _group_signatures(theirs, dims).T).numpy()
    _, match = linear_sum_assignment(-similarity)
    groups = torch.as_tensor(match, dtype=torch.long)
    q = _heads(theirs["q"], h_kv * r).reshape(h_kv, r, d_h, -1)[groups]
    k, v = _heads(theirs["k"], h_kv)[groups], _heads(theirs["v"], h_kv)[groups]
    o = theirs["o"].reshape(-1, h_kv, r, d_h)[:, groups]
    q_a = _heads(ours["q"], h_kv * r).reshape(h_kv, r, d_h, -1)
    k_a, v_a = _heads(ours["k"], h_kv), _heads(ours["v"], h_kv)
    o_a = ours["o"].reshape(-1, h_kv, r, d_h)
    for g in range(h_kv):
        v[g], o[:, g] = _vo_map(v[g], o[:, g], v_a[g], o_a[:, g], general_vo)
        k[g], q[g] = _plane_rotations(k[g], q[g], k_a[g], q_a[g])
    aligned = {
        names["q"]: q.reshape(theirs["q"].shape),
        names["k"]: k.reshape(theirs["k"].shape),
        names["v"]: v.reshape(theirs["v"].shape),
        names["o"]: o.reshape(theirs["o"].shape),
    }
    return {name: value.to(copy[name].dtype) for name, value in aligned.items()}


def _vo_map(v: Tensor, o: Tensor, v_a: Tensor, o_a: Tensor, general: bool) -> tuple[Tensor, Tensor]:
    """One group's v rows (d_h, in) and o columns (out, r, d_h) mapped onto the anchor's."""
    if general:  # M·v ≈ v_a by least squares, o·M⁻¹ on o: the OV products stay the copy's
        m = torch.linalg.lstsq(v.T, v_a.T).solution.T
        return m @ v, o @ torch.linalg.inv(m)
    x = torch.cat([v, o.reshape(-1, o.shape[-1]).T], dim=1)  # M acts on rows of v, cols of o
    x_a = torch.cat([v_a, o_a.reshape(-1, o_a.shape[-1]).T], dim=1)
    u, _, vh = torch.linalg.svd(x_a @ x.T)
    m = u @ vh
    return m @ v, o @ m.T


def _plane_rotations(k: Tensor, q: Tensor, k_a: Tensor, q_a: Tensor) -> tuple[Tensor, Tensor]:
    """The rotation in each RoPE plane (i, i + d_h/2) taking k rows (d_h, in) and the group's
    q rows (r, d_h, in) closest to the anchor's: φ = atan2(C₁₀ − C₀₁, C₀₀ + C₁₁), C = Y_a Yᵀ."""
    half = k.shape[0] // 2
    y = torch.cat([k[None], q], dim=0)  # (1 + r, d_h, in)
    y_a = torch.cat([k_a[None], q_a], dim=0)
    top, bottom = y[:, :half], y[:, half:]
    top_a, bottom_a = y_a[:, :half], y_a[:, half:]
    c00 = (top_a * top).sum((0, 2))
    c01 = (top_a * bottom).sum((0, 2))
    c10 = (bottom_a * top).sum((0, 2))
    c11 = (bottom_a * bottom).sum((0, 2))
    phi = torch.atan2(c10 - c01, c00 + c11)[None, :, None]
    cos, sin = torch.cos(phi), torch.sin(phi)
    rotated = torch.cat([cos * top - sin * bottom, sin * top + cos * bottom], dim=1)
    return rotated[0], rotated[1:]


def harmonic_combination(
    copies: Sequence[Mapping[str, Tensor]], scales: Sequence[float]
) -> dict[str, Tensor]:
    """Σ_k α_k⁻¹ C_k / Σ_k α_k⁻¹ of aligned copies: the server's own
    :class:`~fedunlearn.mpu.aggregate.HarmonicAggregator`, applied to weights."""
    if len(copies) != len(scales) or not copies:
        raise ValueError(f"{len(copies)} copies for {len(scales)} scales")
    aggregate = HarmonicAggregator()
    for copy, alpha in zip(copies, scales, strict=True):
        aggregate.add(copy, alpha)
    return aggregate.result()


def min_norm_combination(
    copies: Sequence[Mapping[str, Tensor]], num_layers: int
) -> dict[str, Tensor]:
    """Per decoder layer ℓ the point Σ_k w_k C_k (Σ_k w_k = 1) of smallest norm, for a client
    that does not know the scales: C_1 + Σ_k β_k (C_k − C_1) with β the least-squares solution
    over the layer's tensors. Tensors outside the layers are copy 1's."""
    if len(copies) < 2:
        raise ValueError("a combination needs at least two copies")
    out = dict(copies[0])
    for names in layer_groups(copies[0].keys(), num_layers).values():
        first = torch.cat([copies[0][n].detach().to(torch.float64).flatten() for n in names])
        diffs = torch.stack(
            [
                torch.cat([c[n].detach().to(torch.float64).flatten() for n in names]) - first
                for c in copies[1:]
            ],
            dim=1,
        )
        beta = torch.linalg.lstsq(diffs, -first[:, None]).solution[:, 0]
        combined = first + diffs @ beta
        offset = 0
        for n in names:
            size = copies[0][n].numel()
            piece = combined[offset : offset + size].reshape(copies[0][n].shape)
            out[n] = piece.to(copies[0][n].dtype)
            offset += size
    return out


def ov_combination(
    combined: Mapping[str, Tensor],
    copies: Sequence[Mapping[str, Tensor]],
    scales: Sequence[float],
    dims: ReparamDims,
    num_layers: int,
) -> dict[str, Tensor]:
    """``combined`` with every group's v/o replaced by a factorisation of the harmonic mean of
    the copies' OV products: per KV group g, [W_o,h W_v,g]_h stacked over its query heads is
    (r·out) × in of rank d_h in every copy, whatever invertible v/o map the copy carries; the
    weighted mean of the products cancels the zero-sum noise to first order, and its rank-d_h
    SVD U S Vᵀ gives W_v,g = S Vᵀ and the stacked W_o,h = U. The copies must already have their
    KV groups matched (:func:`align_copy`)."""
    h_kv, r, d_h = dims.num_key_value_heads, dims.group_size, dims.head_dim
    out = dict(combined)
    for layer in range(num_layers):
        v_name, o_name = projection_name(layer, "v"), projection_name(layer, "o")
        aggregate = HarmonicAggregator()
        for c, alpha in zip(copies, scales, strict=True):
            v = _heads(c[v_name].detach().to(torch.float64), h_kv)  # (g, d_h, in)
            o = c[o_name].detach().to(torch.float64).reshape(-1, h_kv, r, d_h)
            aggregate.add({"ov": torch.einsum("xgrd,gdy->grxy", o, v)}, alpha)  # (g, r, out, in)
        mean = aggregate.result()["ov"]
        v_new = torch.empty(h_kv, d_h, mean.shape[-1], dtype=torch.float64)
        o_new = torch.empty(mean.shape[2], h_kv, r, d_h, dtype=torch.float64)
        for g in range(h_kv):
            u, sv, vh = torch.linalg.svd(mean[g].reshape(-1, mean.shape[-1]), full_matrices=False)
            v_new[g] = sv[:d_h, None] * vh[:d_h]
            o_new[:, g] = u[:, :d_h].reshape(r, -1, d_h).transpose(0, 1)
        out[v_name] = v_new.reshape(copies[0][v_name].shape).to(copies[0][v_name].dtype)
        out[o_name] = o_new.reshape(copies[0][o_name].shape).to(copies[0][o_name].dtype)
    return out
