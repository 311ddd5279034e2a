"""Full fine-tuning of a client's copy: the adapted weights themselves move (no adapter).

A client fine-tunes the model (or, under MPU, the copy) it received in full or through LoRA
(docs/algorithms.md, "Local training", "Client side, mapping back, harmonic aggregation").
Here the weights named by the LoRA target/layer settings are trained directly with the role's
objective and the task vector is θ_after − θ_received for exactly those weights, so uploads,
Fisher diagonals and every merge look the same as with LoRA.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from fedunlearn.objectives import ObjectiveContext, objective_requirements
from fedunlearn.training.batching import Example
from fedunlearn.training.local_loop import (
    check_objective_data,
    objective_context,
    run_objective_steps,
)
from fedunlearn.training.lora import LocalTrainSettings


def train_full_task_vector(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    pad_token_id: int,
    target_names: Sequence[str],
    train: LocalTrainSettings,
    context: ObjectiveContext | None = None,
    show_progress: bool = False,
    retain_examples: Sequence[Example] | None = None,
    alternate_examples: Sequence[Example] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Fine-tune the parameters ``target_names`` of ``model`` with ``train.objective``.

    Returns ``{name: θ_after − θ_received}`` (float32, CPU) and the loop statistics; ``model``
    is handed back with its received weights and ``requires_grad`` flags. The frozen
    reference π_ref (NPO, DPO, KL, UnDIAL, RMU) is a copy of the received model unless
    ``context.reference_model`` is given. Data requirements are checked as for LoRA.
    """
    params = dict(model.named_parameters())
    missing = [n for n in target_names if n not in params]
    if missing or not target_names:
        raise ValueError(
            f"full fine-tuning: parameters {missing[:3] or '(none given)'} are not in the model"
        )
    check_objective_data(train.objective, examples, retain_examples, alternate_examples, context)
    device = next(model.parameters()).device
    context = objective_context(
        train, context, pad_token_id=pad_token_id, device=device, retain_examples=retain_examples
    )
    if context.reference_model is None and objective_requirements(train.objective).needs_reference:
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
        context = dataclasses.replace(context, reference_model=reference)
    received = {n: params[n].detach().clone() for n in target_names}
    was_training = model.training
    requires_grad = {name: p.requires_grad for name, p in params.items()}
    torch.manual_seed(train.seed)
    try:
        model.requires_grad_(False)
        trained = [params[n].requires_grad_(True) for n in target_names]
        stats = run_objective_steps(
            model,
            trained,
            examples,
            pad_token_id=pad_token_id,
            train=train,
            context=context,
            alternate_examples=alternate_examples,
            show_progress=show_progress,
        )
        with torch.no_grad():
            task_vector = {
                n: (params[n].detach() - received[n]).to("cpu", torch.float32).contiguous()
                for n in target_names
            }
    finally:
        with torch.no_grad():  # hand ``model`` back with its received weights
            for n, value in received.items():
                params[n].copy_(value)
        model.train(was_training)
        for name, p in params.items():
            p.requires_grad_(requires_grad[name])
    return task_vector, stats
