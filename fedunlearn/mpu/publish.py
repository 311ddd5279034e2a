"""MPU's published copies, built one tensor at a time (SPEC §3 steps 1–2).

θ_pub,k = T_k(θ + α_k ε⁰_k) for k = 1..m. :func:`perturbed_copies` gives what
``apply_transform(noisy_copy(θ, zero_sum_noise(...)[k], α_k), T_k)`` gives (the same normals
from the same generator; equal up to float32 rounding) in one walk over the weights: for each
tensor it draws the m − 1 normals u_j, forms every copy's θ + Σ_j α_k B_kj u_j
(:func:`.noise.zero_sum_coefficients`; for m = 2 one multiply-add per entry and copy), maps it
with T_k and drops the normals, so no set of ε⁰_k is ever held in full.

With ``shared_sigmas`` every copy also carries one noise η (σ per tensor, drawn after the
normals of that tensor) that the m copies have in common: θ_pub,k = T_k(θ + η + α_k ε⁰_k). The
harmonic aggregate cancels ε⁰ but not η, so a client that aligns its copies and averages them
away is left with θ + η instead of θ (see the MPU threat model in the docs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .noise import _compute_dtype, _sigmas, zero_sum_coefficients
from .reparam import LayerTransform, transform_tensor

__all__ = ["perturbed_copies"]


def perturbed_copies(
    state: Mapping[str, Tensor],
    sigmas: Mapping[str, float],
    scales: Sequence[float],
    generator: torch.Generator,
    transforms: Sequence[Mapping[int, LayerTransform]] | None = None,
    *,
    shared_sigmas: Mapping[str, float] | None = None,
) -> list[dict[str, Tensor]]:
    """The m published copies T_k(θ + α_k ε⁰_k) of ``state`` (θ).

    ``sigmas``: σ per perturbed tensor (:func:`fedunlearn.mpu.sigma_per_tensor`; tensors not
    named are not perturbed); ``scales``: α_1..α_m (m ≥ 2); ``generator``: the noise
    generator, drawn in sorted-name order as :func:`fedunlearn.mpu.zero_sum_noise` draws it;
    ``transforms``: T_1..T_m (one ``{layer: LayerTransform}`` per copy), or None for no
    reparameterisation; ``shared_sigmas``: σ_η per perturbed tensor of the noise shared by
    all copies (None or 0: none). Each copy is a new dict in ``state``'s order; a tensor
    neither perturbed nor transformed is shared with ``state``.
    """
    m = len(scales)
    if transforms is not None and len(transforms) != m:
        raise ValueError(f"{len(transforms)} transforms for {m} copies")
    missing = [name for name in sigmas if name not in state]
    if missing:
        raise KeyError(f"noise given for {missing[0]!r}, which is not in the state")
    sig = _sigmas({name: state[name].shape for name in sigmas}, sigmas)
    shared = _sigmas({name: state[name].shape for name in sig}, shared_sigmas or 0.0)

    def mapped(name: str, tensor: Tensor, k: int) -> Tensor:
        return tensor if transforms is None else transform_tensor(name, tensor, transforms[k])

    copies: list[dict[str, Tensor]] = [{} for _ in range(m)]
    with torch.no_grad():
        for name in sorted(sig):
            weight = state[name].detach()
            dtype = _compute_dtype(weight.dtype)
            normals = torch.randn((m - 1, *weight.shape), generator=generator).to(dtype)
            base = weight.to(dtype)
            if shared[name] > 0:
                eta = torch.randn(weight.shape, generator=generator).to(dtype)
                base = torch.add(base, eta, alpha=shared[name])
            for k, row in enumerate(zero_sum_coefficients(m, sig[name]).tolist()):
                noisy = base
                for u, coefficient in zip(normals, row, strict=True):
                    noisy = torch.add(noisy, u, alpha=scales[k] * coefficient)
                copies[k][name] = mapped(name, noisy.to(weight.dtype), k)
        for name, weight in state.items():
            if name not in sig:
                for k in range(m):
                    copies[k][name] = mapped(name, weight, k)
    return [{name: copy[name] for name in state} for copy in copies]
