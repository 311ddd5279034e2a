"""Checks every client reply must pass before the server merges it (issue 7).

Each check is one function that raises :class:`ReplyRejected` naming the client, the tensor
(where there is one) and the problem. The strategy calls them —
``MergeStrategy.aggregate_train`` (payload size, the round's key sets, the minimum number of
valid replies), ``MergeStrategy.decode_reply`` and ``MpuStrategy``'s per-copy decoding
(:func:`validate_reply_content`) — excludes a client that fails one and records the message
in ``results.json`` as ``clients[*].excluded``.

What a valid reply is:

* the whole reply (arrays, texts, metrics) takes at most the upload limit (``server.max-upload-mb``;
  by default the largest honest reply: a float64 task vector and Fisher for every weight of
  the global model per copy, plus ``reply_fields.METADATA_ALLOWANCE``);
* its metrics are finite numbers of the right kind in range (``reply_fields.REPLY_METRICS``)
  and its ``objective`` a short string;
* it has the ``task_vector``, ``metrics`` and ``info`` records, a known role equal to the
  role the server assigned to that node, and the domain the server assigned to that node;
* every task-vector tensor is a weight of the global model with the same shape, floating
  point, finite and no entry above ``sanity.MAX_ABS_VALUE`` in magnitude; all clients of a
  round send the same key set (the majority set wins);
* a Fisher diagonal, when sent (required for the merges in :data:`FISHER_MERGES`, from every
  client), has exactly the task vector's keys and shapes, is floating point, finite, >= 0 and
  bounded like the task vector.

Any exception while a reply is read excludes that client (``MergeStrategy``); only
:class:`RoundFailedError` ends a round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedunlearn.merging import MERGES
from fedunlearn.merging.base import ROLES
from fedunlearn.merging.sanity import MAX_ABS_VALUE
from fedunlearn.upload_codec import DecodedTensors, UploadFormatError
from strategies.reply_fields import (
    METADATA_ALLOWANCE,
    REPLY_METRICS,
    ReplyRejected,
    parse_metrics,
    short_text,
    shown,
)

#: Merges that weight clients by their Fisher diagonal and therefore need one from EVERY
#: client (FIRM: ``firm._group`` refuses any client without Fisher, forget and retain alike).
#: A plug-in merge declares the same with a ``needs_fisher = True`` attribute.
FISHER_MERGES: tuple[str, ...] = ("firm",)

#: ``excluded`` reason of a node that was sent a task but whose reply never came.
NO_REPLY_REASON = (
    "no reply within server.round-timeout (the client crashed, was lost or is a straggler)"
)

#: Records every reply (or MPU copy, after ``_copy_reply``) must hold.
REQUIRED_RECORDS: tuple[str, ...] = ("task_vector", "metrics", "info")

_MB = 2**20


class RoundFailedError(RuntimeError):
    """The round cannot be merged safely (too few valid replies, or a merged update that is
    non-finite or absurd): the round fails, the global model is kept and nothing of the round
    is checkpointed."""


@dataclass(frozen=True)
class ReplySpec:
    """What the server expects from one node's reply.

    Attributes:
        role: the role the server assigned (None: not known, only checked to be a known role).
        domain: the domain the server assigned (None: not checked).
        shapes: ``{weight name: shape}`` of the global model (None: not checked).
        needs_fisher: the merge needs a Fisher diagonal from this client.
        merge: the merge's name, for the message.
        max_rank: the run's LoRA rank: a task vector uploaded as factors of a higher rank is
            refused before its product is computed (None: not checked).
    """

    role: str | None
    domain: str | None
    shapes: Mapping[str, tuple[int, ...]] | None
    needs_fisher: bool
    merge: str = ""
    max_rank: int | None = None


# ---- facts about the server side ---------------------------------------------------------


def merge_needs_fisher(merge_fn: Any) -> bool:
    """True when ``merge_fn`` is one of :data:`FISHER_MERGES` or has ``needs_fisher = True``."""
    if bool(getattr(merge_fn, "needs_fisher", False)):
        return True
    return any(MERGES.get(name) is merge_fn for name in FISHER_MERGES)


def expected_shapes(arrays: ArrayRecord) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the global model's weights (metadata only, nothing decoded)."""
    return {name: tuple(int(d) for d in array.shape) for name, array in arrays.items()}


def auto_upload_limit(
    shapes: Mapping[str, tuple[int, ...]], copies: int = 1, tensors_per_copy: int = 2
) -> int:
    """The largest honest reply in bytes: ``copies`` × ``tensors_per_copy`` (task vector and
    Fisher; FedAvg: the weights) in float64 for every weight of the global model, plus the
    metadata allowance (``server.max-upload-mb = 0``)."""
    numel = sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values())
    return int(copies) * int(tensors_per_copy) * 8 * numel + METADATA_ALLOWANCE


# ---- one check each --------------------------------------------------------------------


def check_payload_size(node: Any, nbytes: int, limit_bytes: int) -> None:
    """The reply (``reply_fields.reply_bytes``) must not exceed ``limit_bytes``."""
    if limit_bytes > 0 and nbytes > limit_bytes:
        raise ReplyRejected(
            node,
            f"reply holds {nbytes / _MB:.1f} MB (arrays and metadata), over the upload limit of "
            f"{limit_bytes / _MB:.1f} MB (server.max-upload-mb)",
        )


def check_records(node: Any, content: RecordDict) -> None:
    """The reply must hold the records of :data:`REQUIRED_RECORDS` with the right record types
    (``task_vector`` / ``fisher``: ArrayRecord, ``metrics``: MetricRecord with ``num-examples``,
    ``info``: ConfigRecord)."""
    for name in REQUIRED_RECORDS:
        if name not in content:
            raise ReplyRejected(node, f"reply has no {name!r} record")
    kinds: dict[str, type[ArrayRecord | MetricRecord | ConfigRecord]] = {
        "task_vector": ArrayRecord,
        "fisher": ArrayRecord,
    }
    kinds.update(metrics=MetricRecord, info=ConfigRecord)
    for name, kind in kinds.items():
        if name in content and not isinstance(content[name], kind):
            raise ReplyRejected(node, f"reply's {name!r} record is not a {kind.__name__}")
    if "num-examples" not in content["metrics"]:
        raise ReplyRejected(node, "reply's metrics have no 'num-examples'")


def check_role(node: Any, role: str, expected: str | None) -> None:
    """The role must be known (``fedunlearn.merging.ROLES``) and the one the server assigned."""
    if role not in ROLES:
        raise ReplyRejected(node, f"unknown role {shown(role)} (expected one of {ROLES})")
    if expected is not None and role != expected:
        raise ReplyRejected(node, f"replied as role {shown(role)} but was assigned {expected!r}")


def check_domain(node: Any, domain: str, expected: str | None) -> None:
    """The domain must be the one the server assigned to that node."""
    if expected is not None and domain != expected:
        raise ReplyRejected(
            node, f"replied for domain {shown(domain)} but was assigned {expected!r}"
        )


def check_task_vector_keys(
    node: Any, names: Collection[str], shapes: Mapping[str, tuple[int, ...]] | None
) -> None:
    """At least one tensor, and every task-vector key a weight of the global model."""
    if not names:
        raise ReplyRejected(node, "sent an empty task vector")
    if shapes is None:
        return
    unknown = sorted(n for n in names if n not in shapes)
    if unknown:
        raise ReplyRejected(
            node, "is not a weight of the global model", kind="task-vector", tensor=unknown[0]
        )


def check_fisher_present(node: Any, has_fisher: bool, spec: ReplySpec) -> None:
    """A Fisher-based merge (:func:`merge_needs_fisher`) needs a Fisher from every client."""
    if spec.needs_fisher and not has_fisher:
        raise ReplyRejected(
            node,
            f"sent no Fisher diagonal, but merge {spec.merge or 'this merge'!r} weights every "
            "client by its Fisher",
        )


def check_fisher_keys(node: Any, fisher_names: Collection[str], tv_names: Collection[str]) -> None:
    """The Fisher diagonal must have exactly the task vector's keys."""
    missing = sorted(set(tv_names) - set(fisher_names))
    extra = sorted(set(fisher_names) - set(tv_names))
    if missing:
        raise ReplyRejected(
            node, "is missing from the Fisher", kind="task-vector", tensor=missing[0]
        )
    if extra:
        raise ReplyRejected(node, "has no task vector", kind="Fisher", tensor=extra[0])


def load_values(node: Any, kind: str, name: str, array: Array) -> np.ndarray:
    """The array's values; a payload that cannot be decoded as a NumPy array is rejected."""
    if array.stype != "numpy.ndarray":
        raise ReplyRejected(node, f"has serialisation {array.stype!r}", kind=kind, tensor=name)
    try:
        return array.numpy()
    except Exception as err:  # noqa: BLE001 — any decoding failure is the client's problem
        raise ReplyRejected(node, f"cannot be decoded ({err})", kind=kind, tensor=name) from None


def check_dtype(node: Any, kind: str, name: str, dtype: np.dtype) -> None:
    """Only floating-point tensors are accepted."""
    if np.dtype(dtype).kind != "f":
        raise ReplyRejected(
            node, f"has non-floating dtype {np.dtype(dtype)}", kind=kind, tensor=name
        )


def check_shape(
    node: Any, kind: str, name: str, shape: tuple[int, ...], expected: tuple[int, ...] | None
) -> None:
    """The tensor's shape must equal the global weight's (or the task vector's) shape."""
    if expected is not None and tuple(shape) != tuple(expected):
        raise ReplyRejected(
            node,
            f"has shape {tuple(shape)} but the global weight has shape {tuple(expected)}",
            kind=kind,
            tensor=name,
        )


def check_finite(node: Any, kind: str, name: str, values: np.ndarray) -> None:
    """No NaN or infinity."""
    finite = np.isfinite(values)
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        raise ReplyRejected(
            node, f"contains {bad} non-finite value(s) (NaN or inf)", kind=kind, tensor=name
        )


def check_magnitude(node: Any, kind: str, name: str, values: np.ndarray) -> None:
    """No entry above ``sanity.MAX_ABS_VALUE`` in magnitude (finite values only)."""
    if values.size == 0:
        return
    largest = float(max(values.max(), -values.min()))
    if largest > MAX_ABS_VALUE:
        raise ReplyRejected(
            node,
            f"has an entry of magnitude {largest:.3g}, above the bound {MAX_ABS_VALUE:g} "
            "no honest upload comes near",
            kind=kind,
            tensor=name,
        )


def check_nonnegative(node: Any, kind: str, name: str, values: np.ndarray) -> None:
    """A Fisher diagonal (a mean of squared gradients) is never negative."""
    negative = int(np.count_nonzero(values < 0))
    if negative:
        raise ReplyRejected(
            node,
            f"contains {negative} negative value(s); a Fisher diagonal must be >= 0",
            kind=kind,
            tensor=name,
        )


def check_same_key_sets(key_sets: Mapping[Any, Collection[str]]) -> dict[Any, str]:
    """All clients of a round must send the same task-vector key set.

    ``key_sets`` maps each valid client (in the scenario's order) to its key set. The set most
    clients sent wins (a tie goes to the set of the earliest client); returns ``{client:
    reason}`` for every client that sent another set (empty when all agree).
    """
    sets = {node: frozenset(keys) for node, keys in key_sets.items()}
    if len(set(sets.values())) <= 1:
        return {}
    counts = Counter(sets.values())
    top = max(counts.values())
    majority = next(s for s in sets.values() if counts[s] == top)
    reasons = {}
    for node, keys in sets.items():
        if keys != majority:
            missing, extra = sorted(majority - keys), sorted(keys - majority)
            reasons[node] = str(
                ReplyRejected(
                    node,
                    f"sent another task-vector key set than the {counts[majority]} client(s) "
                    f"of the round's majority (missing {missing[:5]}, extra {extra[:5]})",
                )
            )
    return reasons


def check_min_replies(
    valid: Sequence[tuple[str, str]], min_replies: int, forget_domains: Collection[str]
) -> str | None:
    """Whether the round may go on with the ``valid`` (role, domain) updates; None = yes.

    Always: at least one forget update. ``min_replies > 0``: at least that many valid updates.
    ``min_replies = 0`` (default): every forget domain the server assigned keeps at least one
    valid forget update (a domain without one would not be unlearned at all).
    Returns the problem otherwise.
    """
    forget = [domain for role, domain in valid if role == "forget"]
    if not forget:
        return "no valid forget update to merge"
    if min_replies > 0:
        if len(valid) < min_replies:
            return f"only {len(valid)} valid update(s), server.min-replies is {min_replies}"
        return None
    uncovered = sorted(set(forget_domains) - set(forget))
    if uncovered:
        return (
            f"no valid forget update for domain(s) {uncovered} (server.min-replies=0 needs one per "
            "assigned forget domain)"
        )
    return None


# ---- all per-reply checks in order ------------------------------------------------------


def validate_reply_content(node: Any, content: RecordDict, spec: ReplySpec) -> dict[str, Any]:
    """Every per-reply check of one single-copy reply (``task_vector`` / ``fisher`` /
    ``metrics`` / ``info``) against ``spec``; raises :class:`ReplyRejected` on the first
    problem. Decodes each array once, one at a time.

    Returns the report fields the reply gives (``objective`` and the parsed
    :data:`~strategies.reply_fields.REPLY_METRICS`: ``num_examples``, ``bytes_sent``, ...).
    """
    check_records(node, content)
    info = content["info"]
    check_role(node, str(info.get("role", "")), spec.role)
    check_domain(node, str(info.get("domain", "")), spec.domain)
    fields: dict[str, Any] = {
        "objective": short_text(node, "objective", info.get("objective"), required=False)
    }
    fields.update(parse_metrics(node, content["metrics"], REPLY_METRICS))
    has_fisher = "fisher" in content
    check_fisher_present(node, has_fisher, spec)
    # check_records checked the record types
    task_vector = decoded_record(
        node, "task-vector", cast(ArrayRecord, content["task_vector"]), spec.shapes
    )
    check_task_vector_keys(node, list(task_vector), spec.shapes)
    check_factor_ranks(node, task_vector, spec.max_rank)
    records = [("task-vector", task_vector)]
    if has_fisher:
        fisher = decoded_record(node, "Fisher", cast(ArrayRecord, content["fisher"]), spec.shapes)
        check_fisher_keys(node, list(fisher), list(task_vector))
        records.append(("Fisher", fisher))
    tv_shapes: dict[str, tuple[int, ...]] = {}
    for kind, record in records:
        for name in record:
            values = decoded_values(node, kind, name, record)
            expected = spec.shapes[name] if spec.shapes is not None else tv_shapes.get(name)
            check_shape(node, kind, name, values.shape, expected)
            check_finite(node, kind, name, values)
            check_magnitude(node, kind, name, values)
            if kind == "Fisher":
                check_nonnegative(node, kind, name, values)
            else:
                tv_shapes[name] = tuple(values.shape)
            del values
    return fields


def check_factor_ranks(node: Any, task_vector: DecodedTensors, max_rank: int | None) -> None:
    """LoRA factors of at most the run's rank (a higher rank would make the server spend
    up to a dense matrix product per tensor on one client's say-so)."""
    if max_rank is None:
        return
    for name in task_vector:
        rank = task_vector.factor_rank(name)
        if rank is not None and rank > max_rank:
            raise ReplyRejected(
                node,
                f"is uploaded as LoRA factors of rank {rank}, above the run's lora.rank {max_rank}",
                kind="task-vector",
                tensor=name,
            )


def decoded_record(
    node: Any, kind: str, record: ArrayRecord, shapes: Mapping[str, tuple[int, ...]] | None
) -> DecodedTensors:
    """The record's weights, decoded one at a time from their upload parts
    (:mod:`fedunlearn.upload_codec`); parts that do not form an upload are rejected."""
    try:
        return DecodedTensors(list(record), lambda name: _part(node, kind, record, name), shapes)
    except UploadFormatError as err:
        raise ReplyRejected(node, err.problem, kind=kind, tensor=err.key) from None


def _part(node: Any, kind: str, record: ArrayRecord, name: str) -> torch.Tensor:
    values = load_values(node, kind, name, record[name])
    if values.dtype.kind not in "fiu":
        raise ReplyRejected(node, f"has dtype {values.dtype}", kind=kind, tensor=name)
    return torch.from_numpy(values)


def decoded_values(node: Any, kind: str, name: str, record: DecodedTensors) -> np.ndarray:
    """Weight ``name``'s dense values (floating point: the codec refuses other dtypes) as a
    NumPy array."""
    try:
        return record[name].detach().numpy()
    except UploadFormatError as err:
        raise ReplyRejected(node, err.problem, kind=kind, tensor=name) from None
