"""Llama, Mistral and Qwen2 checkpoints: loading, LoRA targets by module name, the wire
format round trip, a task vector and a Fisher diagonal."""

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from fedunlearn.models.llama import load_local_causal_lm, resolve_dtype
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.lora import (
    LoraSettings,
    adapted_parameter_names,
)
from tests.fedunlearn.models.client_pipeline import check_client_pipeline
from wire.messages import describe_model, rebuild_model, wire_state

FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


@pytest.fixture(params=sorted(FAMILIES))
def checkpoint(request, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    config = FAMILIES[request.param](
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / request.param)
    tiny_tokenizer.save_pretrained(tmp_path / request.param)
    return request.param, tmp_path / request.param


def test_family_runs_the_client_pipeline(checkpoint, tiny_data):
    family, folder = checkpoint
    model, tokenizer = load_local_causal_lm(folder)
    assert model.config.model_type == family
    if family == "qwen2":  # Qwen-style q/k/v biases are part of the model
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    examples = [encode_qa(tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:6]]

    lora = LoraSettings(rank=4, alpha=8.0)
    names = adapted_parameter_names(model, lora)
    assert len(names) == 7 * 2 and all(n.endswith("_proj.weight") for n in names)
    wmdp_style = LoraSettings(
        rank=4, alpha=8.0, target_modules=("down_proj",), layers_to_transform=(1,)
    )
    assert adapted_parameter_names(model, wmdp_style) == ["model.layers.1.mlp.down_proj.weight"]

    config = describe_model(model, tokenizer)
    check_client_pipeline(model, tokenizer, examples, lora, names, config, batch_size=3)


def test_dtype_names():
    assert resolve_dtype("bfloat16") == torch.bfloat16
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert resolve_dtype("auto") == expected
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8")


def test_bfloat16_weights_cross_the_wire_as_float32(tiny_model, tiny_tokenizer):
    model = tiny_model.to(torch.bfloat16)
    record = wire_state(model)
    state = record.to_torch_state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    config = {**describe_model(model, tiny_tokenizer), "dtype": "bfloat16"}
    rebuilt = rebuild_model(config, record)
    assert rebuilt.dtype == torch.bfloat16
    for name, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], value), name
