"""Function preservation and invertibility of the MPU reparameterisation T (docs/algorithms.md,
"Function-preserving reparameterisation")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fedunlearn.mpu import (
    LayerTransform,
    ReparamDims,
    apply_transform,
    derive_seed,
    draw_transform,
    draw_transforms,
    invert_delta,
    invert_lora,
    invert_transform,
    parse_target,
)

SECRET = "test-secret-do-not-print"
COMMON = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def _model(family: str, attention_bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(**COMMON, attention_bias=attention_bias, mlp_bias=attention_bias)
    else:
        config = Qwen2Config(**COMMON)  # q/k/v biases
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises biases and norm scales to constants: randomise them
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _transforms(config, round_idx: int, copy_idx: int, permute_groups: bool):
    """T_k for every layer; with ``permute_groups`` the KV-group permutation is forced to be a
    non-identity one (with 2 KV heads a uniform draw is the identity half of the time)."""
    transforms = draw_transforms(
        config, SECRET, round_idx, copy_idx, config.num_hidden_layers, permute_groups=permute_groups
    )
    if permute_groups:
        for layer, tf in transforms.items():
            flipped = torch.arange(config.num_key_value_heads).flip(0)
            transforms[layer] = dataclasses.replace(tf, group_perm=flipped)
    return transforms


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _random_like(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


@pytest.mark.parametrize(("family", "bias"), [("llama", False), ("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("permute_groups", [False, True])
def test_function_preserved(family: str, bias: bool, permute_groups: bool) -> None:
    # Measured max |Δlogits| (fp32, logits std ≈ 0.8): 2.0e-6 .. 2.8e-6 for every case here
    # (llama, llama+biases, qwen2; with and without group permutation).
    model = _model(family, bias)
    config = model.config
    state = {k: v.clone() for k, v in model.state_dict().items()}
    transforms = _transforms(config, 1, 0, permute_groups)
    new_state = apply_transform(state, transforms)
    # T really moved every projection weight
    for name, w in state.items():
        if parse_target(name) is not None and name.endswith(".weight"):
            assert not torch.allclose(new_state[name], w), name

    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    assert ref.std() > 0.3  # logits are not trivially small
    model.load_state_dict(new_state)
    err = (_logits(model, ids) - ref).abs().max().item()
    assert err <= 1e-4, err
    # the input state was not mutated
    for name, w in model.state_dict().items():
        assert torch.equal(new_state[name], w)


def test_adjacent_pairing_breaks_function() -> None:
    # Negative control: rotating adjacent pairs (2i, 2i+1) on q/k does not commute with HF's
    # rotate_half RoPE, so logits change. (The correct plane pairing keeps them; see above.)
    model = _model("llama")
    config = model.config
    d_h = config.hidden_size // config.num_attention_heads
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rot = torch.eye(d_h, dtype=torch.float64)
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    for i in range(0, d_h, 2):
        rot[i, i], rot[i, i + 1], rot[i + 1, i], rot[i + 1, i + 1] = c, -s, s, c
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ):
        w = state[name].double().reshape(-1, d_h, config.hidden_size)
        state[name] = torch.einsum("ab,hbi->hai", rot, w).reshape(-1, config.hidden_size).float()
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    model.load_state_dict(state)
    assert (_logits(model, ids) - ref).abs().max().item() > 1e-3


def test_rope_planes_pair_i_with_i_plus_half() -> None:
    dims = ReparamDims(4, 2, 16, 32)
    rot = draw_transform(dims, 3, permute_groups=False).rope_rotations()
    half = 8
    for g in range(2):
        r = rot[g]
        assert torch.allclose(r @ r.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
        mask = torch.zeros(16, 16, dtype=torch.bool)
        for i in range(half):
            for a in (i, i + half):
                for b in (i, i + half):
                    mask[a, b] = True
        assert torch.all(r[~mask] == 0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("permute_groups", [False, True])
def test_inverse_and_delta(family: str, permute_groups: bool) -> None:
    model = _model(family, True)
    config = model.config
    state = dict(model.state_dict())
    transforms = _transforms(config, 2, 1, permute_groups)
    back = invert_transform(apply_transform(state, transforms), transforms)
    for name, w in state.items():
        assert (back[name] - w).abs().max().item() <= 1e-5, name

    delta = _random_like(state, 5)
    plus = {k: state[k] + delta[k] for k in state}
    t_plus, t_base = apply_transform(plus, transforms), apply_transform(state, transforms)
    copy_delta = {k: t_plus[k] - t_base[k] for k in state}
    recovered = invert_delta(copy_delta, transforms)
    for name in state:
        assert (recovered[name] - delta[name]).abs().max().item() <= 1e-5, name
    # and the copy-coordinate delta equals T(Δ) (linearity)
    t_delta = apply_transform(delta, transforms)
    for name in state:
        assert (t_delta[name] - copy_delta[name]).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("permute_groups", [False, True])
def test_invert_lora_matches_dense(permute_groups: bool) -> None:
    model = _model("llama")
    config = model.config
    state = dict(model.state_dict())
    transforms = _transforms(config, 0, 2, permute_groups)
    gen = torch.Generator().manual_seed(7)
    rank, scale = 4, 2.0
    checked = 0
    for name, w in state.items():
        if parse_target(name) is None or not name.endswith(".weight"):
            continue
        out_dim, in_dim = w.shape
        A = torch.randn(rank, in_dim, generator=gen)
        B = torch.randn(out_dim, rank, generator=gen)
        module = name.removesuffix(".weight")
        peft_name = f"base_model.model.{module}.lora_A.default.weight"
        A2, B2 = invert_lora(A, B, peft_name, transforms)
        dense = invert_delta({name: scale * B @ A}, transforms)[name]
        assert (scale * B2 @ A2 - dense).abs().max().item() <= 1e-4, name
        checked += 1
    assert checked == 14  # 7 projections × 2 layers
    # modules outside the decoder projections pass through
    A, B = torch.ones(2, 3), torch.ones(5, 2)
    A_out, B_out = invert_lora(A, B, "lm_head", transforms)
    assert A_out is A and B_out is B


def test_draw_is_deterministic_and_secret_free_repr() -> None:
    dims = ReparamDims.from_config(_model("qwen2").config)
    seed = derive_seed(SECRET, 0, 0, 0, "reparam")
    a = draw_transform(dims, seed, permute_groups=True)
    b = draw_transform(dims, seed, permute_groups=True)
    c = draw_transform(dims, seed + 1, permute_groups=True)
    assert torch.equal(a.vo_orth, b.vo_orth) and torch.equal(a.mlp_perm, b.mlp_perm)
    assert not torch.equal(a.vo_orth, c.vo_orth)
    eye = torch.eye(dims.head_dim, dtype=torch.float64)
    assert torch.allclose(a.vo_orth @ a.vo_orth.transpose(-1, -2), eye.expand_as(a.vo_orth))
    assert SECRET not in repr(a) and "tensor" not in repr(a)
    assert isinstance(a, LayerTransform)


def test_shape_mismatch_names_tensor() -> None:
    transforms = {0: draw_transform(ReparamDims(4, 2, 16, 32), 0, permute_groups=False)}
    bad = {"model.layers.0.mlp.up_proj.weight": torch.zeros(31, 64)}
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        apply_transform(bad, transforms)
