"""Steps of a training round's aggregation shared by the merge strategy and FedAvg (dp2u).

``aggregate_train`` of both strategies runs *collect* (every reply read and validated once, a
report per node; bad, duplicate, unexpected and missing replies excluded with their reason) →
their own checks and aggregation (merge, or FedAvg) → *check* the new weights → checkpoint →
report.  What the two share lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Generic, TypeVar

from flwr.app import Message
from flwr.common.logger import log

from strategies.reply_fields import exclusion_reason
from strategies.reply_validation import NO_REPLY_REASON, ReplyRejected

T = TypeVar("T")


def exclude(report: dict[str, Any], reason: str) -> None:
    """Mark a client's report as excluded, with its reason, and log it."""
    report["excluded"] = reason
    log(WARNING, "excluding client %s: %s", report["node_id"], reason)


@dataclass
class CollectedReplies(Generic[T]):
    """What :func:`collect_replies` read: ``values`` of the nodes whose reply was read well,
    ``reports`` (one per reply in arrival order, then one per node that never replied) and
    ``first`` (the report of each expected node's first reply)."""

    values: dict[int, T] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    first: dict[int, dict[str, Any]] = field(default_factory=dict)


def collect_replies(
    replies: Iterable[Message],
    expected: Mapping[int, Mapping[str, Any]],
    read: Callable[[int, Message, dict[str, Any]], T],
) -> CollectedReplies[T]:
    """Read each reply with ``read(node_id, reply, report)`` (which may add fields to the
    node's report and raises for a reply that must not count).

    ``expected`` maps the nodes this round was sent to onto the fields their reports start
    with.  A reply from another node, a node's second reply, and a reply ``read`` raises for
    are excluded (``report["excluded"]``, the reason naming the node); an expected node that
    did not reply gets a report excluded with :data:`NO_REPLY_REASON`.  Nothing a reply holds
    stops the others from being read.
    """
    out: CollectedReplies[T] = CollectedReplies()
    for reply in replies:
        node_id = reply.metadata.src_node_id
        report: dict[str, Any] = {"node_id": node_id, **expected.get(node_id, {})}
        out.reports.append(report)
        try:
            if node_id not in expected:
                raise ReplyRejected(node_id, "is not a node this round was sent to")
            if node_id in out.first:
                raise ReplyRejected(node_id, "replied twice; only the first reply counts")
            out.first[node_id] = report
            out.values[node_id] = read(node_id, reply, report)
        except Exception as err:  # noqa: BLE001 — whatever a reply holds, it only excludes it
            exclude(report, exclusion_reason(node_id, err))
    for node_id, fields in expected.items():
        if node_id not in out.first:
            report = {"node_id": node_id, **fields}
            out.reports.append(report)
            exclude(report, str(ReplyRejected(node_id, NO_REPLY_REASON)))
    return out
