"""Real architectures' shapes: every full config builds (on the meta device) with the published
parameter count, and a shrunk one-layer random checkpoint of each runs the client pipeline."""

import json

import pytest
import torch

from fedunlearn.models.llama import load_local_causal_lm
from fedunlearn.models.shapes import (
    BUILD_INFO,
    SHAPES,
    ensure_random_checkpoint,
    parameter_count,
    random_model,
    shape_config,
    shrunk,
)
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.lora import (
    LoraSettings,
    adapted_parameter_names,
)
from tests.fedunlearn.models.client_pipeline import check_client_pipeline
from wire.messages import describe_model, rebuild_model, wire_state

REQUIRED = ("llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b")
SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _meta_model(shape, layers):
    with torch.device("meta"):
        return random_model(shape_config(shape, layers), seed=0, dtype=torch.bfloat16)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head is counted once


def test_the_required_shapes_are_there():
    assert set(REQUIRED) <= set(SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_full_depth_has_the_published_parameter_count(name):
    shape = SHAPES[name]
    full = _meta_model(shape, shape.num_hidden_layers)
    assert _count(full) == shape.parameters == parameter_count(shape, shape.num_hidden_layers)
    one = _meta_model(shape, 1)
    assert _count(one) == parameter_count(shape, 1)
    assert one.config.model_type == shape.model_type
    attention = one.model.layers[0].self_attn
    assert attention.k_proj.out_features == shape.num_key_value_heads * shape.head_dim
    assert attention.q_proj.out_features == shape.hidden_size
    assert (attention.q_proj.bias is not None) == shape.qkv_bias
    assert (attention.v_proj.bias is not None) == shape.qkv_bias
    assert attention.o_proj.bias is None
    tied = one.lm_head.weight is one.model.embed_tokens.weight
    assert tied == shape.tie_word_embeddings
    assert one.config.rope_parameters["rope_theta"] == shape.rope_theta


def test_published_values_that_differ_between_families():
    assert SHAPES["llama-2-7b"].num_key_value_heads == SHAPES["llama-2-7b"].num_attention_heads
    scaling = _meta_model(SHAPES["llama-3.1-8b"], 1).config.rope_parameters
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert shape_config(SHAPES["mistral-7b"], 1).sliding_window == 4096
    assert SHAPES["qwen2.5-7b"].rms_norm_eps == 1e-6 and SHAPES["qwen2.5-1.5b"].tie_word_embeddings


def test_shrinking_keeps_the_heads_and_divides_the_widths():
    shape = shrunk(SHAPES["qwen2.5-7b"], 32)
    assert (shape.hidden_size, shape.intermediate_size, shape.vocab_size) == (112, 592, 4752)
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (28, 4)
    assert shape.qkv_bias and shape.parameters == 0
    assert shrunk(SHAPES["llama-2-7b"], 1) is SHAPES["llama-2-7b"]
    with pytest.raises(ValueError, match="head width"):
        shrunk(SHAPES["llama-2-7b"], 3)


def test_random_checkpoint_is_seeded_cached_and_in_its_dtype(tmp_path):
    first = ensure_random_checkpoint("llama-3-8b", 2, "bfloat16", tmp_path / "a", shrink=32)
    built = (first / BUILD_INFO).stat().st_mtime_ns
    again = ensure_random_checkpoint("llama-3-8b", 2, "bfloat16", tmp_path / "a", shrink=32)
    assert (again / BUILD_INFO).stat().st_mtime_ns == built  # reused, not rebuilt
    other = ensure_random_checkpoint("llama-3-8b", 2, "bfloat16", tmp_path / "b", shrink=32)
    assert again == first
    info = json.loads((first / BUILD_INFO).read_text())
    assert info["parameters"] == parameter_count(shrunk(SHAPES["llama-3-8b"], 32), 2)
    assert info["tokenizer_vocab"] <= 4008
    a, tokenizer = load_local_causal_lm(first, dtype=torch.bfloat16)
    b, _ = load_local_causal_lm(other, dtype=torch.bfloat16)
    assert a.config.num_hidden_layers == 2 and a.dtype == torch.bfloat16
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert len(tokenizer) <= a.config.vocab_size
    assert a.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_one_layer_of_every_shape_runs_the_client_pipeline(name, tmp_path, tiny_data):
    folder = ensure_random_checkpoint(name, 1, "bfloat16", tmp_path, shrink=32)
    model, tokenizer = load_local_causal_lm(folder, dtype=torch.bfloat16)
    examples = [encode_qa(tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:4]]
    assert max(max(ids) for ids, _ in examples) < model.config.vocab_size
    lora = LoraSettings(rank=4, alpha=8.0, target_modules=SEVEN)
    names = adapted_parameter_names(model, lora)
    assert sorted(n.split(".")[-2] for n in names) == sorted(SEVEN)

    config = {**describe_model(model, tokenizer), "dtype": "bfloat16"}
    assert rebuild_model(config, wire_state(model)).dtype == torch.bfloat16
    check_client_pipeline(model, tokenizer, examples, lora, names, config, batch_size=2)
