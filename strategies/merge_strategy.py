"""A single-round Flower strategy that runs a registered fedunlearn merge.

The strategy is thin: it sends every node its own role/shard config, decodes the replies
into ``ClientUpdate`` objects, calls the merge, and returns θ₀ + Δ as the new global model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from clients.messages import decode_client_reply
from fedunlearn.merging import ClientUpdate, MergeResult, apply_delta
from fedunlearn.scenarios import ClientAssignment
from strategies.merge_plugins import merge_kwargs, resolve_merge


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
        Role, domain and data shard per client; node i (in sorted node-id order) gets
        assignment i.
    client_config : Mapping[str, Any] (default: {})
        Settings sent to every client (model description, training settings).
    role_config : Mapping[str, Mapping[str, Any]] (default: {})
        Extra settings per role (``forget`` / ``retain``), e.g. steps and learning rate.
    node_wait_timeout : float (default: 120.0)
        Seconds to wait for enough nodes to connect.
    server_lr : float (default: 1.0)
        η_srv in θ ← θ + η_srv·Δ.
    """

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
    ) -> None:
        if not assignments:
            raise ValueError("MergeStrategy needs at least one client assignment")
        self.merge = merge
        self.merge_fn = resolve_merge(merge)
        self.merge_kwargs = merge_kwargs(self.merge_fn, merge_parameters or {})
        self.assignments = list(assignments)
        self.client_config = dict(client_config or {})
        self.role_config = {k: dict(v) for k, v in (role_config or {}).items()}
        self.node_wait_timeout = node_wait_timeout
        self.server_lr = server_lr
        self.node_assignment: dict[int, ClientAssignment] = {}
        self.global_arrays: ArrayRecord | None = None
        self.last_merge: MergeResult | None = None
        self.client_reports: list[dict[str, Any]] = []
        self.last_updates: list[ClientUpdate] = []
        self.merge_seconds: float = 0.0

    def summary(self) -> None:
        roles = [a.role for a in self.assignments]
        log(INFO, "\t├── Merge: %s %s", self.merge, self.merge_kwargs)
        log(
            INFO,
            "\t└── Clients: %d forget, %d retain",
            roles.count("forget"),
            roles.count("retain"),
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        node_ids = wait_for_nodes(grid, len(self.assignments), self.node_wait_timeout)
        self.global_arrays = arrays
        self.node_assignment = dict(zip(node_ids, self.assignments, strict=False))
        messages = []
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
                    # per client and round (round 1: seed·1000 + position)
                    "seed": int(self.client_config.get("seed", 0)) * 1000
                    + position
                    + 1_000_003 * (server_round - 1),
                }
            )
            content = self.node_content(server_round, position, arrays, node_config)
            messages.append(
                Message(
                    content=content,
                    message_type=MessageType.TRAIN,
                    dst_node_id=node_id,
                    group_id=str(server_round),
                )
            )
        return messages

    def node_content(
        self, server_round: int, position: int, arrays: ArrayRecord, node_config: ConfigRecord
    ) -> RecordDict:
        """What node ``position`` receives: here the exact global weights (MPU overrides)."""
        return RecordDict({"arrays": arrays, "config": node_config})

    def decode_reply(
        self, server_round: int, node_id: int, content: RecordDict
    ) -> tuple[ClientUpdate, dict[str, Any]]:
        """A reply as a ``ClientUpdate`` in the server's coordinates (MPU overrides)."""
        return decode_client_reply(node_id, content)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        updates: list[ClientUpdate] = []
        self.client_reports = []
        for reply in replies:
            node_id = reply.metadata.src_node_id
            assignment = self.node_assignment.get(node_id)
            report: dict[str, Any] = {"node_id": node_id}
            if assignment is not None:
                report.update(role=assignment.role, domain=assignment.domain)
            if reply.has_error():
                report["excluded"] = f"client error: {reply.error.reason}"
                log(WARNING, "client %s failed: %s", node_id, reply.error.reason)
                self.client_reports.append(report)
                continue
            try:
                update, metrics = self.decode_reply(server_round, node_id, reply.content)
                if assignment is not None and update.role != assignment.role:
                    raise ValueError(
                        f"client {node_id}: replied as role {update.role!r} but was assigned "
                        f"{assignment.role!r}"
                    )
            except (ValueError, KeyError, TypeError) as err:
                report["excluded"] = str(err)
                log(WARNING, "excluding client %s: %s", node_id, err)
                self.client_reports.append(report)
                continue
            updates.append(update)
            report.update(
                role=update.role,
                domain=update.domain,
                num_examples=update.num_examples,
                objective=str(reply.content["info"].get("objective", "")),
                bytes_sent=int(metrics.get("bytes-sent", 0)),
                task_vector_norm=float(metrics.get("task-vector-norm", 0.0)),
                seconds=float(metrics.get("total-seconds", 0.0)),
                train_seconds=float(metrics.get("train_seconds", 0.0)),
                fisher_seconds=float(metrics.get("fisher-seconds", 0.0)),
                loss_first=float(metrics.get("loss_first", 0.0)),
                loss_last=float(metrics.get("loss_last", 0.0)),
                cuda=bool(metrics.get("cuda", 0.0)),
            )
            if "mpu-copies" in metrics:
                report.update(
                    mpu_copies=int(metrics["mpu-copies"]),
                    bytes_received=int(metrics["bytes-received"]),
                )
            self.client_reports.append(report)
        if not any(u.role == "forget" for u in updates):
            reasons = [r.get("excluded", "") for r in self.client_reports]
            raise RuntimeError(
                f"round {server_round}: no valid forget update to merge; the global model is "
                f"kept. Client problems: {reasons}"
            )
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        # merge in the scenario's client order, not in the order replies arrived:
        # the same run config then gives the same floating-point sums
        order = {node_id: i for i, node_id in enumerate(self.node_assignment)}
        updates.sort(key=lambda u: order.get(int(u.node_id), len(order)))
        self.last_updates = updates
        started = time.perf_counter()
        result = self.merge_fn(updates, **self.merge_kwargs)
        if not isinstance(result, MergeResult):
            raise TypeError(
                f"merge {self.merge!r} returned {type(result).__name__}, not a MergeResult"
            )
        self.merge_seconds = time.perf_counter() - started
        self.last_merge = result
        delta = result.delta
        if self.server_lr != 1.0:
            delta = {k: self.server_lr * v for k, v in delta.items()}
        state = apply_delta(self.global_arrays.to_torch_state_dict(), delta)
        metrics = MetricRecord(
            {
                "num-updates": len(updates),
                "merge-seconds": self.merge_seconds,
                "update-norm": float(result.report.get("norm_final", 0.0)),
            }
        )
        return ArrayRecord(state), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None
