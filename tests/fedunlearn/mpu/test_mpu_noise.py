"""MPU zero-sum layer noise (docs/algorithms.md, "Zero-sum noise")."""

from __future__ import annotations

import math

import pytest
import torch

from fedunlearn.mpu import (
    alphas,
    layer_groups,
    layer_sigmas,
    noisy_copy,
    sigma_per_tensor,
    zero_sum_noise,
)

KEYS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.q_proj.bias",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.10.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (100, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.mlp.up_proj.weight": (96, 64),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.1.self_attn.q_proj.weight": (64, 64),
        "model.layers.1.mlp.down_proj.weight": (64, 96),
        "model.norm.weight": (64,),
        "lm_head.weight": (100, 64),
    }
    scales = {"model.layers.0": 0.5, "model.layers.1": 3.0}
    state = {}
    for name, shape in shapes.items():
        scale = next((s for p, s in scales.items() if name.startswith(p)), 1.0)
        state[name] = scale * torch.randn(shape, generator=gen)
    return state


def test_layer_groups_only_decoder_layers() -> None:
    with pytest.raises(ValueError, match="no weights"):
        layer_groups(KEYS, 11)  # layers 2..9 have no weights
    with pytest.raises(ValueError, match="model.layers.10"):
        layer_groups(KEYS, 2)
    groups = layer_groups(KEYS[:7] + KEYS[8:], 2)
    assert groups == {0: KEYS[1:4], 1: KEYS[4:7]}
    flat = [n for names in groups.values() for n in names]
    assert not any(n in flat for n in ("model.embed_tokens.weight", "model.norm.weight"))
    assert "lm_head.weight" not in flat
    peft = layer_groups(["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"], 1)
    assert peft == {0: ["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]}


def test_layer_sigmas_rms_and_reference() -> None:
    state = _state()
    groups = layer_groups(state, 2)
    sig = layer_sigmas(state, groups, 0.1)
    for layer, names in groups.items():
        v = torch.cat([state[n].double().flatten() for n in names])
        assert sig[layer] == pytest.approx(0.1 * v.square().mean().sqrt().item(), rel=1e-12)
    reference = {k: 0.9 * v for k, v in state.items()}
    sig_tv = layer_sigmas(state, groups, 0.1, reference=reference)
    for layer in groups:
        assert sig_tv[layer] == pytest.approx(0.1 * sig[layer], rel=1e-5)


@pytest.mark.parametrize("m", [2, 3, 5])
def test_zero_sum_and_std(m: int) -> None:
    state = _state()
    groups = layer_groups(state, 2)
    sig = layer_sigmas(state, groups, 0.05)
    per_tensor = sigma_per_tensor(groups, sig)
    shapes = {n: state[n].shape for n in per_tensor}
    gen = torch.Generator().manual_seed(1234)
    eps0 = zero_sum_noise(shapes, per_tensor, m, gen)
    assert len(eps0) == m
    for name in shapes:
        total = sum(e[name].double() for e in eps0)
        assert total.abs().max().item() < 1e-6 * max(sig.values()), name
        assert eps0[0][name].dtype == torch.float32
    for layer, names in groups.items():
        for k in range(m):
            v = torch.cat([eps0[k][n].double().flatten() for n in names])
            # ~ 4.2k coordinates → the empirical std is within a few % of σ_ℓ
            assert v.std().item() == pytest.approx(sig[layer], rel=0.08)
    # deterministic given the generator seed
    again = zero_sum_noise(shapes, per_tensor, m, torch.Generator().manual_seed(1234))
    assert all(torch.equal(again[k][n], eps0[k][n]) for k in range(m) for n in shapes)


def test_noise_leaves_embeddings_norm_head_untouched() -> None:
    state = _state()
    groups = layer_groups(state, 2)
    per_tensor = sigma_per_tensor(groups, layer_sigmas(state, groups, 0.1))
    eps0 = zero_sum_noise(
        {n: state[n].shape for n in per_tensor}, per_tensor, 2, torch.Generator().manual_seed(0)
    )
    noisy = noisy_copy(state, eps0[0], 1.5)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(noisy[name], state[name])
    for name in per_tensor:
        assert not torch.equal(noisy[name], state[name])
        assert torch.allclose(noisy[name], state[name] + 1.5 * eps0[0][name], atol=1e-6)


def test_zero_sum_needs_two_copies() -> None:
    with pytest.raises(ValueError, match="m >= 2"):
        zero_sum_noise({"w": (3,)}, 1.0, 1, torch.Generator())
    with pytest.raises(KeyError):
        zero_sum_noise({"w": (3,)}, {"other": 1.0}, 2, torch.Generator())


def test_alphas() -> None:
    assert alphas(1) == [1.0]
    assert alphas(2) == [1.0, 2.0]
    a = alphas(5)
    assert len(set(a)) == 5 and a[0] == 1.0 and a[-1] == 2.0
    assert all(math.isclose(a[i + 1] - a[i], 0.25) for i in range(4))
    with pytest.raises(ValueError):
        alphas(3, 2.0, 2.0)
    with pytest.raises(ValueError):
        alphas(0)
