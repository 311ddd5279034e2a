"""wrapper=mpu in real Flower simulations: any inner merge, the baselines, several rounds."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fedunlearn.models.llama import new_tiny_llama
from fedunlearn.uploads import load_uploads
from simulations import run_local
from strategies.secret_files import write_private_file

pytestmark = pytest.mark.slow

SMALL_RUN = (
    "scenario.num-authors=20 scenario.retain-samples=20 scenario.num-forget-clients=2 "
    "eval.retain-samples=20 eval.max-new-tokens=8 lora.rank=4 lora.alpha=8.0 "
    "training.forget-steps=3 training.retain-steps=3"
)


@pytest.mark.parametrize(
    "options",
    [
        # the server secret from a private file (never in the run config); the method as
        # published: no shared noise, and the alignment warning (the default's shared noise
        # runs in the resume and deployment tests)
        "merge='firm' mpu.copies=2 num-rounds=2 mpu.secret-file='{secret_file}' mpu.shared-kappa=0",
        # full fine-tuning of the copies, σ from the task vector θ − θ_pretrained, one set of
        # copies for all three clients of the round, with noise shared by the copies
        "merge='sum' mpu.copies=3 training.finetune='full' mpu.sigma-source='task-vector' "
        "mpu.pretrained-path='{pretrained}' save-uploads=true mpu.publish='per-round' "
        "mpu.shared-kappa=0.01",
        "merge='fulm' mpu.mode='noised'",
        "merge='firm' mpu.mode='clean'",
    ],
)
def test_mpu_through_flower(tmp_path, tiny_checkpoint, options):
    if "{pretrained}" in options:  # another random model stands for θ_pretrained
        pretrained = tmp_path / "pretrained"
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
        new_tiny_llama(model.config, seed=1).save_pretrained(pretrained)
        options = options.format(pretrained=pretrained)
    if "{secret_file}" in options:
        secret_file = write_private_file(tmp_path / "mpu-secret", b"do-not-leak-4711")
        options = options.format(secret_file=secret_file)
    path = run_local.run(
        run_config=f"model.path='{tiny_checkpoint}' wrapper='mpu' {options} {SMALL_RUN}",
        output_dir=tmp_path / "out",
        flwr_home=tmp_path / "flwr_home",
    )
    text = path.read_text()
    assert "do-not-leak-4711" not in text
    results = json.loads(text)
    config = results["config"]
    assert config["wrapper"] == "mpu" and config["mpu.secret"] == ""
    copies = 1 if config["mpu.mode"] != "mpu" else config["mpu.copies"]
    assert len(results["clients"]) == 3
    for client in results["clients"]:
        assert "excluded" not in client
        assert client["mpu_copies"] == copies
        assert client["bytes_received"] > 0
    assert results["merge"]["method"] == config["merge"].split("-")[0]
    assert results["merge"]["norm_final"] > 0
    assert results["metrics"]["after"] != results["metrics"]["before"]
    mpu = results["mpu"]
    assert mpu["mode"] == config["mpu.mode"] and mpu["copies"] == copies
    assert mpu["publish"] == config["mpu.publish"]
    assert mpu["server_seconds"]["publish"] > 0 and mpu["server_seconds"]["map_back"] > 0
    assert mpu["sigma_source"] == config["mpu.sigma-source"]
    # the threat-model warning: MPU without noise shared by a client's copies
    # (left on -1, shared-kappa is 1.5 κ in mpu mode and 0 in the one-copy baselines)
    shared_kappa = config["mpu.shared-kappa"]
    if shared_kappa == -1:
        shared_kappa = 1.5 * config["mpu.kappa"] if config["mpu.mode"] == "mpu" else 0.0
    alignment_warning = any("aligns its m copies" in w for w in mpu["warnings"])
    assert alignment_warning == (config["mpu.mode"] == "mpu" and shared_kappa == 0)
    assert mpu["shared_kappa"] == pytest.approx(shared_kappa)
    assert all(s > 0 for s in mpu["sigma_per_layer"].values()) or config["mpu.mode"] == "clean"
    if config["training.finetune"] == "full":  # dense updates, not 3 copies of rank ≤ 4 mapped back
        forget = [u for u in load_uploads(path.parent / "uploads") if u.role == "forget"]
        update = forget[0].task_vector["model.layers.0.mlp.down_proj.weight"]
        assert torch.linalg.matrix_rank(update) > 3 * 4
