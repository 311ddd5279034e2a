"""Candidate defenses against the alignment attack, as the threat-model study draws them.

Each is what the server could do differently when it publishes a client's m copies. The maps
(:class:`ChannelScaling`, :class:`InvertibleVO`) are extra function-preserving maps S_k applied
on top of MPU's T_k (the copy sent is S_k(T_k(θ + α_k ε⁰_k))), with their inverse on an
update for the server's mapping back. The other defenses change how the copies are drawn
(secret scales, noise shared by a client's copies) and live in :class:`Defense` as flags.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fedunlearn.mpu import ReparamDims
from fedunlearn.mpu.alignment import projection_name


class ChannelScaling:
    """SwiGLU's own symmetry: up row c · s_c and down column c / s_c, log s_c ~ N(0, spread²)
    per layer and copy (the gate row cannot be scaled: SiLU is not homogeneous)."""

    def __init__(self, dims: ReparamDims, num_layers: int, seed: int, spread: float = 1.0):
        gen = torch.Generator().manual_seed(seed)
        self.scales = {
            layer: torch.exp(spread * torch.randn(dims.intermediate_size, generator=gen))
            for layer in range(num_layers)
        }

    def _apply(self, state: Mapping[str, Tensor], inverse: bool) -> dict[str, Tensor]:
        out = dict(state)
        for layer, s in self.scales.items():
            up, down = projection_name(layer, "up"), projection_name(layer, "down")
            up_w, down_w = state[up].double(), state[down].double()
            up_w = up_w / s[:, None] if inverse else up_w * s[:, None]
            down_w = down_w * s[None, :] if inverse else down_w / s[None, :]
            out[up], out[down] = up_w.to(state[up].dtype), down_w.to(state[down].dtype)
        return out

    def forward(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """S(θ): a new dict, the scaled tensors new."""
        return self._apply(state, inverse=False)

    def inverse(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """S⁻¹ of weights or of an update (the map is linear)."""
        return self._apply(state, inverse=True)


class InvertibleVO:
    """A general invertible map per KV group on v / o instead of an orthogonal one:
    v rows ← M_g·v, o columns ← o·M_g⁻¹ with M_g = U diag(e^{z}) Vᵀ (U, V Haar, z ~ N(0,
    spread²)), so condition numbers of a few to tens."""

    def __init__(self, dims: ReparamDims, num_layers: int, seed: int, spread: float = 0.5):
        gen = torch.Generator().manual_seed(seed)
        self.dims = dims
        self.maps = {}
        for layer in range(num_layers):
            mats = []
            for _ in range(dims.num_key_value_heads):
                u, _ = torch.linalg.qr(torch.randn(dims.head_dim, dims.head_dim, generator=gen))
                v, _ = torch.linalg.qr(torch.randn(dims.head_dim, dims.head_dim, generator=gen))
                z = spread * torch.randn(dims.head_dim, generator=gen)
                mats.append((u * torch.exp(z)) @ v.T)
            stack = torch.stack(mats).double()
            self.maps[layer] = (stack, torch.linalg.inv(stack))

    def _apply(self, state: Mapping[str, Tensor], inverse: bool) -> dict[str, Tensor]:
        d = self.dims
        out = dict(state)
        for layer, (m, m_inv) in self.maps.items():
            left, right = (m_inv, m) if inverse else (m, m_inv)
            vn, on = projection_name(layer, "v"), projection_name(layer, "o")
            v = state[vn].double().reshape(d.num_key_value_heads, d.head_dim, -1)
            out[vn] = (left @ v).reshape(state[vn].shape).to(state[vn].dtype)
            o = state[on].double().reshape(-1, d.num_key_value_heads, d.group_size, d.head_dim)
            o = torch.einsum("xgrd,gde->xgre", o, right)
            out[on] = o.reshape(state[on].shape).to(state[on].dtype)
        return out

    def forward(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """S(θ)."""
        return self._apply(state, inverse=False)

    def inverse(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """S⁻¹ of weights or of an update (the map is linear)."""
        return self._apply(state, inverse=True)


ExtraMap = Callable[[ReparamDims, int, int], "ChannelScaling | InvertibleVO"]


@dataclass(frozen=True)
class Defense:
    """How the server publishes under this defense, and what the attacker (who knows the
    algorithm, not the keys) fits in return."""

    description: str
    extra_map: ExtraMap | None = None  # S_k on top of T_k, drawn per copy
    secret_scales: bool = False  # α_k drawn from the secret instead of the public α grid
    shared_noise: bool = False  # one η per client in all its copies: T_k(θ + η + α_k ε⁰_k)
    single_copy: bool = False  # one noisy copy per client (MPU's Noised baseline)
    estimate_scales: bool = False  # the attacker's answer to ChannelScaling
    general_vo: bool = False  # the attacker's answer to InvertibleVO


DEFENSES: dict[str, Defense] = {
    "none": Defense("MPU as published: T_k = permutations, RoPE-plane rotations, orthogonal v/o"),
    "channel-scaling": Defense(
        "+ SwiGLU per-channel scaling of up rows / down columns",
        ChannelScaling,
        estimate_scales=True,
    ),
    "invertible-vo": Defense(
        "+ general invertible (not orthogonal) v/o maps", InvertibleVO, general_vo=True
    ),
    "secret-scales": Defense(
        "α_k drawn from the secret (the attacker cannot weight by 1/α_k)", secret_scales=True
    ),
    "shared-noise": Defense(
        "+ noise η (σ_η = κ_η·RMS) shared by a client's copies, not cancelled by the server",
        shared_noise=True,
    ),
    "single-copy": Defense(
        "one noisy copy per client, no denoising (the Noised baseline)", single_copy=True
    ),
}
