"""A single-round Flower strategy that runs a registered fedunlearn merge.

The strategy is thin: it sends every node its own role/shard config, decodes the replies
into ``ClientUpdate`` objects, calls the merge, and returns θ₀ + Δ as the new global model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from logging import INFO
from pathlib import Path
from typing import Any, NoReturn

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedunlearn.merging import ClientUpdate, MergeResult
from fedunlearn.merging.robust import apply_robust
from fedunlearn.merging.sanity import (
    DEFAULT_CLIENT_NORM_RATIO,
    DEFAULT_MAX_UPDATE_RATIO,
    check_ratio,
    norm_outliers,
)
from fedunlearn.scenarios import ClientAssignment
from strategies.checkpoint import RunCheckpoint
from strategies.memory import phase_peak_bytes, reset_phase_peak
from strategies.merge_plugins import merge_kwargs, resolve_merge, streams_delta
from strategies.mixed_replies import decode_kept_part, is_kept_part, kept_config, node_of
from strategies.model_delivery import ModelDelivery
from strategies.new_weights import NewWeights
from strategies.node_roles import assign_and_declare
from strategies.reply_fields import (
    array_bytes,
    clip,
    metadata_bytes,
    reply_bytes,
)
from strategies.reply_validation import (
    ReplyRejected,
    ReplySpec,
    RoundFailedError,
    auto_upload_limit,
    check_min_replies,
    check_payload_size,
    check_same_key_sets,
    expected_shapes,
    merge_needs_fisher,
    validate_reply_content,
)
from strategies.results import json_safe
from strategies.round_steps import collect_replies, exclude
from strategies.seeding import client_seed
from strategies.upload_spool import UploadSpool
from wire.messages import decode_client_reply, decoded_arrays


def drop_arrays(reply: Message) -> None:
    """Free a read reply's arrays (with the streaming spool, its update lives on disk)."""
    if not reply.has_error():
        for name in list(reply.content.array_records):
            del reply.content[name]


def wait_for_nodes(grid: Grid, expected: int, timeout: float) -> list[int]:
    """Sorted ids of the connected nodes once ``expected`` of them are there."""
    deadline = time.monotonic() + timeout
    while True:
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) >= expected:
            return node_ids
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(node_ids)} of the {expected} clients the scenario needs connected "
                f"within {timeout:.0f} s (set --federation-config num-supernodes={expected})"
            )
        time.sleep(0.5)


class MergeStrategy(Strategy):
    """Run the merge ``merge`` (a name in ``fedunlearn.merging.MERGES``) on client uploads.

    Parameters
    ----------
    merge : str (default: "firm")
        Merge to call on the decoded client updates: a registered name, an entry point of
        the ``fedunlearn.merges`` group or ``package.module:function`` (see merge_plugins).
    merge_parameters : Mapping[str, Any] (default: {})
        Candidate keyword arguments (``gamma``, ``alpha``, ``eps0``, ``epsilon``, ...); the
        merge receives those its signature accepts.
    assignments : Sequence[ClientAssignment]
        Role, domain and data shard per client. Nodes that declare ``role`` (and
        ``partition-id``) in their node config get the assignments of that role in partition
        order (learned with a QUERY round); without declarations node i (in sorted node-id
        order) gets assignment i (see strategies.node_roles).
    client_config : Mapping[str, Any] (default: {})
        Settings sent to every client (model description, training settings).
    role_config : Mapping[str, Mapping[str, Any]] (default: {})
        Extra settings per role (``forget`` / ``retain``), e.g. steps and learning rate.
    node_wait_timeout : float (default: 120.0)
        Seconds to wait for enough nodes to connect.
    server_lr : float (default: 1.0)
        η_srv in θ ← θ + η_srv·Δ.
    min_replies : int (default: 0)
        Valid updates a round needs (``server.min-replies``); 0 = one valid forget update per
        assigned forget domain (see ``reply_validation.check_min_replies``).
    max_upload_mb : float (default: 0.0)
        Upload limit per reply in MiB (``server.max-upload-mb``); 0 = the largest honest reply
        (``reply_validation.auto_upload_limit``).
    robust_norm_bound, fisher_cap : float (default: 0.0)
        ``fedunlearn.merging.robust`` options applied before the merge (0 = off).
    client_norm_ratio : float (default: 100)
        Exclude a client whose task-vector norm is above this × its role's median norm
        (``server.client-norm-ratio``; roles with fewer than 3 valid clients are not checked;
        0 = off;
        ``fedunlearn.merging.sanity.norm_outliers``).
    max_update_ratio : float (default: 100)
        Fail the round when ‖η_srv·Δ‖ exceeds this × the norm of the weights Δ changes
        (``server.max-update-ratio``; 0 = off). A non-finite Δ or new weights always fail the round.
    checkpoint : RunCheckpoint | None (default: None)
        Where the weights after every successful round are saved (with ``round_record()``),
        so that a killed run can resume (``strategies.checkpoint``).
    round_offset : int (default: 0)
        Rounds finished before this start (a resumed run): Flower's round r is the run's round
        r + round_offset, which is what seeds, MPU keys and the checkpoint see.
    spool : UploadSpool | None (default: None)
        With a spool (``upload.stream``), every validated upload is written to disk as it is
        read and merged from a memory map one weight at a time (``strategies.upload_spool``);
        without, uploads are decoded from the reply messages held in memory.
    base_offer : str | None (default: None)
        The checkpoint folder the initial weights were loaded from: a simulated node that
        declares no base of its own and can read it gets only the weights that differ from
        it (``strategies.model_delivery``).
    delivery : str (default: "auto")
        ``model.delivery``: ``auto`` sends a node holding the base only what differs from it,
        ``full`` the whole model every round.
    base_digests : Mapping[str, str] | None (default: None)
        The weight digests of the weights the run started from (θ_base,
        ``wire.delivery.model_digests``), for a strategy whose first round is not the run's:
        its nodes holding the base still get only what differs from it.
    model_dtype : torch.dtype | None (default: None)
        The dtype of the model the weights are loaded into: each round reports
        ``applied_relative_error`` = ‖(θ_new in that dtype − θ) − Δ‖ / ‖Δ‖, how much of the
        merged update it keeps (float32: the rounding of θ + Δ); None: not reported.
    """

    copies: int = 1  # copies of the model each node receives per round (MPU: m)

    def __init__(
        self,
        *,
        merge: str = "firm",
        merge_parameters: Mapping[str, Any] | None = None,
        assignments: Sequence[ClientAssignment],
        client_config: Mapping[str, Any] | None = None,
        role_config: Mapping[str, Mapping[str, Any]] | None = None,
        node_wait_timeout: float = 120.0,
        server_lr: float = 1.0,
        min_replies: int = 0,
        max_upload_mb: float = 0.0,
        robust_norm_bound: float = 0.0,
        fisher_cap: float = 0.0,
        client_norm_ratio: float = DEFAULT_CLIENT_NORM_RATIO,
        max_update_ratio: float = DEFAULT_MAX_UPDATE_RATIO,
        checkpoint: RunCheckpoint | None = None,
        round_offset: int = 0,
        spool: UploadSpool | None = None,
        base_offer: str | None = None,
        delivery: str = "auto",
        base_digests: Mapping[str, str] | None = None,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        if not assignments:
            raise ValueError("MergeStrategy needs at least one client assignment")
        self.merge = merge
        self.merge_fn = resolve_merge(merge)
        self.merge_kwargs = merge_kwargs(self.merge_fn, merge_parameters or {})
        self.streams_delta = streams_delta(self.merge_fn)
        self.assignments = list(assignments)
        self.client_config = dict(client_config or {})
        self.role_config = {k: dict(v) for k, v in (role_config or {}).items()}
        self.node_wait_timeout = node_wait_timeout
        if not math.isfinite(server_lr):
            raise ValueError(f"mpu.server-lr must be a finite number, got {server_lr}")
        self.server_lr = float(server_lr)
        if min_replies < 0 or max_upload_mb < 0:
            raise ValueError("server.min-replies and server.max-upload-mb must be >= 0")
        self.min_replies = int(min_replies)
        self.max_upload_mb = float(max_upload_mb)
        self.robust_norm_bound = float(robust_norm_bound)
        self.fisher_cap = float(fisher_cap)
        self.client_norm_ratio = check_ratio("server.client-norm-ratio", client_norm_ratio)
        self.max_update_ratio = check_ratio("server.max-update-ratio", max_update_ratio)
        self.update_ratio = math.nan  # ‖η·Δ‖ / ‖θ‖ of the last merged round
        self.model_dtype = model_dtype
        self.applied_error: float | None = None  # of the last merged round (model_dtype)
        self._reports: dict[int, dict[str, Any]] = {}  # node id → its report, this round
        self.needs_fisher = merge_needs_fisher(self.merge_fn)
        self.node_assignment: dict[int, ClientAssignment] = {}
        self.global_arrays: ArrayRecord | None = None
        self.last_merge: MergeResult | None = None
        self.client_reports: list[dict[str, Any]] = []
        self.last_updates: list[ClientUpdate] = []
        self.merge_seconds: float = 0.0
        self.spool = spool
        self._round = round_offset + 1  # the run's round being trained (configure_train)
        # replies read as they arrived (StreamingGrid): (node, message id) → (update, fields)
        # or the error that excludes it
        self._received: dict[tuple[int, str], Any] = {}
        self.round_peak_rss_bytes = 0  # the last round's peak resident memory (VmHWM)
        self.checkpoint = checkpoint
        self.round_offset = int(round_offset)
        # the full model, or what differs from a node's base
        self.delivery = ModelDelivery(
            offer=base_offer, by_reference=delivery != "full", base_digests=base_digests
        )

    def summary(self) -> None:
        roles = [a.role for a in self.assignments]
        log(INFO, "\t├── Merge: %s %s", self.merge, self.merge_kwargs)
        log(
            INFO,
            "\t└── Clients: %d forget (%d of them mixed-role), %d retain",
            roles.count("forget"),
            sum(a.mixed for a in self.assignments),
            roles.count("retain"),
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.round_offset  # the run's round number (resumed runs continue it)
        self._round, self._received = server_round, {}
        reset_phase_peak()  # the round's peak memory (round_peak_rss_bytes) counts from here
        node_ids = wait_for_nodes(grid, len(self.assignments), self.node_wait_timeout)
        self.global_arrays = arrays

        self.node_assignment, declarations = assign_and_declare(
            grid,
            node_ids,
            self.assignments,
            self.node_wait_timeout,
            self.node_assignment,
            self.delivery.offer,
        )
        if declarations is not None:
            self.delivery.declare(declarations)
        self.delivery.start_round(server_round, arrays)
        return self._messages(server_round, arrays, config)

    def _messages(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> Iterator[Message]:
        """Each node's TRAIN message, built when it is taken (a grid that sends a few at a
        time, ``server.max-in-flight``, holds only those nodes' contents)."""
        for position, (node_id, assignment) in enumerate(self.node_assignment.items()):
            node_config = ConfigRecord(
                {
                    **self.client_config,
                    **dict(config),
                    **self.role_config.get(assignment.role, {}),
                    "role": assignment.role,
                    "domain": assignment.domain,
                    "indices": list(assignment.indices),
                    "retain-indices": list(assignment.retain_indices),
                    "seed": client_seed(
                        int(self.client_config.get("seed", 0)), position, server_round
                    ),
                    **kept_config(
                        assignment,
                        list(self.node_assignment.values()),
                        self.role_config.get("retain", {}),
                        int(self.client_config.get("seed", 0)),
                        server_round,
                    ),
                }
            )
            content = self.node_content(server_round, position, arrays, node_config)
            self.delivery.record(node_id, content)
            yield Message(
                content=content,
                message_type=MessageType.TRAIN,
                dst_node_id=node_id,
                group_id=str(server_round),
            )

    def node_content(
        self, server_round: int, position: int, arrays: ArrayRecord, node_config: ConfigRecord
    ) -> RecordDict:
        """What node ``position`` receives: the exact global weights, in full or (a node that
        holds the base checkpoint) only those that differ from it (``strategies.
        model_delivery``; MPU overrides)."""
        node_id = list(self.node_assignment)[position]
        return self.delivery.content(node_id, arrays, node_config)

    def reply_spec(self, node_id: int) -> ReplySpec:
        """What node ``node_id``'s reply must look like (assigned role and domain, the global
        model's weights, Fisher when the merge needs it)."""
        assignment = self.node_assignment.get(node_id)
        return ReplySpec(
            role=assignment.role if assignment is not None else None,
            domain=assignment.domain if assignment is not None else None,
            shapes=expected_shapes(self.global_arrays) if self.global_arrays is not None else None,
            needs_fisher=self.needs_fisher,
            merge=self.merge,
            max_rank=int(self.client_config["lora-rank"])
            if "lora-rank" in self.client_config
            else None,
        )

    def upload_limit_bytes(self, node_id: int | None = None) -> int:
        """``server.max-upload-mb`` in bytes, or (0) the largest honest reply for this model;
        twice that for a mixed-role node (two uploads in one reply)."""
        assignment = self.node_assignment.get(node_id) if node_id is not None else None
        parts = 2 if assignment is not None and assignment.mixed else 1
        if self.max_upload_mb > 0:
            return parts * int(self.max_upload_mb * 2**20)
        if self.global_arrays is None:
            return 0
        return parts * auto_upload_limit(expected_shapes(self.global_arrays), self.copies)

    def decode_reply(
        self, server_round: int, node_id: int, content: RecordDict
    ) -> tuple[ClientUpdate, dict[str, Any]]:
        """A validated reply (``reply_validation.validate_reply_content``) as a
        ``ClientUpdate`` in the server's coordinates and the report fields it gives
        (objective, parsed metrics; MPU overrides)."""
        spec = self.reply_spec(node_id)
        fields = validate_reply_content(node_id, content, spec)
        update, _ = decode_client_reply(node_id, content, spec.shapes)
        return update, fields

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, exclude bad, crashed, missing and outlier clients (reason in
        ``client_reports[*]["excluded"]``), merge the rest, check the merged update and the
        new weights, checkpoint them — or raise ``RoundFailedError`` (the global model is kept,
        nothing is checkpointed) when too few valid updates remain or the merged update is
        non-finite or absurd (``fedunlearn.merging.sanity``)."""
        server_round += self.round_offset  # the run's round number (resumed runs continue it)
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        self.client_reports, self._reports = [], {}
        if self.spool is not None:
            self.spool.begin_round(server_round)
        updates = self._collect_updates(server_round, replies)
        updates = self._drop_inconsistent(updates)
        problem = check_min_replies(
            [(u.role, str(u.domain)) for u in updates],
            self.min_replies,
            {a.domain for a in self.node_assignment.values() if a.role == "forget"},
        )
        if problem is not None:
            self._fail(server_round, problem)
        self.last_updates = updates  # as uploaded (before the robust options)
        new_weights = NewWeights(
            self.global_arrays,
            server_lr=self.server_lr,
            model_dtype=self.model_dtype,
            folder=self.scratch_folder(),
        )
        try:
            result = self._merge(self._robust(updates), new_weights)
            new_arrays = self._new_weights(server_round, result, new_weights)
        finally:
            new_weights.close()
        self.last_merge = result
        self.round_peak_rss_bytes = phase_peak_bytes()
        if self.checkpoint is not None:
            self.checkpoint.save(server_round, decoded_arrays(new_arrays), self.round_record())
            log(INFO, "round %d saved to %s", server_round, self.checkpoint.folder)
        metrics = MetricRecord(
            {
                "num-updates": len(updates),
                "merge-seconds": self.merge_seconds,
                "update-norm": float(result.report.get("norm_final", 0.0)),
            }
        )
        return new_arrays, metrics

    # ---- the steps of aggregate_train ----------------------------------------------------------

    def _fail(self, server_round: int, problem: str) -> NoReturn:
        reasons = [r["excluded"] for r in self.client_reports if "excluded" in r]
        raise RoundFailedError(
            f"round {server_round}: {problem}; the global model is kept. "
            f"Excluded clients: {reasons}"
        )

    def _collect_updates(self, server_round: int, replies: Iterable[Message]) -> list[ClientUpdate]:
        """One validated update per node that replied well, in the scenario's client order
        (the same run config then gives the same floating-point sums); a report per node
        (:func:`~strategies.round_steps.collect_replies`)."""

        def read(node_id: int, reply: Message, report: dict[str, Any]) -> list[ClientUpdate]:
            limit = self.upload_limit_bytes(node_id)
            updates, fields = self._take_reply(server_round, node_id, reply, limit)
            report.update(role=updates[0].role, domain=updates[0].domain, **fields)
            return updates

        # Flower's start loop hands over only the replies that arrived before the round timeout
        expected = {
            n: {"role": a.role, "domain": a.domain} for n, a in self.node_assignment.items()
        }
        collected = collect_replies(replies, expected, read)
        self.client_reports, self._reports = collected.reports, collected.first
        for report in self.client_reports:  # what each node was sent (model_delivery)
            report.update(self.delivery.report(int(report["node_id"])))
        order = {node_id: i for i, node_id in enumerate(self.node_assignment)}
        nodes = sorted(collected.values, key=order.__getitem__)
        # every node's own upload, then the mixed-role nodes' kept parts (``fold_mixed``)
        return [collected.values[n][0] for n in nodes] + [
            u for n in nodes for u in collected.values[n][1:]
        ]

    def receive_reply(self, reply: Message) -> None:
        """Read a TRAIN reply the moment it arrives (``strategies.streaming_grid``): with a
        spool, it is validated, written to disk and its arrays are dropped now; the outcome
        waits for ``aggregate_train``, which reports and orders it like any other reply."""
        meta = reply.metadata
        node_id = meta.src_node_id
        if (
            self.spool is None
            or meta.message_type != MessageType.TRAIN
            or node_id not in self.node_assignment
            or any(key[0] == node_id for key in self._received)
        ):
            return  # aggregate_train reads (or refuses) it as usual
        try:
            updates, fields = self._take_reply(
                self._round, node_id, reply, self.upload_limit_bytes(node_id)
            )
            outcome: Any = (updates, {**fields, "read_on_arrival": True})
        except Exception as err:  # noqa: BLE001 — reported when aggregate_train gets to it
            outcome = err
        self._received[(node_id, meta.message_id)] = outcome

    def _take_reply(
        self, server_round: int, node_id: int, reply: Message, limit: int
    ) -> tuple[list[ClientUpdate], dict[str, Any]]:
        """The reply's validated updates (its own; a mixed-role node's kept part second),
        stored in the spool, if any, and report fields, read now or taken from what
        :meth:`receive_reply` read on arrival."""
        received = self._received.pop((node_id, reply.metadata.message_id), None)
        if isinstance(received, Exception):
            raise received
        if received is not None:
            return received
        updates, fields = self._read_reply(server_round, node_id, reply, limit)
        if self.spool is not None:
            self.spool.begin_round(server_round)
            shapes = self.reply_spec(node_id).shapes
            updates = [self.spool.store(u, shapes) for u in updates]
            drop_arrays(reply)
        return updates, fields

    def _read_reply(
        self, server_round: int, node_id: int, reply: Message, limit: int
    ) -> tuple[list[ClientUpdate], dict[str, Any]]:
        if reply.has_error():
            raise ReplyRejected(
                node_id,
                f"crashed: error reply (code {reply.error.code}) instead of an update: "
                f"{clip(str(reply.error.reason))}",
            )
        check_payload_size(node_id, reply_bytes(reply.content), limit)
        sizes = {
            "bytes_arrays": array_bytes(reply.content),
            "bytes_metadata": metadata_bytes(reply.content),
        }
        update, fields = self.decode_reply(server_round, node_id, reply.content)
        assignment = self.node_assignment[node_id]
        if not assignment.mixed:
            return [update], {**fields, **sizes}
        kept, kept_fields = decode_kept_part(
            node_id, reply.content, self.reply_spec(node_id), assignment.kept_domain
        )
        return [update, kept], {**fields, **sizes, "kept": kept_fields}

    def _drop_inconsistent(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """Exclude clients off the round's key set, then task-vector norm outliers of their
        role (``server.client-norm-ratio``; ``sanity.norm_outliers``). A mixed-role node is
        excluded with both its uploads when either is."""
        odd = check_same_key_sets({u.node_id: u.task_vector.keys() for u in updates})
        for update_id, reason in odd.items():
            exclude(self._reports[node_of(update_id)], reason)
        dropped = {node_of(n) for n in odd}
        updates = [u for u in updates if node_of(u.node_id) not in dropped]
        outliers, norms = norm_outliers(updates, self.client_norm_ratio)
        for update_id, norm in norms.items():
            self._part_report(update_id)["upload_norm"] = norm
        for update_id, problem in outliers.items():
            exclude(self._reports[node_of(update_id)], str(ReplyRejected(update_id, problem)))
        dropped = {node_of(n) for n in outliers}
        return [u for u in updates if node_of(u.node_id) not in dropped]

    def _part_report(self, update_id: int | str) -> dict[str, Any]:
        """The report of the node an update came from (a kept part: its ``kept`` fields)."""
        report = self._reports[node_of(update_id)]
        return report["kept"] if is_kept_part(update_id) else report

    def _robust(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The ``server.robust-norm-bound`` / ``server.fisher-cap`` options (both 0: ``updates``
        as given)."""
        if self.robust_norm_bound <= 0 and self.fisher_cap <= 0:
            return updates
        updates, robust = apply_robust(
            updates, norm_bound=self.robust_norm_bound, fisher_cap=self.fisher_cap
        )
        for u in updates:
            self._part_report(u.node_id).update(robust.get(str(u.node_id), {}))
        return updates

    def _merge(self, updates: list[ClientUpdate], new_weights: NewWeights) -> MergeResult:
        """The merge's result; a merge that accepts ``delta_out`` hands its Δ to
        ``new_weights`` weight by weight (``strategies.new_weights``)."""
        started = time.perf_counter()
        streamed = {"delta_out": new_weights} if self.streams_delta else {}
        result = self.merge_fn(updates, **self.merge_kwargs, **streamed)
        if not isinstance(result, MergeResult):
            raise TypeError(
                f"merge {self.merge!r} returned {type(result).__name__}, not a MergeResult"
            )
        self.merge_seconds = time.perf_counter() - started
        return result

    def _new_weights(
        self, server_round: int, result: MergeResult, new_weights: NewWeights
    ) -> ArrayRecord:
        """θ + η_srv·Δ, after checking that Δ is finite and not absurd (``server.max-update-ratio``)
        and that the new weights are finite; otherwise the round fails and θ is kept. The new
        weights replace the changed ones in the global arrays themselves, one weight at a time
        (no second copy of the model; the old values are not needed once the checks passed)."""
        if self.global_arrays is None:
            raise RuntimeError("_new_weights called before configure_train")
        if result.delta is not new_weights:  # a merge that returns its Δ whole
            for key, value in result.delta.items():
                new_weights[key] = value
        problem, self.update_ratio = new_weights.problem(self.max_update_ratio)
        if problem is not None:
            self._fail(server_round, f"the merged update is not safe to apply: {problem}")
        new_weights.apply()
        self.applied_error = new_weights.applied_error()
        return self.global_arrays

    def scratch_folder(self) -> Path | None:
        """Where a round's new weights wait for their checks: the spool's or the checkpoint's
        folder (the run's output folder), else the system's temporary folder."""
        if self.spool is not None:
            return self.spool.folder
        return self.checkpoint.folder if self.checkpoint is not None else None

    def release_weights(self) -> None:
        """Let go of the global weights once the run has taken the final ones (the strategy
        keeps its record of the last round)."""
        self.global_arrays = None
        self.delivery.end_rounds()

    def round_record(self) -> dict[str, Any]:
        """What results.json reports about the last round (JSON-safe): ``clients``, ``merge``
        (report and seconds) and ``assignments``; also stored in the checkpoint."""
        return json_safe(
            {
                "clients": self.client_reports,
                "merge": {
                    **(self.last_merge.report if self.last_merge else {}),
                    "seconds": self.merge_seconds,
                    "update_ratio": self.update_ratio,
                    "applied_relative_error": self.applied_error,
                    "round_peak_rss_bytes": self.round_peak_rss_bytes,
                    "streamed": self.spool is not None,
                },
                "assignments": [
                    {
                        "node_id": node_id,
                        "role": a.role,
                        "domain": a.domain,
                        "indices": list(a.indices),
                        "retain_indices": list(a.retain_indices),
                        **(
                            {"kept_indices": list(a.kept_indices), "kept_domain": a.kept_domain}
                            if a.mixed
                            else {}
                        ),
                    }
                    for node_id, a in self.node_assignment.items()
                ],
            }
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None
