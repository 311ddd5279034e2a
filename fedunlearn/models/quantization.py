"""4-bit NF4 training copies through bitsandbytes (QLoRA-style clients).

The client computes the Fisher diagonal on the unquantised weights it received (quantisation
noise would swamp it; docs/algorithms.md, "What a client uploads") and trains its LoRA adapter
on an NF4 copy made here.

CPU pitfall (bitsandbytes 0.50, see NOTES): on CPUs with AVX512-BF16 a ``Linear4bit`` that
once ran a forward pass in eval mode without gradients repacks its weight for a fast CPU
kernel that has no autograd; LoRA gradients computed through it afterwards are silently
wrong. :func:`quantize_4bit` switches that path off on every 4-bit layer.
"""

from __future__ import annotations

import importlib.util
import tempfile

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel


def bitsandbytes_available() -> bool:
    """Whether the optional ``bitsandbytes`` package is installed."""
    return importlib.util.find_spec("bitsandbytes") is not None


def disable_cpu_packed_kernels(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' AVX512-BF16 CPU repacking on every ``Linear4bit`` of ``model``
    (its kernel has no autograd). Returns the number of 4-bit layers."""
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def quantize_4bit(
    model: PreTrainedModel, *, compute_dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """An NF4 copy of ``model`` (every Linear except the LM head), on CUDA when present.

    ``compute_dtype`` defaults to bfloat16 on CUDA and float32 on CPU. Raises ImportError with
    the install hint when bitsandbytes is missing.
    """
    if not bitsandbytes_available():
        raise ImportError(
            "model.load-in-4bit needs bitsandbytes: pip install 'fedunlearn[quantization]'"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=["lm_head"],
    )
    with tempfile.TemporaryDirectory(prefix="fedunlearn-nf4-") as folder:
        model.save_pretrained(folder)
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=config, device_map=device, dtype=compute_dtype
        )
    if disable_cpu_packed_kernels(quantized) == 0:
        raise RuntimeError("4-bit loading produced no Linear4bit layer")
    quantized.eval()
    return quantized
