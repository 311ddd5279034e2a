"""Check the GPU path end to end (for a person with a CUDA GPU).

    python -m simulations.gpu_check --real
    python -m simulations.gpu_check [--family llama|mistral|qwen2] [--no-4bit]

``--real`` runs :mod:`simulations.real_check` on CUDA: the real pretrained SmolLM2-135M from
the registry package, MPU's function-preserving copy on the GPU in float32, and one real
Flower round of FIRM on the real TOFU files with a bfloat16 server and clients; besides the
CPU checks, every client must have trained on CUDA. Its last line is ``real-check: ok (...)``
or ``real-check: FAILED ...``.

Without ``--real`` (the tiny family check) it generates a tiny checkpoint of the chosen family
(random weights, a tokenizer trained on the TOFU background corpus) under
``outputs/gpu-check/``, then runs the full Flower pipeline on it with ``model.path``: the
server in bfloat16 on CUDA, clients computing Fisher on the bf16 copy and training LoRA on a
4-bit NF4 copy through bitsandbytes. It checks that CUDA was used, that every client replied,
and that the task vectors and merge are finite, and prints the summary.

Not part of CI (CI machines have no GPU); exits with an error (code 2) without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from simulations import real_check, run_local

FAMILIES = ("llama", "mistral", "qwen2")


def make_checkpoint(folder: Path, family: str) -> Path:
    """A tiny randomly initialised checkpoint of ``family`` with a locally trained tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedunlearn.benchmarks.tofu import generate_background_corpus
    from fedunlearn.models.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(generate_background_corpus(0, 400), 1024)
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="the real-model check on CUDA")
    parser.add_argument("--family", choices=FAMILIES, default=None, help="tiny check: family")
    parser.add_argument("--no-4bit", action="store_true", help="tiny check: train on bf16")
    args = parser.parse_args(argv)
    if args.real and (args.family or args.no_4bit):
        parser.error("--family and --no-4bit belong to the tiny check, not to --real")
    if not torch.cuda.is_available():
        print("error: no CUDA device; this check is for GPU machines", file=sys.stderr)
        return 2
    if args.real:
        return real_check.main(["--cuda"])
    return tiny_check(args.family or "llama", four_bit=not args.no_4bit)


def tiny_check(family: str, *, four_bit: bool) -> int:
    """The pipeline on a tiny generated ``family`` checkpoint (bf16 server, NF4 clients)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = (run_local.REPO_ROOT / "outputs" / "gpu-check" / f"{family}-{stamp}").resolve()
    checkpoint = make_checkpoint(root / "checkpoint", family)
    results_path = run_local.run(
        run_config=(
            f"model.path='{checkpoint}' model.dtype='bfloat16' "
            f"model.load-in-4bit={str(four_bit).lower()} scenario.num-authors=20 "
            "scenario.retain-samples=20 eval.retain-samples=20 eval.max-new-tokens=8"
        ),
        federation_config="client-resources-num-gpus=0.1",  # else Ray hides the GPU
        output_dir=root / "run",
    )
    results = json.loads(results_path.read_text())
    problems = [c for c in results["clients"] if "excluded" in c]
    norms = [c["task_vector_norm"] for c in results["clients"] if "excluded" not in c]
    checks = {
        "server dtype is bfloat16": results["substrate"].get("dtype") == "bfloat16",
        "every client replied": not problems,
        "every client trained on CUDA": all(c.get("cuda") for c in results["clients"]),
        "task vectors finite and non-zero": all(math.isfinite(n) and n > 0 for n in norms),
        "merge finite": math.isfinite(float(results["merge"]["norm_final"])),
    }
    for name, ok in checks.items():
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    print(f"client problems: {problems}" if problems else f"results: {results_path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
