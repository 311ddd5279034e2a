"""Shared pieces of the objectives: per-token NLL from logits, sequence log-probs, batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALT_PREFIX = "alt_"
BATCH_KEYS = ("input_ids", "labels", "attention_mask")


def model_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of ``model`` on ``batch`` (shape [batch, time, vocab])."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def shifted(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token alignment: (logits[:, :-1] as float32, labels[:, 1:], labelled mask)."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return shift_logits, shift_labels, shift_labels != -100


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL ℓ_t (0 on unlabelled positions) and the labelled mask, both [batch, T-1]."""
    shift_logits, shift_labels, mask = shifted(logits, labels)
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(shift_labels.shape)
    return nll * mask, mask


def sequence_log_prob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log π(y|x) = −Σ_t ℓ_t over the labelled tokens of every sequence, shape [batch]."""
    nll, _ = token_losses(logits, labels)
    return -nll.sum(dim=1)


def mean_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Length-normalised NLL ℓ̄ = (1/|y|) Σ_t ℓ_t per sequence, shape [batch]."""
    nll, mask = token_losses(logits, labels)
    return nll.sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def alternate_batch(batch: dict[str, torch.Tensor], objective_name: str) -> dict[str, torch.Tensor]:
    """The refusal-answer rows (``alt_input_ids`` ...) of ``batch`` under the plain key names."""
    missing = [ALT_PREFIX + k for k in BATCH_KEYS if ALT_PREFIX + k not in batch]
    if missing:
        raise ValueError(
            f"objective {objective_name!r} needs alternate (refusal) answers: the batch lacks "
            f"{missing}; pass alternate_examples= to train_lora_task_vector"
        )
    return {k: batch[ALT_PREFIX + k] for k in BATCH_KEYS}
