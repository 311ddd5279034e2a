"""Representation misdirection for unlearning (RMU; Li et al., 2024, the WMDP paper)."""

from __future__ import annotations

from typing import cast

import torch
from transformers import PreTrainedConfig

from fedunlearn.objectives import ObjectiveContext, reference_outputs, register_objective

RMU_STEERING = 6.5
RMU_ALPHA = 100.0
RMU_SEED = 0.0


def steering_direction(hidden_size: int, seed: int) -> torch.Tensor:
    """The fixed random unit vector u (float32, CPU), as in the reference code.

    u is drawn uniform on [0, 1)^hidden_size from a ``torch.Generator`` seeded with ``seed``
    and divided by its Euclidean norm.
    """
    generator = torch.Generator().manual_seed(int(seed))
    u = torch.rand(hidden_size, generator=generator, dtype=torch.float32)
    return u / u.norm()


def rmu_layer_index(model: torch.nn.Module, context: ObjectiveContext) -> int:
    """Layer L: option ``rmu_layer`` or, when absent, ``num_hidden_layers // 2``."""
    # a causal LM or its PEFT wrapper: ``config`` is the transformers config (torch types
    # a module's attributes as Tensor | Module)
    config = cast(PreTrainedConfig, model.config)
    num_layers = int(config.num_hidden_layers)
    layer = int(context.options.get("rmu_layer", num_layers // 2))
    if not 0 <= layer < num_layers:
        raise ValueError(f"rmu_layer={layer} is outside the model's layers 0..{num_layers - 1}")
    return layer


def _hidden(outputs: object, layer: int) -> torch.Tensor:
    return outputs.hidden_states[layer + 1].float()  # type: ignore[attr-defined]


def _masked_mse(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """mean over non-padding tokens of ||a_t − b_t||² / hidden_size."""
    per_token = (a - b).pow(2).mean(dim=-1)
    mask = attention_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _layer_state(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], layer: int
) -> torch.Tensor:
    outputs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        output_hidden_states=True,
    )
    return _hidden(outputs, layer)


@register_objective("rmu", needs_retain=True, needs_reference=True)
def rmu_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """RMU: steer layer-L activations on forget text toward c·u, keep them on retain text.

    L = mean_t ||h_L(x_f)_t − c·u||² / d + α · mean_t ||h_L(x_r)_t − h_L^ref(x_r)_t||² / d,
    both means over the non-padding tokens (attention_mask; RMU scores every token, the
    labels are not used), d = hidden_size, h_L^ref from the frozen π_ref.

    h_L is the OUTPUT hidden state of decoder layer L, ``outputs.hidden_states[L + 1]`` (for the
    last layer Hugging Face returns it after the final norm). Options:
    ``rmu_layer`` = L (default ``num_hidden_layers // 2``, the middle of the network as the
    paper's layer 7 of 32), ``rmu_steering`` = c (default 6.5, the paper's Zephyr-7B value),
    ``rmu_alpha`` = α (default 100, the reference code's default; the paper tunes it, e.g.
    1200 for Zephyr-7B), ``rmu_seed`` = seed of u (default 0, see :func:`steering_direction`).
    """
    layer = rmu_layer_index(model, context)
    steering = context.option("rmu_steering", RMU_STEERING)
    alpha = context.option("rmu_alpha", RMU_ALPHA)
    seed = int(context.option("rmu_seed", RMU_SEED))
    retain = context.next_retain_batch("rmu")
    forget_h = _layer_state(model, batch, layer)
    control = steering * steering_direction(forget_h.size(-1), seed).to(forget_h.device)
    forget_term = _masked_mse(forget_h, control, batch["attention_mask"])
    retain_h = _layer_state(model, retain, layer)
    ref_h = _hidden(reference_outputs(model, retain, context, output_hidden_states=True), layer)
    retain_term = _masked_mse(retain_h, ref_h, retain["attention_mask"])
    return forget_term + alpha * retain_term
