"""A damaged or foreign checkpoint folder is refused and never deleted; one run per output-dir.

Real files damaged on disk, the real ``open_checkpoint`` of the ServerApp's unlearn pipeline,
and for the output-dir lock a second real process.
"""

import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from flwr.common.config import flatten_dict

from fedunlearn.files import FolderInUseError, exclusive_folder
from strategies import server_app
from strategies.checkpoint import CHECKPOINT_DIR, MARKER_FILE, CheckpointError
from strategies.settings import RunSettings
from strategies.unlearn_pipeline import open_checkpoint

ROOT = Path(__file__).resolve().parents[2]
#: the run config Flower reads: pyproject's tables flattened to dotted keys ("firm.alpha")
DEFAULTS = flatten_dict(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
)


def _settings(output_dir: Path, **overrides) -> RunSettings:
    config = {**DEFAULTS, "output-dir": str(output_dir), "merge": "firm", "num-rounds": 3}
    return RunSettings.from_run_config({**config, **overrides})


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _saved_run(output_dir: Path, model) -> tuple[RunSettings, dict[str, bytes]]:
    """A run that finished round 1 and stored a fresh MPU secret; its checkpoint files."""
    settings = _settings(output_dir)
    checkpoint, done, _, _ = open_checkpoint(settings, output_dir, model)
    assert done == 0
    checkpoint.save(1, model.state_dict(), {"clients": []})
    checkpoint.mpu_secret("")
    return settings, _files(checkpoint.folder)


def test_a_truncated_state_is_an_error_and_nothing_is_deleted(tmp_path, tiny_model):
    settings, saved = _saved_run(tmp_path, tiny_model)
    folder = tmp_path / CHECKPOINT_DIR
    (folder / "state.json").write_bytes(saved["state.json"][:40])
    with pytest.raises(CheckpointError, match=r"state\.json is unreadable.*resume=false"):
        open_checkpoint(settings, tmp_path, tiny_model)
    after = _files(folder)
    assert after["weights.safetensors"] == saved["weights.safetensors"]
    assert after["mpu-secret"] == saved["mpu-secret"]


def test_same_size_corrupted_weights_are_an_error_naming_the_file(tmp_path, tiny_model):
    settings, saved = _saved_run(tmp_path, tiny_model)
    weights = tmp_path / CHECKPOINT_DIR / "weights.safetensors"
    damaged = saved["weights.safetensors"][:-8] + b"\xff" * 8  # NaN in the last tensor
    weights.write_bytes(damaged)
    with pytest.raises(CheckpointError, match=rf"{weights} differs from the sha256"):
        open_checkpoint(settings, tmp_path, tiny_model)
    assert weights.read_bytes() == damaged


def test_missing_weights_and_an_altered_secret_are_errors(tmp_path, tiny_model):
    settings, saved = _saved_run(tmp_path, tiny_model)
    folder = tmp_path / CHECKPOINT_DIR
    (folder / "weights.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"weights\.safetensors is missing"):
        open_checkpoint(settings, tmp_path, tiny_model)
    (folder / "weights.safetensors").write_bytes(saved["weights.safetensors"])
    checkpoint, done, _, _ = open_checkpoint(settings, tmp_path, tiny_model)
    assert done == 1
    record = json.loads(saved["mpu-secret"])
    flipped = "0" if record["secret"][0] != "0" else "1"
    (folder / "mpu-secret").write_text(
        json.dumps({**record, "secret": flipped + record["secret"][1:]})
    )
    with pytest.raises(CheckpointError, match=r"mpu-secret differs from its sha256"):
        checkpoint.mpu_secret("")


@pytest.mark.parametrize("resume", [True, False])
def test_a_folder_the_project_did_not_write_is_never_deleted(tmp_path, tiny_model, resume):
    folder = tmp_path / CHECKPOINT_DIR
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=rf"{folder} exists and is not a fedunlearn"):
        open_checkpoint(_settings(tmp_path, resume=resume), tmp_path, tiny_model)
    assert _files(folder) == {"notes.txt": b"mine"}


def test_resume_false_clears_only_the_files_the_checkpoint_listed(tmp_path, tiny_model):
    settings, saved = _saved_run(tmp_path, tiny_model)
    folder = tmp_path / CHECKPOINT_DIR
    (folder / "my-plot.png").write_bytes(b"png")
    fresh = _settings(tmp_path, resume=False)
    with pytest.raises(CheckpointError, match=r"files the checkpoint did not write \(my-plot"):
        open_checkpoint(fresh, tmp_path, tiny_model)
    assert _files(folder) == {**saved, "my-plot.png": b"png"}  # nothing removed

    (folder / "my-plot.png").unlink()
    checkpoint, done, state, _ = open_checkpoint(fresh, tmp_path, tiny_model)
    assert (done, state) == (0, None)
    assert sorted(_files(folder)) == [MARKER_FILE]  # weights, state and secret went
    checkpoint.save(1, tiny_model.state_dict(), {})
    assert open_checkpoint(settings, tmp_path, tiny_model)[1] == 1


HOLDER = """
import sys
from pathlib import Path
from fedunlearn.files import exclusive_folder
with exclusive_folder(Path(sys.argv[1]), "output-dir"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_run_on_the_same_output_dir_is_refused_at_once(tmp_path):
    output_dir, cache_dir = tmp_path / "out", tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(output_dir)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        run_config = {**DEFAULTS, "output-dir": str(output_dir), "model.cache-dir": str(cache_dir)}
        context = Context(1, 0, {}, RecordDict(), run_config)
        started = time.perf_counter()
        with pytest.raises(FolderInUseError, match=rf"{output_dir} is in use by PID {holder.pid}"):
            server_app.app(None, context)  # the ServerApp as Flower calls it
        assert time.perf_counter() - started < 5
        assert not cache_dir.exists()  # refused before any model was built or loaded
    finally:
        holder.send_signal(signal.SIGKILL)  # a crashed run: the kernel drops its lock
        holder.wait()
    with exclusive_folder(output_dir, "output-dir"):
        assert (output_dir / ".fedunlearn-run.lock.pid").read_text().strip().isdigit()
    assert not (output_dir / ".fedunlearn-run.lock.pid").exists()
