"""One-pass publishing of MPU copies and mapping LoRA factors back (docs/algorithms.md, "Zero-sum
noise", "Function-preserving reparameterisation", "Client side, mapping back, harmonic
aggregation")."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fedunlearn.mpu import (
    alphas,
    apply_transform,
    draw_transforms,
    invert_delta,
    layer_groups,
    layer_sigmas,
    map_back,
    noisy_copy,
    perturbed_copies,
    sigma_per_tensor,
    zero_sum_coefficients,
    zero_sum_draw,
    zero_sum_noise,
)
from fedunlearn.upload_codec import (
    DecodedTensors,
    LowRankDelta,
    encode_fisher,
    encode_task_vector,
)

SECRET = b"publish-test-secret"


def _model() -> tuple[dict[str, torch.Tensor], LlamaConfig]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, config


def _transforms(config, copy: int):
    transforms = draw_transforms(config, SECRET, 1, copy, 2, permute_groups=True)
    flipped = torch.arange(config.num_key_value_heads).flip(0)  # a non-trivial π
    return {layer: dataclasses.replace(tf, group_perm=flipped) for layer, tf in transforms.items()}


@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("reparameterise", [True, False])
def test_one_pass_copies_equal_the_step_by_step_copies(m: int, reparameterise: bool) -> None:
    """T_k(θ + α_k ε⁰_k) built tensor by tensor equals noisy_copy + apply_transform of the same
    draws (zero_sum_noise from the same generator state) up to float32 rounding."""
    state, config = _model()
    groups = layer_groups(state, 2)
    sigmas = sigma_per_tensor(groups, layer_sigmas(state, groups, 0.05))
    scales = alphas(m)
    transforms = [_transforms(config, k) for k in range(m)] if reparameterise else None
    copies = perturbed_copies(state, sigmas, scales, torch.Generator().manual_seed(3), transforms)
    shapes = {n: state[n].shape for n in sigmas}
    eps0 = zero_sum_noise(shapes, sigmas, m, torch.Generator().manual_seed(3))
    for k in range(m):
        expected = noisy_copy(state, eps0[k], scales[k])
        if transforms is not None:
            expected = apply_transform(expected, transforms[k])
        assert list(copies[k]) == list(state)  # the state's order
        for name, value in expected.items():
            assert copies[k][name].dtype == value.dtype
            assert torch.allclose(copies[k][name], value, rtol=0, atol=1e-6), (k, name)
            if name not in sigmas and not reparameterise:
                assert copies[k][name] is state[name]  # untouched tensors are shared
    assert not torch.equal(
        copies[0]["model.layers.0.mlp.up_proj.weight"],
        copies[1]["model.layers.0.mlp.up_proj.weight"],
    )
    with pytest.raises(ValueError, match="3 transforms for 2 copies"):
        perturbed_copies(state, sigmas, [1.0, 2.0], torch.Generator(), [transforms or {}] * 3)


@pytest.mark.parametrize("m", [2, 3, 5])
def test_zero_sum_coefficients_give_the_centred_law(m: int) -> None:
    """B·u with u ~ N(0, I_{m−1}) has the covariance of √(m/(m−1))·(z − z̄), z ~ N(0, σ² I_m):
    B Bᵀ = σ²·m/(m−1)·(I − 11ᵀ/m); and every column sums to 0 (zero-sum for any u)."""
    sigma = 0.3
    b = zero_sum_coefficients(m, sigma)
    assert b.shape == (m, m - 1)
    centring = torch.eye(m, dtype=torch.float64) - 1.0 / m
    assert torch.allclose(b @ b.T, sigma**2 * m / (m - 1) * centring, atol=1e-15)
    assert b.sum(dim=0).abs().max() < 1e-15
    draws = zero_sum_draw((4000,), sigma, m, torch.Generator().manual_seed(0))
    total = sum(d.double() for d in draws)
    assert total.abs().max() == 0 if m == 2 else total.abs().max() < 1e-6 * sigma
    assert all(math.isclose(d.std().item(), sigma, rel_tol=0.05) for d in draws)


def _factor_upload(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    deltas = {
        name: LowRankDelta(
            torch.randn(w.shape[0], rank, generator=gen),
            torch.randn(rank, w.shape[1], generator=gen),
            2.0,
        )
        for name, w in state.items()
        if name.endswith("_proj.weight")
    }
    return encode_task_vector(deltas, "factors")


def test_factors_map_back_like_their_dense_product() -> None:
    """T⁻¹ moved onto the LoRA factors equals T⁻¹ of the dense s·B@A (float tolerance), for
    every projection (rows: q/k/v/gate/up; columns: o/down); dense parts map as dense."""
    state, config = _model()
    transforms = _transforms(config, 1)
    parts = _factor_upload(state, rank=4)
    dense = dict(DecodedTensors.from_parts(parts))
    assert len(dense) == 14  # 7 projections × 2 layers
    mapped = map_back(parts, transforms)
    assert set(mapped) == set(parts)  # still factors, same names
    decoded = DecodedTensors.from_parts(mapped)
    expected = invert_delta(dense, transforms)
    for name, value in expected.items():
        assert decoded.form(name) == "factors"
        scale = value.abs().max().item()
        assert (decoded[name] - value).abs().max().item() <= 1e-5 * scale, name
        assert not torch.allclose(decoded[name], dense[name])  # T⁻¹ did move them
    mixed = {**parts, "model.layers.0.mlp.down_proj.bias": torch.ones(64)}
    name = "model.layers.1.self_attn.v_proj.weight"
    as_dense = {k: v for k, v in parts.items() if not k.startswith(name)} | {name: dense[name]}
    out = map_back(as_dense, transforms)
    assert torch.equal(out[name], expected[name])  # exactly invert_delta's dense result
    assert torch.equal(
        map_back(mixed, transforms)["model.layers.0.mlp.down_proj.bias"],
        mixed["model.layers.0.mlp.down_proj.bias"],
    )  # T never touches a down_proj bias (hidden space)


def test_compact_fisher_forms_are_refused() -> None:
    state, config = _model()
    name = "model.layers.0.self_attn.q_proj.weight"
    fisher = {name: state[name].square()}
    for form in ("bf16", "topk"):
        with pytest.raises(ValueError, match=f"a {form} upload is a Fisher"):
            map_back(encode_fisher(fisher, form, 0.5), _transforms(config, 0))
