"""Deletion requests over time (docs/scenarios.md, "Deletion requests over time"): a schedule of
forget requests, each served by the unlearning round it names.

``requests.schedule`` maps a round to the forget requests that arrive before it, each in the
form of dp2u's forget request (:func:`fedunlearn.dp2u.parse_forget_request`)::

    {"1": {"0": {"authors": ["A"]}}, "2": {"1": {"authors": ["B"]}}, "3": {"5": {"records": [7]}}}

Round r serves the requests of round r (every round of the run has at least one); after it
the model is evaluated on every request served so far (what was forgotten must stay
forgotten), on retain data and general utility. Clients hold their records as in the
federated learning stage (:func:`fedunlearn.learn.learn_shards`): a client that asks to forget
keeps the rest of its records, and a request must name records its client holds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedunlearn.dp2u import DataShard, ForgetRequest, forget_requests, json_or_file
from fedunlearn.evaluation.intervals import SCORE_SETS_KEY, SCORES_KEY, metric_intervals
from fedunlearn.evaluation.tofu_metrics import forget_quality
from fedunlearn.options import option, option_group
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.scenarios.tofu import TOFU_FORGET_DOMAIN


@option_group("requests")
@dataclass(frozen=True)
class RequestsOptions:
    """Deletion requests over time (``[tool.flwr.app.config.requests]``)."""

    schedule: str = option(
        "",
        'forget requests by round, JSON {"<round>": {"<client>": {"authors": [...], '
        '"records": [...]}}} or the path of a JSON file; "" = no schedule (the scenario\'s '
        "forget split in every round)",
    )


def read_schedule(text: str, num_rounds: int | None = None) -> dict[int, list[ForgetRequest]]:
    """``requests.schedule`` (inline JSON or a JSON file) → the requests of each round, rounds
    ascending; {} when unset. With ``num_rounds``, rounds 1..num_rounds must each have
    requests and none come later. Syntax and types only: the pipeline checks the names and
    indices against the clients' records before any round."""
    if not text.strip():
        return {}
    text = json_or_file("requests.schedule", text)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"requests.schedule is not valid JSON: {err}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            'requests.schedule must be a non-empty JSON object {"<round>": {"<client>": '
            f'{{"authors": [...], "records": [...]}}}}, got {text[:80]!r}'
        )
    schedule: dict[int, list[ForgetRequest]] = {}
    for round_text, requests in raw.items():
        if not str(round_text).isdigit() or int(round_text) < 1:
            raise ValueError(f"requests.schedule: round {round_text!r} is not a round >= 1")
        try:
            schedule[int(round_text)] = forget_requests(requests)
        except ValueError as err:
            raise ValueError(f"requests.schedule, round {round_text}: {err}") from None
    if num_rounds is not None and sorted(schedule) != list(range(1, num_rounds + 1)):
        raise ValueError(
            f"requests.schedule names rounds {sorted(schedule)}: each round 1..{num_rounds} "
            "(num-rounds) needs its requests, and none may come later"
        )
    return dict(sorted(schedule.items()))


#: The domain of every retain upload in a schedule's rounds
RETAIN_DOMAIN = "retain"


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of the schedule, checked against the clients' records: it arrives before
    round ``round`` and asks client ``client`` to forget ``records`` (author QA indices)."""

    round: int
    client: int
    authors: tuple[str, ...]
    records: tuple[int, ...]


def round_assignments(
    shards: Sequence[DataShard],
    serving: Sequence[ScheduledRequest],
    forgotten: Collection[int],
    *,
    retain_samples: int,
    local_retain_samples: int,
    seed: int,
    mixed_clients: int = 0,
) -> list[ClientAssignment]:
    """Who does what in one round of the schedule, one assignment per client in shard order: a
    client asked to forget (``serving``) unlearns the requested records (with
    ``local_retain_samples`` of the records it keeps as local retain data); every other client
    retains a seeded sample of ``retain_samples`` of the records it keeps. A client among the
    first ``mixed_clients`` that is asked to forget is mixed-role: it also uploads a retain
    task vector of such a sample from the same node. Records forgotten in this or an earlier
    round (``forgotten``) are nobody's retain data any more."""
    rng = random.Random(seed)
    asked: dict[int, list[int]] = {}
    for request in serving:
        asked.setdefault(request.client, []).extend(request.records)
    gone = set(forgotten)
    out = []
    for k, shard in enumerate(shards):
        kept = [i for i in shard.indices if i not in gone]
        if k in asked:
            local = rng.sample(kept, min(local_retain_samples, len(kept)))
            records = tuple(dict.fromkeys(asked[k]))
            also = _retain_sample(k, kept, retain_samples, rng) if k < mixed_clients else ()
            out.append(
                ClientAssignment(
                    "forget",
                    TOFU_FORGET_DOMAIN,
                    records,
                    tuple(local),
                    kept_indices=also,
                    kept_domain=RETAIN_DOMAIN if also else "",
                )
            )
        else:
            sample = _retain_sample(k, kept, retain_samples, rng)
            out.append(ClientAssignment("retain", RETAIN_DOMAIN, sample))
    return out


def _retain_sample(client: int, kept: list[int], size: int, rng: random.Random) -> tuple[int, ...]:
    """A seeded sample of at most ``size`` of the records client ``client`` keeps."""
    if not kept:
        raise ValueError(f"client {client} keeps no records to retain")
    return tuple(sorted(rng.sample(kept, min(size, len(kept)))))


def request_metrics(
    metrics: Mapping[str, Any],
    positions: Sequence[int],
    reference: Mapping[str, Any] | None,
    seed: int,
) -> tuple[dict[str, float | None], dict[str, list[float]]]:
    """One request's forget metrics from a whole-forget-split evaluation: the means of the
    per-question forget scores at ``positions`` (the request's questions in the forget split),
    forget quality against the reference's truth ratios on the same questions, and their
    95 % percentile-bootstrap intervals over the request's questions."""
    scores = metrics[SCORES_KEY]
    names = [n for n in scores if n.startswith("forget_")]
    view: dict[str, Any] = {
        SCORES_KEY: {n: [scores[n][p] for p in positions] for n in names},
        SCORE_SETS_KEY: {n: "forget" for n in names},
        "forget_truth_ratios": [metrics["forget_truth_ratios"][p] for p in positions],
    }
    values: dict[str, float | None] = {n: float(np.mean(view[SCORES_KEY][n])) for n in names}
    reference_view = None
    values["forget_quality"] = None
    if reference is not None:
        reference_view = {
            "forget_truth_ratios": [reference["forget_truth_ratios"][p] for p in positions]
        }
        values["forget_quality"] = forget_quality(
            view["forget_truth_ratios"], reference_view["forget_truth_ratios"]
        )
    view.update(values)
    return values, metric_intervals(view, reference_view, seed=seed)
