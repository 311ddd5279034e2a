"""NLL-based objectives: NLL (retain), GA, GradDiff, IDK and SatImp (forget).

Notation (docs/algorithms.md, "Local unlearning objectives"): ℓ = token NLL, ℓ_f on the forget
batch, ℓ_r on a retain batch; the per-sequence loss is the mean over its labelled tokens and
batches are averaged.
"""

from __future__ import annotations

import torch

from fedunlearn.objectives import ObjectiveContext, register_objective
from fedunlearn.objectives.common import alternate_batch, model_logits, token_losses
from fedunlearn.training.batching import token_nll

GRADDIFF_ALPHA = 1.0
SATIMP_BETA1 = 5.0
SATIMP_BETA2 = 1.0


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


@register_objective("graddiff", needs_retain=True)
def gradient_difference_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Gradient difference GradDiff = −ℓ_f + α·ℓ_r.

    α = option ``graddiff_alpha`` (default 1.0); ℓ_r is the NLL of the next retain batch.
    """
    alpha = context.option("graddiff_alpha", GRADDIFF_ALPHA)
    retain = context.next_retain_batch("graddiff")
    return -token_nll(model, batch).mean() + alpha * token_nll(model, retain).mean()


@register_objective("idk", needs_alternate=True)
def idk_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """IDK = ℓ(y_idk|x): plain NLL of the refusal answer ("I don't know ...") to each forget
    question (the ``alt_*`` rows of the batch); the forget answer itself is not used."""
    return token_nll(model, alternate_batch(batch, "idk")).mean()


@register_objective("satimp")
def satimp_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Saturation-importance weighted gradient ascent (SatImp).

    Per labelled token t: p_t = e^{−ℓ_t} (detached), weight w_t = p_t^β1 · (1 − p_t)^β2 and
    L = −Σ_t w_t·ℓ_t / N with N the number of labelled tokens in the batch.
    β1 = option ``satimp_beta1`` (default 5), β2 = option ``satimp_beta2`` (default 1).
    """
    beta1 = context.option("satimp_beta1", SATIMP_BETA1)
    beta2 = context.option("satimp_beta2", SATIMP_BETA2)
    nll, mask = token_losses(model_logits(model, batch), batch["labels"])
    p = torch.exp(-nll.detach())
    weight = p.pow(beta1) * (1.0 - p).pow(beta2) * mask
    return -(weight * nll).sum() / mask.sum().clamp(min=1)
