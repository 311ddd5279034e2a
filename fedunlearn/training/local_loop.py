"""The local unlearning loop shared by LoRA and full fine-tuning of a client's copy.

Both :func:`fedunlearn.training.lora.train_lora_task_vector` and
:func:`fedunlearn.training.full_finetune.train_full_task_vector` check the data an
objective needs, build the seeded batch streams, run ``train.steps`` optimiser steps of the
objective, and differ only in which parameters move and how the task vector is read out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from fedunlearn.objectives import ObjectiveContext, get_objective, objective_requirements
from fedunlearn.training.batching import Example, cycled_batches


def _on_device(
    batches: Iterator[dict[str, torch.Tensor]], device: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches:
        yield {k: v.to(device) for k, v in batch.items()}


def check_objective_data(
    objective: str,
    examples: Sequence[Example],
    retain_examples: Sequence[Example] | None,
    alternate_examples: Sequence[Example] | None,
    context: ObjectiveContext | None,
) -> None:
    """Raise ``ValueError`` before training when ``objective`` lacks the data it needs."""
    spec = objective_requirements(objective)
    if not examples:
        raise ValueError("local training needs at least one example")
    if retain_examples is not None and not retain_examples:
        raise ValueError("retain_examples is empty; pass None or at least one example")
    if alternate_examples is not None and len(alternate_examples) != len(examples):
        raise ValueError(
            f"alternate_examples has {len(alternate_examples)} entries for {len(examples)} "
            "examples; it must hold one refusal example per example, in the same order"
        )
    has_retain_stream = context is not None and context.retain_batches is not None
    if spec.needs_retain and retain_examples is None and not has_retain_stream:
        raise ValueError(
            f"objective {objective!r} needs retain examples on the forget client: pass "
            "retain_examples= (or ObjectiveContext.retain_batches)"
        )
    if spec.needs_alternate and alternate_examples is None:
        raise ValueError(
            f"objective {objective!r} needs alternate (refusal) answers aligned with the "
            "examples: pass alternate_examples= (see fedunlearn.objectives.refusal)"
        )


def objective_context(
    train,
    context: ObjectiveContext | None,
    *,
    pad_token_id: int,
    device: torch.device,
    retain_examples: Sequence[Example] | None,
) -> ObjectiveContext:
    """``context`` with the seeded endless retain stream and ``train.options`` merged in."""
    context = context or ObjectiveContext()
    retain_batches = context.retain_batches
    if retain_examples is not None:
        retain_rng = random.Random(1_000_003 * train.seed + 1)
        retain_batches = _on_device(
            cycled_batches(
                retain_examples,
                min(train.batch_size, len(retain_examples)),
                pad_token_id,
                retain_rng,
            ),
            device,
        )
    return dataclasses.replace(
        context, retain_batches=retain_batches, options={**context.options, **train.options}
    )


@contextlib.contextmanager
def recomputed_activations(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """With ``on``, ``model`` (a Hugging Face model, or a PEFT model around one) keeps only each
    decoder layer's input in the forward pass and recomputes the layer in the backward pass
    (activation checkpointing) while the block runs: the activations of one layer are alive
    instead of every layer's, for one more forward pass per step; the gradients are the same
    (the same operations run again). Off again afterwards."""
    if not on:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} cannot recompute its activations (activation "
            "checkpointing): set training.activation-checkpointing = 'off'"
        )
    config: Any = model.config  # a PretrainedConfig (torch types Module attributes loosely)
    use_cache = config.use_cache  # no key/value cache is built in training: none to drop
    config.use_cache = False
    model.activation_checkpointing_enable()  # type: ignore[operator]
    try:
        yield
    finally:
        model.activation_checkpointing_disable()  # type: ignore[operator]
        config.use_cache = use_cache


def run_objective_steps(
    model: torch.nn.Module,
    params: Sequence[torch.Tensor],
    examples: Sequence[Example],
    *,
    pad_token_id: int,
    train,
    context: ObjectiveContext,
    alternate_examples: Sequence[Example] | None = None,
    show_progress: bool = False,
) -> dict[str, float]:
    """``train.steps`` AdamW steps of ``train.objective`` on ``params`` (gradient clipping at
    ``train.max_grad_norm``); seeded batches. Returns timing and first/last loss."""
    objective = get_objective(train.objective)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
    batches = _on_device(
        cycled_batches(
            examples,
            min(train.batch_size, len(examples)),
            pad_token_id,
            random.Random(train.seed),
            alternates=alternate_examples,
        ),
        device,
    )
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    steps = tqdm(range(train.steps), desc=f"local {train.objective}", disable=not show_progress)
    with recomputed_activations(model, train.activation_checkpointing):
        for _ in steps:
            loss = objective(model, next(batches), context)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(
                    f"objective {train.objective!r} produced a non-finite loss "
                    f"({loss.item()}) at step {len(losses) + 1} of {train.steps}"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
    return {
        "train_seconds": time.perf_counter() - started,
        "steps": float(train.steps),
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": losses[-1] if losses else float("nan"),
    }
