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


def cycled_index_batches(
    num_examples: int, batch_size: int, rng: random.Random
) -> Iterator[list[int]]:
    """Endless index batches: shuffled passes over ``range(num_examples)`` (seeded by ``rng``),
    a batch may straddle two passes."""
    if num_examples < 1 or batch_size < 1:
        raise ValueError("cycled batches need at least one example and batch_size >= 1")
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(num_examples))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = order[:batch_size], order[batch_size:]
        yield chosen


def cycled_batches(
    examples: Sequence[Example],
    batch_size: int,
    pad_token_id: int,
    rng: random.Random,
    *,
    alternates: Sequence[Example] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless seeded shuffled batches of ``examples`` (see :func:`cycled_index_batches`).

    With ``alternates`` (aligned with ``examples``) every batch also carries the same rows of
    the alternates as ``alt_input_ids``, ``alt_labels``, ``alt_attention_mask``.
    """
    if alternates is not None and len(alternates) != len(examples):
        raise ValueError(
            f"{len(alternates)} alternate examples for {len(examples)} examples; they must align"
        )
    for chosen in cycled_index_batches(len(examples), batch_size, rng):
        batch = collate([examples[i] for i in chosen], pad_token_id)
        if alternates is not None:
            alt = collate([alternates[i] for i in chosen], pad_token_id)
            batch.update({f"alt_{k}": v for k, v in alt.items()})
        yield batch


def token_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sequence mean next-token NLL over labelled tokens, shape [batch].

    The labels are shifted onto the logits (position t scores token t + 1; the last position
    scores nothing) instead of slicing the logits, so the loss reads them in place: slicing
    and flattening copied the whole ``[batch, length, vocab]`` tensor, and its gradient again
    in backward (2 × 157 MB per step for SmolLM2 at batch 8). Values and gradients are bit
    for bit those of the sliced form."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.float().view(-1, logits.size(-1)),
        shifted.view(-1),
        ignore_index=-100,
        reduction="none",
    ).view(shifted.shape)[:, :-1]
    counts = (shifted[:, :-1] != -100).sum(dim=1).clamp(min=1)
    return nll.sum(dim=1) / counts
