"""Real Flower simulations where the nodes hold the base checkpoint — by default the folder
the server loaded its model from, or ``model.base-checkpoint`` in the run config: they are sent
only the weights that differ from it, and the run ends with the weights of a run that sends
the full model (``model.delivery='full'``)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fedunlearn.models.llama import new_tiny_llama
from simulations import run_local
from strategies.checkpoint import CHECKPOINT_DIR, WEIGHTS_FILE
from strategies.copy_files import COPIES_DIR
from strategies.secret_files import write_private_file
from wire.delivery import DELTA

pytestmark = pytest.mark.slow

SMALL_RUN = (  # as in test_mpu_flower.py
    "scenario.num-authors=20 scenario.retain-samples=20 scenario.num-forget-clients=2 "
    "eval.retain-samples=20 eval.max-new-tokens=8 lora.rank=4 lora.alpha=8.0 "
    "training.forget-steps=3 training.retain-steps=3"
)


def _run(tmp_path, name: str, checkpoint, options: str = "num-rounds=2") -> tuple[dict, dict]:
    path = run_local.run(
        run_config=f"model.path='{checkpoint}' {SMALL_RUN} {options}",
        output_dir=tmp_path / name,
        flwr_home=tmp_path / f"{name}-flwr",
    )
    weights = load_file(path.parent / CHECKPOINT_DIR / WEIGHTS_FILE)
    return json.loads(path.read_text()), weights


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_checkpoint):
    return _run(
        tmp_path_factory.mktemp("full"),
        "out",
        tiny_checkpoint,
        "num-rounds=2 model.delivery='full'",
    )


def test_simulated_nodes_read_the_servers_checkpoint_and_end_with_the_same_weights(
    tmp_path, tiny_checkpoint, full_run
):
    """By default (``model.delivery='auto'``, nothing declared) every simulated node takes the
    folder the server loaded as its base: round 1 sends no weights at all."""
    full, full_weights = full_run
    delta, delta_weights = _run(tmp_path, "delta", tiny_checkpoint)
    assert delta_weights.keys() == full_weights.keys()
    assert all(torch.equal(delta_weights[k], full_weights[k]) for k in full_weights)
    assert delta["merge"]["norm_final"] == full["merge"]["norm_final"]
    for sent, got in zip(full["clients"], delta["clients"], strict=True):
        assert sent["model_delivery"] == "full" and got["model_delivery"] == DELTA
        assert "excluded" not in got
        first_full, second_full = sent["bytes_received_model_by_round"]
        first, second = got["bytes_received_model_by_round"]
        assert first == 0 and first_full > 0  # round 1: nothing but the hashes
        hashes = got["bytes_received_config"] - sent["bytes_received_config"]
        assert first_full >= 100 * (first + hashes)
        assert 0 < second < first_full / 2  # round 2: the merged weights only


def test_nodes_with_another_base_get_the_full_model(tmp_path, tiny_checkpoint, capfd):
    other = tmp_path / "other"  # another random model of the same shapes
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    new_tiny_llama(model.config, seed=1).save_pretrained(other)
    results, _ = _run(
        tmp_path, "other", tiny_checkpoint, f"num-rounds=1 model.base-checkpoint='{other}'"
    )
    clients = results["clients"]
    assert all(c["model_delivery"] == "full" and "excluded" not in c for c in clients)
    log = capfd.readouterr().out
    for client in clients:  # the run log says why, once per node
        reason = f"node {client['node_id']} gets the full model: its base-checkpoint has sha256"
        assert log.count(reason) == 1


def test_mpu_copies_read_from_files_end_with_the_weights_of_copies_sent_in_full(
    tmp_path, tiny_checkpoint
):
    """MPU in a simulation: every node rebuilds its copies from θ_base and the files the server
    wrote (no weights in any message), and the run ends bit for bit where the same run whose
    copies all travel in full in the messages ends; the copy files are gone after the run."""
    secret = write_private_file(tmp_path / "mpu-secret", b"the-same-copies-in-both-runs")
    mpu = f"num-rounds=2 wrapper='mpu' merge='firm' mpu.copies=2 mpu.secret-file='{secret}'"
    files, files_weights = _run(tmp_path, "files", tiny_checkpoint, mpu)
    full, full_weights = _run(tmp_path, "full", tiny_checkpoint, f"{mpu} model.delivery='full'")
    assert files_weights.keys() == full_weights.keys()
    assert all(torch.equal(files_weights[k], full_weights[k]) for k in full_weights)
    for by_file, in_message in zip(files["clients"], full["clients"], strict=True):
        assert "excluded" not in by_file and by_file["model_delivery"] == DELTA
        assert by_file["bytes_received_model_by_round"] == [0, 0]
        assert in_message["bytes_received_model"] > 0 and in_message["bytes_received_files"] == 0
        # the copies' changed weights lie in the files instead: every decoder layer, not the
        # embeddings and head (about half the tiny model's bytes)
        assert 0.4 * in_message["bytes_received_model"] < by_file["bytes_received_files"]
        assert by_file["bytes_received_files"] < 0.6 * in_message["bytes_received_model"]
    assert not (tmp_path / "files" / COPIES_DIR).exists()
