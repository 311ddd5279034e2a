"""RunCheckpoint: atomic saves, config fingerprints, the stored MPU secret; the strategies'
round offset and per-round saves."""

import json
import os
import stat

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, Metadata
from flwr.supercore.task_identity import TaskIdentity

from fedunlearn.scenarios import ClientAssignment
from strategies import checkpoint as checkpoint_module
from strategies.checkpoint import (
    CheckpointError,
    RunCheckpoint,
    config_fingerprint,
    model_structure,
)
from strategies.merge_strategy import MergeStrategy
from strategies.mpu_strategy import MpuStrategy
from wire.messages import encode_client_reply

CONFIG = {"wrapper": "mpu", "gamma": 2.0, "num-rounds": 3, "output-dir": "/a", "mpu.secret": ""}


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), value), "b": torch.arange(4.0) + value}


def _checkpoint(folder, config=CONFIG) -> RunCheckpoint:
    return RunCheckpoint(folder, config_fingerprint(config, model_structure(_state(0))), config)


def test_save_and_load_keep_only_the_last_round(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    assert ckpt.load() is None
    ckpt.save(1, _state(1.0), {"clients": [{"node_id": 5}]})
    ckpt.save(2, _state(2.0), {"clients": [{"node_id": 6}]})
    done, state, extra = _checkpoint(tmp_path / "ckpt").load()
    assert done == 2 and extra == {"clients": [{"node_id": 6}]}
    assert all(torch.equal(state[k], v) for k, v in _state(2.0).items())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "fedunlearn-checkpoint.json",  # the marker: this folder is the project's
        "state.json",
        "weights.safetensors",
    ]


def test_tied_weights_are_saved(tmp_path):
    shared = torch.ones(2, 2)
    ckpt = _checkpoint(tmp_path)
    ckpt.save(1, {"embed": shared, "lm_head": shared}, {})
    assert torch.equal(ckpt.load()[1]["lm_head"], shared)


@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_crash_inside_save_leaves_one_whole_round(tmp_path, monkeypatch, crash_at):
    """Killed before the weights move (1): round 1 stays; killed between the weights and the
    state move (2): the new weights and the fsynced pending state make round 2 whole."""
    ckpt = _checkpoint(tmp_path)
    ckpt.save(1, _state(1.0), {"round": 1})
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):
        calls.append(dst)
        if len(calls) == crash_at:
            raise KeyboardInterrupt("killed")  # nothing after this point runs
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, _state(2.0), {"round": 2})
    monkeypatch.setattr(checkpoint_module.os, "replace", real_replace)
    done, state, extra = _checkpoint(tmp_path).load()
    assert done == crash_at and extra == {"round": crash_at}
    assert torch.equal(state["w"], _state(float(crash_at))["w"])
    ckpt.save(3, _state(3.0), {})  # and saving goes on normally afterwards
    assert _checkpoint(tmp_path).load()[0] == 3


def test_weights_that_do_not_belong_to_the_state_are_refused(tmp_path):
    first, second = _checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b")
    first.save(1, _state(1.0), {})
    second.save(2, _state(2.0), {})
    os.replace(second.weights_path, first.weights_path)
    with pytest.raises(CheckpointError, match="inconsistent"):
        first.load()


def test_another_config_is_refused_with_the_differing_keys(tmp_path):
    _checkpoint(tmp_path).save(1, _state(1.0), {})
    other = {**CONFIG, "gamma": 4.0}
    with pytest.raises(CheckpointError, match=r"gamma \(2\.0 → 4\.0\).*resume=false"):
        _checkpoint(tmp_path, other).load()
    # output folder, secret and the number of rounds do not change the finished rounds
    same = {**CONFIG, "output-dir": "/b", "num-rounds": 5, "mpu.secret": "x", "resume": False}
    assert _checkpoint(tmp_path, same).load()[0] == 1
    other_model = RunCheckpoint(
        tmp_path, config_fingerprint(CONFIG, model_structure({"w": torch.zeros(2)})), CONFIG
    )
    with pytest.raises(CheckpointError, match="the model"):
        other_model.load()


def test_fresh_secret_is_stored_0600_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDUNLEARN_MPU_SECRET", raising=False)
    ckpt = _checkpoint(tmp_path)
    secret = ckpt.mpu_secret("")
    mode = stat.S_IMODE(os.stat(ckpt.secret_path).st_mode)
    assert mode == 0o600
    assert len(secret) == 64 and "<redacted" in repr(secret)
    assert _checkpoint(tmp_path).mpu_secret("") == secret  # a restart draws the same keys
    assert _checkpoint(tmp_path).mpu_secret(secret.decode()) == secret
    with pytest.raises(CheckpointError, match="another MPU secret"):
        _checkpoint(tmp_path).mpu_secret("something-else")
    ckpt.clear()
    assert _checkpoint(tmp_path).mpu_secret("") != secret


def test_a_given_secret_is_never_stored_only_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDUNLEARN_MPU_SECRET", raising=False)
    ckpt = _checkpoint(tmp_path)
    assert ckpt.mpu_secret("given-secret-4711") == b"given-secret-4711"
    text = ckpt.secret_path.read_text()
    assert "given-secret-4711" not in text and json.loads(text)["kind"] == "given"
    assert stat.S_IMODE(os.stat(ckpt.secret_path).st_mode) == 0o600
    monkeypatch.setenv("FEDUNLEARN_MPU_SECRET", "given-secret-4711")
    assert _checkpoint(tmp_path).mpu_secret("") == b"given-secret-4711"
    monkeypatch.delenv("FEDUNLEARN_MPU_SECRET")
    with pytest.raises(CheckpointError, match="given MPU secret"):
        _checkpoint(tmp_path).mpu_secret("")
    with pytest.raises(CheckpointError, match="another MPU secret"):
        _checkpoint(tmp_path).mpu_secret("wrong")


class _Grid:
    """Just enough of a Flower Grid for configure_train with known nodes."""

    def __init__(self, node_ids):
        self.node_ids = node_ids

    def get_node_ids(self):
        return self.node_ids


def _configured(strategy, flower_round, arrays):
    strategy.node_assignment = {17: strategy.assignments[0]}
    (message,) = strategy.configure_train(flower_round, arrays, ConfigRecord(), _Grid([17]))
    return message


def test_round_offset_continues_seeds_and_mpu_keys(tiny_model, monkeypatch):
    """Flower's round 1 of a run resumed after round 1 is the uninterrupted run's round 2."""
    for name in ("_run_id", "_node_id", "_task_id"):  # set by Flower inside a ServerApp
        monkeypatch.setattr(TaskIdentity, name, 1)
    arrays = ArrayRecord({k: v.detach().clone() for k, v in tiny_model.state_dict().items()})

    def mpu(offset):
        return MpuStrategy(
            merge="sum",
            model_config=tiny_model.config,
            secret=b"secret",
            assignments=[ClientAssignment("forget", "d", (0, 1))],
            client_config={"seed": 3},
            round_offset=offset,
        )

    resumed = _configured(mpu(1), 1, arrays)
    uninterrupted = _configured(mpu(0), 2, arrays)
    first = _configured(mpu(0), 1, arrays)
    assert resumed.content["config"]["seed"] == uninterrupted.content["config"]["seed"]
    assert resumed.content["config"]["seed"] != first.content["config"]["seed"]
    assert resumed.metadata.group_id == "2"
    name = "model.layers.0.mlp.up_proj.weight"
    for k in range(2):
        copy = resumed.content[f"arrays-{k}"].to_torch_state_dict()[name]
        assert torch.equal(copy, uninterrupted.content[f"arrays-{k}"].to_torch_state_dict()[name])
        assert not torch.equal(copy, first.content[f"arrays-{k}"].to_torch_state_dict()[name])


def test_every_merged_round_is_saved_with_its_run_round(tmp_path):
    ckpt = _checkpoint(tmp_path)
    strategy = MergeStrategy(
        merge="sum",
        merge_parameters={"gamma": 1.0},
        assignments=[ClientAssignment("forget", "d", (0,))],
        max_upload_mb=1.0,
        checkpoint=ckpt,
        round_offset=2,
    )
    strategy.node_assignment = {11: strategy.assignments[0]}
    strategy.global_arrays = ArrayRecord({"w": torch.zeros(2, 2), "n": torch.ones(2)})
    content = encode_client_reply(
        role="forget",
        domain="d",
        objective="ga",
        num_examples=1,
        task_vector={"w": torch.full((2, 2), 0.5)},
        fisher=None,
        metrics={},
    )
    metadata = Metadata(
        run_id=1,
        message_id="r",
        src_node_id=11,
        dst_node_id=0,
        reply_to_message_id="t",
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type=MessageType.TRAIN,
    )
    arrays, _ = strategy.aggregate_train(1, [Message(content, metadata=metadata)])
    done, state, extra = ckpt.load()
    assert done == 3  # Flower's round 1 after two finished rounds
    assert all(torch.equal(state[k], v) for k, v in arrays.to_torch_state_dict().items())
    assert extra["clients"][0]["node_id"] == 11 and extra["merge"]["method"] == "sum"
    assert extra["assignments"] == [
        {"node_id": 11, "role": "forget", "domain": "d", "indices": [0], "retain_indices": []}
    ]
