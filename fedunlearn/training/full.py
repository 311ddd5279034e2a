"""A plain full-parameter training loop (AdamW, linear warm-up, cosine decay)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from fedunlearn.training.batching import Example, iterate_batches, token_nll


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to 0.05."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_full(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    pad_token_id: int,
    epochs: int,
    lr: float,
    batch_size: int = 32,
    warmup_ratio: float = 0.05,
    weight_decay: float = 0.0,
    seed: int = 0,
    desc: str = "train",
    show_progress: bool = True,
    proximal_mu: float = 0.0,
    lr_schedule: str = "warmup-cosine",
) -> list[float]:
    """Train every parameter of ``model`` that requires a gradient on ``examples`` with
    next-token NLL; ``proximal_mu`` > 0 adds FedProx's proximal term μ/2·‖w − w₀‖² over those
    parameters, w₀ their values at the start (the round's global weights). ``lr_schedule``:
    ``warmup-cosine`` (linear warm-up, cosine decay to 0.05 × ``lr``) or ``constant`` (a
    federated round's local steps, whose decay the server schedules over the rounds).

    Returns the mean loss (the NLL, without the proximal term) of every epoch. Shuffling is
    seeded by ``seed``.
    """
    if not examples:
        raise ValueError(f"{desc}: no training examples")
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trained] if proximal_mu > 0 else []
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total = epochs * steps_per_epoch
    if lr_schedule not in ("warmup-cosine", "constant"):
        raise ValueError(f"{desc}: unknown lr_schedule {lr_schedule!r}")
    warmup = int(warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(s, total, warmup) if lr_schedule == "warmup-cosine" else 1.0,
    )
    rng = random.Random(seed)
    epoch_losses: list[float] = []
    bar = tqdm(total=total, desc=desc, disable=not show_progress, unit="step", leave=False)
    for _ in range(epochs):
        running, count = 0.0, 0
        for batch in iterate_batches(examples, batch_size, pad_token_id, rng=rng):
            loss = token_nll(model, batch).mean()
            optimizer.zero_grad(set_to_none=True)
            if start:
                proximal = sum(((p - p0) ** 2).sum() for p, p0 in zip(trained, start, strict=True))
                (loss + 0.5 * proximal_mu * proximal).backward()
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            count += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        epoch_losses.append(running / count)
    bar.close()
    model.eval()
    return epoch_losses
