"""The federated learning stage (docs/scenarios.md, "Federated learning stage"): who trains the
knowledgeable model on which records, and with which Flower aggregation.

Instead of one central fine-tune on everything the clients hold, the knowledgeable model can
be learned federatedly from the pre-trained start: every client of the scenario's layout trains
on its own records for ``learn.local-epochs`` epochs per round, and a Flower strategy (FedAvg,
FedProx, FedAdam, FedYogi) aggregates the weights for ``learn.rounds`` rounds. The retain-only
reference is the same training without the forget records (federated retraining, the gold
standard), each forget client dropping them on its own node.

Record layout: each forget client holds its forget records (the scenario's assignment) and
every client — forget and retain — a share of the knowledge that is kept (``learn.partitioner``,
:mod:`fedunlearn.partitioners`: ``iid``, equal random parts; ``dirichlet``, each author's records
spread in Dirichlet proportions; ``authors``, whole authors per client), so that a forget
client is a data holder that also keeps data, as in deployments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedunlearn.dp2u import DataShard
from fedunlearn.options import NON_NEGATIVE, POSITIVE, POSITIVE_INT, OneOf, option, option_group
from fedunlearn.partitioners import PARTITIONERS, partition

#: Where the knowledgeable model and the reference come from (``learn.source``).
LEARN_SOURCES = ("central", "federated")
#: Flower's aggregation strategies the learning stage runs (``learn.strategy``).
LEARN_STRATEGY_NAMES = ("fedavg", "fedprox", "fedadam", "fedyogi")
#: What a client trains in a learning round (``learn.finetune``).
LEARN_FINETUNE = ("full", "lora")


@option_group("learn")
@dataclass(frozen=True)
class LearnOptions:
    """The federated learning stage (``[tool.flwr.app.config.learn]``)."""

    source: str = option(
        "central",
        "central: the knowledgeable model and the reference are fine-tuned on all the data in "
        "one place (cached); federated: learned by the clients with learn.strategy",
        OneOf(lambda: LEARN_SOURCES),
    )
    strategy: str = option(
        "fedavg",
        "Flower's aggregation of the learning rounds: fedavg, fedprox, fedadam, fedyogi",
        OneOf(lambda: LEARN_STRATEGY_NAMES),
    )
    rounds: int = option(20, "rounds of federated learning (each model)", POSITIVE_INT)
    local_epochs: int = option(3, "epochs over its own records per client and round", POSITIVE_INT)
    finetune: str = option(
        "full",
        "full: every weight; lora: a LoRA adapter (lora.rank, lora.targets) merged into the "
        "weights before they are sent",
        OneOf(lambda: LEARN_FINETUNE),
    )
    lr: float = option(
        3e-3, "clients' AdamW learning rate in round 1, cosine-decayed over the rounds", POSITIVE
    )
    batch_size: int = option(32, "clients' batch size", POSITIVE_INT)
    proximal_mu: float = option(
        0.01, "fedprox: μ of the proximal term μ/2·‖w − w_round‖² on the clients", NON_NEGATIVE
    )
    server_lr: float = option(
        3e-2, "fedadam / fedyogi: the server optimiser's step η (fedadam: measured best)", POSITIVE
    )
    partitioner: str = option(
        "iid",
        "how the kept knowledge is split over all clients (Flower Datasets' partitioners): iid "
        "(equal random parts), dirichlet (each author's records in Dirichlet proportions) or "
        "authors (whole authors per client)",
        OneOf(lambda: PARTITIONERS),
    )
    dirichlet_alpha: float = option(
        0.5, "dirichlet: the concentration α (small: each author mostly on one client)", POSITIVE
    )


def learn_shards(
    forget: Sequence[Sequence[int]],
    num_clients: int,
    kept: Sequence[int],
    kept_groups: Sequence[str],
    *,
    partitioner: str,
    seed: int,
    dirichlet_alpha: float = 0.5,
) -> list[DataShard]:
    """One :class:`~fedunlearn.dp2u.DataShard` per client of the layout: client ``k`` holds
    ``forget[k]`` (its forget records; forget clients come first, retain clients hold none)
    and part ``k`` of the ``kept`` knowledge. ``DataShard.forget`` marks the forget records,
    which the reference's training drops on the client."""
    if len(forget) > num_clients:
        raise ValueError(f"{len(forget)} forget clients but only {num_clients} clients")
    overlap = set(kept).intersection(i for part in forget for i in part)
    if overlap:
        raise ValueError(f"records {sorted(overlap)[:5]} are both kept and forgotten")
    parts = partition(kept, kept_groups, num_clients, partitioner, seed, dirichlet_alpha)
    shards = []
    for k in range(num_clients):
        own = tuple(forget[k]) if k < len(forget) else ()
        if not own and not parts[k]:
            raise ValueError(f"client {k} would hold no records to learn from")
        shards.append(DataShard(indices=own + parts[k], forget=own))
    return shards
