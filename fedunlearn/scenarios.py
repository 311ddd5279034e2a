"""Who holds what: role, domain and data shard of every client in a scenario."""

from __future__ import annotations

import random
from dataclasses import dataclass

from fedunlearn.benchmarks.tofu import TofuData

TOFU_FORGET_DOMAIN = "tofu-forget"


@dataclass(frozen=True)
class ClientAssignment:
    """One client's part in an unlearning request.

    ``indices`` point into ``TofuData.author_qa``; the client materialises its own records
    from its local copy of the data, so no record text travels in the assignment.
    """

    role: str  # "forget" | "retain"
    domain: str
    indices: tuple[int, ...]


def tofu_assignments(
    data: TofuData,
    *,
    forget_percent: float = 1.0,
    num_forget_clients: int = 5,
    num_retain_clients: int = 1,
    retain_samples: int = 200,
    seed: int = 0,
) -> list[ClientAssignment]:
    """The FIRM paper's TOFU setup: forget clients hold disjoint contiguous shards of the
    forget split; each retain client holds its own disjoint random sample of the retain split.
    """
    if num_forget_clients < 1:
        raise ValueError(f"num_forget_clients must be >= 1, got {num_forget_clients}")
    if num_retain_clients < 0:
        raise ValueError(f"num_retain_clients must be >= 0, got {num_retain_clients}")
    position = {(r["author"], r["question"]): i for i, r in enumerate(data.author_qa)}
    forget_idx = [position[(r["author"], r["question"])] for r in data.forget_split(forget_percent)]
    retain_idx = [position[(r["author"], r["question"])] for r in data.retain_split(forget_percent)]
    if len(forget_idx) < num_forget_clients:
        raise ValueError(
            f"forget-{forget_percent}% has {len(forget_idx)} QA, fewer than "
            f"num_forget_clients={num_forget_clients}"
        )
    if num_retain_clients * retain_samples > len(retain_idx):
        raise ValueError(
            f"{num_retain_clients} retain clients × {retain_samples} samples exceed the "
            f"{len(retain_idx)} retain QA"
        )
    out: list[ClientAssignment] = []
    base, extra = divmod(len(forget_idx), num_forget_clients)
    start = 0
    for c in range(num_forget_clients):
        size = base + (1 if c < extra else 0)
        shard = forget_idx[start : start + size]
        out.append(ClientAssignment("forget", TOFU_FORGET_DOMAIN, tuple(shard)))
        start += size
    rng = random.Random(seed)
    sample = rng.sample(retain_idx, num_retain_clients * retain_samples)
    for c in range(num_retain_clients):
        chunk = sorted(sample[c * retain_samples : (c + 1) * retain_samples])
        out.append(ClientAssignment("retain", "retain", tuple(chunk)))
    return out
