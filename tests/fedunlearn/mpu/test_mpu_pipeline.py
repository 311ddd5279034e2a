"""MPU end to end on tensors: publish copies, invert updates, aggregate harmonically
(docs/algorithms.md, "MPU")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fedunlearn.mpu import (
    HarmonicAggregator,
    alphas,
    apply_transform,
    derive_seed,
    draw_transforms,
    invert_delta,
    invert_transform,
    layer_groups,
    layer_sigmas,
    noisy_copy,
    plain_mean,
    sigma_per_tensor,
    zero_sum_noise,
)

SECRET = b"pipeline-test-secret"
ETA = 0.1


def _state(family: str) -> tuple[dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    common = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, config


def _publish(state, config, m: int, kappa: float, round_idx: int = 0):
    """Server pre-process: (θ_pub,k, T_k, α_k) for k = 1..m."""
    groups = layer_groups(state, config.num_hidden_layers)
    sigma = sigma_per_tensor(groups, layer_sigmas(state, groups, kappa))
    gen = torch.Generator().manual_seed(derive_seed(SECRET, round_idx, "noise"))
    eps0 = zero_sum_noise({n: state[n].shape for n in sigma}, sigma, m, gen)
    scales = alphas(m)
    copies = []
    for k in range(m):
        transforms = draw_transforms(
            config, SECRET, round_idx, k, config.num_hidden_layers, permute_groups=True
        )
        # make the KV-group permutation non-trivial (2 KV heads: a uniform draw is often identity)
        for layer, tf in transforms.items():
            if k % 2 == 0:
                flipped = torch.arange(config.num_key_value_heads).flip(0)
                transforms[layer] = dataclasses.replace(tf, group_perm=flipped)
        published = apply_transform(noisy_copy(state, eps0[k], scales[k]), transforms)
        copies.append((published, transforms, scales[k]))
    return copies, groups


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("m", [2, 3])
def test_first_order_cancellation(family: str, m: int) -> None:
    state, config = _state(family)
    copies, _ = _publish(state, config, m, kappa=0.1)

    # Client update f(θ') = −η·θ', computed in the copy's own coordinates (the client knows
    # nothing of T_k); it commutes with every permutation/orthogonal map of T_k, so
    # T_k⁻¹(f(θ_pub,k)) = −η(θ + α_k ε⁰_k) and the harmonic weights cancel Σ_k ε⁰_k = 0.
    agg = HarmonicAggregator()
    inverted = []
    for published, transforms, alpha in copies:
        delta = {n: -ETA * w for n, w in published.items()}
        delta_hat = invert_delta(delta, transforms)
        agg.add(delta_hat, alpha)
        inverted.append(delta_hat)
    assert agg.count == m and agg.s0 == pytest.approx(sum(1 / a for a in alphas(m)))
    harmonic = agg.result()
    target = {n: -ETA * w for n, w in state.items()}  # the noise-free update f(θ)

    err_harmonic = _max_diff(harmonic, target)
    err_plain = _max_diff(plain_mean(inverted), target)
    assert err_harmonic <= 1e-6, err_harmonic
    assert err_plain >= 1e-4, err_plain  # the plain mean keeps Σ_k α_k ε⁰_k / m ≠ 0
    assert err_plain > 100 * err_harmonic


def test_cancellation_for_affine_update_in_original_coordinates() -> None:
    # An affine but NOT T-equivariant step g(θ) = A∘θ + b (element-wise A, offset b), taken by
    # an idealised client that is equivariant by construction: in copy coordinates it returns
    # Δ_k = T_k(g(T_k⁻¹ θ_pub,k)) − θ_pub,k. Back in original coordinates Δ̂_k = g(θ_k) − θ_k with
    # θ_k = θ + α_k ε⁰_k, which is affine in ε⁰_k, so the harmonic mean is exactly g(θ) − θ.
    state, config = _state("llama")
    copies, _ = _publish(state, config, 3, kappa=0.2)
    gen = torch.Generator().manual_seed(9)
    A = {n: 1 + 0.1 * torch.randn(w.shape, generator=gen) for n, w in state.items()}
    b = {n: 0.01 * torch.randn(w.shape, generator=gen) for n, w in state.items()}

    agg, inverted = HarmonicAggregator(), []
    for published, transforms, alpha in copies:
        theta_k = invert_transform(published, transforms)
        after = apply_transform({n: A[n] * w + b[n] for n, w in theta_k.items()}, transforms)
        delta = {n: after[n] - published[n] for n in published}
        delta_hat = invert_delta(delta, transforms)
        agg.add(delta_hat, alpha)
        inverted.append(delta_hat)
    target = {n: (A[n] - 1) * w + b[n] for n, w in state.items()}
    assert _max_diff(agg.result(), target) <= 1e-5
    assert _max_diff(plain_mean(inverted), target) >= 1e-4


def test_published_copies_hide_every_decoder_tensor() -> None:
    state, config = _state("qwen2")
    copies, groups = _publish(state, config, 2, kappa=0.01)
    perturbed = {n for names in groups.values() for n in names}
    # embeddings, final norm and LM head are not perturbed by design (docs/algorithms.md,
    # "Zero-sum noise"): they are published as they are and may equal the server's tensors.
    unperturbed = set(state) - perturbed
    assert unperturbed == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for published, _, _ in copies:
        for name in perturbed:
            assert not torch.equal(published[name], state[name]), name
        for name in unperturbed:
            assert torch.equal(published[name], state[name]), name
    # two copies never publish the same tensor either
    for name in perturbed:
        assert not torch.equal(copies[0][0][name], copies[1][0][name]), name


def test_aggregator_errors_name_the_tensor() -> None:
    agg = HarmonicAggregator()
    with pytest.raises(RuntimeError):
        agg.result()
    agg.add({"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4)}, 1.0)
    with pytest.raises(ValueError, match="b.weight"):
        agg.add({"a.weight": torch.ones(2, 3), "b.weight": torch.ones(5)}, 2.0)
    with pytest.raises(KeyError, match="b.weight"):
        agg.add({"a.weight": torch.ones(2, 3)}, 2.0)
    with pytest.raises(KeyError, match="c.weight"):
        agg.add(
            {"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4), "c.weight": torch.ones(1)},
            2.0,
        )
    with pytest.raises(ValueError, match="alpha"):
        agg.add({"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4)}, 0.0)
    assert agg.count == 1  # failed adds leave the sums untouched
    agg.add({"a.weight": 4 * torch.ones(2, 3), "b.weight": torch.zeros(4)}, 2.0)
    out = agg.result()
    # (1·1 + ½·4) / (1 + ½) = 2 ; (1·1 + ½·0) / 1.5 = 2/3
    assert torch.allclose(out["a.weight"], torch.full((2, 3), 2.0))
    assert torch.allclose(out["b.weight"], torch.full((4,), 2 / 3))
    assert out["a.weight"].dtype == torch.float32
