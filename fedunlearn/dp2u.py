"""DP2Unlearning, federated (docs/algorithms.md, "DP2Unlearning"): who holds which records and
the proof of what reached a training loop.

Every data client holds a contiguous shard of the fictitious authors (all of their QA).
A forget request names authors (TOFU convention: the last ``forget_percent`` % of them), or
names authors and single records on named clients (:class:`ForgetRequest`); the clients
holding them keep every other record. Stage A trains the base model BM_DP under
DP on all records, stage B fine-tunes it on all records (deployed model FM), stage C
restarts from BM_DP on the retained records only (unlearned model UM). The forgotten records
were only ever seen under (ε, δ)-DP, so UM carries that guarantee for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedunlearn.benchmarks.tofu import TofuData
from fedunlearn.options import (
    POSITIVE,
    POSITIVE_INT,
    Number,
    OneOf,
    option,
    option_group,
)
from fedunlearn.training.batching import Example

STAGES = ("dp-base", "mlm-base", "public-base", "deploy", "unlearn", "retrain")
#: The DP2Unlearning methods and the baselines run by the same pipeline.
DP2U_METHODS = ("dp2u-sgd", "dp2u-mlm", "rfs-r", "ga", "graddiff", "kl", "idk")


@option_group("dp2u")
@dataclass(frozen=True)
class Dp2uOptions:
    """DP2Unlearning (``pipeline = "dp2u"``; ``[tool.flwr.app.config.dp2u]``)."""

    method: str = option(
        "dp2u-sgd",
        "dp2u-sgd, dp2u-mlm, or the baselines rfs-r, ga, graddiff, kl, idk",
        OneOf(lambda: DP2U_METHODS),
    )
    clients: int = option(
        2, "data clients (contiguous author shards; the forget authors on the last)", POSITIVE_INT
    )
    epsilon: float = option(
        1.0, "DP-SGD: ε per client for all stage-A rounds; DP-MLM: ε per replaced token", POSITIVE
    )
    delta: float = option(1e-5, "DP-SGD: δ", Number(low=0, high=1, low_open=True, high_open=True))
    clip: float = option(1.0, "DP-SGD: per-example clipping norm C", POSITIVE)
    dp_rounds: int = option(2, "stage A: rounds (one epoch each)", POSITIVE_INT)
    dp_lr: float = option(0.05, "stage A: SGD learning rate", POSITIVE)
    dp_batch_size: int = option(64, "stage A: expected Poisson batch q·N", POSITIVE_INT)
    finetune_rounds: int = option(3, "E′: rounds of stages B and C", POSITIVE_INT)
    retrain_rounds: int = option(
        6, "E: rounds of RFS-R and of the non-DP deployed model", POSITIVE_INT
    )
    local_epochs: int = option(4, "local epochs per round of the non-DP stages", POSITIVE_INT)
    lr: float = option(4e-3, "non-DP federated training: AdamW learning rate", POSITIVE)
    batch_size: int = option(32, "non-DP federated training: batch size", POSITIVE_INT)
    public_knowledge: bool = option(
        True, "every data client also trains on the public knowledge (never forgotten)"
    )
    mlm_sensitive_only: bool = option(
        False, "DP-MLM: rewrite only the generator's marked names and values"
    )
    mlm_path: str = option("", 'DP-MLM: a local masked-LM checkpoint; "" = one trained here')
    forget_request: str = option(
        "",
        'a named forget request, JSON {"<client>": {"authors": [...], "records": [...]}} or '
        'the path of a JSON file; "" = the last scenario.forget-percent % of the authors '
        "(read and checked when pipeline = dp2u)",
    )


@dataclass(frozen=True)
class DataShard:
    """One data client's records: ``indices`` into the scenario's records (its private author
    QA), ``forget`` ⊆ ``indices``, the records a forget request removes from this client, and
    ``public``: public knowledge every client also trains on (never forgotten, not private)."""

    indices: tuple[int, ...]
    forget: tuple[int, ...]
    public: tuple[int, ...] = ()

    @property
    def retained(self) -> tuple[int, ...]:
        """D_r on this client: its records minus the forgotten ones, then the public ones."""
        gone = set(self.forget)
        return tuple(i for i in self.indices if i not in gone) + self.public

    @property
    def training(self) -> tuple[int, ...]:
        """Everything this client trains on before any forget request: private + public."""
        return self.indices + self.public


def _records_by_author(data: TofuData) -> dict[str, list[int]]:
    """Author name → indices of their QA in ``data.author_qa``, in author order."""
    by_author: dict[str, list[int]] = {a: [] for a in data.author_names}
    for i, record in enumerate(data.author_qa):
        by_author[record["author"]].append(i)
    return by_author


def data_shards(
    data: TofuData,
    num_clients: int,
    forget_percent: float,
    public: tuple[int, ...] = (),
) -> list[DataShard]:
    """Contiguous author shards (every author's QA on one client), the forget authors marked,
    and the same ``public`` record indices on every client.

    Author order is the benchmark's, so the forget authors (the last ones) sit on the last
    client(s), as a deletion request would hit whoever holds those people's data.
    """
    authors = data.author_names
    if not 1 <= num_clients <= len(authors):
        raise ValueError(f"dp2u.clients must be in [1, {len(authors)}], got {num_clients}")
    forget_authors = set(data.forget_authors(forget_percent))
    by_author = _records_by_author(data)
    bounds = [round(k * len(authors) / num_clients) for k in range(num_clients + 1)]
    shards = []
    for k in range(num_clients):
        names = authors[bounds[k] : bounds[k + 1]]
        indices = tuple(i for a in names for i in by_author[a])
        forget = tuple(i for a in names if a in forget_authors for i in by_author[a])
        shards.append(DataShard(indices, forget, tuple(public)))
    return shards


@dataclass(frozen=True)
class ForgetRequest:
    """What one client is asked to forget: every record of ``authors`` it holds and the single
    ``records`` (indices into the benchmark's author QA, dataset order)."""

    client: int
    authors: tuple[str, ...] = ()
    records: tuple[int, ...] = ()


def json_or_file(key: str, text: str) -> str:
    """The JSON text of run-config key ``key``: ``text`` itself when it is a JSON object, else
    the contents of the file it names (``~`` expanded); a clear error when it is neither."""
    text = text.strip()
    if text.startswith("{"):
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"{key}: {text!r} is neither JSON nor a file")
    return path.read_text()


def parse_forget_request(text: str) -> list[ForgetRequest]:
    """``{"<client>": {"authors": [...], "records": [...]}, ...}`` (JSON) → requests in client
    order. Syntax and types only; :func:`apply_forget_request` checks them against the data."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"forget request is not valid JSON: {err}") from None
    return forget_requests(raw)


def forget_requests(raw: object) -> list[ForgetRequest]:
    """:func:`parse_forget_request` of the already decoded JSON value ``raw``."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            'forget request must be a non-empty JSON object {"<client>": {"authors": [...], '
            f'"records": [...]}}, got {json.dumps(raw)[:80]!r}'
        )
    requests = []
    for client, entry in raw.items():
        if not str(client).isdigit():
            raise ValueError(f"forget request: client {client!r} is not a client index")
        if not isinstance(entry, dict) or set(entry) - {"authors", "records"}:
            raise ValueError(
                f"forget request for client {client}: expected an object with 'authors' "
                f"and/or 'records', got {entry!r}"
            )
        authors, records = entry.get("authors", []), entry.get("records", [])
        if not isinstance(authors, list) or not all(isinstance(a, str) for a in authors):
            raise ValueError(f"forget request for client {client}: 'authors' must be names")
        if not isinstance(records, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in records
        ):
            raise ValueError(f"forget request for client {client}: 'records' must be indices")
        if not authors and not records:
            raise ValueError(f"forget request for client {client}: names nothing to forget")
        requests.append(ForgetRequest(int(client), tuple(authors), tuple(records)))
    return sorted(requests, key=lambda r: r.client)


def apply_forget_request(
    data: TofuData, shards: Sequence[DataShard], requests: Sequence[ForgetRequest]
) -> list[DataShard]:
    """``shards`` with their forget sets replaced by ``requests``; clients not named forget
    nothing. Every name and index must exist and sit on the client the request names."""
    owner = {i: k for k, sh in enumerate(shards) for i in sh.indices}
    by_author = _records_by_author(data)
    forget: dict[int, set[int]] = {k: set() for k in range(len(shards))}
    for request in requests:
        k = request.client
        if not 0 <= k < len(shards):
            raise ValueError(
                f"forget request: client {k} does not exist (clients 0..{len(shards) - 1})"
            )
        for author in request.authors:
            if author not in by_author:
                raise ValueError(f"forget request for client {k}: no author named {author!r}")
            held_by = owner[by_author[author][0]]
            if held_by != k:
                raise ValueError(
                    f"forget request for client {k}: author {author!r} is held by client "
                    f"{held_by}, not client {k}"
                )
            forget[k].update(by_author[author])
        for i in request.records:
            if i not in owner:
                raise ValueError(
                    f"forget request for client {k}: record {i} is not an author QA index "
                    f"(0..{len(data.author_qa) - 1})"
                )
            if owner[i] != k:
                raise ValueError(
                    f"forget request for client {k}: record {i} is held by client {owner[i]}"
                )
            forget[k].add(i)
    out = [
        dataclasses.replace(sh, forget=tuple(i for i in sh.indices if i in forget[k]))
        for k, sh in enumerate(shards)
    ]
    for k, sh in enumerate(out):
        if not sh.retained:
            raise ValueError(f"forget request for client {k}: the client would keep no records")
    return out


def examples_digest(examples: Sequence[Example]) -> str:
    """SHA-256 over the sorted token sequences of ``examples``: what a client reports about
    the data that reached its training loop (order-free, reveals no text)."""
    h = hashlib.sha256()
    for ids, labels in sorted((tuple(i), tuple(lab)) for i, lab in examples):
        h.update(repr((ids, labels)).encode())
    return h.hexdigest()
