"""The learning stage's and dp2u's Flower strategies survive bad clients (issue 13): broken
metrics, metadata and weights exclude only that client, and no client can take over or poison
the aggregate — real Flower messages into the real ``aggregate_train`` of the Flower strategies
wrapped by ``ShardTraining``."""

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

from fedunlearn.dp2u import DataShard
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from strategies.learn_strategy import LEARN_STRATEGIES, ShardTraining
from strategies.reply_validation import NO_REPLY_REASON, RoundFailedError
from tests.strategies.replies import reply_metadata

CONFIG = tiny_llama_config(64, hidden_size=16, num_hidden_layers=1, intermediate_size=32)
STATE = {k: v.detach().clone() for k, v in new_tiny_llama(CONFIG, seed=0).state_dict().items()}
SHARDS = [DataShard(indices=(0, 1, 2), forget=(), public=(9,)), DataShard((3, 4), (), (9,))]
SHARDS.append(DataShard((5, 6, 7, 8), (), (9,)))
NODES = (21, 22, 23)
DIGEST = "ab" * 32


def fedavg(states, weights) -> dict[str, torch.Tensor]:
    """The float64 reference: Σ_k w_k θ_k / Σ_k w_k per tensor."""
    total = float(sum(weights))
    return {
        k: sum((w / total) * s[k].double() for s, w in zip(states, weights, strict=True)).float()
        for k in states[0]
    }


def _strategy(name: str = "fedavg", **kwargs) -> ShardTraining:
    strategy = LEARN_STRATEGIES[name](stage="deploy", shards=SHARDS, **kwargs)
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


def _averaged_without(strategy: ShardTraining, replies: list[Message], node: int) -> str:
    """Run the round; it averages exactly the other clients' weights; ``node``'s reason."""
    arrays, metrics = strategy.aggregate_train(1, replies)
    others = [n for n in NODES if n != node]
    assert metrics["num-clients"] == len(others)
    expected = fedavg(
        [_weights(n) for n in others], [len(SHARDS[NODES.index(n)].training) for n in others]
    )
    averaged = arrays.to_torch_state_dict()
    _assert_mean(averaged, expected)
    excluded = {
        c["node_id"]: c["excluded"] for c in strategy.rounds[-1]["clients"] if "excluded" in c
    }
    assert set(excluded) == {node}, excluded
    assert excluded[node].startswith(f"client {node}")
    return excluded[node]


def _assert_mean(averaged, expected) -> None:
    """Flower's float32 weighted mean against the float64 one, to float32 rounding."""
    for k in STATE:
        assert averaged[k].dtype == torch.float32
        torch.testing.assert_close(averaged[k], expected[k], rtol=2e-6, atol=1e-7)


def test_honest_round_is_the_weighted_average():
    strategy = _strategy()
    arrays, metrics = strategy.aggregate_train(1, _replies())
    expected = fedavg([_weights(n) for n in NODES], [4, 3, 5])
    _assert_mean(arrays.to_torch_state_dict(), expected)
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


def test_spooled_replies_average_to_the_same_bits(tmp_path):
    """upload.stream: Flower's mean one tensor at a time over the memory maps equals its mean
    over the replies in memory, bit for bit."""
    from strategies.upload_spool import UploadSpool

    in_memory, _ = _strategy().aggregate_train(1, _replies())
    spooled, _ = _strategy(spool=UploadSpool(tmp_path / "spool")).aggregate_train(1, _replies())
    a, b = in_memory.to_torch_state_dict(), spooled.to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in STATE)


@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
def test_server_optimisers_step_towards_the_mean_in_the_model_dtype(name):
    """FedOpt's first step moves every weight by about η·sign(mean − θ) (Adam / Yogi with zero
    moments), and comes back in float32 for the next round's dtype checks."""
    strategy = _strategy(name, eta=1e-3)
    strategy.current_arrays = {k: v.numpy() for k, v in STATE.items()}  # configure_train's
    arrays, metrics = strategy.aggregate_train(1, _replies())
    mean = fedavg([_weights(n) for n in NODES], [4, 3, 5])
    for k, value in arrays.to_torch_state_dict().items():
        assert value.dtype == torch.float32
        step, direction = value - STATE[k], mean[k] - STATE[k]
        moved = direction.abs() > 1e-5
        assert torch.equal(torch.sign(step[moved]), torch.sign(direction[moved]))
        assert step.abs().max() <= 1e-3
    assert metrics["num-clients"] == 3


def test_only_the_trained_weights_are_aggregated_and_the_rest_kept_bit_for_bit():
    """learn.finetune='lora': replies carry the adapted weights alone; FedAdam steps those and
    leaves every other weight exactly as it was (no server-optimiser step on rounding noise)."""
    trained = sorted(k for k in STATE if k.endswith(("q_proj.weight", "v_proj.weight")))
    strategy = _strategy("fedadam", eta=1e-3, trained_keys=trained)
    strategy.current_arrays = {k: STATE[k].numpy() for k in trained}  # configure_train's
    replies = [_reply(n, weights={k: _weights(n)[k] for k in trained}) for n in NODES]
    arrays, _ = strategy.aggregate_train(1, replies)
    state = arrays.to_torch_state_dict()
    assert set(state) == set(STATE)
    assert all(torch.equal(state[k], STATE[k]) for k in STATE if k not in trained)
    assert all(not torch.equal(state[k], STATE[k]) for k in trained)
    full = _reply(21)  # all weights where only the trained ones are expected
    reason = _averaged_without_trained(strategy, full, trained)
    assert "missing or unexpected" in reason, reason


def _averaged_without_trained(strategy, bad: Message, trained) -> str:
    others = [_reply(n, weights={k: _weights(n)[k] for k in trained}) for n in NODES[1:]]
    strategy.aggregate_train(1, [bad, *others])
    return next(c["excluded"] for c in strategy.rounds[-1]["clients"] if "excluded" in c)
