"""Preference-style forget objectives: NPO, SimNPO and DPO (refusal preferred over forget).

Sequence log-probabilities are sums over the labelled (answer) tokens:
log π(y|x) = −Σ_t ℓ_t. π_ref is the frozen received model (see ``reference_outputs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedunlearn.objectives import ObjectiveContext, reference_logits, register_objective
from fedunlearn.objectives.common import (
    alternate_batch,
    mean_token_nll,
    model_logits,
    sequence_log_prob,
)

NPO_BETA = 0.1
SIMNPO_BETA = 4.5
SIMNPO_DELTA = 0.0
DPO_BETA = 0.1


def _log_ratio(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """log π(y|x) − log π_ref(y|x) per sequence, shape [batch]."""
    log_p = sequence_log_prob(model_logits(model, batch), batch["labels"])
    log_p_ref = sequence_log_prob(reference_logits(model, batch, context), batch["labels"])
    return log_p - log_p_ref


@register_objective("npo", needs_reference=True)
def npo_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Negative preference optimisation (Zhang et al., 2024).

    L = −(2/β) · mean_i log σ(−β · (log π(y_i|x_i) − log π_ref(y_i|x_i))) with sequence
    log-probs (sums over answer tokens); β = option ``npo_beta`` (default 0.1). Starts at
    (2/β)·log 2 and falls as π(y|x) drops below π_ref(y|x).
    """
    beta = context.option("npo_beta", NPO_BETA)
    return -(2.0 / beta) * F.logsigmoid(-beta * _log_ratio(model, batch, context)).mean()


@register_objective("simnpo")
def simnpo_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Simple NPO (Fan et al., 2024), reference-free.

    L = −(2/β) · mean_i log σ(β · (ℓ̄(y_i|x_i) − δ)) with ℓ̄ the length-normalised NLL
    (−(1/|y|) log π(y|x)); minimising it raises ℓ̄. β = option ``simnpo_beta`` (default 4.5),
    δ = option ``simnpo_delta`` (reward margin, default 0; the paper's γ equals β·δ).
    """
    beta = context.option("simnpo_beta", SIMNPO_BETA)
    delta = context.option("simnpo_delta", SIMNPO_DELTA)
    nll = mean_token_nll(model_logits(model, batch), batch["labels"])
    return -(2.0 / beta) * F.logsigmoid(beta * (nll - delta)).mean()


@register_objective("dpo", needs_alternate=True, needs_reference=True)
def dpo_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """DPO with the refusal answer y_idk preferred over the forget answer y_f.

    L = −(2/β) · mean_i log σ(β·[(log π(y_idk|x) − log π_ref(y_idk|x))
                                − (log π(y_f|x) − log π_ref(y_f|x))])
    (the 2/β scaling of the NPO paper's DPO baseline); β = option ``dpo_beta`` (default 0.1).
    y_idk comes from the batch's ``alt_*`` rows (same prompt x, refusal answer).
    """
    beta = context.option("dpo_beta", DPO_BETA)
    win = _log_ratio(model, alternate_batch(batch, "dpo"), context)
    lose = _log_ratio(model, batch, context)
    return -(2.0 / beta) * F.logsigmoid(beta * (win - lose)).mean()
