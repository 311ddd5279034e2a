"""Every registered forget objective runs in a real Flower simulation on the TOFU scenario."""

import json

import pytest

from fedunlearn.objectives import OBJECTIVES, objective_requirements
from simulations import run_local

pytestmark = pytest.mark.slow

SMALL_RUN = (
    "num-authors=20 retain-samples=20 eval-retain-samples=20 lora-rank=4 lora-alpha=8.0 "
    "eval-max-new-tokens=8 local-retain-samples=6 forget-steps=4 retain-steps=4"
)
FORGET_OBJECTIVES = sorted(set(OBJECTIVES) - {"nll"})


def test_every_objective_is_covered():
    assert set(FORGET_OBJECTIVES) >= {
        "ga", "graddiff", "npo", "simnpo", "dpo", "idk", "rmu", "undial", "satimp", "kl"
    }  # fmt: skip


@pytest.mark.parametrize("objective", FORGET_OBJECTIVES)
def test_objective_through_flower(tmp_path, tiny_checkpoint, objective):
    path = run_local.run(
        run_config=f"model-path='{tiny_checkpoint}' objective='{objective}' {SMALL_RUN}",
        output_dir=tmp_path / "out",
        flwr_home=tmp_path / "flwr_home",
    )
    results = json.loads(path.read_text())
    forget = [c for c in results["clients"] if c["role"] == "forget"]
    retain = [c for c in results["clients"] if c["role"] == "retain"]
    assert len(forget) == 5 and len(retain) == 1
    assert all("excluded" not in c for c in results["clients"])
    assert {c["objective"] for c in forget} == {objective}
    assert {c["objective"] for c in retain} == {"nll"}
    assert all(c["task_vector_norm"] > 0 for c in results["clients"])
    # forget clients hold local retain data exactly when their objective uses it
    held = [len(a["retain_indices"]) for a in results["assignments"] if a["role"] == "forget"]
    expected = 6 if objective_requirements(objective).needs_retain else 0
    assert held == [expected] * 5
    assert results["merge"]["norm_final"] > 0
    assert results["metrics"]["after"] != results["metrics"]["before"]
