"""Who holds what: role, domain and data shard of every client in a scenario."""

from __future__ import annotations

import random
from dataclasses import dataclass

from fedunlearn.benchmarks.tofu import TofuData

TOFU_FORGET_DOMAIN = "tofu-forget"
RETAIN_LAYOUTS = ("random", "heterogeneous")


def all_records(data: TofuData) -> list[dict]:
    """One index space over every record: author QA, then real authors, then world facts."""
    return data.author_qa + data.real_authors + data.world_facts


@dataclass(frozen=True)
class ClientAssignment:
    """One client's part in an unlearning request.

    ``indices`` point into :func:`all_records` of the benchmark; the client materialises its
    own records from its local copy of the data, so no record text travels in the assignment.
    """

    role: str  # "forget" | "retain"
    domain: str
    indices: tuple[int, ...]


def _split_contiguous(items: list, parts: int) -> list[list]:
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def _forget_clients(
    data: TofuData, forget_percent: float, num_clients: int, num_domains: int
) -> list[ClientAssignment]:
    authors = data.forget_authors(forget_percent)
    if num_domains < 1 or num_domains > len(authors):
        raise ValueError(
            f"num_forget_domains={num_domains} must be between 1 and the {len(authors)} "
            f"forget authors of forget-{forget_percent}%"
        )
    if num_clients < num_domains:
        raise ValueError(
            f"num_forget_clients={num_clients} is smaller than num_forget_domains={num_domains}"
        )
    index = {(r["author"], r["question"]): i for i, r in enumerate(data.author_qa)}
    out = []
    client_groups = _split_contiguous(list(range(num_clients)), num_domains)
    for d, (group, clients) in enumerate(
        zip(_split_contiguous(authors, num_domains), client_groups, strict=True)
    ):
        domain = TOFU_FORGET_DOMAIN if num_domains == 1 else f"{TOFU_FORGET_DOMAIN}-{d}"
        members = set(group)
        rows = [
            index[(r["author"], r["question"])] for r in data.author_qa if r["author"] in members
        ]
        if len(rows) < len(clients):
            raise ValueError(
                f"forget domain {domain} has {len(rows)} QA, fewer than its {len(clients)} "
                "clients (raise forget-percent or lower num-forget-clients)"
            )
        for shard in _split_contiguous(rows, len(clients)):
            out.append(ClientAssignment("forget", domain, tuple(shard)))
    return out


def _retain_clients(
    data: TofuData,
    forget_percent: float,
    num_clients: int,
    samples: int,
    layout: str,
    seed: int,
) -> list[ClientAssignment]:
    forget = set(data.forget_authors(forget_percent))
    retain_idx = [i for i, r in enumerate(data.author_qa) if r["author"] not in forget]
    rng = random.Random(seed)
    if layout == "random":
        if num_clients * samples > len(retain_idx):
            raise ValueError(
                f"{num_clients} retain clients × {samples} samples exceed the "
                f"{len(retain_idx)} retain QA"
            )
        sample = rng.sample(retain_idx, num_clients * samples)
        return [
            ClientAssignment(
                "retain", "retain", tuple(sorted(sample[c * samples : (c + 1) * samples]))
            )
            for c in range(num_clients)
        ]
    if layout != "heterogeneous":
        raise ValueError(f"retain layout {layout!r} unknown; expected one of {RETAIN_LAYOUTS}")
    # heterogeneous: client 0 fictitious authors of the first half, client 1 the real-world
    # knowledge (real authors + world facts), client 2 authors of the second half, then repeat
    halves = _split_contiguous(retain_idx, 2)
    offset = len(data.author_qa)
    world = list(range(offset, offset + len(data.real_authors) + len(data.world_facts)))
    pools = [halves[0], world, halves[1]]
    out = []
    for c in range(num_clients):
        pool = pools[c % 3]
        chosen = sorted(rng.sample(pool, min(samples, len(pool))))
        out.append(
            ClientAssignment(
                "retain", f"retain-{('authors-a', 'world', 'authors-b')[c % 3]}", tuple(chosen)
            )
        )
    return out


def tofu_assignments(
    data: TofuData,
    *,
    forget_percent: float = 1.0,
    num_forget_clients: int = 5,
    num_retain_clients: int = 1,
    retain_samples: int = 200,
    num_forget_domains: int = 1,
    retain_layout: str = "random",
    seed: int = 0,
) -> list[ClientAssignment]:
    """The FIRM paper's TOFU setup and its generalisations.

    Forget: the forget authors are split into ``num_forget_domains`` contiguous author groups
    (domains ``tofu-forget`` or ``tofu-forget-<d>``); each domain's QA are split into disjoint
    contiguous shards over its clients. Retain (``retain_layout``): ``random`` — each client a
    disjoint random sample of ``retain_samples`` retain QA; ``heterogeneous`` — clients cycle
    through fictitious authors (first half), real-world knowledge (real authors + world
    facts) and fictitious authors (second half), ``retain_samples`` records each at most.
    """
    if num_forget_clients < 1:
        raise ValueError(f"num_forget_clients must be >= 1, got {num_forget_clients}")
    if num_retain_clients < 0:
        raise ValueError(f"num_retain_clients must be >= 0, got {num_retain_clients}")
    forget = data.forget_split(forget_percent)
    if len(forget) < num_forget_clients:
        raise ValueError(
            f"forget-{forget_percent}% has {len(forget)} QA, fewer than "
            f"num_forget_clients={num_forget_clients}"
        )
    return _forget_clients(data, forget_percent, num_forget_clients, num_forget_domains) + (
        _retain_clients(
            data, forget_percent, num_retain_clients, retain_samples, retain_layout, seed
        )
    )
