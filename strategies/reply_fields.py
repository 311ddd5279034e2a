"""Parsing a reply's metadata: its size, its metrics and its text fields (issue 13).

Everything a client writes besides its tensors (the ``metrics`` MetricRecord, the ``info``
ConfigRecord) is read here, inside the per-client validation, so that a broken value excludes
that client instead of aborting the round:

* :func:`reply_bytes` — the whole reply (arrays, every text, bytes and number of every
  record) counts against the upload limit, so a 50 MB string in ``info`` is refused like a
  50 MB tensor;
* :func:`parse_metrics` — every metric the server reports is a finite number of the right
  kind inside its range (:data:`REPLY_METRICS` for the unlearning replies);
* :func:`short_text` — a text field is a string of at most :data:`MAX_TEXT_CHARS` characters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import RecordDict

#: Largest count a client may report: examples (the FedAvg / merge weight), bytes.
MAX_COUNT = 1e9
#: Largest number of seconds or bytes a client may report (about 30 years; 1 PB).
MAX_REPORTED = 1e15
#: Longest text field (objective, stage, digest) a reply may hold.
MAX_TEXT_CHARS = 200
#: Metadata an honest reply needs on top of its arrays (``server.max-upload-mb = 0``): a few dozen
#: metrics and short texts, with a wide margin.
METADATA_ALLOWANCE = 2**20

_NUMBER_BYTES = 8  # a metric or config number as Flower serialises it


class ReplyRejected(ValueError):
    """A reply the server refuses to merge; the message names client, tensor and problem.

    Attributes: ``node`` (the client, e.g. its node id or ``"17 copy 1"``), ``problem``,
    ``kind`` (``"task-vector"`` / ``"Fisher"`` or None) and ``tensor`` (a name or None).
    """

    def __init__(
        self, node: Any, problem: str, *, kind: str | None = None, tensor: str | None = None
    ) -> None:
        self.node, self.problem, self.kind, self.tensor = node, problem, kind, tensor
        where = f"client {node}"
        if tensor is not None:
            where += f": {kind} tensor {tensor!r}"
        super().__init__(f"{where}: {problem}" if tensor is None else f"{where} {problem}")


@dataclass(frozen=True)
class MetricRule:
    """How one metric is read: its ``report`` key, ``kind`` (``count``: a whole number;
    ``flag``: 0 or 1; ``number``: any finite number), the range ``[low, high]`` and whether the
    reply must hold it (optional ones default to 0)."""

    report: str
    kind: str = "number"
    low: float = -math.inf
    high: float = math.inf
    required: bool = False


#: The metrics of an unlearning reply (``clients.client_app``) and their report keys.
REPLY_METRICS: dict[str, MetricRule] = {
    "num-examples": MetricRule("num_examples", "count", 0, MAX_COUNT, required=True),
    "bytes-sent": MetricRule("bytes_sent", "count", 0, MAX_REPORTED),
    "bytes-task-vector": MetricRule("bytes_task_vector", "count", 0, MAX_REPORTED),
    "bytes-fisher": MetricRule("bytes_fisher", "count", 0, MAX_REPORTED),
    "bytes-dense": MetricRule("bytes_dense", "count", 0, MAX_REPORTED),
    "task-vector-norm": MetricRule("task_vector_norm", low=0),
    "total-seconds": MetricRule("seconds", low=0, high=MAX_REPORTED),
    "train-seconds": MetricRule("train_seconds", low=0, high=MAX_REPORTED),
    "fisher-seconds": MetricRule("fisher_seconds", low=0, high=MAX_REPORTED),
    "loss-first": MetricRule("loss_first"),
    "loss-last": MetricRule("loss_last"),
    "cuda": MetricRule("cuda", "flag"),
    "peak-rss-mb": MetricRule("peak_rss_mb", low=0, high=MAX_REPORTED),
}


def _value_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(_value_bytes(v) for v in value)
    return _NUMBER_BYTES


def reply_bytes(content: RecordDict) -> int:
    """Bytes of the whole reply: every array's payload plus every key, text, bytes value and
    number of its metric and config records."""
    return array_bytes(content) + metadata_bytes(content)


def array_bytes(content: RecordDict) -> int:
    """Payload bytes of the reply's arrays."""
    return sum(
        len(array.data) for record in content.array_records.values() for array in record.values()
    )


def metadata_bytes(content: RecordDict) -> int:
    """Bytes of the reply's metric and config records (keys, texts, numbers)."""
    total = 0
    for records in (content.metric_records, content.config_records):
        for name, record in records.items():
            total += len(name) + sum(len(k) + _value_bytes(v) for k, v in record.items())
    return total


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about client-sent values."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit + 2 else text[:limit] + "…"


def clip(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters (free text a client sent, e.g. an error reason)."""
    return text if len(text) <= limit else text[:limit] + "…"


def short_text(node: Any, name: str, value: Any, *, required: bool = True) -> str:
    """The text field ``name``: a string of at most :data:`MAX_TEXT_CHARS` characters
    (``""`` when absent and not ``required``)."""
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ReplyRejected(node, f"info field {name!r} is {shown(value)}, not a string")
    if len(value) > MAX_TEXT_CHARS:
        raise ReplyRejected(
            node,
            f"info field {name!r} holds {len(value)} characters, more than {MAX_TEXT_CHARS}",
        )
    return value


def parse_metric(node: Any, name: str, value: Any, rule: MetricRule) -> float | int | bool:
    """One metric checked against ``rule``: a finite scalar of its kind inside its range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyRejected(node, f"metric {name!r} is a {type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ReplyRejected(node, f"metric {name!r} is {number}, not a finite number")
    if rule.kind == "flag":
        if number not in (0.0, 1.0):
            raise ReplyRejected(node, f"metric {name!r} must be 0 or 1, got {number}")
        return bool(number)
    if rule.kind == "count" and not number.is_integer():
        raise ReplyRejected(node, f"metric {name!r} is {number}, not a whole number")
    if not rule.low <= number <= rule.high:
        raise ReplyRejected(
            node, f"metric {name!r} is {number:g}, outside [{rule.low:g}, {rule.high:g}]"
        )
    return int(number) if rule.kind == "count" else number


def parse_metrics(
    node: Any, metrics: Mapping[str, Any], rules: Mapping[str, MetricRule]
) -> dict[str, float | int | bool]:
    """``{rule.report: value}`` for every metric of ``rules`` (optional absent ones: 0 of
    their kind); raises :class:`ReplyRejected` naming the client and metric on the first bad
    one. Metrics not in ``rules`` are not read."""
    out: dict[str, float | int | bool] = {}
    for name, rule in rules.items():
        if name not in metrics:
            if rule.required:
                raise ReplyRejected(node, f"reply's metrics have no {name!r}")
            out[rule.report] = {"count": 0, "flag": False}.get(rule.kind, 0.0)
            continue
        out[rule.report] = parse_metric(node, name, metrics[name], rule)
    return out


def exclusion_reason(node: Any, err: Exception) -> str:
    """What a client's ``excluded`` entry says about a reply whose reading raised ``err``."""
    if isinstance(err, ReplyRejected):
        return str(err)
    return f"client {node}: reply could not be read ({type(err).__name__}: {clip(str(err))})"


def parse_all_metrics(
    node: Any, metrics: Mapping[str, Any], rules: Mapping[str, MetricRule]
) -> dict[str, float | int | bool]:
    """Like :func:`parse_metrics`, and every other metric of the reply too, as a finite number
    reported under its name with ``-`` turned into ``_``."""
    out = parse_metrics(node, metrics, rules)
    for name, value in metrics.items():
        if name not in rules:
            rule = MetricRule(name.replace("-", "_"))
            out[rule.report] = parse_metric(node, name, value, rule)
    return out
