"""Objectives that match output distributions of the frozen reference π_ref: UnDIAL and KL."""

from __future__ import annotations

import torch

from fedunlearn.objectives import ObjectiveContext, reference_logits, register_objective
from fedunlearn.objectives.common import model_logits, shifted
from fedunlearn.training.batching import token_nll

UNDIAL_BETA = 10.0
KL_ALPHA = 1.0


@register_objective("undial", needs_reference=True)
def undial_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """UnDIAL: self-distillation with adjusted logits (Dong et al., 2024).

    At every labelled position t with target token y_t the teacher distribution is
    q_t = softmax(z_ref,t − β·onehot(y_t)), z_ref the logits of π_ref (no gradient); the loss is
    the cross-entropy L = (1/N) Σ_t −Σ_v q_t(v) log π(v|x,y_<t) over the N labelled tokens
    (= KL(q_t ‖ π) + const). β = option ``undial_beta`` (default 10).
    """
    beta = context.option("undial_beta", UNDIAL_BETA)
    logits, labels, mask = shifted(model_logits(model, batch), batch["labels"])
    teacher, _, _ = shifted(reference_logits(model, batch, context), batch["labels"])
    # z_ref − β·onehot(y) without materialising a [batch, time, vocab] one-hot tensor
    adjusted = teacher.scatter_add(
        -1,
        labels.clamp(min=0).unsqueeze(-1),
        torch.full_like(teacher[..., :1], -beta),
    )
    target = torch.softmax(adjusted, dim=-1)
    ce = -(target * torch.log_softmax(logits, dim=-1)).sum(dim=-1)
    return (ce * mask).sum() / mask.sum().clamp(min=1)


@register_objective("kl", needs_retain=True, needs_reference=True)
def kl_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Gradient ascent with a KL retain term: L = −ℓ_f + α·KL(π_ref ‖ π) on retain data.

    KL(π_ref ‖ π) = Σ_v π_ref(v) (log π_ref(v) − log π(v)), averaged over the labelled
    positions of the next retain batch; α = option ``kl_alpha`` (default 1.0).
    """
    alpha = context.option("kl_alpha", KL_ALPHA)
    retain = context.next_retain_batch("kl")
    logits, _, mask = shifted(model_logits(model, retain), retain["labels"])
    ref, _, _ = shifted(reference_logits(model, retain, context), retain["labels"])
    ref_logp = torch.log_softmax(ref, dim=-1)
    kl = (ref_logp.exp() * (ref_logp - torch.log_softmax(logits, dim=-1))).sum(dim=-1)
    retain_kl = (kl * mask).sum() / mask.sum().clamp(min=1)
    return -token_nll(model, batch).mean() + alpha * retain_kl
