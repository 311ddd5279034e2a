"""Crash safety in real processes: kill a multi-round run mid-way, rerun the same command.

Every run is ``python -m simulations.run_local`` in its own process group. The killed run is
stopped with SIGKILL (no cleanup) together with everything it started — the ``flwr run``
client, the SuperLink (its own session), the ServerApp, the simulation and Ray: all of them
inherit a marker environment variable by which they are found. The rerun must resume from
the last finished round and end with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from simulations import run_local
from strategies.secret_files import write_private_file

pytestmark = pytest.mark.slow

SMALL_RUN = (  # as in test_mpu_flower.py
    "scenario.num-authors=20 scenario.retain-samples=20 scenario.num-forget-clients=2 "
    "eval.retain-samples=20 eval.max-new-tokens=8 lora.rank=4 lora.alpha=8.0 "
    "training.forget-steps=3 training.retain-steps=3"
)
MARKER = "FEDUNLEARN_TEST_RESUME_MARKER"
FLWR_HOMES = run_local.REPO_ROOT / ".flwr_home"  # where run_local's CLI puts its Flower homes


class Runs:
    """Starts run_local CLI processes and finds (and finally removes) what they leave."""

    def __init__(self) -> None:
        self.marker = uuid.uuid4().hex
        self.flwr_homes: set[Path] = set()
        self.outputs: list[str] = []
        self.logs: dict[int, Path] = {}

    def start(self, run_config: str, output_dir: Path) -> subprocess.Popen:
        env = {**os.environ, MARKER: self.marker}  # one thread: tests/conftest.py
        command = [sys.executable, "-m", "simulations.run_local", "--run-config", run_config]
        log = output_dir.with_name(f"{output_dir.name}-{len(self.logs)}.log")
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                [*command, "--output-dir", str(output_dir)],
                cwd=run_local.REPO_ROOT,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed as one
            )
        self.logs[process.pid] = log
        return process

    def _collect(self, process: subprocess.Popen) -> None:
        self.outputs.append(self.logs[process.pid].read_text(errors="replace"))

    def processes(self, root: subprocess.Popen | None = None) -> list[psutil.Process]:
        """Live processes of these runs: marked ones and the descendants of ``root``."""
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if env.get(MARKER) == self.marker:
                found[proc.pid] = proc
                if env.get("FLWR_HOME"):
                    self.flwr_homes.add(Path(env["FLWR_HOME"]))
        if root is not None and root.poll() is None:
            try:
                found[root.pid] = psutil.Process(root.pid)
                for child in found[root.pid].children(recursive=True):
                    found[child.pid] = child
            except psutil.NoSuchProcess:
                pass
        alive = []
        for proc in found.values():
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        return alive

    def command_lines(self, root: subprocess.Popen) -> list[str]:
        """Command lines of the run's live processes (those that vanish meanwhile skipped)."""
        lines = []
        for proc in self.processes(root):
            try:
                lines.append(" ".join(proc.cmdline()))
            except psutil.Error:
                pass
        return lines

    def wait(self, process: subprocess.Popen, until=None, timeout: float = 600.0) -> bool:
        """Wait for ``process`` to end (True) or for ``until()`` to hold (False)."""
        deadline = time.monotonic() + timeout
        while process.poll() is None:
            self.processes()  # remember the Flower homes while they are in use
            if until is not None and until():
                return False
            if time.monotonic() > deadline:
                self.kill(process)
                raise AssertionError(f"run did not finish within {timeout:.0f} s")
            time.sleep(0.1)
        self._collect(process)
        return True

    def kill(self, root: subprocess.Popen) -> None:
        """SIGKILL the run's process group, then every process it started, until none is left."""
        try:
            os.killpg(root.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while alive := self.processes(root):
            for proc in alive:
                try:
                    proc.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            assert time.monotonic() < deadline, f"still running after SIGKILL: {alive}"
            time.sleep(0.2)
        root.wait(timeout=30)
        self._collect(root)
        assert not self.processes(), "a process of the killed run survived"

    def run(self, run_config: str, output_dir: Path) -> dict:
        process = self.start(run_config, output_dir)
        self.wait(process)
        assert process.returncode == 0, self.outputs[-1][-3000:]
        return json.loads((output_dir / "results.json").read_text())

    def cleanup(self) -> None:
        for proc in self.processes():  # a failed assertion may have left one running
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        for home in self.flwr_homes:  # only the homes these runs created under .flwr_home/
            if home.parent == FLWR_HOMES and home.is_dir():
                shutil.rmtree(home, ignore_errors=True)


@pytest.fixture()
def runs():
    runs = Runs()
    yield runs
    runs.cleanup()


def _finished_round(output_dir: Path) -> int:
    try:
        return json.loads((output_dir / "checkpoint" / "state.json").read_text())["round"]
    except (OSError, ValueError):
        return 0


def _final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "checkpoint" / "weights.safetensors"))


def _kill_after_first_round(runs: Runs, run_config: str, output_dir: Path) -> int:
    process = runs.start(run_config, output_dir)
    ended = runs.wait(process, until=lambda: _finished_round(output_dir) >= 1)
    assert not ended, "the run ended before its first checkpoint: " + runs.outputs[-1][-3000:]
    # the SuperLink (own session) and Ray are found by the marker before the kill ...
    running = runs.command_lines(process)
    assert any("flower-superlink" in c for c in running), running
    assert any("raylet" in c for c in running), running
    # ... and none of them survives it (Ray's own processes may also exit by themselves
    # once their parents are gone, so what matters is that nothing is left)
    runs.kill(process)
    done = _finished_round(output_dir)
    assert not (output_dir / "results.json").exists()
    return done


# One run with the most state to carry over a kill: MPU's copies, secret and history, over three
# rounds (a plain FIRM run resumes through the same checkpoint code, without MPU's state).
RESUMED_RUN = "wrapper='mpu' merge='firm' mpu.copies=2"
NUM_ROUNDS = 3


def test_killed_run_resumes_to_the_same_weights(tmp_path, tiny_checkpoint, runs):
    run_config = f"model.path='{tiny_checkpoint}' {RESUMED_RUN} num-rounds={NUM_ROUNDS} {SMALL_RUN}"
    killed = tmp_path / "killed"
    done = _kill_after_first_round(runs, run_config, killed)
    assert 1 <= done < NUM_ROUNDS, "killed too late: every round had finished"

    resumed = runs.run(run_config, killed)
    assert resumed["resumed_from_round"] == done
    assert _finished_round(killed) == NUM_ROUNDS

    # the uninterrupted run, with the fresh MPU secret the killed run stored for its resume
    secret_file = killed / "checkpoint" / "mpu-secret"
    assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
    secret = json.loads(secret_file.read_text())["secret"]
    given = write_private_file(tmp_path / "reference-secret", secret.encode())
    for text in [*runs.outputs, (killed / "results.json").read_text()]:
        assert secret not in text
    reference = runs.run(f"{run_config} mpu.secret-file='{given}'", tmp_path / "reference")
    assert "resumed_from_round" not in reference

    got, want = _final_weights(killed), _final_weights(tmp_path / "reference")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), max(
        float((got[k] - want[k]).abs().max()) for k in want
    )
    assert resumed["metrics"]["after"] == reference["metrics"]["after"]
    roles = sorted(c["role"] for c in reference["clients"])  # listed in reply order
    assert sorted(c["role"] for c in resumed["clients"]) == roles
    assert resumed["merge"]["norm_final"] == reference["merge"]["norm_final"]

    # all rounds done: a rerun only evaluates the saved weights
    again = runs.run(run_config, killed)
    assert again["resumed_from_round"] == NUM_ROUNDS
    assert again["metrics"]["after"] == reference["metrics"]["after"]
    assert again["clients"] == resumed["clients"]


def _schedule() -> str:
    """Three requests, one forget author each, from clients 0, 1 and 2 at rounds 1, 2, 3."""
    from fedunlearn.benchmarks.tofu import generate_tofu

    authors = generate_tofu(seed=0, num_authors=20, qa_per_author=10).forget_authors(15.0)
    return json.dumps({str(k + 1): {str(k): {"authors": [a]}} for k, a in enumerate(authors)})


def test_a_request_schedule_killed_after_round_two_resumes_to_the_same_results(
    tmp_path, tiny_checkpoint, runs
):
    (tmp_path / "schedule.json").write_text(_schedule())
    run_config = (
        SMALL_RUN.replace("num-forget-clients=2", "num-forget-clients=3")
        + f" model.path='{tiny_checkpoint}' num-rounds=3 scenario.forget-percent=15.0 "
        f"requests.schedule='{tmp_path / 'schedule.json'}' scenario.mixed-clients=1"
    )
    killed = tmp_path / "killed"
    process = runs.start(run_config, killed)
    ended = runs.wait(process, until=lambda: _finished_round(killed) >= 2)
    assert not ended, "the run ended before round 2: " + runs.outputs[-1][-3000:]
    runs.kill(process)
    assert _finished_round(killed) == 2 and not (killed / "results.json").exists()

    resumed = runs.run(run_config, killed)
    assert resumed["resumed_from_round"] == 2
    reference = runs.run(run_config, tmp_path / "reference")
    got, want = _final_weights(killed), _final_weights(tmp_path / "reference")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert resumed["requests"] == reference["requests"]
    assert resumed["rounds"] == reference["rounds"]
    assert resumed["metrics"]["after"] == reference["metrics"]["after"]

    requests = reference["requests"]
    assert [(q["round"], q["client"], q["records"]) for q in requests] == [
        (1, 0, 10),
        (2, 1, 10),
        (3, 2, 10),
    ]
    assert [r["requests_served"] for r in reference["rounds"]] == [1, 2, 3]
    # client 0 is mixed-role: in round 1 its node uploaded both parts, recorded under the node
    for run in (reference, resumed):
        mixed = [[c for c in run["clients_by_round"][r] if "kept" in c] for r in "123"]
        assert [len(m) for m in mixed] == [1, 0, 0]
        assert mixed[0][0]["role"] == "forget" and mixed[0][0]["kept"]["role"] == "retain"
        assert mixed[0][0]["kept"]["num_examples"] == 20  # scenario.retain-samples
    # every round's nodes hold the run's initial weights: sent only what changed since them
    for run in (reference, resumed):
        for r in "123":
            assert {c["model_delivery"] for c in run["clients_by_round"][r]} == {"delta-from-base"}
    first, third = (reference["clients_by_round"][r][0] for r in "13")
    assert first["bytes_received_model"] == 0 < third["bytes_received_model"]
    for q in requests:  # every request scored after every round, with its interval
        assert sorted(q["metrics_by_round"]) == ["1", "2", "3"]
        assert "reference" not in q  # a model.path run has no reference to compare with
        low, high = q["metrics_ci_by_round"]["3"]["forget_rouge_l"]
        assert low <= q["metrics_by_round"]["3"]["forget_rouge_l"] <= high
    (forget,) = [a for a in reference["assignments"] if a["role"] == "forget"]  # round 3's
    assert len(forget["indices"]) == 10 and len(reference["assignments"]) == 4
    assert "Deletion requests" in (tmp_path / "reference" / "report.html").read_text()
