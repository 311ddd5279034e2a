"""How the kept knowledge is split over the clients (``learn.partitioner``).

``iid`` and ``dirichlet`` are Flower Datasets' partitioners (``flwr_datasets.partitioner``:
``IidPartitioner``, ``DirichletPartitioner``) run over a table of the records' indices and
their authors; ``authors`` deals whole authors to a fixed number of clients, which none of
Flower Datasets' partitioners does (``NaturalIdPartitioner`` makes one part per author,
``GroupedNaturalIdPartitioner`` parts of a fixed number of authors).

Flower Datasets 0.6 declares ``datasets < 5``, which this project's ``transformers`` rules out;
its partitioners run unchanged on ``datasets`` 5, so it is installed beside the project with
``--no-deps`` (README, "Quick start") and imported only when a partition is made.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

PARTITIONERS = ("iid", "dirichlet", "authors")
#: Smallest part DirichletPartitioner accepts before it redraws the proportions
MIN_DIRICHLET_PART = 1


def partition(
    pool: Sequence[int],
    groups: Sequence[str],
    num_parts: int,
    how: str,
    seed: int,
    alpha: float = 0.5,
) -> list[tuple[int, ...]]:
    """Split the record indices ``pool`` into ``num_parts`` parts, each in the pool's order.

    * ``iid``: equal parts of a seeded random order (``IidPartitioner`` cuts the order into
      contiguous parts; the order is the seeded shuffle dealt round-robin, so the parts are those
      this project's ``iid`` always made);
    * ``dirichlet``: each author's records (``groups[i]`` names the author of ``pool[i]``)
      spread over the parts in Dirichlet(``alpha``) proportions, seeded
      (``DirichletPartitioner``; small ``alpha``: each author mostly on one client);
    * ``authors``: each author whole; the authors' order shuffled (seeded) and dealt to the parts
      with the fewest records first.
    """
    if num_parts < 1:
        raise ValueError(f"partition needs >= 1 part, got {num_parts}")
    if len(groups) != len(pool):
        raise ValueError(f"{len(groups)} group names for {len(pool)} records")
    rng = random.Random(seed)
    if how == "authors":
        parts = _whole_groups(pool, groups, num_parts, rng)
    elif how in ("iid", "dirichlet"):
        parts = _flower_datasets_parts(pool, groups, num_parts, how, rng, seed, alpha)
    else:
        raise ValueError(f"unknown partitioner {how!r} (expected one of {PARTITIONERS})")
    position = {index: i for i, index in enumerate(pool)}
    return [tuple(sorted(part, key=position.__getitem__)) for part in parts]


def _whole_groups(
    pool: Sequence[int], groups: Sequence[str], num_parts: int, rng: random.Random
) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    by_group: dict[str, list[int]] = {}
    for index, group in zip(pool, groups, strict=True):
        by_group.setdefault(group, []).append(index)
    names = list(by_group)
    rng.shuffle(names)
    for name in names:
        smallest = min(range(num_parts), key=lambda k: (len(parts[k]), k))
        parts[smallest].extend(by_group[name])
    return parts


def _flower_datasets_parts(
    pool: Sequence[int],
    groups: Sequence[str],
    num_parts: int,
    how: str,
    rng: random.Random,
    seed: int,
    alpha: float,
) -> list[list[int]]:
    from datasets import Dataset

    partitioners = _flower_datasets_partitioners()
    author = dict(zip(pool, groups, strict=True))
    if how == "iid":
        shuffled = list(pool)
        rng.shuffle(shuffled)
        order = [i for k in range(num_parts) for i in shuffled[k::num_parts]]
        if len(order) < num_parts:  # parts of one record and empty ones (IidPartitioner refuses)
            return [order[k : k + 1] for k in range(num_parts)]
        partitioner: Any = partitioners["iid"](num_partitions=num_parts)
    else:
        order = list(pool)
        partitioner = partitioners["dirichlet"](
            num_partitions=num_parts,
            partition_by="author",
            alpha=alpha,
            min_partition_size=MIN_DIRICHLET_PART,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    partitioner.dataset = Dataset.from_dict({"index": order, "author": [author[i] for i in order]})
    try:
        return [list(partitioner.load_partition(k)["index"]) for k in range(num_parts)]
    except ValueError as err:  # DirichletPartitioner gives up after its redraws
        raise ValueError(
            f"learn.partitioner={how!r} (learn.dirichlet-alpha={alpha:g}) cannot split the "
            f"{len(pool)} kept records into {num_parts} parts of at least "
            f"{MIN_DIRICHLET_PART}: {err}"
        ) from err


def _flower_datasets_partitioners() -> dict[str, Any]:
    try:
        from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner
    except ImportError as err:
        raise ImportError(
            "learn.partitioner 'iid' and 'dirichlet' use Flower Datasets, which is installed "
            "beside this project: pip install --no-deps 'flwr-datasets==0.6.1' "
            f"(README, 'Quick start'); {type(err).__name__}: {err}"
        ) from err
    return {"iid": IidPartitioner, "dirichlet": DirichletPartitioner}
