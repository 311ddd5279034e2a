"""Turning tokenised examples into padded batches."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch

Example = tuple[list[int], list[int]]  # (input_ids, labels with -100 on unscored positions)


def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of (input_ids, labels) to one batch with an attention mask."""
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def iterate_batches(
    examples: Sequence[Example],
    batch_size: int,
    pad_token_id: int,
    *,
    rng: random.Random | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """One epoch of batches; shuffled with ``rng`` when given, in data order otherwise."""
    order = list(range(len(examples)))
    if rng is not None:
        rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        yield collate([examples[i] for i in order[start : start + batch_size]], pad_token_id)


def token_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sequence mean next-token NLL over labelled tokens, shape [batch]."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift_logits = logits[:, :-1].float()
    shift_labels = batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(shift_labels.shape)
    counts = (shift_labels != -100).sum(dim=1).clamp(min=1)
    return nll.sum(dim=1) / counts
