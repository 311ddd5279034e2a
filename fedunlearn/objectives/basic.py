"""Gradient ascent (forget) and next-token NLL (retain)."""

from __future__ import annotations

import torch

from fedunlearn.objectives import ObjectiveContext, register_objective
from fedunlearn.training.batching import token_nll


@register_objective("nll")
def nll_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Ordinary next-token NLL ℓ — the retain clients' objective."""
    return token_nll(model, batch).mean()


@register_objective("ga")
def gradient_ascent_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Gradient ascent GA = −ℓ_f: minimising it raises the NLL of the forget answers."""
    return -token_nll(model, batch).mean()
