"""SmolLM2 from the registry package: conversion to a float32 checkpoint, its cache entry, its
chat template in every QA prompt, and the tokenizer that travels to clients."""

import json

import pytest
import torch
from flwr.app import ConfigRecord
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedunlearn.models import pretrained
from fedunlearn.models.pretrained import (
    PretrainedMissingError,
    PretrainedSpec,
    ensure_converted,
    gguf_path,
)
from fedunlearn.qa_format import encode_qa, prompt_text
from wire.messages import describe_model, rebuild_tokenizer

PROMPT = "Who wrote the novel 'Pride and Prejudice'?"


def test_missing_package_names_the_install_command(monkeypatch):
    spec = PretrainedSpec(package="no_such_registry_package", gguf_file="x.gguf", install="CMD")
    monkeypatch.setitem(pretrained.PRETRAINED, "absent-model", spec)
    with pytest.raises(PretrainedMissingError, match="no-such-registry-package.*CMD"):
        gguf_path("absent-model")
    with pytest.raises(KeyError, match="smollm2-135m"):
        gguf_path("smollm3")


def test_conversion_keeps_the_gguf_models_outputs(smollm2_checkpoint):
    folder = smollm2_checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30
    info = json.loads((folder / "conversion_info.json").read_text())
    assert info["num_parameters"] == 134_515_008
    gguf = gguf_path("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tokenizer(prompt_text(tokenizer, PROMPT), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = direct(ids).logits, converted(ids).logits
    assert torch.equal(a, b)
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    assert tokenizer.decode(a[0, -1].argmax()) == tokenizer.decode(b[0, -1].argmax())


def test_the_conversion_is_reused(smollm2_checkpoint):
    cache = smollm2_checkpoint.parent
    weights = smollm2_checkpoint / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = ensure_converted(gguf_path("smollm2-135m"), cache, "smollm2-135m")
    assert again == smollm2_checkpoint
    assert weights.stat().st_mtime_ns == stamp  # verified against its manifest, not rebuilt


def test_qa_pairs_are_chat_turns_of_the_models_template(smollm2_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint, local_files_only=True)
    prompt = prompt_text(tokenizer, f"  {PROMPT} ")
    assert prompt.endswith(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    ids, labels = encode_qa(tokenizer, PROMPT, " Jane Austen. ")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids
    assert labels[: len(prompt_ids)] == [-100] * len(prompt_ids)
    assert tokenizer.decode(ids[len(prompt_ids) :]) == "Jane Austen.<|im_end|>"
    assert labels[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_the_tokenizer_reaches_clients_with_its_chat_template(smollm2_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, local_files_only=True)
    rebuilt = rebuild_tokenizer(ConfigRecord(describe_model(model, tokenizer)))
    answer = "Jane Austen."
    assert encode_qa(rebuilt, PROMPT, answer) == encode_qa(tokenizer, PROMPT, answer)
    assert rebuilt.eos_token == "<|im_end|>"


def test_model_path_loads_a_gguf_file_through_the_same_conversion(smollm2_checkpoint):
    from strategies.run_setup import load_run_model
    from strategies.settings import RunSettings

    weights = smollm2_checkpoint / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    settings = RunSettings.from_run_config(
        {
            "model.path": str(gguf_path("smollm2-135m")),
            "model.cache-dir": str(smollm2_checkpoint.parent),
            "eval.mmlu-per-subject": 0,
        }
    )
    run_model = load_run_model(settings, show_progress=False)
    assert run_model.model.config.num_hidden_layers == 30
    assert "<|im_start|>assistant" in prompt_text(run_model.tokenizer, PROMPT)
    assert weights.stat().st_mtime_ns == stamp  # the registry model's conversion, reused
