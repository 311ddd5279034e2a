"""MPU's published copies, built one tensor at a time (docs/algorithms.md, "Zero-sum noise",
"Function-preserving reparameterisation").

θ_pub,k = T_k(θ + α_k ε⁰_k) for k = 1..m. :func:`perturbed_copies` gives what
``apply_transform(noisy_copy(θ, zero_sum_noise(...)[k], α_k), T_k)`` gives (the same normals
from the same generator; equal up to float32 rounding) in one walk over the weights: for each
tensor it draws the m − 1 normals u_j, forms every copy's θ + Σ_j α_k B_kj u_j
(:func:`.noise.zero_sum_coefficients`; for m = 2 one multiply-add per entry and copy), maps it
with T_k and drops the normals, so no set of ε⁰_k is ever held in full.
:func:`published_tensors` yields the m copies of one tensor at a time (the server turns each
into the arrays it sends before the next is drawn, so no copy is held in full either);
:func:`noised_tensors` does the same for the ``noised`` baseline's one copy θ + ε.

With ``shared_sigmas`` every copy also carries one noise η (σ per tensor, drawn after the
normals of that tensor) that the m copies have in common: θ_pub,k = T_k(θ + η + α_k ε⁰_k). The
harmonic aggregate cancels ε⁰ but not η, so a client that aligns its copies and averages them
away is left with θ + η instead of θ (see the MPU threat model in the docs).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from .noise import _compute_dtype, _sigmas, perturb, zero_sum_coefficients
from .reparam import LayerTransform, transform_tensor

__all__ = ["noised_tensors", "perturbed_copies", "published_tensors"]


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
    copies: list[dict[str, Tensor]] = [{} for _ in scales]
    for name, _, tensors in published_tensors(
        state, sigmas, scales, generator, transforms, shared_sigmas=shared_sigmas
    ):
        for copy, tensor in zip(copies, tensors, strict=True):
            copy[name] = tensor
    return [{name: copy[name] for name in state} for copy in copies]


def published_tensors(
    state: Mapping[str, Tensor],
    sigmas: Mapping[str, float],
    scales: Sequence[float],
    generator: torch.Generator,
    transforms: Sequence[Mapping[int, LayerTransform]] | None = None,
    *,
    shared_sigmas: Mapping[str, float] | None = None,
) -> Iterator[tuple[str, Tensor, list[Tensor]]]:
    """:func:`perturbed_copies` one tensor at a time: ``(name, θ's tensor, [its m copies])``,
    the perturbed tensors in sorted-name order (the order the noise is drawn in), then the
    others in ``state``'s order. ``state`` is read once per tensor (it may decode on access);
    a copy that is θ's tensor itself (neither perturbed nor transformed) is that object."""
    m = len(scales)
    if transforms is not None and len(transforms) != m:
        raise ValueError(f"{len(transforms)} transforms for {m} copies")
    missing = [name for name in sigmas if name not in state]
    if missing:
        raise KeyError(f"noise given for {missing[0]!r}, which is not in the state")
    names = dict.fromkeys(sigmas, ())  # _sigmas needs the names only, not the tensors
    sig = _sigmas(names, sigmas)
    shared = _sigmas(names, shared_sigmas or 0.0)

    def mapped(name: str, tensor: Tensor, k: int) -> Tensor:
        return tensor if transforms is None else transform_tensor(name, tensor, transforms[k])

    with torch.no_grad():
        for name in sorted(sig):
            weight = state[name].detach()
            dtype = _compute_dtype(weight.dtype)
            normals = torch.randn((m - 1, *weight.shape), generator=generator).to(dtype)
            base = weight.to(dtype)
            if shared[name] > 0:
                eta = torch.randn(weight.shape, generator=generator).to(dtype)
                base = torch.add(base, eta, alpha=shared[name])
            tensors = []
            for k, row in enumerate(zero_sum_coefficients(m, sig[name]).tolist()):
                noisy = base
                for u, coefficient in zip(normals, row, strict=True):
                    noisy = torch.add(noisy, u, alpha=scales[k] * coefficient)
                tensors.append(mapped(name, noisy.to(weight.dtype), k))
            del normals, base
            yield name, weight, tensors
        for name in state:
            if name not in sig:
                weight = state[name]
                yield name, weight, [mapped(name, weight, k) for k in range(m)]


def noised_tensors(
    state: Mapping[str, Tensor], sigmas: Mapping[str, float], generator: torch.Generator
) -> Iterator[tuple[str, Tensor, list[Tensor]]]:
    """The ``noised`` baseline's one copy θ + ε, ε ~ N(0, σ²) per tensor named in ``sigmas``
    (drawn in ``sigmas``' order), as :func:`published_tensors` yields copies: ``(name, θ's
    tensor, [θ + ε])``, then the tensors without noise (the same objects) in ``state``'s order.
    """
    with torch.no_grad():
        for name, sigma in sigmas.items():
            weight = state[name]
            noise = torch.randn(weight.shape, generator=generator).mul_(sigma)
            yield name, weight, [perturb(name, weight, noise, 1.0)]
        for name in state:
            if name not in sigmas:
                weight = state[name]
                yield name, weight, [weight]
