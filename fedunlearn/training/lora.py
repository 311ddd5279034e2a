"""Client-side LoRA training that ends in a dense task vector s·B@A per adapted weight."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from tqdm.auto import tqdm

from fedunlearn.objectives import ObjectiveContext, get_objective
from fedunlearn.training.batching import Example, collate

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
    """LoRA adapter W + s·B·A with s = alpha / rank (paper default r = 16, alpha = 32)."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = ALL_LLAMA_PROJECTIONS
    dropout: float = 0.0


@dataclass(frozen=True)
class LocalTrainSettings:
    """Optimiser settings of one client's local run."""

    objective: str
    steps: int
    lr: float
    batch_size: int = 8
    seed: int = 0
    max_grad_norm: float = 1.0


def adapted_parameter_names(model: torch.nn.Module, lora: LoraSettings) -> list[str]:
    """Names of the base weights LoRA will adapt (``...q_proj.weight`` etc.)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in lora.target_modules:
            names.append(f"{name}.weight")
    if not names:
        raise ValueError(f"no Linear module matches the LoRA targets {list(lora.target_modules)}")
    return names


def _cycled_batches(
    examples: Sequence[Example], batch_size: int, pad_token_id: int, rng: random.Random
):
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = order[:batch_size], order[batch_size:]
        yield collate([examples[i] for i in chosen], pad_token_id)


def train_lora_task_vector(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    pad_token_id: int,
    lora: LoraSettings,
    train: LocalTrainSettings,
    context: ObjectiveContext | None = None,
    show_progress: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Train a LoRA adapter on ``model`` and return its dense task vector and statistics.

    The task vector maps each adapted base weight name (e.g.
    ``model.layers.0.self_attn.q_proj.weight``) to s·B@A, same shape as that weight. The
    adapter is removed afterwards, so ``model`` is returned to its received weights.
    """
    if not examples:
        raise ValueError("local training needs at least one example")
    objective = get_objective(train.objective)
    context = context or ObjectiveContext()
    device = next(model.parameters()).device
    torch.manual_seed(train.seed)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
    rng = random.Random(train.seed)
    batches = _cycled_batches(examples, min(train.batch_size, len(examples)), pad_token_id, rng)
    losses: list[float] = []
    started = time.perf_counter()
    peft_model.train()
    for _ in tqdm(range(train.steps), desc=f"local {train.objective}", disable=not show_progress):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        loss = objective(peft_model, batch, context)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"objective {train.objective!r} produced a non-finite loss")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - started
    peft_model.eval()
    task_vector: dict[str, torch.Tensor] = {}
    prefix = "base_model.model."
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                base_name = name[len(prefix) :] if name.startswith(prefix) else name
                delta = module.get_delta_weight("default").detach().to("cpu", torch.float32)
                task_vector[f"{base_name}.weight"] = delta.contiguous()
    peft_model.unload()
    stats = {
        "train_seconds": seconds,
        "steps": float(train.steps),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    return task_vector, stats
