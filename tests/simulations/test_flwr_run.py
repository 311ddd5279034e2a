"""The app run with Flower's own command, ``flwr run . <connection> --stream``, not run_local.

A real simulation SuperLink on loopback ports; the repository folder itself is submitted (what
a user types in the checkout), with an empty cache so the ServerApp builds the substrate itself:
its progress must show in the streamed log, and the run must leave results.json and
report.html where ``output-dir`` says.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from simulations import run_local
from tests.simulations.presets import SMALL_TOFU

pytestmark = pytest.mark.slow

# The substrate pre-trained for one epoch and fine-tuned in half the epochs at twice the rate (as
# the scenario tests do; build 58 s instead of 108 s on an idle 2-core CPU, forget ROUGE-L
# 0.86 → 0.33): this test needs a build to show and knowledge to forget, not the preset's recall
QUICK_BUILD = "substrate.pretrain-epochs=1 substrate.finetune-epochs=8 substrate.finetune-lr=4e-3"


def test_flwr_run_stream_runs_the_app_and_shows_the_first_build(tmp_path) -> None:
    flwr_home = tmp_path / "flwr_home"
    flwr_home.mkdir()
    env = run_local.flower_env(flwr_home)
    out, cache = tmp_path / "out", tmp_path / "cache"
    process, port = run_local.start_superlink(flwr_home, env)
    try:
        (flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n'
            f'[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        completed = subprocess.run(
            [
                str(run_local.BIN_DIR / "flwr"),
                "run",
                ".",
                "local",
                "--stream",
                "--run-config",
                f"{SMALL_TOFU} {QUICK_BUILD} output-dir='{out}' model.cache-dir='{cache}'",
                "--federation-config",
                "num-supernodes=6 client-resources-num-cpus=1 init-args-num-cpus=1",
            ],
            env=env,
            cwd=run_local.REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    finally:
        run_local.stop_process(process)
    log = completed.stdout + completed.stderr
    assert completed.returncode == 0, log[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["merge"]["method"] == "firm"
    assert len(results["clients"]) == 6
    assert (
        results["metrics"]["after"]["forget_rouge_l"]
        < results["metrics"]["before"]["forget_rouge_l"]
    )
    assert (out / "report.html").stat().st_size > 10_000
    # the substrate was built inside the ServerApp, and its progress reached the streamed log
    assert any(cache.glob("tofu-substrate-*/knowledgeable"))
    assert "knowledge fine-tune" in log
