"""Llama-architecture models built from a config, and local Hugging Face checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def tiny_llama_config(
    vocab_size: int,
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 1024,
    max_position_embeddings: int = 256,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
) -> LlamaConfig:
    """A small Llama config with grouped-query attention (by default 4 heads, 2 KV heads)."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not a multiple of "
            f"num_key_value_heads={num_key_value_heads}"
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def new_tiny_llama(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Randomly initialised model, seeded so the same config gives the same weights."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(gen_state)
    return model


def resolve_dtype(name: str) -> torch.dtype:
    """Run-config ``dtype`` → torch dtype; ``auto`` is bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # no fp16: no loss scaling
    if name not in dtypes:
        raise ValueError(f"dtype must be auto or one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def load_local_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (unless ``tokenizer`` is given) from a local Hugging
    Face checkpoint folder.

    Never touches a model hub: ``local_files_only=True``. A tokenizer without a pad token
    gets its EOS token as pad token.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model.path {str(folder)!r} is not a folder")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path {str(folder)!r} has no config.json: not a Hugging Face checkpoint"
        )
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {str(folder)!r} defines no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    model.eval()
    return model, tokenizer
