"""``python -m simulations.real_check`` as a user runs it: a real process on the real SmolLM2
checkpoint, the real TOFU files and a real Flower round (no mocks). The check itself decides
pass or fail (its thresholds are documented in the module); these tests assert that it ran
every stage and passed, and that a failure ends in the ``FAILED`` line with exit code 1."""

import json
import subprocess
import sys

import pytest
import torch

from simulations import run_local
from tests.shared_paths import shared_data

STAGES = ("[load]", "[mpu]", "[flower]")


def _real_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simulations.real_check", *args],
        cwd=run_local.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_real_check_passes_end_to_end(tmp_path):
    shared_data("tofu", "full.json")  # fails (not skips) without the real TOFU files
    completed = _real_check("--output-dir", str(tmp_path), timeout=1200)
    lines = completed.stdout.strip().splitlines()
    assert lines, completed.stderr[-3000:]
    assert completed.returncode == 0, (lines[-1], completed.stderr[-3000:])
    assert lines[-1].startswith("real-check: ok ("), lines[-1]
    for stage in STAGES:
        assert any(line.startswith(stage) for line in lines), stage
    assert not any("[FAILED]" in line for line in lines)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["metrics"] == {}  # evaluate=false: the check measures its NLLs itself
    assert {"evaluation_before", "federated_round"} <= results["seconds"].keys()
    assert (tmp_path / "run" / "checkpoint" / "weights.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_a_failure_ends_in_the_failed_line_and_exit_1(tmp_path):
    completed = _real_check("--cuda", "--output-dir", str(tmp_path), timeout=300)
    assert completed.returncode == 1, completed.stderr[-3000:]
    last = completed.stdout.strip().splitlines()[-1]
    assert last == "real-check: FAILED --cuda was given but no CUDA device is available"
