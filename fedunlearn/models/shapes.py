"""Real architectures' shapes, for randomly initialised models of any depth.

:data:`SHAPES` holds the values of each model's published ``config.json`` (the Hugging Face
repository named in ``source``) that fix its tensors and its forward pass: widths, head
counts, vocabulary, RoPE, normalisation, tied embeddings and the q/k/v biases of Qwen2. Nothing
is downloaded: a model built from a shape has the architecture's tensors with random values,
and :func:`shape_config` can give it fewer decoder layers than the real model
(``num_hidden_layers``) or scale its widths down (:func:`shrunk`, for tests).

The special-token ids are not part of a shape: a checkpoint built here carries its own
tokenizer (:func:`ensure_random_checkpoint`), whose ids are set in the config.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from fedunlearn.files import build_entry, cached_entry_ok, waiting_lock

#: config class of each ``model_type``
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
}
#: bytes per parameter of the dtypes a checkpoint is built in
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
#: the file a random checkpoint's build writes last (its description)
BUILD_INFO = "random_build.json"
#: largest tokenizer vocabulary a random checkpoint gets (the scenario's text needs no more)
TOKENIZER_VOCAB = 2048


@dataclass(frozen=True)
class ArchitectureShape:
    """The published config values of one architecture that fix its tensors and forward pass."""

    source: str  # the Hugging Face repository whose config.json these values are
    model_type: str  # llama, mistral or qwen2
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # q, k and v projections with a bias (Qwen2 has them, by its architecture)
    rope_scaling: tuple[tuple[str, float | int | str], ...] = ()  # () = none
    sliding_window: int | None = None  # mistral only (Qwen2's is off: use_sliding_window false)
    parameters: int = 0  # parameter count of the published weights, all layers

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Output width of the k and v projections."""
        return self.num_key_value_heads * self.head_dim


_LLAMA3_ROPE_SCALING = (
    ("rope_type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)

SHAPES: dict[str, ArchitectureShape] = {
    "llama-2-7b": ArchitectureShape(
        "meta-llama/Llama-2-7b-hf", "llama", 4096, 11008, 32, 32, 32, 32000, 4096,
        1e-5, 10000.0, tie_word_embeddings=False, qkv_bias=False, parameters=6_738_415_616,
    ),
    "llama-3-8b": ArchitectureShape(
        "meta-llama/Meta-Llama-3-8B", "llama", 4096, 14336, 32, 32, 8, 128256, 8192,
        1e-5, 500000.0, tie_word_embeddings=False, qkv_bias=False, parameters=8_030_261_248,
    ),
    "llama-3.1-8b": ArchitectureShape(
        "meta-llama/Llama-3.1-8B", "llama", 4096, 14336, 32, 32, 8, 128256, 131072,
        1e-5, 500000.0, tie_word_embeddings=False, qkv_bias=False,
        rope_scaling=_LLAMA3_ROPE_SCALING, parameters=8_030_261_248,
    ),
    "mistral-7b": ArchitectureShape(
        "mistralai/Mistral-7B-v0.1", "mistral", 4096, 14336, 32, 32, 8, 32000, 32768,
        1e-5, 10000.0, tie_word_embeddings=False, qkv_bias=False, sliding_window=4096,
        parameters=7_241_732_096,
    ),
    "qwen2.5-7b": ArchitectureShape(
        "Qwen/Qwen2.5-7B", "qwen2", 3584, 18944, 28, 28, 4, 152064, 131072,
        1e-6, 1000000.0, tie_word_embeddings=False, qkv_bias=True, parameters=7_615_616_512,
    ),
    "qwen2.5-1.5b": ArchitectureShape(
        "Qwen/Qwen2.5-1.5B", "qwen2", 1536, 8960, 28, 12, 2, 151936, 131072,
        1e-6, 1000000.0, tie_word_embeddings=True, qkv_bias=True, parameters=1_543_714_304,
    ),
}  # fmt: skip


def get_shape(name: str) -> ArchitectureShape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def shrunk(shape: ArchitectureShape, factor: int) -> ArchitectureShape:
    """``shape`` with hidden size, MLP width and vocabulary divided by ``factor`` (head counts,
    and so grouped-query attention, kept; the head width shrinks). ``parameters`` becomes 0:
    no published model has these shapes."""
    if factor < 1:
        raise ValueError(f"shrink factor must be >= 1, got {factor}")
    if factor == 1:
        return shape
    hidden = shape.hidden_size // factor
    if hidden % shape.num_attention_heads or (hidden // shape.num_attention_heads) % 2:
        raise ValueError(
            f"shrinking by {factor} leaves hidden size {hidden}: not an even head width for "
            f"{shape.num_attention_heads} heads"
        )
    return dataclasses.replace(
        shape,
        hidden_size=hidden,
        intermediate_size=shape.intermediate_size // factor,
        vocab_size=shape.vocab_size // factor,
        parameters=0,
    )


def parameter_count(shape: ArchitectureShape, layers: int) -> int:
    """Parameters of the model with ``layers`` decoder layers: embeddings (and an untied output
    head), per layer the four attention projections (with Qwen2's q/k/v biases), the three MLP
    projections and two RMSNorm weights, and the final norm."""
    h, kv = shape.hidden_size, shape.kv_size
    attention = 2 * h * h + 2 * h * kv + (h + 2 * kv if shape.qkv_bias else 0)
    layer = attention + 3 * h * shape.intermediate_size + 2 * h
    heads = 1 if shape.tie_word_embeddings else 2
    return heads * shape.vocab_size * h + layers * layer + h


def shape_config(
    shape: ArchitectureShape,
    layers: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PretrainedConfig:
    """The Hugging Face config of ``shape`` with ``layers`` decoder layers (and the special-token
    ids of the tokenizer that goes with it)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling:
        rope = {**dict(shape.rope_scaling), "rope_theta": shape.rope_theta}
    values: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if shape.model_type == "llama":
        values.update(attention_bias=shape.qkv_bias, mlp_bias=False)
    elif shape.model_type == "mistral":
        values["sliding_window"] = shape.sliding_window
    elif shape.model_type == "qwen2":
        values.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    return CONFIG_CLASSES[shape.model_type](**values)


def random_model(config: PretrainedConfig, *, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """The model of ``config`` with the architecture's own random initialisation, seeded."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)


def ensure_random_checkpoint(
    name: str, layers: int, dtype: str, cache_dir: Path, *, shrink: int = 1, seed: int = 0
) -> Path:
    """A local Hugging Face checkpoint (weights in ``dtype``, config, fast tokenizer) of shape
    ``name`` with ``layers`` decoder layers, randomly initialised from ``seed``; built once in
    ``<cache_dir>/random-models/`` and reused (verified against its manifest).

    The tokenizer is a byte-level BPE trained on the generated background corpus (at most
    :data:`TOKENIZER_VOCAB` tokens, all below the shape's vocabulary size)."""
    from fedunlearn.benchmarks.tofu import generate_background_corpus
    from fedunlearn.models.tokenizer import train_bpe_tokenizer

    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    shape = shrunk(get_shape(name), shrink)
    suffix = f"-shrink{shrink}" if shrink > 1 else ""
    folder = cache_dir / "random-models" / f"{name}{suffix}-L{layers}-{dtype}-seed{seed}"

    def build(tmp: Path) -> None:
        started = time.perf_counter()
        corpus = generate_background_corpus(seed=seed, num_documents=300)
        tokenizer = train_bpe_tokenizer(corpus, min(TOKENIZER_VOCAB, shape.vocab_size))
        config = shape_config(
            shape,
            layers,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = random_model(config, seed=seed, dtype=getattr(torch, dtype))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {
            "shape": name,
            "source": shape.source,
            "shrink": shrink,
            "layers": layers,
            "dtype": dtype,
            "seed": seed,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokenizer_vocab": len(tokenizer),
            "build_seconds": time.perf_counter() - started,
        }
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2))

    with waiting_lock(folder.with_name(f"{folder.name}.lock"), "a random checkpoint build"):
        if not cached_entry_ok(folder, BUILD_INFO, "random checkpoint", _refuse_legacy):
            build_entry(folder, BUILD_INFO, "random checkpoint", build)
    return folder


def _refuse_legacy(folder: Path) -> None:
    raise ValueError(f"{folder} has no manifest")
