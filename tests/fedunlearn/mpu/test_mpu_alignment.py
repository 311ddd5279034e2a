"""The alignment attack on MPU's copies, and the shared-noise option of publishing.

A tiny random Llama (norm weights randomised as in a trained model) is published with the
functions the MPU strategy publishes with; a client holding the copies aligns them with
:mod:`fedunlearn.mpu.alignment`. The numbers asserted are what the threat model in the docs
rests on: without shared noise the aligned combination is far closer to θ than one copy; with
it, the client is left with θ + η.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.mpu import (
    alphas,
    draw_transforms,
    invert_transform,
    layer_groups,
    layer_sigmas,
    perturbed_copies,
    plan_reparam,
    sigma_per_tensor,
    zero_sum_draw,
)
from fedunlearn.mpu.alignment import (
    align_copy,
    harmonic_combination,
    min_norm_combination,
    ov_combination,
)

SECRET = b"alignment-test-secret"


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = tiny_llama_config(128, hidden_size=64, num_hidden_layers=2, intermediate_size=96)
    model = new_tiny_llama(config, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm weights as in a trained model, not HF's 1.0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    return model


def _publish(model, kappa: float, m: int, *, shared: bool = False, permute: bool = True):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers = model.config.num_hidden_layers
    groups = layer_groups(state.keys(), layers)
    sigmas = sigma_per_tensor(groups, layer_sigmas(state, groups, kappa))
    dims = plan_reparam(model.config, permute_groups=permute).dims
    transforms = [
        draw_transforms(dims, SECRET, 1, k, layers, permute_groups=permute) for k in range(m)
    ]
    gen = torch.Generator().manual_seed(7)
    copies = perturbed_copies(
        state, sigmas, alphas(m), gen, transforms, shared_sigmas=sigmas if shared else None
    )
    return state, copies, transforms, dims


def _logits(model, state) -> torch.Tensor:
    probe = LlamaForCausalLM(model.config).eval()
    probe.load_state_dict(state)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        return probe(input_ids=ids).logits


def _attack(model, copies, dims):
    layers = model.config.num_hidden_layers
    aligned = [copies[0]] + [align_copy(c, copies[0], dims, layers) for c in copies[1:]]
    return harmonic_combination(aligned, alphas(len(copies))), min_norm_combination(aligned, layers)


def test_noise_free_copies_align_exactly_to_the_anchor(model) -> None:
    """κ = 0: every map of T (MLP permutation, KV-group permutation, v/o basis, RoPE planes)
    is recovered, so the aligned copy equals copy 1 tensor by tensor."""
    _, copies, _, dims = _publish(model, 0.0, 2)
    aligned = align_copy(copies[1], copies[0], dims, model.config.num_hidden_layers)
    assert any(not torch.equal(copies[1][n], copies[0][n]) for n in copies[0])
    for name, tensor in copies[0].items():
        torch.testing.assert_close(aligned[name], tensor, atol=1e-5, rtol=0)


@pytest.mark.parametrize("m", [2, 3])
def test_aligned_copies_cancel_the_zero_sum_noise(model, m: int) -> None:
    """The harmonic mean of aligned copies is over 10× closer to θ's logits than one copy and
    is T_1(θ) in weights up to the alignment's error."""
    state, copies, transforms, dims = _publish(model, 0.01, m)
    reference = _logits(model, state)
    one = float((_logits(model, copies[0]) - reference).abs().max())
    harmonic, _ = _attack(model, copies, dims)
    gap_harmonic = float((_logits(model, harmonic) - reference).abs().max())
    assert one > 10 * gap_harmonic
    back = invert_transform(harmonic, transforms[0])
    noise = sum(
        float((copies_back - state[n]).norm())
        for n, copies_back in invert_transform(copies[0], transforms[0]).items()
        if ".layers." in n
    )
    error = sum(float((back[n] - state[n]).norm()) for n in state if ".layers." in n)
    assert error < noise / 10


def test_shared_noise_is_left_in_the_aligned_estimate(model) -> None:
    """With η shared by the copies the aligned harmonic mean is θ + η: its logits stay at
    least half as far from θ's as one copy's, and T_1⁻¹ of it is θ + η exactly where the
    alignment is exact (ε⁰ cancelled, η kept)."""
    state, copies, transforms, dims = _publish(model, 0.01, 2, shared=True)
    reference = _logits(model, state)
    one = float((_logits(model, copies[0]) - reference).abs().max())
    harmonic, _ = _attack(model, copies, dims)
    gap = float((_logits(model, harmonic) - reference).abs().max())
    assert gap > 0.5 * one
    # the server's own view: T_k⁻¹ of each copy, harmonically combined, is θ + η (η ≠ 0)
    back = [invert_transform(c, t) for c, t in zip(copies, transforms, strict=True)]
    combined = harmonic_combination(back, alphas(2))
    name = "model.layers.0.mlp.up_proj.weight"
    eta = combined[name] - state[name]
    sigma = sigma_per_tensor(
        layer_groups(state, 2), layer_sigmas(state, layer_groups(state, 2), 0.01)
    )[name]
    assert 0.8 * sigma < float(eta.std()) < 1.2 * sigma
    # and the ε⁰ part cancelled: copy 1 alone is θ + η + α_1 ε⁰_1, farther away
    assert float((back[0][name] - state[name]).std()) > 1.3 * float(eta.std())


def test_without_shared_noise_publishing_is_unchanged(model) -> None:
    """shared_sigmas=None and all-zero shared σ publish bit-identical copies."""
    state, copies, transforms, _ = _publish(model, 0.01, 2)
    layers = model.config.num_hidden_layers
    groups = layer_groups(state.keys(), layers)
    sigmas = sigma_per_tensor(groups, layer_sigmas(state, groups, 0.01))
    zero = {n: 0.0 for n in sigmas}
    again = perturbed_copies(
        state, sigmas, alphas(2), torch.Generator().manual_seed(7), transforms, shared_sigmas=zero
    )
    for a, b in zip(copies, again, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("m", [2, 3])
def test_min_norm_combination_needs_no_scales(m: int) -> None:
    """Copies θ + α_k ε⁰_k of one layer of d weights, α unknown to the combiner: the shortest
    affine combination leaves noise of about ⟨θ, ε⟩/‖ε‖² ≈ 1/(κ√d) of one ε — here
    1/(0.01·√250000) = 0.2 — instead of α_1 = 1 for the first copy."""
    gen = torch.Generator().manual_seed(3)
    d, kappa = 250_000, 0.01
    theta = torch.randn(d, generator=gen, dtype=torch.float64)
    eps = zero_sum_draw((d,), kappa, m, gen, dtype=torch.float64)
    copies = [
        {"model.layers.0.w": theta + a * e, "lm_head.weight": theta[:5]}
        for a, e in zip(alphas(m), eps, strict=True)
    ]
    combined = min_norm_combination(copies, 1)
    residual = float((combined["model.layers.0.w"] - theta).norm())
    one = float((copies[0]["model.layers.0.w"] - theta).norm())
    assert residual < 0.5 * one
    assert residual / float(eps[0].norm()) < 3 / (kappa * d**0.5)
    assert torch.equal(combined["lm_head.weight"], theta[:5])


def test_general_invertible_vo_maps_are_undone_by_averaging_the_ov_products(model) -> None:
    """Copies with an extra invertible (not orthogonal) v/o map per group: matching the groups
    and averaging the OV products W_o,h W_v,g (then factoring them again) still lands over 10×
    closer to θ's logits than one copy."""
    from simulations.mpu_attack_defenses import InvertibleVO

    state, copies, _, dims = _publish(model, 0.01, 2)
    layers = model.config.num_hidden_layers
    copies = [InvertibleVO(dims, layers, seed).forward(c) for seed, c in enumerate(copies)]
    reference = _logits(model, state)
    one = float((_logits(model, copies[0]) - reference).abs().max())
    aligned = [copies[0], align_copy(copies[1], copies[0], dims, layers, general_vo=True)]
    combined = ov_combination(
        harmonic_combination(aligned, alphas(2)), aligned, alphas(2), dims, layers
    )
    gap = float((_logits(model, combined) - reference).abs().max())
    assert one > 10 * gap
