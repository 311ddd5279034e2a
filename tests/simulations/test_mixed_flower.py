"""Mixed-role clients in a real Flower simulation: a forget node that also keeps records
uploads both task vectors; the run ends with the weights of the same clients on separate
nodes (``fold_mixed`` keeps their seeds and merge order)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from simulations import run_local

pytestmark = pytest.mark.slow

RUN = (
    "scenario.num-authors=20 scenario.retain-samples=20 scenario.num-forget-clients=2 "
    "scenario.num-retain-clients=2 lora.rank=4 lora.alpha=8.0 training.forget-steps=3 "
    "training.retain-steps=3 evaluate=false"
)


def _run(tmp_path, checkpoint, name: str, options: str = "") -> dict:
    path = run_local.run(
        run_config=f"model.path='{checkpoint}' {RUN} {options}",
        output_dir=tmp_path / name,
        flwr_home=tmp_path / "flwr_home",
        cache_dir=tmp_path / "cache",
    )
    return json.loads(path.read_text())


def _weights(tmp_path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp_path / name / "checkpoint" / "weights.safetensors"))


def test_a_mixed_role_node_ends_with_the_weights_of_separate_clients(tmp_path, tiny_checkpoint):
    separate = _run(tmp_path, tiny_checkpoint, "separate")
    mixed = _run(tmp_path, tiny_checkpoint, "mixed", "scenario.mixed-clients=1")
    assert len(separate["clients"]) == 4 and len(mixed["clients"]) == 3
    got, want = _weights(tmp_path, "mixed"), _weights(tmp_path, "separate")
    assert all(torch.equal(got[k], want[k]) for k in want)

    # the node holding both parts is recorded once, with its second upload beside its first
    assignments = mixed["assignments"]
    assert [a["role"] for a in assignments] == ["forget", "forget", "retain"]
    node = {c["node_id"]: c for c in mixed["clients"]}[assignments[0]["node_id"]]
    alone = separate["assignments"][-1]  # the retain client whose records the node keeps
    assert assignments[0]["kept_indices"] == alone["indices"]
    retain_alone = {c["node_id"]: c for c in separate["clients"]}[alone["node_id"]]
    assert node["role"] == "forget" and node["kept"]["role"] == "retain"
    for field in ("num_examples", "task_vector_norm", "loss_first", "loss_last", "bytes_sent"):
        assert node["kept"][field] == retain_alone[field], field
    assert sum("kept" in c for c in mixed["clients"]) == 1
