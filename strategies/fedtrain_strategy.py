"""Federated training of full weights (FedAvg) for DP2Unlearning's stages (SPEC §4).

Every round each data client receives the global weights and its own config (stage, shard,
the records a forget request removes), trains one round locally and returns its weights; the
server averages them weighted by the number of examples each client trained on. Replies are
checked before use (same tensor names and shapes as the global model, finite values); a
client that fails is excluded with its reason, and a round with no valid reply fails with the
previous global model kept.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedunlearn.dp2u import DataShard, fedavg
from strategies.merge_strategy import wait_for_nodes


class FedTrainStrategy(Strategy):
    """FedAvg of full client weights for one DP2Unlearning stage.

    Parameters
    ----------
    stage : str
        ``dp-base``, ``mlm-base``, ``deploy``, ``unlearn`` or ``retrain`` (see clients.fit_task).
    shards : Sequence[DataShard]
        One per data client; node i (sorted node ids) gets shard i.
    client_config : Mapping[str, Any] (default: {})
        Settings sent to every client (model description, scenario, training settings).
    num_rounds : int (default: 1)
        Rounds of this stage (sent as ``total-rounds``: DP-SGD plans its noise for all of them).
    node_wait_timeout : float (default: 120.0)
        Seconds to wait for enough nodes to connect.
    """

    def __init__(
        self,
        *,
        stage: str,
        shards: Sequence[DataShard],
        client_config: Mapping[str, Any] | None = None,
        num_rounds: int = 1,
        node_wait_timeout: float = 120.0,
    ) -> None:
        if not shards:
            raise ValueError("FedTrainStrategy needs at least one data shard")
        self.stage = stage
        self.shards = list(shards)
        self.client_config = dict(client_config or {})
        self.num_rounds = num_rounds
        self.node_wait_timeout = node_wait_timeout
        self.node_shard: dict[int, DataShard] = {}
        self.global_arrays: ArrayRecord | None = None
        self.rounds: list[dict[str, Any]] = []  # per round: client reports, seconds

    def summary(self) -> None:
        log(INFO, "\t└── FedAvg stage %s on %d data clients", self.stage, len(self.shards))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        node_ids = wait_for_nodes(grid, len(self.shards), self.node_wait_timeout)
        self.global_arrays = arrays
        self.node_shard = dict(zip(node_ids, self.shards, strict=False))
        self._round_started = time.perf_counter()
        messages = []
        for position, (node_id, shard) in enumerate(self.node_shard.items()):
            node_config = ConfigRecord(
                {
                    **self.client_config,
                    "task": "fit",
                    "stage": self.stage,
                    "indices": list(shard.training),
                    "forget-indices": list(shard.forget),
                    "public-indices": list(shard.public),
                    "total-rounds": self.num_rounds,
                    "round": server_round,
                    "seed": int(self.client_config.get("seed", 0)) * 1000
                    + position
                    + 1_000_003 * (server_round - 1),
                }
            )
            messages.append(
                Message(
                    content=RecordDict({"arrays": arrays, "config": node_config}),
                    message_type=MessageType.TRAIN,
                    dst_node_id=node_id,
                    group_id=f"{self.stage}-{server_round}",
                )
            )
        return messages

    def _check_reply(self, node_id: int, content: RecordDict) -> dict[str, torch.Tensor]:
        for key in ("arrays", "metrics", "info"):
            if key not in content:
                raise ValueError(f"client {node_id}: reply has no {key!r} record")
        state = content["arrays"].to_torch_state_dict()
        expected = self.global_arrays.to_torch_state_dict()
        if set(state) != set(expected):
            diff = sorted(set(state) ^ set(expected))[:3]
            raise ValueError(f"client {node_id}: weights {diff} missing or unexpected")
        for name, value in state.items():
            if value.shape != expected[name].shape:
                raise ValueError(
                    f"client {node_id}: tensor {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(expected[name].shape)}"
                )
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"client {node_id}: tensor {name!r} has non-finite values")
        if float(content["metrics"].get("num-examples", 0)) <= 0:
            raise ValueError(f"client {node_id}: reply reports no training examples")
        return state

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        order = {node_id: i for i, node_id in enumerate(self.node_shard)}
        valid: list[tuple[int, dict[str, torch.Tensor], float]] = []
        reports = []
        for reply in replies:
            node_id = reply.metadata.src_node_id
            report: dict[str, Any] = {"node_id": node_id, "position": order.get(node_id)}
            if reply.has_error():
                report["excluded"] = f"client error: {reply.error.reason}"
                log(WARNING, "client %s failed: %s", node_id, reply.error.reason)
                reports.append(report)
                continue
            try:
                state = self._check_reply(node_id, reply.content)
            except ValueError as err:
                report["excluded"] = str(err)
                log(WARNING, "excluding client %s: %s", node_id, err)
                reports.append(report)
                continue
            metrics = dict(reply.content["metrics"])
            report.update({k.replace("-", "_"): v for k, v in metrics.items()})
            report["examples_digest"] = str(reply.content["info"]["examples-digest"])
            reports.append(report)
            valid.append((order.get(node_id, len(order)), state, metrics["num-examples"]))
        reports.sort(key=lambda r: (r["position"] is None, r["position"] or 0))
        self.rounds.append(
            {
                "round": server_round,
                "clients": reports,
                "seconds": time.perf_counter() - self._round_started,
            }
        )
        if not valid:
            raise RuntimeError(
                f"{self.stage} round {server_round}: no valid client weights; the global model "
                f"is kept. Client problems: {[r.get('excluded') for r in reports]}"
            )
        valid.sort(key=lambda v: v[0])  # client order, not arrival order: deterministic sums
        averaged = fedavg([v[1] for v in valid], [float(v[2]) for v in valid])
        losses = [float(r["loss_last"]) for r in reports if "loss_last" in r]
        return ArrayRecord(averaged), MetricRecord(
            {"num-clients": len(valid), "loss-mean": sum(losses) / max(1, len(losses))}
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None
