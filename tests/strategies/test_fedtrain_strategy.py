"""dp2u's FedAvg stages survive bad clients (issue 13): broken metrics, metadata and weights
exclude only that client, and no client can take over or poison the average — real Flower
messages into the real ``FedTrainStrategy.aggregate_train``."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)

from fedunlearn.dp2u import DataShard, fedavg
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from strategies.fedtrain_strategy import FedTrainStrategy
from strategies.reply_validation import NO_REPLY_REASON, RoundFailedError
from tests.strategies.replies import reply_metadata

CONFIG = tiny_llama_config(64, hidden_size=16, num_hidden_layers=1, intermediate_size=32)
STATE = {k: v.detach().clone() for k, v in new_tiny_llama(CONFIG, seed=0).state_dict().items()}
SHARDS = [DataShard(indices=(0, 1, 2), forget=(), public=(9,)), DataShard((3, 4), (), (9,))]
SHARDS.append(DataShard((5, 6, 7, 8), (), (9,)))
NODES = (21, 22, 23)
DIGEST = "ab" * 32


def _strategy(**kwargs) -> FedTrainStrategy:
    strategy = FedTrainStrategy(stage="deploy", shards=SHARDS, **kwargs)
    strategy.node_shard = dict(zip(NODES, SHARDS, strict=True))
    strategy.global_arrays = ArrayRecord(STATE)
    strategy._round_started = 0.0
    return strategy


def _weights(node: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """θ plus a small seeded step (one local round of training)."""
    gen = torch.Generator().manual_seed(node)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in STATE.items()}


def _reply(node: int, *, weights=None, metrics=None, info=None) -> Message:
    position = NODES.index(node)
    content = RecordDict(
        {
            "arrays": ArrayRecord(_weights(node) if weights is None else weights),
            "metrics": MetricRecord(
                {
                    "num-examples": float(len(SHARDS[position].training)),
                    "loss-last": 1.5,
                    "total-seconds": 2.0,
                    **(metrics or {}),
                }
            ),
            "info": ConfigRecord({"stage": "deploy", "examples-digest": DIGEST, **(info or {})}),
        }
    )
    return Message(content, metadata=reply_metadata(node, "deploy-1"))


def _replies(**bad: Message | None) -> list[Message]:
    out = [bad.get(f"n{node}", _reply(node)) for node in NODES]
    return [r for r in out if r is not None]


def _averaged_without(strategy: FedTrainStrategy, replies: list[Message], node: int) -> str:
    """Run the round; it averages exactly the other clients' weights; ``node``'s reason."""
    arrays, metrics = strategy.aggregate_train(1, replies)
    others = [n for n in NODES if n != node]
    assert metrics["num-clients"] == len(others)
    expected = fedavg(
        [_weights(n) for n in others], [len(SHARDS[NODES.index(n)].training) for n in others]
    )
    averaged = arrays.to_torch_state_dict()
    assert all(torch.equal(averaged[k], expected[k]) for k in STATE)
    excluded = {
        c["node_id"]: c["excluded"] for c in strategy.rounds[-1]["clients"] if "excluded" in c
    }
    assert set(excluded) == {node}, excluded
    assert excluded[node].startswith(f"client {node}")
    return excluded[node]


def test_honest_round_is_the_weighted_average():
    strategy = _strategy()
    arrays, metrics = strategy.aggregate_train(1, _replies())
    expected = fedavg([_weights(n) for n in NODES], [4, 3, 5])
    assert all(torch.equal(arrays.to_torch_state_dict()[k], expected[k]) for k in STATE)
    assert metrics["num-clients"] == 3 and metrics["loss-mean"] == 1.5
    report = strategy.rounds[-1]["clients"][0]
    assert report["num_examples"] == 4 and report["examples_digest"] == DIGEST


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (math.inf, "'num-examples' is inf, not a finite number"),
        (math.nan, "'num-examples' is nan, not a finite number"),
        (1e30, "'num-examples' is 1e+30, outside [1, 3]"),  # node 22 was given 3 records
        (4.0, "'num-examples' is 4, outside [1, 3]"),
        (0.0, "'num-examples' is 0, outside [1, 3]"),
    ],
)
def test_num_examples_is_bounded_by_the_records_the_client_was_given(value, problem):
    reply = _reply(22, metrics={"num-examples": value})
    reason = _averaged_without(_strategy(), _replies(n22=reply), 22)
    assert problem in reason, reason


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        (_reply(23, metrics={"loss-last": math.nan}), "'loss-last' is nan"),
        (_reply(23, metrics={"epsilon-spent": [1.0]}), "'epsilon-spent' is a list"),
        (_reply(23, info={"examples-digest": 7}), "'examples-digest' is 7, not a string"),
        (_reply(23, info={"stage": "unlearn"}), "replied for stage 'unlearn'"),
        (_reply(23, info={"note": "z" * (50 * 2**20)}), "over the upload limit"),
    ],
    ids=["nan-loss", "list-metric", "digest-type", "stage", "50MB-info"],
)
def test_a_broken_metadata_field_excludes_only_that_client(reply, problem):
    reason = _averaged_without(_strategy(), _replies(n23=reply), 23)
    assert problem in reason, reason


def test_missing_digest_and_missing_records_exclude_not_abort():
    no_digest = _reply(21)
    no_digest.content["info"] = ConfigRecord({"stage": "deploy"})
    assert "'examples-digest'" in _averaged_without(_strategy(), _replies(n21=no_digest), 21)
    no_metrics = _reply(21)
    del no_metrics.content["metrics"]
    assert "no 'metrics'" in _averaged_without(_strategy(), _replies(n21=no_metrics), 21)


@pytest.mark.parametrize(
    ("weights", "problem"),
    [
        ({k: torch.full_like(v, 3e38) for k, v in STATE.items()}, "magnitude 3e+38"),
        ({k: v.double() for k, v in _weights(21).items()}, "float64 but the global weight is"),
        ({k: v + 100.0 for k, v in STATE.items()}, "server.max-update-ratio"),
    ],
    ids=["float32-max", "float64", "far-away"],
)
def test_absurd_weights_are_excluded(weights, problem):
    reason = _averaged_without(_strategy(), _replies(n21=_reply(21, weights=weights)), 21)
    assert problem in reason, reason


def test_missing_and_crashed_clients_and_a_round_without_valid_replies():
    crash = Message(Error(code=3, reason="killed"), metadata=reply_metadata(22, "deploy-1"))
    strategy = _strategy()
    with pytest.raises(RoundFailedError, match="deploy round 1: no valid client weights"):
        strategy.aggregate_train(1, [crash])
    reasons = {c["node_id"]: c["excluded"] for c in strategy.rounds[-1]["clients"]}
    assert "client error: killed" in reasons[22]
    assert NO_REPLY_REASON in reasons[21] and NO_REPLY_REASON in reasons[23]
