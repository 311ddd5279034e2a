"""Client-side LoRA training that ends in a task vector s·B@A per adapted weight (dense, or
kept as its factors for a compact upload: :class:`fedunlearn.upload_codec.LowRankDelta`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists

from fedunlearn.objectives import ObjectiveContext
from fedunlearn.training.batching import Example
from fedunlearn.training.local_loop import (
    check_objective_data,
    objective_context,
    run_objective_steps,
)
from fedunlearn.upload_codec import LowRankDelta

ALL_LLAMA_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter W + s·B·A with s = alpha / rank (paper default r = 16, alpha = 32).

    ``target_modules`` match a module name when equal to it or when the name ends with
    ``"." + target`` (so ``layers.1.mlp.down_proj`` works); ``layers_to_transform`` restricts
    suffix matches to decoder layers with those indices (PEFT's ``LoraConfig`` semantics).
    """

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = ALL_LLAMA_PROJECTIONS
    dropout: float = 0.0
    layers_to_transform: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LocalTrainSettings:
    """Optimiser settings of one client's local run; ``options`` are the objective's
    hyper-parameters by name (e.g. ``{"npo_beta": 0.1}``), passed on in its context;
    ``activation_checkpointing``: recompute each decoder layer in the backward pass instead of
    keeping its activations (:func:`~fedunlearn.training.local_loop.recomputed_activations`)."""

    objective: str
    steps: int
    lr: float
    batch_size: int = 8
    seed: int = 0
    max_grad_norm: float = 1.0
    options: dict[str, float] = field(default_factory=dict)
    activation_checkpointing: bool = False


def _adapter_delta(module: LoraLayer, as_factors: bool) -> torch.Tensor | LowRankDelta:
    """The trained adapter's s·B@A (float32, CPU), or its factors."""
    if as_factors:
        # the adapters of a targeted linear layer are nn.Linear (a ModuleDict types them Module)
        lora_b = cast(torch.nn.Linear, module.lora_B["default"])
        lora_a = cast(torch.nn.Linear, module.lora_A["default"])
        return LowRankDelta(
            lora_B=lora_b.weight.detach().to("cpu", torch.float32),
            lora_A=lora_a.weight.detach().to("cpu", torch.float32),
            scaling=float(module.scaling["default"]),
        )
    # every concrete LoraLayer (Linear, bnb Linear4bit) defines it; the base class does not
    delta = module.get_delta_weight("default")  # type: ignore[attr-defined]
    return delta.detach().to("cpu", torch.float32).contiguous()


def lora_config(lora: LoraSettings) -> LoraConfig:
    """The PEFT ``LoraConfig`` of ``lora``."""
    return LoraConfig(
        r=lora.rank,
        # peft annotates lora_alpha as int; a float alpha is used as given (s = alpha / r)
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        layers_to_transform=(
            None if lora.layers_to_transform is None else list(lora.layers_to_transform)
        ),
        bias="none",
    )


def parse_layers(text: str) -> tuple[int, ...] | None:
    """``"1,2"`` → (1, 2); ``"all"`` or ``""`` → None (every layer). Clear error otherwise."""
    text = text.strip()
    if text in ("", "all"):
        return None
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"LoRA layers must be 'all' or comma-separated layer indices, got {text!r}"
        ) from None
    if any(i < 0 for i in layers):
        raise ValueError(f"LoRA layer indices must be >= 0, got {text!r}")
    return layers


def adapted_parameter_names(model: torch.nn.Module, lora: LoraSettings) -> list[str]:
    """Names of the base weights LoRA will adapt (``...q_proj.weight`` etc.).

    Uses PEFT's own target matching on the ``torch.nn.Linear`` modules, so the names equal the
    keys of the task vector :func:`train_lora_task_vector` returns.
    """
    config = lora_config(lora)
    names = [
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and check_target_module_exists(config, name)
    ]
    if not names:
        raise ValueError(
            f"no Linear module matches the LoRA targets {list(lora.target_modules)}"
            + (
                ""
                if lora.layers_to_transform is None
                else f" in layers {list(lora.layers_to_transform)}"
            )
        )
    return names


def train_lora_task_vector(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    pad_token_id: int,
    lora: LoraSettings,
    train: LocalTrainSettings,
    context: ObjectiveContext | None = None,
    show_progress: bool = False,
    retain_examples: Sequence[Example] | None = None,
    alternate_examples: Sequence[Example] | None = None,
    as_factors: bool = False,
) -> tuple[dict[str, torch.Tensor | LowRankDelta], dict[str, float]]:
    """Train a LoRA adapter on ``model`` and return its task vector and statistics.

    The task vector maps each adapted base weight name (e.g.
    ``model.layers.0.self_attn.q_proj.weight``) to s·B@A, same shape as that weight (float32),
    or with ``as_factors`` to its factors (:class:`LowRankDelta`, whose ``dense()`` is that
    same tensor). The adapter is removed afterwards, so ``model`` is returned to its received
    weights.

    ``retain_examples`` feed ``context.retain_batches`` (an endless seeded shuffled cycle with
    the same batch size; they take precedence over ``context.retain_batches``) for objectives
    that need retain data (graddiff, kl, rmu);
    ``alternate_examples`` (refusal answers, aligned with ``examples``) add the ``alt_*`` rows
    to every batch for dpo and idk. Missing required data is a ValueError before training.
    ``train.options`` are merged over ``context.options``. The frozen reference π_ref is the
    adapter-disabled PEFT model unless ``context.reference_model`` is set.
    """
    check_objective_data(train.objective, examples, retain_examples, alternate_examples, context)
    device = next(model.parameters()).device
    context = objective_context(
        train, context, pad_token_id=pad_token_id, device=device, retain_examples=retain_examples
    )
    was_training = model.training
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    torch.manual_seed(train.seed)
    peft_model = get_peft_model(model, lora_config(lora))
    try:
        stats = run_objective_steps(
            peft_model,
            [p for p in peft_model.parameters() if p.requires_grad],
            examples,
            pad_token_id=pad_token_id,
            train=train,
            context=context,
            alternate_examples=alternate_examples,
            show_progress=show_progress,
        )
        peft_model.eval()
        task_vector: dict[str, torch.Tensor | LowRankDelta] = {}
        prefix = "base_model.model."
        with torch.no_grad():
            for name, module in peft_model.named_modules():
                if isinstance(module, LoraLayer) and "default" in module.lora_A:
                    base_name = name[len(prefix) :] if name.startswith(prefix) else name
                    task_vector[f"{base_name}.weight"] = _adapter_delta(module, as_factors)
    finally:
        # the adapter goes in every case: ``model`` is handed back with its received weights
        peft_model.unload()
        model.train(was_training)
        for name, p in model.named_parameters():
            p.requires_grad_(requires_grad.get(name, p.requires_grad))
    return task_vector, stats
