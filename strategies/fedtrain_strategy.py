"""Federated training of full weights (FedAvg) for DP2Unlearning's stages (docs/algorithms.md,
"DP2Unlearning").

Every round each data client receives the global weights and its own config (stage, shard,
the records a forget request removes), trains one round locally and returns its weights; the
server averages them weighted by the number of examples each client trained on. Every field
of a reply is checked before use (issue 13): its size (``server.max-upload-mb``, texts and metrics
included), its stage and examples digest (short strings), every metric (a finite number;
``num-examples`` a whole number from 1 to the records the server assigned to that client, so
one client cannot take over the average), and its weights (the global model's names, shapes
and dtype, finite, no entry above ``sanity.MAX_ABS_VALUE``, at most
``server.max-update-ratio`` × the global weights' norm away from them). A client that fails any
check, or whose reply cannot be read at all, is excluded with its reason; a round with no
valid reply, or a non-finite average, fails with the previous global model kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedunlearn.dp2u import DataShard, fedavg
from fedunlearn.merging.sanity import (
    DEFAULT_MAX_UPDATE_RATIO,
    check_ratio,
    nonfinite_problem,
    tensors_norm,
)
from strategies.merge_strategy import drop_arrays, wait_for_nodes
from strategies.reply_fields import (
    MAX_REPORTED,
    MetricRule,
    clip,
    parse_all_metrics,
    reply_bytes,
    short_text,
    shown,
)
from strategies.reply_validation import (
    ReplyRejected,
    RoundFailedError,
    auto_upload_limit,
    check_dtype,
    check_finite,
    check_magnitude,
    check_payload_size,
    check_shape,
    expected_shapes,
    load_values,
)
from strategies.round_steps import collect_replies
from strategies.seeding import client_seed
from strategies.upload_spool import UploadSpool
from wire.messages import FIT_MESSAGE_TYPE


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
    max_upload_mb : float (default: 0.0)
        Limit per reply in MiB, arrays and metadata together; 0 = the honest reply's size
        (float64 weights plus ``reply_fields.METADATA_ALLOWANCE``).
    max_update_ratio : float (default: 100)
        Exclude a client whose weights are further than this × ‖θ‖ from the global θ (0 = off).
    """

    def __init__(
        self,
        *,
        stage: str,
        shards: Sequence[DataShard],
        client_config: Mapping[str, Any] | None = None,
        num_rounds: int = 1,
        node_wait_timeout: float = 120.0,
        max_upload_mb: float = 0.0,
        max_update_ratio: float = DEFAULT_MAX_UPDATE_RATIO,
        spool: UploadSpool | None = None,
    ) -> None:
        """``spool`` (``upload.stream``): each client's weights go to disk as they are read
        and are averaged from memory maps one tensor at a time (``strategies.upload_spool``)."""
        if not shards:
            raise ValueError("FedTrainStrategy needs at least one data shard")
        self.stage = stage
        self.shards = list(shards)
        self.client_config = dict(client_config or {})
        self.num_rounds = num_rounds
        self.node_wait_timeout = node_wait_timeout
        if not 0 <= max_upload_mb < math.inf:
            raise ValueError(f"server.max-upload-mb must be >= 0 and finite, got {max_upload_mb}")
        self.max_upload_bytes = int(max_upload_mb * 2**20)
        self.max_update_ratio = check_ratio("server.max-update-ratio", max_update_ratio)
        self.node_shard: dict[int, DataShard] = {}
        self.global_arrays: ArrayRecord | None = None
        self.rounds: list[dict[str, Any]] = []  # per round: client reports, seconds
        self.spool = spool

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
                    "stage": self.stage,
                    "indices": list(shard.training),
                    "forget-indices": list(shard.forget),
                    "public-indices": list(shard.public),
                    "total-rounds": self.num_rounds,
                    "round": server_round,
                    "seed": client_seed(
                        int(self.client_config.get("seed", 0)), position, server_round
                    ),
                }
            )
            messages.append(
                Message(
                    content=RecordDict({"arrays": arrays, "config": node_config}),
                    message_type=FIT_MESSAGE_TYPE,
                    dst_node_id=node_id,
                    group_id=f"{self.stage}-{server_round}",
                )
            )
        return messages

    def _read_reply(
        self, node_id: int, reply: Message, global_state: Mapping[str, torch.Tensor], limit: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A reply's weights and report fields, every field checked (raises on the first
        problem): size, records, stage, digest, metrics, then the weights."""
        if reply.has_error():
            raise ReplyRejected(node_id, f"client error: {clip(str(reply.error.reason))}")
        content = reply.content
        check_payload_size(node_id, reply_bytes(content), limit)
        for key, kind in (
            ("arrays", ArrayRecord),
            ("metrics", MetricRecord),
            ("info", ConfigRecord),
        ):
            if key not in content or not isinstance(content[key], kind):
                raise ReplyRejected(node_id, f"reply has no {key!r} {kind.__name__}")
        info = content["info"]
        stage = short_text(node_id, "stage", info.get("stage"))
        if stage != self.stage:
            raise ReplyRejected(node_id, f"replied for stage {stage!r}, not {self.stage!r}")
        fields: dict[str, Any] = {
            "examples_digest": short_text(node_id, "examples-digest", info.get("examples-digest"))
        }
        assigned = len(self.node_shard[node_id].training)
        rules = {
            # a client weighs at most the records the server gave it (FedAvg weight)
            "num-examples": MetricRule("num_examples", "count", 1, assigned, required=True),
            "total-seconds": MetricRule("total_seconds", low=0, high=MAX_REPORTED),
        }
        fields.update(parse_all_metrics(node_id, content["metrics"], rules))
        # the loop above checked the record types
        arrays = cast(ArrayRecord, content["arrays"])
        return self._checked_weights(node_id, arrays, global_state), fields

    def _checked_weights(
        self, node_id: int, arrays: ArrayRecord, global_state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The client's weights: the global model's names, shapes and dtypes, finite, no entry
        above ``sanity.MAX_ABS_VALUE``, and at most ``server.max-update-ratio`` × ‖θ‖ away
        from θ."""
        if set(arrays) != set(global_state):
            diff = sorted(set(arrays) ^ set(global_state))[:3]
            raise ReplyRejected(
                node_id, f"weights {[shown(d) for d in diff]} missing or unexpected"
            )
        state: dict[str, torch.Tensor] = {}
        for name, array in arrays.items():
            values = load_values(node_id, "weights", name, array)
            expected = global_state[name]
            check_dtype(node_id, "weights", name, values.dtype)
            check_shape(node_id, "weights", name, values.shape, tuple(expected.shape))
            check_finite(node_id, "weights", name, values)
            check_magnitude(node_id, "weights", name, values)
            value = torch.from_numpy(values)
            if value.dtype != expected.dtype:
                raise ReplyRejected(
                    node_id,
                    f"has dtype {value.dtype} but the global weight is {expected.dtype}",
                    kind="weights",
                    tensor=name,
                )
            state[name] = value
        if self.max_update_ratio > 0:
            step = tensors_norm(state[n] - global_state[n] for n in global_state)
            scale = tensors_norm(global_state.values())
            if scale > 0 and step > self.max_update_ratio * scale:
                raise ReplyRejected(
                    node_id,
                    f"weights are {step:.4g} away from the global model's, more than "
                    f"server.max-update-ratio ({self.max_update_ratio:g}) × its norm {scale:.4g}",
                )
        return state

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg of the valid replies; a client whose reply fails a check is excluded with its
        reason (``rounds[*]["clients"][*]["excluded"]``); no valid reply, or a non-finite
        average, fails the round (``RoundFailedError``, the global model is kept)."""
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        global_state = self.global_arrays.to_torch_state_dict()
        limit = self.max_upload_bytes or auto_upload_limit(
            expected_shapes(self.global_arrays), tensors_per_copy=1
        )
        order = {node_id: i for i, node_id in enumerate(self.node_shard)}
        if self.spool is not None:
            self.spool.begin_round(server_round)

        def read(
            node_id: int, reply: Message, report: dict[str, Any]
        ) -> tuple[Mapping[str, torch.Tensor], int]:
            state: Mapping[str, torch.Tensor]
            state, fields = self._read_reply(node_id, reply, global_state, limit)
            if self.spool is not None:
                state = self.spool.store_state(node_id, state)
                drop_arrays(reply)
            report.update(fields)
            return state, int(fields["num_examples"])

        collected = collect_replies(replies, {n: {"position": i} for n, i in order.items()}, read)
        # client order, not arrival order: deterministic reports and sums
        clients = sorted(
            collected.reports,
            key=lambda r: (collected.first.get(r["node_id"]) is not r, order.get(r["node_id"], 0)),
        )
        for report in clients:
            report.setdefault("position", None)
        self.rounds.append(
            {
                "round": server_round,
                "clients": clients,
                "seconds": time.perf_counter() - self._round_started,
            }
        )
        valid = [collected.values[n] for n in sorted(collected.values, key=order.__getitem__)]
        problems = [r["excluded"] for r in clients if "excluded" in r]
        if not valid:
            raise RoundFailedError(
                f"{self.stage} round {server_round}: no valid client weights; the global model "
                f"is kept. Client problems: {problems}"
            )
        averaged = fedavg([v[0] for v in valid], [float(v[1]) for v in valid])
        problem = nonfinite_problem(averaged, "the averaged weights'")
        if problem is not None:
            raise RoundFailedError(
                f"{self.stage} round {server_round}: {problem}; the global model is kept"
            )
        losses = [float(r["loss_last"]) for r in clients if "loss_last" in r]
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
