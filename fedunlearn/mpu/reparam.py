"""Secret, invertible, function-preserving reparameterisation T_k of MPU (docs/algorithms.md,
"Function-preserving reparameterisation").

For HF Llama-style decoders (``model.layers.<i>.self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``, grouped-query attention, optional q/k/v/o and MLP biases; which
architectures qualify is decided by :func:`.support.plan_reparam`) each layer ℓ of copy k gets a
:class:`LayerTransform` made of

* an MLP channel permutation P (intermediate_size): rows of gate_proj/up_proj (and their
  biases) are permuted, columns of down_proj likewise — SwiGLU is element-wise, so the output
  is unchanged;
* per KV head g, RoPE-plane rotation angles φ_g,i, i < head_dim/2. In HF's ``rotate_half``
  convention RoPE rotates the plane (i, i + head_dim/2) — NOT the adjacent pair (2i, 2i+1) — so
  a rotation R_g by φ_g,i in each such plane commutes with RoPE at every position. R_g is applied
  to the k_proj rows of head g and to the q_proj rows of every query head using g (biases too),
  leaving q·k unchanged. With q/k RMSNorm (``ReparamDims.qk_norm``) the angles are 0 or π only
  (a sign flip of the plane), the only rotations that commute with the norm's channel weights;
* per KV head g an orthogonal matrix Q_g (QR of a Gaussian with sign fix, i.e. Haar): v_proj
  rows of head g (and bias) become Q_g·W_v,g, and the o_proj columns of every query head using g
  become W_o,h·Q_gᵀ, so o_proj undoes the basis change;
* optionally a permutation π of the KV groups: new KV slot j holds old KV head π(j) together
  with its query heads and their o_proj columns (query head h uses KV head h // (H_Q/H_KV), as in
  HF's ``repeat_kv``). A q/k norm over the whole projection (Olmo2) has its weight permuted
  alike; a per-head one (Qwen3, Gemma3) is shared by all heads and stays as it is.

T acts on each tensor separately and linearly (no offsets), so T⁻¹ of a weight update is the
inverse map on that tensor (:func:`invert_delta`), and for LoRA it moves onto the factors
(:func:`invert_lora`). Hidden-space norms, embeddings and the LM head are left untouched: the
hidden basis never changes. Any other tensor of a transformed decoder layer (a fused
``qkv_proj``, an unknown norm) is refused with an error naming it, never passed through.
All matrix algebra is done in float64 and cast back to the tensor's dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .keys import derive_seed
from .support import HIDDEN_NORMS, ReparamDims

__all__ = [
    "LayerTransform",
    "ReparamDims",
    "apply_transform",
    "draw_transform",
    "draw_transforms",
    "invert_delta",
    "invert_lora",
    "invert_transform",
    "parse_target",
    "transform_tensor",
]

_PROJ_PATTERN = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj(?:\.|$)"
)
_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_QK_NORM_PATTERN = re.compile(r"^self_attn\.(q|k)_norm\.weight$")
_HIDDEN_NORM_PATTERN = re.compile(rf"^(?:{'|'.join(HIDDEN_NORMS)})\.(?:weight|bias)$")
_ROW_KINDS = frozenset({"q", "k", "v", "gate", "up"})  # T acts on the output (row) dimension
_COL_KINDS = frozenset({"o", "down"})  # T acts on the input (column) dimension


def _as_dims(config_dims: ReparamDims | Any) -> ReparamDims:
    return (
        config_dims
        if isinstance(config_dims, ReparamDims)
        else ReparamDims.from_config(config_dims)
    )


@dataclass(frozen=True, eq=False, repr=False)
class LayerTransform:
    """T_k restricted to one decoder layer ℓ (secret key material: its repr shows shapes only).

    Attributes:
        dims: the layer's head/MLP dims.
        mlp_perm: P as an index tensor (int64, intermediate_size): new channel c = old mlp_perm[c].
        rope_angles: φ_g,i (float64, H_KV × head_dim/2), indexed by the ORIGINAL KV head g.
        vo_orth: Q_g (float64, H_KV × head_dim × head_dim), indexed by the original KV head g.
        group_perm: π (int64, H_KV) or None: new KV slot j holds original KV head π(j).
    """

    dims: ReparamDims
    mlp_perm: Tensor
    rope_angles: Tensor
    vo_orth: Tensor
    group_perm: Tensor | None = None

    def __post_init__(self) -> None:
        d = self.dims
        if tuple(self.mlp_perm.shape) != (d.intermediate_size,):
            raise ValueError("mlp_perm has the wrong shape")
        if tuple(self.rope_angles.shape) != (d.num_key_value_heads, d.head_dim // 2):
            raise ValueError("rope_angles has the wrong shape")
        if tuple(self.vo_orth.shape) != (d.num_key_value_heads, d.head_dim, d.head_dim):
            raise ValueError("vo_orth has the wrong shape")
        if self.group_perm is not None and tuple(self.group_perm.shape) != (d.num_key_value_heads,):
            raise ValueError("group_perm has the wrong shape")
        if d.sign_flips_only and not bool(
            ((self.rope_angles == 0) | (self.rope_angles == math.pi)).all()
        ):
            raise ValueError(f"q/k norm ({d.qk_norm}): rope_angles must all be 0 or π")

    def __repr__(self) -> str:
        return (
            f"LayerTransform(<secret>, heads={self.dims.num_attention_heads}, "
            f"kv_heads={self.dims.num_key_value_heads}, head_dim={self.dims.head_dim}, "
            f"intermediate={self.dims.intermediate_size}, "
            f"permute_groups={self.group_perm is not None})"
        )

    def plane_cos_sin(self) -> tuple[Tensor, Tensor]:
        """(cos φ_g,i, sin φ_g,i), float64, H_KV × d_h/2 each."""
        if self.dims.sign_flips_only:  # exact ±1, no 1e-16 leak of sin(π) into the other axis
            cos = torch.where(self.rope_angles == 0, 1.0, -1.0).to(torch.float64)
            return cos, torch.zeros_like(self.rope_angles)
        return torch.cos(self.rope_angles), torch.sin(self.rope_angles)

    def rope_rotations(self) -> Tensor:
        """R_g (float64, H_KV × d_h × d_h): rotation by φ_g,i in every plane (i, i + d_h/2)."""
        h_kv, half = self.rope_angles.shape
        cos, sin = self.plane_cos_sin()
        rot = torch.zeros(h_kv, 2 * half, 2 * half, dtype=torch.float64)
        idx = torch.arange(half)
        rot[:, idx, idx] = cos
        rot[:, idx, idx + half] = -sin
        rot[:, idx + half, idx] = sin
        rot[:, idx + half, idx + half] = cos
        return rot


def draw_transform(
    config_dims: ReparamDims | Any, seed: int, *, permute_groups: bool
) -> LayerTransform:
    """Draw one layer's T from ``seed`` (derive it per (round, copy, layer) with ``derive_seed``).

    P and π are uniform permutations, φ_g,i ~ U[0, 2π) (uniform on {0, π} under q/k norms),
    Q_g is Haar-orthogonal (QR of a Gaussian matrix with the signs of diag(R) folded into Q).
    ``config_dims`` is a :class:`ReparamDims` or an HF config (checked by ``plan_reparam``).
    """
    dims = _as_dims(config_dims)
    gen = torch.Generator().manual_seed(int(seed))
    h_kv, d = dims.num_key_value_heads, dims.head_dim
    mlp_perm = torch.randperm(dims.intermediate_size, generator=gen)
    if dims.sign_flips_only:
        angles = torch.randint(0, 2, (h_kv, d // 2), generator=gen).to(torch.float64) * math.pi
    else:
        angles = torch.rand(h_kv, d // 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
    gauss = torch.randn(h_kv, d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs[signs == 0] = 1.0
    q = q * signs.unsqueeze(-2)
    group_perm = torch.randperm(h_kv, generator=gen) if permute_groups else None
    return LayerTransform(dims, mlp_perm, angles, q, group_perm)


def draw_transforms(
    config_dims: ReparamDims | Any,
    secret: bytes | str,
    round_idx: int,
    copy_idx: int | str,
    num_layers: int,
    *,
    permute_groups: bool,
) -> dict[int, LayerTransform]:
    """T_k of copy ``copy_idx`` in round ``round_idx``: one :class:`LayerTransform` per layer ℓ.

    Layer ℓ is drawn from ``derive_seed(secret, round_idx, copy_idx, ℓ, "reparam")``, so the
    server can rebuild T_k (and hence T_k⁻¹) from its secret alone.
    """
    dims = _as_dims(config_dims)
    return {
        layer: draw_transform(
            dims,
            derive_seed(secret, round_idx, copy_idx, layer, "reparam"),
            permute_groups=permute_groups,
        )
        for layer in range(num_layers)
    }


def parse_target(name: str) -> tuple[int, str] | None:
    """(layer ℓ, projection kind in q/k/v/o/gate/up/down) of a weight/LoRA name, or None."""
    match = _PROJ_PATTERN.search(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2)


# ---------------------------------------------------------------------------------------------
# Row (output-dim) and column (input-dim) actions on arbitrary tensors.
# Rows: x has the projection's output dim first (weight, bias, LoRA B). Columns: x has the
# projection's input dim last (weight, LoRA A). ``inverse`` applies the inverse action.


def _inverse_perm(perm: Tensor) -> Tensor:
    return torch.argsort(perm)


def _check_dim(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: {what} has size {actual}, expected {expected} for this layer")


def _rows(
    x: Tensor, kind: str, tf: LayerTransform, inverse: bool, name: str, square: bool = False
) -> Tensor:
    d = tf.dims
    if kind in ("gate", "up"):
        _check_dim(name, x.shape[0], d.intermediate_size, "output dim")
        mlp_perm = _inverse_perm(tf.mlp_perm) if inverse else tf.mlp_perm
        return x.index_select(0, mlp_perm.to(x.device))
    h_kv, d_h, n_rep = d.num_key_value_heads, d.head_dim, d.group_size
    heads = h_kv * (n_rep if kind == "q" else 1)
    _check_dim(name, x.shape[0], heads * d_h, "output dim")
    rest = x.shape[1:]
    y = x.to(torch.float64).reshape(h_kv, heads // h_kv, d_h, -1)  # (g, r, d_h, rest)
    perm = tf.group_perm.to(x.device) if tf.group_perm is not None else None
    if inverse and perm is not None:
        y = y.index_select(0, _inverse_perm(perm))
    if kind == "v":
        mats = tf.vo_orth.to(x.device) ** 2 if square else tf.vo_orth.to(x.device)
        # block g ← M_g · block g (forward) or M_gᵀ · block g (inverse)
        y = torch.matmul((mats.transpose(1, 2) if inverse else mats).unsqueeze(1), y)
    else:
        y = _rotate_planes(y, tf, inverse, square)
    if not inverse and perm is not None:
        y = y.index_select(0, perm)  # slot j ← original group π(j)
    return y.reshape(x.shape[0], *rest).to(x.dtype)


def _rotate_planes(y: Tensor, tf: LayerTransform, inverse: bool, square: bool) -> Tensor:
    """R_g (or R_gᵀ; with ``square`` their entries squared) on the d_h axis of ``y`` (g, r, d_h,
    rest), plane by plane: R_g only mixes i with i + d_h/2 (:meth:`LayerTransform.
    rope_rotations`), so two multiply-adds per entry replace a d_h × d_h product."""
    cos, sin = tf.plane_cos_sin()
    cos = cos.to(y.device)[:, None, :, None]  # (g, 1, d_h/2, 1)
    sin = sin.to(y.device)[:, None, :, None]
    if square:
        cos, sin = cos * cos, sin * sin  # R∘² = [[c², s²], [s², c²]] = (Rᵀ)∘²
    elif inverse:
        sin = -sin  # Rᵀ rotates by −φ
    half = y.shape[2] // 2
    top, bottom = y[:, :, :half], y[:, :, half:]
    if square:
        return torch.cat([cos * top + sin * bottom, sin * top + cos * bottom], dim=2)
    return torch.cat([cos * top - sin * bottom, sin * top + cos * bottom], dim=2)


def _cols(
    x: Tensor, kind: str, tf: LayerTransform, inverse: bool, name: str, square: bool = False
) -> Tensor:
    d = tf.dims
    if kind == "down":
        _check_dim(name, x.shape[-1], d.intermediate_size, "input dim")
        mlp_perm = _inverse_perm(tf.mlp_perm) if inverse else tf.mlp_perm
        return x.index_select(-1, mlp_perm.to(x.device))
    # o_proj: columns are the concatenated query-head outputs.
    h_kv, d_h, n_rep = d.num_key_value_heads, d.head_dim, d.group_size
    _check_dim(name, x.shape[-1], h_kv * n_rep * d_h, "input dim")
    lead = x.shape[:-1]
    mats = tf.vo_orth.to(x.device) ** 2 if square else tf.vo_orth.to(x.device)
    y = x.to(torch.float64).reshape(-1, h_kv, n_rep, d_h)  # (o, g, r, d_h)
    perm = tf.group_perm.to(x.device) if tf.group_perm is not None else None
    if not inverse:
        y = torch.einsum("ogrb,gab->ogra", y, mats)  # W_o,h ← W_o,h · Q_gᵀ
        if perm is not None:
            y = y[:, perm]
    else:
        if perm is not None:
            y = y[:, _inverse_perm(perm)]
        y = torch.einsum("ogrb,gba->ogra", y, mats)  # W_o,h ← W_o,h · Q_g
    return y.reshape(*lead, x.shape[-1]).to(x.dtype)


def _map_tensor(
    name: str,
    x: Tensor,
    transforms: Mapping[int, LayerTransform],
    inverse: bool,
    square: bool = False,
) -> Tensor | None:
    """T (or T⁻¹) on one state-dict tensor; None when T leaves it unchanged."""
    target = parse_target(name)
    if target is None:
        return _map_other(name, x, transforms, inverse)
    layer, kind = target
    tf = transforms.get(layer)
    if tf is None:
        return None
    is_bias = name.endswith(".bias")
    if kind in _ROW_KINDS:
        return _rows(x, kind, tf, inverse, name, square)
    if is_bias:  # o/down bias lives in the hidden space, which T does not touch
        return None
    if x.dim() < 2:
        raise ValueError(f"{name}: expected a weight matrix, got shape {tuple(x.shape)}")
    return _cols(x, kind, tf, inverse, name, square)


def _map_other(
    name: str, x: Tensor, transforms: Mapping[int, LayerTransform], inverse: bool
) -> Tensor | None:
    """A tensor that is not a projection: q/k norms, hidden-space norms, or a refusal."""
    match = _LAYER_TENSOR.search(name)
    if match is None or int(match.group(1)) not in transforms:
        return None  # embeddings, final norm, LM head, layers T does not touch
    tf, rel = transforms[int(match.group(1))], match.group(2)
    if _HIDDEN_NORM_PATTERN.match(rel):
        return None
    norm = _QK_NORM_PATTERN.match(rel)
    if norm is None:
        raise ValueError(
            f"{name}: the reparameterisation does not know this decoder-layer tensor (fused or "
            "unknown module); refusing to publish a copy that would compute something else"
        )
    return _qk_norm(x, norm.group(1), tf, inverse, name)


def _qk_norm(x: Tensor, kind: str, tf: LayerTransform, inverse: bool, name: str) -> Tensor | None:
    """q/k RMSNorm weight: unchanged per head; permuted with the KV groups per projection."""
    d = tf.dims
    if d.qk_norm == "none":
        raise ValueError(
            f"{name}: a q/k norm, but these transforms were drawn for a model without one "
            "(continuous RoPE-plane rotations do not commute with it)"
        )
    if d.qk_norm == "per-head":
        _check_dim(name, x.shape[0], d.head_dim, "per-head norm weight")
        return None
    heads = d.num_key_value_heads * (d.group_size if kind == "q" else 1)
    _check_dim(name, x.shape[0], heads * d.head_dim, "projection norm weight")
    if tf.group_perm is None:
        return None
    perm = _inverse_perm(tf.group_perm) if inverse else tf.group_perm
    y = x.reshape(d.num_key_value_heads, -1)[perm.to(x.device)]
    return y.reshape(x.shape)


def _map_state(
    state: Mapping[str, Tensor],
    transforms: Mapping[int, LayerTransform],
    inverse: bool,
    square: bool = False,
) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, x in state.items():
            mapped = _map_tensor(name, x.detach(), transforms, inverse, square)
            out[name] = x if mapped is None else mapped
    return out


def apply_transform(
    state: Mapping[str, Tensor], transforms: Mapping[int, LayerTransform]
) -> dict[str, Tensor]:
    """θ ↦ T(θ) for a state dict; ``transforms`` maps layer ℓ → :class:`LayerTransform`.

    Returns a new dict; every transformed tensor is a new tensor and the input is never
    mutated. Tensors T does not act on (embeddings, norms, LM head, o/down biases, layers absent
    from ``transforms``) are passed through as the same objects.
    """
    return _map_state(state, transforms, inverse=False)


def transform_tensor(name: str, x: Tensor, transforms: Mapping[int, LayerTransform]) -> Tensor:
    """T on one state-dict tensor ``name`` (what :func:`apply_transform` does to it): a new
    tensor, or ``x`` itself when T leaves it unchanged."""
    with torch.no_grad():
        mapped = _map_tensor(name, x.detach(), transforms, inverse=False)
    return x if mapped is None else mapped


def invert_transform(
    state: Mapping[str, Tensor], transforms: Mapping[int, LayerTransform]
) -> dict[str, Tensor]:
    """θ' ↦ T⁻¹(θ'): the exact inverse of :func:`apply_transform` (same conventions)."""
    return _map_state(state, transforms, inverse=True)


def invert_delta(
    delta: Mapping[str, Tensor], transforms: Mapping[int, LayerTransform]
) -> dict[str, Tensor]:
    """Δ̂_k = T_k⁻¹(Δ_k) for a dense update given in copy k's coordinates.

    T is linear on each tensor (permutations, rotations, orthogonal maps, no offset), so
    T⁻¹(θ' + Δ) − T⁻¹(θ') = T⁻¹(Δ): the update maps back exactly like a weight does.
    """
    return _map_state(delta, transforms, inverse=True)


def invert_fisher(
    fisher: Mapping[str, Tensor], transforms: Mapping[int, LayerTransform]
) -> dict[str, Tensor]:
    """A Fisher diagonal measured on copy k, mapped to original coordinates.

    For W' = M·W (and column maps alike) the chain rule gives F(a) = Σ_b M_ba² F'(b) when the
    copy's Fisher is diagonal: the inverse map with every matrix entry squared. Exact for the
    permutations; for the rotations and orthogonal maps it drops the off-diagonal Fisher terms
    (the diagonal approximation every Fisher-based merge makes anyway). Stays non-negative.
    """
    return _map_state(fisher, transforms, inverse=True, square=True)


def invert_lora(
    A: Tensor, B: Tensor, name: str, transforms: Mapping[int, LayerTransform]
) -> tuple[Tensor, Tensor]:
    """LoRA factors in copy coordinates → original coordinates: s·B'@A' = T⁻¹(s·B@A).

    ``A`` is r × in, ``B`` is out × r and ``name`` the adapted module or weight (e.g.
    ``model.layers.3.self_attn.q_proj`` or a PEFT ``...q_proj.lora_A.default.weight`` name).
    T acts on a weight as W ↦ L·W·Rᵀ with L on rows, R on columns, so the row inverse moves onto
    B and the column inverse onto A. Modules T does not touch return the inputs unchanged.
    """
    target = parse_target(name)
    if target is None:
        return A, B
    layer, kind = target
    tf = transforms.get(layer)
    if tf is None:
        return A, B
    with torch.no_grad():
        if kind in _ROW_KINDS:
            return A, _rows(B.detach(), kind, tf, True, name)
        return _cols(A.detach(), kind, tf, True, name), B
