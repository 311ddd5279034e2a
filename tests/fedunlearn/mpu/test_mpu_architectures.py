"""MPU's reparameterisation T on many HF architectures: logits preserved, or a clear refusal.

Every model is a tiny random one built in-process, with norm weights and biases randomised as in
a trained model (HF initialises them to 1 / 0, which hides any norm or bias T mishandles). The
copy is built with the functions the strategy publishes with (zero-sum noise with κ = 0, i.e.
noise off, then T) and must give the original logits to 1e-5 in fp32 — or the architecture is
refused, naming the module or config field, before any copy exists.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from fedunlearn.mpu import (
    ReparamDims,
    UnsupportedArchitectureError,
    apply_transform,
    draw_transforms,
    invert_delta,
    invert_fisher,
    invert_transform,
    layer_groups,
    layer_sigmas,
    noisy_copy,
    parse_target,
    plan_reparam,
    sigma_per_tensor,
    zero_sum_noise,
)

SECRET = b"architectures-test-secret"
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
#: family → (config class, extra config fields). Llama exercises tied embeddings, q/k/v/o and MLP
#: biases, llama3 RoPE scaling and head_dim ≠ hidden/heads; the sliding-window families a window
#: shorter than the test sequence.
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=8)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=True)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    "olmo2": ("Olmo2Config", dict(attention_bias=True)),
    "phi": ("PhiConfig", dict(qk_layernorm=True)),
    "phi3": ("Phi3Config", {}),
    "stablelm": ("StableLmConfig", dict(qk_layernorm=True, use_qkv_bias=True)),
    "granite": (
        "GraniteConfig",
        dict(
            attention_bias=True,
            mlp_bias=True,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
        ),
    ),
}
#: What T does per family: the RoPE map it keeps, or the fields / modules the refusal must name.
EXPECTED = {
    "llama": "rope-plane-rotations",
    "mistral": "rope-plane-rotations",
    "qwen2": "rope-plane-rotations",
    "qwen3": "rope-plane-sign-flips",
    "gemma": "rope-plane-rotations",
    "gemma2": "rope-plane-rotations",
    "gemma3_text": "rope-plane-sign-flips",
    "olmo2": "rope-plane-sign-flips",
    "granite": "rope-plane-rotations",
    "phi": ("partial_rotary_factor", "self_attn.dense", "mlp.fc1"),
    "phi3": ("self_attn.qkv_proj", "mlp.gate_up_proj"),
    "stablelm": ("partial_rotary_factor", "self_attn.q_layernorm"),
}


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny ``family`` config (eager attention, so every family computes the same way)."""
    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**BASE, **extra, **overrides})
    config._attn_implementation = "eager"
    return config


def tiny_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """A seeded random model whose norm weights and biases are not the HF constants."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _logits(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    if state is not None:
        model.load_state_dict(state)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _transforms(dims: ReparamDims, num_layers: int, copy_idx: int = 0):
    """T of one copy, with a non-identity KV-group permutation (a uniform draw over 2 KV heads is
    the identity half of the time)."""
    transforms = draw_transforms(dims, SECRET, 1, copy_idx, num_layers, permute_groups=True)
    flipped = torch.arange(dims.num_key_value_heads).flip(0)
    return {i: dataclasses.replace(tf, group_perm=flipped) for i, tf in transforms.items()}


def _published_copy(state, config, dims: ReparamDims) -> dict[str, torch.Tensor]:
    """Copy 0 as MpuStrategy builds it, with the noise off (κ = 0): T(θ + α·0)."""
    groups = layer_groups(state, config.num_hidden_layers)
    sigmas = sigma_per_tensor(groups, layer_sigmas(state, groups, kappa=0.0))
    eps0 = zero_sum_noise({n: state[n].shape for n in sigmas}, sigmas, 2, torch.Generator())
    noisy = noisy_copy(state, eps0[0], 1.0)
    return apply_transform(noisy, _transforms(dims, config.num_hidden_layers))


def _is_qk_norm(name: str) -> bool:
    return ".self_attn.q_norm." in name or ".self_attn.k_norm." in name


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_publish_preserves_logits_or_refuses(family: str) -> None:
    # Measured max |Δlogits| (fp32, logits std 0.4–0.9): 0.7e-6 .. 3.1e-6 for every supported
    # family. Before the fix qwen3 / gemma3_text / olmo2 / phi / phi3 / stablelm changed them by
    # 0.17 .. 4.6 without any error.
    config = tiny_config(family)
    expected = EXPECTED[family]
    if isinstance(expected, tuple):
        with pytest.raises(UnsupportedArchitectureError) as refused:
            plan_reparam(config)
        for name in expected:
            assert name in str(refused.value), (name, str(refused.value))
        assert refused.value.model_type == family
        return

    plan = plan_reparam(config)
    assert plan.rope_map == expected
    model = tiny_model(config)
    state = _state(model)
    ref = _logits(model)
    assert ref.std() > 0.3  # logits are not trivially small
    copy = _published_copy(state, config, plan.dims)
    for name, weight in state.items():  # T really moved every projection weight
        if parse_target(name) is not None and name.endswith(".weight"):
            assert not torch.equal(copy[name], weight), name
    err = (_logits(model, copy) - ref).abs().max().item()
    assert err <= 1e-5, (family, err)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "olmo2"])
def test_continuous_rotations_break_qk_norm_models_and_are_refused(family: str) -> None:
    # The old behaviour: continuous RoPE-plane rotations, q/k norm weights passed through. The
    # tensor path now refuses it by name; done by hand it changes the logits (negative control).
    config = tiny_config(family)
    model = tiny_model(config)
    state, ref = _state(model), _logits(model)
    plain = dataclasses.replace(plan_reparam(config).dims, qk_norm="none")
    transforms = _transforms(plain, config.num_hidden_layers)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        apply_transform(state, transforms)
    without_norms = {n: t for n, t in state.items() if not _is_qk_norm(n)}
    copy = {**state, **apply_transform(without_norms, transforms)}
    assert (_logits(model, copy) - ref).abs().max().item() > 1e-2


def test_olmo2_group_permutation_permutes_the_projection_norms() -> None:
    # Olmo2's q/k RMSNorm runs over the whole projection, one weight per channel: permuting the
    # KV groups must permute those weights too. Leaving them in place changes the logits.
    config = tiny_config("olmo2")
    plan = plan_reparam(config)
    assert plan.dims.qk_norm == "per-projection"
    model = tiny_model(config)
    state, ref = _state(model), _logits(model)
    copy = apply_transform(state, _transforms(plan.dims, config.num_hidden_layers))
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    halves = state[q_norm].reshape(2, -1)
    assert torch.equal(copy[q_norm], halves.flip(0).reshape(-1))
    norms_kept = {n: state[n] if _is_qk_norm(n) else t for n, t in copy.items()}
    assert (_logits(model, norms_kept) - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_qk_norm_transforms_invert_exactly(family: str) -> None:
    config = tiny_config(family)
    plan = plan_reparam(config)
    state = _state(tiny_model(config))
    transforms = _transforms(plan.dims, config.num_hidden_layers, copy_idx=3)
    back = invert_transform(apply_transform(state, transforms), transforms)
    for name, weight in state.items():
        assert (back[name] - weight).abs().max().item() <= 1e-6, name
    gen = torch.Generator().manual_seed(5)
    delta = {n: torch.randn(t.shape, generator=gen) for n, t in state.items()}
    copy_delta = apply_transform(delta, transforms)
    for name, value in invert_delta(copy_delta, transforms).items():
        assert (value - delta[name]).abs().max().item() <= 1e-5, name
    # under q/k norms T is a signed permutation on q_proj and the norms, so the Fisher measured
    # on the copy is |T(F)| and maps back exactly
    fisher = {n: t.abs() for n, t in delta.items() if _is_qk_norm(n) or "q_proj" in n}
    on_copy = {n: t.abs() for n, t in apply_transform(fisher, transforms).items()}
    mapped = invert_fisher(on_copy, transforms)
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert torch.allclose(mapped[q_proj], fisher[q_proj], atol=1e-6)
    for name in fisher:
        if _is_qk_norm(name):
            assert torch.equal(mapped[name], fisher[name]), name


def test_sign_flip_angles_are_exact_and_both_values_occur() -> None:
    dims = plan_reparam(tiny_config("qwen3")).dims
    angles = torch.cat([tf.rope_angles for tf in _transforms(dims, 2).values()])
    assert set(angles.unique().tolist()) == {0.0, torch.pi}
    rot = _transforms(dims, 2)[0].rope_rotations()
    assert set(rot.unique().tolist()) == {-1.0, 0.0, 1.0}
    with pytest.raises(ValueError, match="0 or π"):
        dataclasses.replace(_transforms(dims, 2)[0], rope_angles=angles[:2] + 0.5)


def test_fused_tensors_are_refused_by_name_on_the_tensor_path() -> None:
    # Even with dims given by hand (no plan), T never passes a fused projection through.
    config = tiny_config("phi3")
    state = _state(tiny_model(config))
    dims = ReparamDims(4, 2, 16, 96)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        apply_transform(state, _transforms(dims, 2))


def test_allow_list_refuses_an_unverified_family_with_llama_names() -> None:
    # Cohere has Llama's module names but pairs RoPE dims (2i, 2i+1): T breaks it, so only the
    # model_type allow-list can catch it.
    config = transformers.CohereConfig(**BASE)
    config._attn_implementation = "eager"
    with pytest.raises(UnsupportedArchitectureError, match="model_type='cohere'"):
        plan_reparam(config)
    model = tiny_model(config)
    state, ref = _state(model), _logits(model)
    copy = apply_transform(state, _transforms(ReparamDims(4, 2, 16, 96), 2))
    assert (_logits(model, copy) - ref).abs().max().item() > 1e-2


PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"rope_parameters": PARTIAL_ROPE}, "config.rope_parameters['partial_rotary_factor']=0.5"),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            "config.rope_parameters['rope_type']='proportional'",
        ),
        ({"hidden_act": "prelu"}, "config.hidden_act='prelu'"),
        (
            {"layer_types": ["full_attention", "linear_attention"]},
            "config.layer_types[1]='linear_attention'",
        ),
    ],
)
def test_config_fields_are_refused_by_name(edit: dict, named: str) -> None:
    config = tiny_config("qwen2")
    for key, value in edit.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedArchitectureError) as refused:
        plan_reparam(config)
    assert named in str(refused.value)


def test_plan_describes_maps_skips_and_warnings() -> None:
    llama = plan_reparam(tiny_config("llama"))
    assert llama.maps == (
        "mlp-channel-permutation",
        "rope-plane-rotations",
        "vo-orthogonal",
        "kv-group-permutation",
    )
    assert llama.skipped == {} and llama.warnings == ()
    described = llama.describe()
    assert described["tied_embeddings"] is True and described["activation"] == "silu"
    assert "self_attn.q_proj" in described["biases"] and "mlp.down_proj" in described["biases"]

    qwen3 = plan_reparam(tiny_config("qwen3"), permute_groups=False)
    assert qwen3.maps == ("mlp-channel-permutation", "rope-plane-sign-flips", "vo-orthogonal")
    assert set(qwen3.skipped) == {"rope-plane-rotations", "kv-group-permutation"}
    assert "Qwen3RMSNorm" in qwen3.skipped["rope-plane-rotations"]
    (warning,) = qwen3.warnings
    assert "sign flips" in warning
    assert json.loads(json.dumps(qwen3.describe()))["warnings"] == [warning]
