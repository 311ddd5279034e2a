"""learn.source='federated' in real Flower simulations: the knowledgeable model and the
reference learned by the clients with Flower's strategies, cached, then unlearned as usual."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from simulations import run_local
from tests.shared_paths import shared_data
from tests.simulations.presets import SMALL_TOFU

pytestmark = pytest.mark.slow

LEARN = "learn.source='federated' learn.local-epochs=2"


def _run(tmp_path, name: str, options: str, rounds: int = 2) -> dict:
    path = run_local.run(
        run_config=f"{SMALL_TOFU} {LEARN} learn.rounds={rounds} {options}",
        output_dir=tmp_path / name,
        flwr_home=tmp_path / "flwr_home",
        cache_dir=tmp_path / "cache",
    )
    return json.loads(path.read_text())


def test_fedprox_learns_both_models_on_the_clients_and_caches_them(tmp_path):
    results = _run(tmp_path, "first", "learn.strategy='fedprox' learn.proximal-mu=0.05")
    learn = results["substrate"]["learn"]
    assert learn["strategy"] == "fedprox" and learn["start"].endswith("pretrained")
    shards = learn["shards"]
    assert [s["forget_records"] > 0 for s in shards] == [True] * 5 + [False]
    for name in ("knowledgeable", "reference"):
        stage = learn["stages"][name]
        assert not stage["cached"]
        losses = [r["loss_mean"] for r in stage["rounds"]]
        assert len(losses) == 2 and losses[1] < losses[0]
        assert all(not r["excluded"] for r in stage["rounds"])
        clients = stage["clients_last_round"]
        # FedProx's μ reached every client through the Flower strategy's config
        assert [c["proximal_mu"] for c in clients] == [0.05] * 6
    # the reference's clients trained without their forget records (dropped on the node)
    trained = [c["num_examples"] for c in learn["stages"]["reference"]["clients_last_round"]]
    assert trained == [s["records"] - s["forget_records"] for s in shards]
    everything = [c["num_examples"] for c in learn["stages"]["knowledgeable"]["clients_last_round"]]
    assert everything == [s["records"] for s in shards]
    assert results["metrics"]["before"] != results["metrics"]["reference"]
    assert "federated_learning" in results["seconds"]

    # the second run takes both models from the cache and unlearns the same model to the same
    # weights (compared bit for bit; its evaluation would only repeat the first run's)
    again = _run(
        tmp_path, "second", "learn.strategy='fedprox' learn.proximal-mu=0.05 evaluate=false"
    )
    stages = again["substrate"]["learn"]["stages"]
    assert stages["knowledgeable"]["cached"] and stages["reference"]["cached"]
    weights = [
        load_file(str(tmp_path / n / "checkpoint" / "weights.safetensors"))
        for n in ("first", "second")
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_lora_learning_changes_only_the_adapted_weights(tmp_path):
    results = _run(
        tmp_path,
        "lora",
        "learn.strategy='fedadam' learn.finetune='lora' lora.targets='q_proj,v_proj' "
        "evaluate=false",
        rounds=1,
    )
    learn = results["substrate"]["learn"]
    key = learn["stages"]["knowledgeable"]["key"]
    (entry,) = (tmp_path / "cache" / "learn").glob(f"*/{key}")
    learned = load_file(str(entry / "model.safetensors"))
    start = AutoModelForCausalLM.from_pretrained(learn["start"], dtype=torch.float32).state_dict()
    changed = {k for k, v in learned.items() if not torch.equal(v, start[k])}
    assert changed, "FedAdam over the merged adapters moved no weight"
    assert all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), sorted(changed)


def test_the_published_tofu_files_are_learned_on_the_clients_that_hold_them(
    tmp_path, tiny_checkpoint
):
    """learn.source='federated' on the real TOFU files (a tiny random model: the layout and the
    Flower rounds, not what is learned): the forget authors' QA on the forget clients, the other
    authors in play shared by all, the reference trained without the forget QA."""
    path = run_local.run(
        run_config=(
            f"model.path='{tiny_checkpoint}' scenario.data-path='{shared_data('tofu')}' "
            "scenario.num-forget-clients=2 scenario.tofu-subset-authors=4 "
            "scenario.retain-samples=20 learn.source='federated' learn.rounds=1 "
            "learn.local-epochs=1 "
            "learn.partitioner='dirichlet' evaluate=false"
        ),
        output_dir=tmp_path / "real",
        flwr_home=tmp_path / "flwr_home",
        cache_dir=tmp_path / "cache",
    )
    learn = json.loads(path.read_text())["substrate"]["learn"]
    shards = learn["shards"]
    # forget01: the last 2 authors' 40 QA over the 2 forget clients; 2 more authors' 40 QA kept
    assert [s["forget_records"] for s in shards] == [20, 20, 0]
    assert sum(s["records"] - s["forget_records"] for s in shards) == 40
    assert learn["partitioner"] == "dirichlet" and learn["dirichlet_alpha"] == 0.5
    stages = learn["stages"]
    trained = [c["num_examples"] for c in stages["reference"]["clients_last_round"]]
    assert trained == [s["records"] - s["forget_records"] for s in shards]
    everything = [c["num_examples"] for c in stages["knowledgeable"]["clients_last_round"]]
    assert everything == [s["records"] for s in shards]
