"""MpuStrategy refuses architectures its reparameterisation would break, before any copy exists,
and publishes function-preserving copies (with a recorded warning) for q/k-norm models."""

import json

import pytest
import torch
import transformers
from flwr.app import ArrayRecord, ConfigRecord
from transformers import AutoModelForCausalLM

from fedunlearn.mpu import UnsupportedArchitectureError
from fedunlearn.scenarios import ClientAssignment
from strategies.mpu_options import ALIGNMENT_WARNING
from strategies.mpu_strategy import MpuStrategy
from strategies.results import json_safe
from tests.fedunlearn.mpu.test_mpu_architectures import BASE  # the same tiny configs


def _config(class_name: str, **extra):
    config = getattr(transformers, class_name)(**BASE, **extra)
    config._attn_implementation = "eager"
    return config


def _strategy(config, mode: str = "mpu", kappa: float = 0.05) -> MpuStrategy:
    strategy = MpuStrategy(
        merge="sum",
        model_config=config,
        secret=b"architecture-test-secret",
        mode=mode,
        copies=2,
        kappa=kappa,
        assignments=[ClientAssignment("forget", "d", (0,))],
    )
    strategy.node_assignment = {1: strategy.assignments[0]}
    return strategy


@pytest.mark.parametrize(
    ("class_name", "extra", "named"),
    [
        ("Phi3Config", {}, "model.layers.0.self_attn.qkv_proj"),
        ("StableLmConfig", {}, "config.rope_parameters['partial_rotary_factor']=0.25"),
        ("PhiConfig", {}, "model.layers.0.mlp.fc1"),
    ],
)
def test_refused_in_the_constructor_before_any_copy(class_name, extra, named):
    with pytest.raises(UnsupportedArchitectureError) as refused:
        _strategy(_config(class_name, **extra))
    assert named in str(refused.value)
    assert "mpu.mode=clean or noised" in str(refused.value)


def test_baselines_do_not_reparameterise_so_any_architecture_runs():
    config = _config("Phi3Config")
    state = AutoModelForCausalLM.from_config(config).state_dict()
    noised = _strategy(config, mode="noised")
    content = noised.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    assert "arrays-0" in content and "arrays-1" not in content
    assert noised.report()["reparam"] is None and noised.report()["warnings"] == []


def test_qk_norm_model_copies_keep_the_logits_and_the_warning_is_recorded():
    config = _config("Olmo2Config", attention_bias=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm weights and biases as in a trained model, not HF's 1 / 0
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, BASE["vocab_size"], (2, 16), generator=gen)
    with torch.no_grad():
        ref = model(input_ids=ids).logits

    strategy = _strategy(config, kappa=0.0)  # noise off: only the reparameterisation
    content = strategy.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    for k in range(2):
        copy = content[f"arrays-{k}"].to_torch_state_dict()
        assert not torch.equal(
            copy["model.layers.0.self_attn.q_proj.weight"],
            state["model.layers.0.self_attn.q_proj.weight"],
        )
        model.load_state_dict(copy)
        with torch.no_grad():
            err = (model(input_ids=ids).logits - ref).abs().max().item()
        assert err <= 1e-5, (k, err)

    report = json.loads(json.dumps(json_safe(strategy.report())))
    warning, alignment = report["warnings"]  # the architecture's, then the threat model's
    assert "olmo2" in warning and "sign flips" in warning
    assert alignment == ALIGNMENT_WARNING
    assert report["reparam"]["maps"] == [
        "mlp-channel-permutation",
        "rope-plane-sign-flips",
        "vo-orthogonal",
        "kv-group-permutation",
    ]
    assert report["reparam"]["qk_norm"] == "per-projection"
