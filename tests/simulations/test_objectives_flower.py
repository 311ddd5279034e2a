"""Forget objectives in real Flower simulations on the TOFU scenario.

One Flower run per distinct data requirement (``ObjectiveSpec``: local retain sample, refusal
alternates, frozen reference — the first objective of each kind), so every data path a
ClientApp assembles for an objective runs on Ray; objectives that share a requirement share
that path (their losses and training are tested in-process for every objective in
tests/fedunlearn/objectives; RMU also runs through Flower in the wmdp end-to-end test).
"""

import json

import pytest

from fedunlearn.objectives import OBJECTIVES, objective_requirements
from simulations import run_local

pytestmark = pytest.mark.slow

SMALL_RUN = (
    "scenario.num-authors=20 scenario.retain-samples=20 scenario.local-retain-samples=6 "
    "eval.retain-samples=20 eval.max-new-tokens=8 lora.rank=4 lora.alpha=8.0 "
    "training.forget-steps=4 training.retain-steps=4"
)
FORGET_OBJECTIVES = sorted(set(OBJECTIVES) - {"nll"})
#: the first objective (alphabetically) of each distinct data requirement
ONE_PER_REQUIREMENT = sorted(
    {objective_requirements(o): o for o in reversed(FORGET_OBJECTIVES)}.values()
)


def test_every_objective_is_covered():
    assert set(FORGET_OBJECTIVES) >= {
        "ga", "graddiff", "npo", "simnpo", "dpo", "idk", "rmu", "undial", "satimp", "kl"
    }  # fmt: skip


def test_one_objective_per_requirement_covers_every_requirement():
    specs = {objective_requirements(o) for o in FORGET_OBJECTIVES}
    assert {objective_requirements(o) for o in ONE_PER_REQUIREMENT} == specs
    assert {"ga", "graddiff", "dpo", "idk"} <= set(ONE_PER_REQUIREMENT)


@pytest.mark.parametrize("objective", ONE_PER_REQUIREMENT)
def test_objective_through_flower(tmp_path, tiny_checkpoint, objective):
    path = run_local.run(
        run_config=f"model.path='{tiny_checkpoint}' objective.name='{objective}' {SMALL_RUN}",
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
