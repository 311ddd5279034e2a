"""No client can abort, poison or wipe a run (issue 13): replies with broken metrics or
metadata are excluded, absurd task vectors never reach the model, and a merged update that is
non-finite or absurd fails the round with the previous model kept — real Flower messages into
the real ``aggregate_train`` on a tiny Llama's weights."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fedunlearn.merging import firm_merge
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.scenarios import ClientAssignment
from strategies.checkpoint import RunCheckpoint
from strategies.merge_strategy import MergeStrategy
from strategies.mpu_strategy import MpuStrategy
from strategies.reply_validation import RoundFailedError
from strategies.settings import RunSettings
from tests.strategies.replies import reply_metadata
from wire.arrays import array_tensor, weights_record
from wire.messages import encode_client_reply

CONFIG = tiny_llama_config(64, hidden_size=16, num_hidden_layers=1, intermediate_size=32)
STATE = {k: v.detach().clone() for k, v in new_tiny_llama(CONFIG, seed=0).state_dict().items()}
NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")
NODES = (11, 12, 13, 14)
ASSIGNMENTS = [ClientAssignment("forget", "d", (i,)) for i in range(3)] + [
    ClientAssignment("retain", "retain", (3,))
]
CHECKS_OFF = {"client_norm_ratio": 0.0, "max_update_ratio": 0.0}


def _honest(node: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA-like update (scale·B@A, rank 2: a shared and an own direction, a few % of the
    weight's norm) and a positive Fisher diagonal, seeded per node."""
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(node)
    tv, fisher = {}, {}
    for name in NAMES:
        rows, cols = STATE[name].shape
        b = torch.cat([torch.randn(rows, 1, generator=shared), torch.randn(rows, 1, generator=own)])
        a = torch.cat([torch.randn(1, cols, generator=shared), torch.randn(1, cols, generator=own)])
        delta = b.reshape(2, rows).T @ a.reshape(2, cols)
        tv[name] = 0.03 * delta * STATE[name].norm() / delta.norm()
        fisher[name] = 1e-5 * torch.rand(rows, cols, generator=own) + 1e-9
    return tv, fisher


def _metrics(**changes: float | list) -> dict:
    metrics = {
        "bytes-sent": 1024.0,
        "task-vector-norm": 0.1,
        "total-seconds": 1.5,
        "train-seconds": 1.0,
        "fisher-seconds": 0.2,
        "loss-first": 2.5,
        "loss-last": 3.5,
        "cuda": 0.0,
    }
    metrics.update(changes)
    return metrics


def _reply(node: int, *, tv=None, num_examples: float = 4, metrics=None, objective="ga"):
    assignment = dict(zip(NODES, ASSIGNMENTS, strict=True))[node]
    honest_tv, fisher = _honest(node)
    content = encode_client_reply(
        role=assignment.role,
        domain=assignment.domain,
        objective=objective,
        num_examples=num_examples,
        task_vector=honest_tv if tv is None else tv,
        fisher=fisher if tv is None else {k: torch.ones_like(v) for k, v in tv.items()},
        metrics=_metrics() if metrics is None else metrics,
    )
    return Message(content, metadata=reply_metadata(node))


def _replies(**bad: Message | None) -> list[Message]:
    out = [bad.get(f"n{node}", _reply(node)) for node in NODES]
    return [r for r in out if r is not None]


def _strategy(merge: str = "firm", assignments=ASSIGNMENTS, **kwargs) -> MergeStrategy:
    strategy = MergeStrategy(
        merge=merge, merge_parameters={"gamma": 1.0}, assignments=assignments, **kwargs
    )
    strategy.node_assignment = dict(zip(NODES, assignments, strict=False))
    strategy.global_arrays = ArrayRecord(STATE)
    return strategy


def _excluded(strategy: MergeStrategy) -> dict[int, str]:
    return {r["node_id"]: r["excluded"] for r in strategy.client_reports if "excluded" in r}


def _merged_without(strategy: MergeStrategy, replies: list[Message], node: int) -> str:
    """Run the round; it merges every other node into finite weights; ``node``'s reason."""
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num-updates"] == len(replies) - 1
    assert all(torch.isfinite(t).all() for t in arrays.to_torch_state_dict().values())
    excluded = _excluded(strategy)
    assert set(excluded) == {node}, excluded
    assert excluded[node].startswith(f"client {node}")
    return excluded[node]


# ---- one bad report field aborted the whole round -------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("bytes-sent", math.nan, "'bytes-sent' is nan, not a finite number"),
        ("loss-last", math.inf, "'loss-last' is inf, not a finite number"),
        ("total-seconds", -3.0, "'total-seconds' is -3, outside [0"),
        ("cuda", 0.5, "'cuda' must be 0 or 1"),
        ("bytes-sent", [1.0, 2.0], "'bytes-sent' is a list, not a number"),
    ],
)
def test_a_broken_report_metric_excludes_only_that_client(field, value, problem):
    reply = _reply(12, metrics=_metrics(**{field: value}))
    reason = _merged_without(_strategy(), _replies(n12=reply), 12)
    assert problem in reason, reason


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (math.inf, "'num-examples' is inf, not a finite number"),
        (math.nan, "'num-examples' is nan, not a finite number"),
        (2.5, "'num-examples' is 2.5, not a whole number"),
        (1e30, "'num-examples' is 1e+30, outside [0, 1e+09]"),
    ],
)
def test_num_examples_must_be_a_bounded_count(value, problem):
    reason = _merged_without(_strategy(), _replies(n13=_reply(13, num_examples=value)), 13)
    assert problem in reason, reason


def test_huge_metadata_counts_against_the_upload_limit():
    big = _reply(11)
    big.content["info"]["note"] = "x" * (50 * 2**20)  # 50 MB of text in the info record
    reason = _merged_without(_strategy(), _replies(n11=big), 11)
    assert "over the upload limit" in reason and "server.max-upload-mb" in reason
    many = _reply(12)
    many.content["extra"] = MetricRecord({"junk": [0.0] * 1_000_000})  # 8 MB of metrics
    _merged_without(_strategy(), _replies(n12=many), 12)


def test_objective_must_be_a_short_string():
    reason = _merged_without(_strategy(), _replies(n13=_reply(13, objective="y" * 5000)), 13)
    assert "objective" in reason and "5000 characters" in reason
    odd = _reply(12)
    odd.content["info"] = ConfigRecord({"role": "forget", "domain": "d", "objective": [1, 2]})
    assert "objective" in _merged_without(_strategy(), _replies(n12=odd), 12)


def test_missing_info_record_is_excluded_not_fatal():
    broken = _reply(14)
    del broken.content["info"]
    reason = _merged_without(_strategy(), _replies(n14=broken), 14)
    assert "no 'info' record" in reason


# ---- absurd task vectors never reach the model ----------------------------------------------


def test_float32_near_max_task_vector_is_excluded():
    tv = {k: torch.full_like(v, 3e38) for k, v in _honest(12)[0].items()}
    reason = _merged_without(_strategy(), _replies(n12=_reply(12, tv=tv)), 12)
    assert "magnitude" in reason and "3e+38" in reason


def test_float64_huge_task_vector_of_a_lone_retain_client_is_excluded():
    """The only retain client: no median to compare with, the magnitude bound catches it."""
    tv = {k: torch.full(v.shape, 1e300, dtype=torch.float64) for k, v in _honest(14)[0].items()}
    reason = _merged_without(_strategy(), _replies(n14=_reply(14, tv=tv)), 14)
    assert "magnitude" in reason and "1e+300" in reason


def test_client_norm_far_above_its_role_median_is_excluded():
    tv = {k: 1e5 * v for k, v in _honest(13)[0].items()}
    reason = _merged_without(_strategy(), _replies(n13=_reply(13, tv=tv)), 13)
    assert "server.client-norm-ratio" in reason and "median" in reason and "3 forget" in reason
    # with the bound off the client is merged (and the round fails on the absurd update)
    strategy = _strategy(client_norm_ratio=0.0)
    with pytest.raises(RoundFailedError, match="server.max-update-ratio"):
        strategy.aggregate_train(1, _replies(n13=_reply(13, tv=tv)))
    assert not _excluded(strategy)


def test_absurd_update_of_a_two_client_role_fails_the_round_and_saves_nothing(tmp_path):
    """Two forget clients: no honest majority, no norm bound; the merged update is 100s of
    times the weights' norm, so the round fails and the checkpoint stays as it was."""
    assignments = ASSIGNMENTS[1:]
    checkpoint = RunCheckpoint(tmp_path / "checkpoint", "fingerprint")
    strategy = _strategy(assignments=assignments, checkpoint=checkpoint)
    strategy.node_assignment = dict(zip(NODES[1:], assignments, strict=True))
    tv = {k: 1e5 * v for k, v in _honest(12)[0].items()}
    replies = [_reply(12, tv=tv), _reply(13), _reply(14)]
    with pytest.raises(
        RoundFailedError, match=r"round 1: .*server\.max-update-ratio.*model is kept"
    ):
        strategy.aggregate_train(1, replies)
    assert strategy.last_merge is None and not checkpoint.weights_path.exists()
    # the global arrays (updated in place by a round that passes) are untouched
    kept = strategy.global_arrays.to_torch_state_dict()
    assert all(torch.equal(kept[k], v) for k, v in STATE.items())
    # the same round with the honest client instead is saved
    strategy.aggregate_train(1, [_reply(12), _reply(13), _reply(14)])
    assert checkpoint.weights_path.exists() and strategy.last_merge is not None


NAN_MERGE = textwrap.dedent("""
    import torch
    from fedunlearn.merging import MergeResult

    def nan_merge(updates):
        keys = list(updates[0].task_vector)
        delta = {k: torch.full_like(updates[0].task_vector[k], float("nan")) for k in keys}
        return MergeResult(delta=delta, report={})
""")


def test_non_finite_merge_result_fails_the_round_even_with_the_ratio_off(tmp_path, monkeypatch):
    (tmp_path / "nan_merges.py").write_text(NAN_MERGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        strategy = _strategy("nan_merges:nan_merge", **CHECKS_OFF)
        with pytest.raises(RoundFailedError, match=r"non-finite.*model is kept"):
            strategy.aggregate_train(1, _replies())
        assert strategy.last_merge is None
    finally:
        sys.modules.pop("nan_merges", None)


def test_server_lr_must_be_finite_and_a_huge_one_fails_the_round():
    with pytest.raises(ValueError, match="mpu.server-lr must be a finite number, got nan"):
        _strategy(server_lr=math.nan)
    with pytest.raises(RoundFailedError, match="server.max-update-ratio"):
        _strategy(server_lr=1e30).aggregate_train(1, _replies())
    strategy = _strategy(server_lr=1e300, max_update_ratio=0.0)  # η·Δ overflows float32
    with pytest.raises(RoundFailedError, match="non-finite"):
        strategy.aggregate_train(1, _replies())


@pytest.mark.parametrize("merge", ["firm", "avg", "ties"])
def test_honest_rounds_merge_bit_for_bit_as_without_the_checks(merge):
    default = _strategy(merge)
    arrays, _ = default.aggregate_train(1, _replies())
    off = _strategy(merge, **CHECKS_OFF)
    arrays_off, _ = off.aggregate_train(1, _replies())
    assert not _excluded(default)
    new, new_off = arrays.to_torch_state_dict(), arrays_off.to_torch_state_dict()
    assert all(torch.equal(new[k], new_off[k]) for k in STATE)
    assert any(not torch.equal(new[k], STATE[k]) for k in NAMES)  # the round did change θ
    ratio = default.round_record()["merge"]["update_ratio"]
    assert 0 < ratio < 1, ratio


# ---- MPU: every copy and its metrics go through the same checks -----------------------------


def _mpu_strategy(**kwargs) -> MpuStrategy:
    assignment = ClientAssignment("forget", "d", (0,))
    strategy = MpuStrategy(
        merge="sum",
        model_config=CONFIG,
        secret=b"test",
        copies=2,
        assignments=[assignment],
        **kwargs,
    )
    strategy.node_assignment = {11: assignment}
    strategy.global_arrays = ArrayRecord(STATE)
    return strategy


def _mpu_reply(*, copy1_scale: float = 1.0, dtype=torch.float32, metrics=None) -> Message:
    content = _reply(11, metrics=metrics).content
    tv, fisher = content["task_vector"], content["fisher"]
    del content["task_vector"], content["fisher"]
    for k in range(2):
        values = {
            n: t.to(dtype) * (copy1_scale if k else 1.0)
            for n, t in tv.to_torch_state_dict().items()
        }
        content[f"task_vector-{k}"] = ArrayRecord(values)
        content[f"fisher-{k}"] = fisher
    return Message(content, metadata=reply_metadata(11))


def test_mpu_reply_with_a_broken_metric_or_huge_copy_is_excluded():
    strategy = _mpu_strategy()
    arrays, _ = strategy.aggregate_train(1, [_mpu_reply()])
    assert all(torch.isfinite(t).all() for t in arrays.to_torch_state_dict().values())
    for reply, problem in (
        (_mpu_reply(metrics=_metrics(**{"bytes-sent": math.nan})), "'bytes-sent' is nan"),
        (_mpu_reply(copy1_scale=1e300, dtype=torch.float64), "magnitude"),
    ):
        strategy = _mpu_strategy()
        with pytest.raises(RoundFailedError, match="no valid forget update"):
            strategy.aggregate_train(1, [reply])
        (reason,) = _excluded(strategy).values()
        assert problem in reason, reason


def test_mpu_server_lr_nan_is_refused():
    with pytest.raises(ValueError, match="server-lr"):
        _mpu_strategy(server_lr=math.nan)


@pytest.mark.parametrize("name", ["client_norm_ratio", "max_update_ratio"])
def test_ratio_keys_are_off_or_at_least_one(name):
    key = "server." + name.replace("_", "-")
    assert getattr(RunSettings.from_run_config({}).server, name) > 1
    assert getattr(RunSettings.from_run_config({key: 0.0}).server, name) == 0
    with pytest.raises(ValueError, match=key):
        RunSettings.from_run_config({key: 0.5})
    with pytest.raises(ValueError, match=key):
        _strategy(**{name: 0.5})


@pytest.mark.parametrize(("dtype", "lost"), [(torch.float32, False), (torch.bfloat16, True)])
def test_the_round_reports_what_the_models_dtype_keeps_of_the_update(dtype, lost):
    strategy = _strategy(model_dtype=dtype)
    arrays, _ = strategy.aggregate_train(1, _replies())
    new = arrays.to_torch_state_dict()
    # the merge is deterministic: its Δ from the round's updates is the one the round applied
    delta = firm_merge(strategy.last_updates, gamma=1.0).delta
    assert all(torch.equal(new[k], STATE[k] + delta[k]) for k in delta)  # float32 θ + Δ
    error = strategy.round_record()["merge"]["applied_relative_error"]
    applied = sum(
        float(((new[k].to(dtype).double() - STATE[k].double() - delta[k].double()) ** 2).sum())
        for k in delta
    )
    norm = sum(float((delta[k].double() ** 2).sum()) for k in delta)
    assert error == pytest.approx(math.sqrt(applied / norm), rel=1e-9)
    # float32 keeps Δ up to the rounding of θ + Δ; bfloat16 rounds small entries away
    assert (error > 1e-3) if lost else error < 1e-6


STREAMING_MERGES = textwrap.dedent("""
    import torch
    from fedunlearn.merging import MergeResult, firm_merge

    def firm_whole(updates, *, gamma=1.0):
        # no delta_out: Δ comes back whole, as from a plug-in written for a dict
        return firm_merge(updates, gamma=gamma)

    def nan_second(updates, *, delta_out=None):
        delta = {} if delta_out is None else delta_out
        for i, key in enumerate(updates[0].task_vector):
            value = 1e-3 * torch.ones_like(updates[0].task_vector[key])
            delta[key] = value if i == 0 else torch.full_like(value, float("nan"))
        return MergeResult(delta=delta, report={})
""")


@pytest.fixture
def streaming_merges(tmp_path, monkeypatch):
    (tmp_path / "streaming_merges.py").write_text(STREAMING_MERGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "streaming_merges"
    sys.modules.pop("streaming_merges", None)


def test_a_merge_returning_its_delta_whole_gives_the_streamed_rounds_weights(streaming_merges):
    streamed = _strategy("firm")
    assert streamed.streams_delta
    new = streamed.aggregate_train(1, _replies())[0].to_torch_state_dict()
    whole = _strategy(f"{streaming_merges}:firm_whole")
    assert not whole.streams_delta
    new_whole = whole.aggregate_train(1, _replies())[0].to_torch_state_dict()
    assert all(torch.equal(new[k], new_whole[k]) for k in STATE)
    assert streamed.round_record()["merge"]["update_ratio"] == pytest.approx(
        whole.round_record()["merge"]["update_ratio"], rel=1e-12
    )


def test_a_streamed_merge_failing_after_its_first_weight_changes_no_weight(
    streaming_merges, tmp_path
):
    checkpoint = RunCheckpoint(tmp_path / "checkpoint", "fingerprint")
    strategy = _strategy(f"{streaming_merges}:nan_second", checkpoint=checkpoint, **CHECKS_OFF)
    with pytest.raises(RoundFailedError, match=r"non-finite.*model is kept"):
        strategy.aggregate_train(1, _replies())
    kept = strategy.global_arrays.to_torch_state_dict()
    assert all(torch.equal(kept[k], v) for k, v in STATE.items())  # not even the first weight
    # the new weights waited in an unnamed temporary file: nothing is left in the folder
    assert not [p.name for p in checkpoint.folder.iterdir() if p.name.startswith("tmp")]


def test_bfloat16_global_weights_stay_bfloat16_with_theta_plus_delta_rounded_once():
    strategy = _strategy(model_dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in STATE.items()}
    strategy.global_arrays = weights_record(state)
    arrays, _ = strategy.aggregate_train(1, _replies())
    assert {arrays[k].dtype for k in arrays} == {"bfloat16"}
    new = {k: array_tensor(arrays[k]) for k in arrays}
    delta = firm_merge(strategy.last_updates, gamma=1.0).delta
    for k in STATE:
        expected = (state[k].float() + delta[k]).to(torch.bfloat16) if k in delta else state[k]
        assert new[k].dtype == torch.bfloat16 and torch.equal(new[k], expected), k
    assert strategy.round_record()["merge"]["applied_relative_error"] > 1e-3
