"""Zero-sum layer-wise noise of MPU (docs/algorithms.md, "Zero-sum noise").

For every decoder layer ℓ the server sets σ_ℓ = κ · RMS(v_ℓ), where v_ℓ is the concatenation of
the layer's weights (or of its task vector θ − θ_reference), draws z_k,ℓ ~ N(0, σ_ℓ² I) for the
m copies and centres them::

    ε⁰_k = √(m/(m−1)) · (z_k − mean_j z_j),      so that  Σ_k ε⁰_k = 0,

which keeps the per-coordinate variance at σ_ℓ² (:func:`zero_sum_coefficients`: the same law
from m − 1 normals per coordinate, drawn in float32). Copy k then receives θ + α_k ε⁰_k with
distinct scales α_k > 0 (:func:`alphas`). Only weights under ``model.layers.<i>.`` are
perturbed: the embeddings, the final norm and the LM head are never touched.
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
    "perturb",
    "zero_sum_coefficients",
    "zero_sum_draw",
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
    variants of docs/algorithms.md, "Zero-sum noise". RMS(v) = √(Σ_t v(t)² / d_ℓ), accumulated
    in float64 (a float64 norm of each tensor, read once without a float64 copy of the weights).
    """
    if not math.isfinite(kappa) or kappa < 0:
        raise ValueError(f"kappa must be finite and >= 0, got {kappa}")
    sigmas: dict[int, float] = {}
    for layer, names in groups.items():
        total, count = 0.0, 0
        for name in names:
            if name not in state:
                raise KeyError(f"layer {layer}: tensor {name!r} missing from state")
            v = state[name].detach()
            if reference is not None:
                if name not in reference:
                    raise KeyError(f"layer {layer}: tensor {name!r} missing from reference")
                ref = reference[name].detach()
                if ref.shape != v.shape:
                    raise ValueError(
                        f"{name}: reference shape {tuple(ref.shape)} != {tuple(v.shape)}"
                    )
                v = v.to(torch.float64) - ref.to(device=v.device, dtype=torch.float64)
            total += float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2
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

    σ = ``sigma`` (one value for all tensors, or a per-tensor mapping such as
    :func:`sigma_per_tensor` gives); every tensor is drawn by :func:`zero_sum_draw`, in
    sorted-name order, so the result is a deterministic function of the ``generator`` state
    (the server seeds it with :func:`fedunlearn.mpu.keys.derive_seed`). Σ_k ε⁰_k = 0 (exactly
    for m = 2, up to float rounding otherwise) and each ε⁰_k has per-coordinate standard
    deviation σ. Requires m ≥ 2 (one copy cannot be zero-sum).
    """
    _check_copies(m)
    sig = _sigmas(shapes, sigma)
    drawn = {
        name: zero_sum_draw(shapes[name], sig[name], m, generator, dtype=_compute_dtype(dtype))
        for name in sorted(shapes)
    }
    return [
        {name: drawn[name][k].to(device=device, dtype=dtype) for name in shapes} for k in range(m)
    ]


def zero_sum_draw(
    shape: Sequence[int] | torch.Size,
    sigma: float,
    m: int,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
) -> list[Tensor]:
    """ε⁰_1..ε⁰_m of one tensor: ε⁰_k = Σ_j B_kj u_j with u_1..u_{m−1} ~ N(0, I) drawn in
    ``dtype`` (one call ``randn((m−1, *shape))``) and B = :func:`zero_sum_coefficients`.

    For m = 2 this is (σ·u, −σ·u): Σ_k ε⁰_k = 0 exactly. For m > 2 the combination is formed
    in float64 and cast to ``dtype``.
    """
    _check_copies(m)
    u = torch.randn((m - 1, *tuple(shape)), generator=generator, dtype=dtype)
    coefficients = zero_sum_coefficients(m, sigma)
    if m == 2:
        first = u[0].mul_(float(coefficients[0, 0]))
        return [first, -first]
    eps = torch.tensordot(coefficients, u.to(torch.float64), dims=1)
    return list(eps.to(dtype).unbind(0))


def zero_sum_coefficients(m: int, sigma: float) -> Tensor:
    """B = √(m/(m−1)) · σ · Hᵀ (m × (m−1), float64), H the (m−1) × m Helmert matrix.

    H has orthonormal rows, each orthogonal to 1, so the centring matrix is I − 11ᵀ/m = HᵀH:
    for z ~ N(0, σ² I_m) per coordinate the centred draw is Hᵀ(Hz), and Hz ~ N(0, σ² I_{m−1})
    because HHᵀ = I. Hence ε⁰ = B·u with u ~ N(0, I_{m−1}) has exactly the law of
    √(m/(m−1))·(z − z̄), from one normal fewer per coordinate; the columns of B sum to 0.
    """
    _check_copies(m)
    helmert = torch.zeros(m - 1, m, dtype=torch.float64)
    for j in range(1, m):  # row j = (1, …, 1, −j, 0, …, 0) / √(j(j+1))
        helmert[j - 1, :j] = 1.0
        helmert[j - 1, j] = -float(j)
        helmert[j - 1] /= math.sqrt(j * (j + 1))
    return helmert.T * (math.sqrt(m / (m - 1)) * sigma)


def _check_copies(m: int) -> None:
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        raise ValueError(f"zero-sum noise needs m >= 2 copies, got m={m!r}")


def _sigmas(
    shapes: Mapping[str, Sequence[int] | torch.Size], sigma: float | Mapping[str, float]
) -> dict[str, float]:
    """σ per tensor of ``shapes``, each finite and >= 0."""
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
    return sig


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 tensors (half-precision weights are handled in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def alphas(m: int, low: float = 1.0, high: float = 2.0) -> list[float]:
    """Distinct noise scales α_1..α_m linearly spaced in [low, high], by default [1, 2]
    (docs/algorithms.md, "Zero-sum noise").

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
        out[name] = perturb(name, state[name], noise, alpha)
    return out


def perturb(name: str, weight: Tensor, noise: Tensor, alpha: float) -> Tensor:
    """w + α·ε for one tensor ``name``, in float32 (float64 for a float64 weight; one rounding
    of the sum, far below σ), returned in the weight's dtype."""
    if noise.shape != weight.shape:
        raise ValueError(f"{name}: noise shape {tuple(noise.shape)} != {tuple(weight.shape)}")
    dtype = _compute_dtype(weight.dtype)
    total = torch.add(weight.to(dtype), noise.to(weight.device, dtype), alpha=alpha)
    return total.to(weight.dtype)
