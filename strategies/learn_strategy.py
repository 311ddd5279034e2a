"""Federated training of full weights with Flower's own aggregation strategies: the learning
stage (``learn.strategy``: FedAvg, FedProx, FedAdam, FedYogi) and DP2Unlearning's stages
(FedAvg) — docs/scenarios.md, "Federated learning stage"; docs/algorithms.md, "DP2Unlearning".

:class:`ShardTraining` goes before a strategy class of ``flwr.serverapp.strategy`` and adds
what this project needs around it, leaving the aggregation to Flower: every round each data
client receives the global weights and its own config (stage, shard, the records a forget
request removes, and what the Flower strategy puts in the config, e.g. FedProx's
``proximal-mu``), trains locally and returns its weights. Every field of a reply is checked
before Flower sees it (issue 13): its size (``server.max-upload-mb``, texts and metrics
included), its stage and examples digest (short strings), every metric (a finite number;
``num-examples`` a whole number from 1 to the records the server assigned to that client, so
one client cannot take over the average), and its weights (the global model's names, shapes
and dtype, finite, no entry above ``sanity.MAX_ABS_VALUE``, at most
``server.max-update-ratio`` × the global weights' norm away from them). A client that fails any
check, or whose reply cannot be read at all, is excluded with its reason; a round with no
valid reply, or a non-finite aggregate, fails with the previous global model kept. The valid
replies go to the Flower strategy's own ``aggregate_train`` (FedAvg's weighted mean by
``num-examples``; FedOpt's server optimiser on top); with a spool (``upload.stream``) each
client's weights go to disk as they are read, Flower's weighted mean runs one tensor at a time
over their memory maps, and the strategy's ``aggregate_train`` receives that mean as one reply
(its weight the clients' total, so FedAvg returns it unchanged, bit for bit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from logging import INFO
from typing import Any, cast

import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, FedYogi
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedunlearn.dp2u import DataShard
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

#: Flower's weighting key: a reply's records (checked against the shard it was given)
WEIGHT_KEY = "num-examples"


class ShardTraining:
    """Mixin before a Flower strategy class (see the module docstring; one subclass per
    strategy below, :data:`LEARN_STRATEGIES`).

    Parameters
    ----------
    stage : str
        ``deploy`` (train on every record), ``retrain`` (the forget records dropped on the
        client), or DP2Unlearning's ``dp-base``, ``mlm-base``, ``unlearn`` (clients.fit_task).
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
    spool : UploadSpool | None (default: None)
        ``upload.stream``: each client's weights go to disk as they are read and are averaged
        from memory maps one tensor at a time (``strategies.upload_spool``).
    round_config : Callable[[int], Mapping[str, Any]] | None (default: None)
        Config keys that change with the round (the learning stage's ``lr``, decayed over
        the rounds), added to every node's config.
    trained_keys : Collection[str] | None (default: None)
        The weights clients train and send back (``learn.finetune='lora'``: the adapted ones);
        the Flower strategy aggregates these alone and the others stay as they are. None: all.
    **flower : Any
        The Flower strategy's own keyword arguments (FedProx's ``proximal_mu``, FedOpt's
        ``eta``, ``beta_1``, ...); its node counts are set to the shards'.
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
        trained_keys: Collection[str] | None = None,
        round_config: Callable[[int], Mapping[str, Any]] | None = None,
        **flower: Any,
    ) -> None:
        if not shards:
            raise ValueError(f"{type(self).__name__} needs at least one data shard")
        super().__init__(  # type: ignore[call-arg]  # the Flower strategy's constructor
            min_train_nodes=len(shards),
            min_available_nodes=len(shards),
            weighted_by_key=WEIGHT_KEY,
            **flower,
        )
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
        self.trained_keys = None if trained_keys is None else sorted(trained_keys)
        self.round_config = round_config

    def summary(self) -> None:
        log(INFO, "\t├── stage %s on %d data clients", self.stage, len(self.shards))
        super().summary()  # type: ignore[misc]  # the Flower strategy's

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The Flower strategy's messages (its config keys kept, e.g. FedProx's
        ``proximal-mu``), each node's with its own shard and seed added."""
        node_ids = wait_for_nodes(grid, len(self.shards), self.node_wait_timeout)
        self.global_arrays = arrays
        self.node_shard = dict(zip(node_ids, self.shards, strict=False))
        self._round_started = time.perf_counter()
        trained = (
            arrays
            if self.trained_keys is None
            else ArrayRecord({k: arrays[k] for k in self.trained_keys})
        )
        flower = super().configure_train(  # type: ignore[misc]  # FedOpt keeps ``trained``
            server_round, trained, config, grid
        )
        flower_config = {m.metadata.dst_node_id: m.content["config"] for m in flower}
        messages = []
        for position, (node_id, shard) in enumerate(self.node_shard.items()):
            node_config = ConfigRecord(
                {
                    **self.client_config,
                    **dict(flower_config.get(node_id, {})),
                    **(self.round_config(server_round) if self.round_config else {}),
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
        """The Flower strategy's aggregate of the valid replies; a client whose reply fails a
        check is excluded with its reason (``rounds[*]["clients"][*]["excluded"]``); no valid
        reply, or a non-finite aggregate, fails the round (``RoundFailedError``, the global
        model is kept)."""
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        global_state = self._trained(self.global_arrays.to_torch_state_dict())
        limit = self.max_upload_bytes or auto_upload_limit(
            expected_shapes(self.global_arrays), tensors_per_copy=1
        )
        order = {node_id: i for i, node_id in enumerate(self.node_shard)}
        if self.spool is not None:
            self.spool.begin_round(server_round)

        def read(
            node_id: int, reply: Message, report: dict[str, Any]
        ) -> tuple[ArrayRecord | Mapping[str, torch.Tensor], int]:
            state, fields = self._read_reply(node_id, reply, global_state, limit)
            report.update(fields)
            if self.spool is None:  # the checked record itself goes to Flower
                return cast(ArrayRecord, reply.content["arrays"]), int(fields["num_examples"])
            stored = self.spool.store_state(node_id, state)
            drop_arrays(reply)
            return stored, int(fields["num_examples"])

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
        arrays, _ = super().aggregate_train(  # type: ignore[misc]  # the Flower strategy's
            server_round, self._flower_replies(valid)
        )
        state = self._in_model_dtypes(arrays)
        problem = nonfinite_problem(state, "the aggregated weights'")
        if problem is not None:
            raise RoundFailedError(
                f"{self.stage} round {server_round}: {problem}; the global model is kept"
            )
        losses = [float(r["loss_last"]) for r in clients if "loss_last" in r]
        return ArrayRecord(state), MetricRecord(
            {"num-clients": len(valid), "loss-mean": sum(losses) / max(1, len(losses))}
        )

    def _flower_replies(
        self, valid: Sequence[tuple[ArrayRecord | Mapping[str, torch.Tensor], int]]
    ) -> list[Message]:
        """The valid replies as Flower's strategy reads them (one ArrayRecord, one
        MetricRecord with ``num-examples``); spooled ones as their weighted mean, computed by
        Flower's ``aggregate_arrayrecords`` one tensor at a time over the memory maps."""
        if self.spool is None:
            return [_flower_reply(cast(ArrayRecord, arrays), n) for arrays, n in valid]
        states = [cast(Mapping[str, torch.Tensor], state) for state, _ in valid]
        mean = ArrayRecord()
        for key in states[0]:
            parts = [
                RecordDict(
                    {
                        "arrays": ArrayRecord({key: Array(state[key].numpy())}),
                        "metrics": MetricRecord({WEIGHT_KEY: n}),
                    }
                )
                for state, (_, n) in zip(states, valid, strict=True)
            ]
            mean[key] = aggregate_arrayrecords(parts, WEIGHT_KEY)[key]
        return [_flower_reply(mean, sum(n for _, n in valid))]

    def _trained(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of ``state`` the clients train (all of it without ``trained_keys``)."""
        if self.trained_keys is None:
            return state
        return {k: state[k] for k in self.trained_keys}

    def _in_model_dtypes(self, arrays: ArrayRecord | None) -> dict[str, torch.Tensor]:
        """The new global weights: the aggregate of the trained ones in the global weights'
        dtypes (FedOpt's server step computes in float64), the others as they were."""
        assert arrays is not None and self.global_arrays is not None  # valid replies were given
        state = self.global_arrays.to_torch_state_dict()
        for key, value in arrays.to_torch_state_dict().items():
            state[key] = value.to(state[key].dtype)
        return state

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the learned model itself."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None


def _flower_reply(arrays: ArrayRecord, num_examples: int, node_id: int = 0) -> Message:
    """A reply holding only what Flower's strategies aggregate (the metadata of a reply,
    which a Message built outside a run's context needs)."""
    content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({WEIGHT_KEY: float(num_examples)})}
    )
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    # a reply's constructor (what the SuperLink hands the ServerApp), outside Flower's typed
    # public overloads; built here because no run context exists to fill it in a test
    return Message(content, metadata=metadata)  # type: ignore[call-overload]


class FedAvgTraining(ShardTraining, FedAvg):
    """Flower's FedAvg: the mean of the clients' weights weighted by their records."""


class FedProxTraining(ShardTraining, FedProx):
    """Flower's FedProx: FedAvg, and ``proximal-mu`` in every client's config (the client adds
    μ/2·‖w − w_round‖² to its loss)."""


class FedAdamTraining(ShardTraining, FedAdam):
    """Flower's FedAdam: Adam on the server over the clients' mean update (``eta``, ...)."""


class FedYogiTraining(ShardTraining, FedYogi):
    """Flower's FedYogi: Yogi on the server over the clients' mean update (``eta``, ...)."""


#: ``learn.strategy`` → its class (one registry of learning aggregations)
LEARN_STRATEGIES: dict[str, type[ShardTraining]] = {
    "fedavg": FedAvgTraining,
    "fedprox": FedProxTraining,
    "fedadam": FedAdamTraining,
    "fedyogi": FedYogiTraining,
}
