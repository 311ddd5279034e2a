"""Zero-sum layer-wise noise of MPU (SPEC §3 step 1).

For every decoder layer ℓ the server sets σ_ℓ = κ · RMS(v_ℓ), where v_ℓ is the concatenation of
the layer's weights (or of its task vector θ − θ_reference), draws z_k,ℓ ~ N(0, σ_ℓ² I) for the
m copies and centres them::

    ε⁰_k = √(m/(m−1)) · (z_k − mean_j z_j),      so that  Σ_k ε⁰_k = 0,

which keeps the per-coordinate variance at σ_ℓ². Copy k then receives θ + α_k ε⁰_k with distinct
scales α_k > 0 (:func:`alphas`). Only weights under ``model.layers.<i>.`` are perturbed: the
embeddings, the final norm and the LM head are never touched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "LAYER_PATTERN",
    "alphas",
    "layer_groups",
    "layer_sigmas",
    "noisy_copy",
    "sigma_per_tensor",
    "zero_sum_noise",
]

#: Matches the decoder-layer prefix of HF Llama/Mistral/Qwen2 state-dict names (also under a
#: PEFT ``base_model.model.`` prefix); group 1 is the layer index.
LAYER_PATTERN = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")


def layer_groups(state_dict_keys: Iterable[str], num_layers: int) -> dict[int, list[str]]:
    """Names of the weights of each decoder layer ℓ = 0..num_layers−1 (in the given order).

    Only names under ``model.layers.<ℓ>.`` are included; embeddings, the final norm and the
    LM head belong to no layer and are therefore never perturbed. Every layer must have at
    least one weight and no name may point past ``num_layers``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    groups: dict[int, list[str]] = {i: [] for i in range(num_layers)}
    for name in state_dict_keys:
        match = LAYER_PATTERN.search(name)
        if match is None:
            continue
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"{name!r} is in layer {layer} but num_layers is {num_layers}")
        groups[layer].append(name)
    empty = [i for i, names in groups.items() if not names]
    if empty:
        raise ValueError(f"no weights found for decoder layer(s) {empty}")
    return groups


def layer_sigmas(
    state: Mapping[str, Tensor],
    groups: Mapping[int, Sequence[str]],
    kappa: float,
    reference: Mapping[str, Tensor] | None = None,
) -> dict[int, float]:
    """σ_ℓ = κ · RMS(v_ℓ) for every layer ℓ in ``groups``.

    v_ℓ is the concatenation of the layer's weights θ_ℓ, or of its task vector
    θ_ℓ − θ_reference,ℓ when ``reference`` (e.g. the pretrained weights) is given — the two
    variants of SPEC §3. RMS(v) = √(Σ_t v(t)² / d_ℓ), accumulated in float64.
    """
    if not math.isfinite(kappa) or kappa < 0:
        raise ValueError(f"kappa must be finite and >= 0, got {kappa}")
    sigmas: dict[int, float] = {}
    for layer, names in groups.items():
        total, count = 0.0, 0
        for name in names:
            if name not in state:
                raise KeyError(f"layer {layer}: tensor {name!r} missing from state")
            v = state[name].detach().to(torch.float64)
            if reference is not None:
                if name not in reference:
                    raise KeyError(f"layer {layer}: tensor {name!r} missing from reference")
                ref = reference[name].detach()
                if ref.shape != v.shape:
                    raise ValueError(
                        f"{name}: reference shape {tuple(ref.shape)} != {tuple(v.shape)}"
                    )
                v = v - ref.to(device=v.device, dtype=torch.float64)
            total += float(v.square().sum())
            count += v.numel()
        if count == 0:
            raise ValueError(f"layer {layer} has no weights")
        sigmas[layer] = kappa * math.sqrt(total / count)
    return sigmas


def sigma_per_tensor(
    groups: Mapping[int, Sequence[str]], sigmas: Mapping[int, float]
) -> dict[str, float]:
    """Expand per-layer σ_ℓ to every tensor name of layer ℓ (input for :func:`zero_sum_noise`)."""
    return {name: float(sigmas[layer]) for layer, names in groups.items() for name in names}


def zero_sum_noise(
    shapes: Mapping[str, Sequence[int] | torch.Size],
    sigma: float | Mapping[str, float],
    m: int,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[dict[str, Tensor]]:
    """Zero-sum base noise ε⁰_1..ε⁰_m for the tensors in ``shapes``.

    ε⁰_k = √(m/(m−1)) · (z_k − mean_j z_j) with z_k ~ N(0, σ² I), σ = ``sigma`` (one value for
    all tensors, or a per-tensor mapping such as :func:`sigma_per_tensor` gives). The centring
    is done in float64 and only then cast to ``dtype``, so Σ_k ε⁰_k = 0 up to float rounding;
    each ε⁰_k has per-coordinate standard deviation σ. The draw is a deterministic function of
    the ``generator`` state (tensors are drawn in sorted-name order), which the server seeds with
    :func:`fedunlearn.mpu.keys.derive_seed`. Requires m ≥ 2 (one copy cannot be zero-sum).
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        raise ValueError(f"zero-sum noise needs m >= 2 copies, got m={m!r}")
    if isinstance(sigma, Mapping):
        missing = [name for name in shapes if name not in sigma]
        if missing:
            raise KeyError(f"no sigma given for tensor(s) {missing[:5]}")
        sig = {name: float(sigma[name]) for name in shapes}
    else:
        sig = {name: float(sigma) for name in shapes}
    for name, s in sig.items():
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"{name}: sigma must be finite and >= 0, got {s}")
    scale = math.sqrt(m / (m - 1))
    drawn: dict[str, Tensor] = {}
    for name in sorted(shapes):
        z = torch.randn((m, *tuple(shapes[name])), generator=generator, dtype=torch.float64)
        z.mul_(sig[name])
        eps0 = (z - z.mean(dim=0, keepdim=True)) * scale
        drawn[name] = eps0.to(device=device, dtype=dtype)
    return [{name: drawn[name][k] for name in shapes} for k in range(m)]


def alphas(m: int, low: float = 1.0, high: float = 2.0) -> list[float]:
    """Distinct noise scales α_1..α_m linearly spaced in [low, high] (SPEC default [1, 2]).

    For m = 1 (the single-copy "Noised" baseline) returns ``[low]``, i.e. ``[1.0]`` by default.
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be a positive integer, got {m!r}")
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0:
        raise ValueError(f"alphas need 0 < low, finite bounds; got low={low}, high={high}")
    if m == 1:
        return [float(low)]
    if high <= low:
        raise ValueError(f"distinct alphas need low < high, got low={low}, high={high}")
    return [low + (high - low) * k / (m - 1) for k in range(m)]


def noisy_copy(
    state: Mapping[str, Tensor], eps0: Mapping[str, Tensor], alpha: float
) -> dict[str, Tensor]:
    """θ + α_k ε⁰_k: a new state dict; tensors without noise are shared with ``state``."""
    out = dict(state)
    for name, noise in eps0.items():
        if name not in state:
            raise KeyError(f"noise given for {name!r}, which is not in the state")
        w = state[name]
        if noise.shape != w.shape:
            raise ValueError(f"{name}: noise shape {tuple(noise.shape)} != {tuple(w.shape)}")
        out[name] = (w.to(torch.float64) + alpha * noise.to(w.device, torch.float64)).to(w.dtype)
    return out
