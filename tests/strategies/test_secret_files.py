"""The MPU secret from a private file or the environment, never from the run config; private
files written 0600 from creation."""

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from strategies.checkpoint import CheckpointError, RunCheckpoint, config_fingerprint
from strategies.secret_files import given_secret, read_secret_file, write_private_file
from strategies.settings import RunSettings

ENV = "FEDUNLEARN_MPU_SECRET"


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _secret_file(folder, text: str, mode: int):
    path = folder / "secret"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_inline_mpu_secret_is_refused_with_the_way_to_give_it():
    with pytest.raises(ValueError, match="'mpu.secret' is refused") as err:
        RunSettings.from_run_config({"wrapper": "mpu", "mpu.secret": "do-not-leak-4711"})
    assert "mpu.secret-file" in str(err.value) and "$FEDUNLEARN_MPU_SECRET" in str(err.value)
    assert "do-not-leak-4711" not in str(err.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_secret_file_others_may_read_is_refused(tmp_path, mode):
    path = _secret_file(tmp_path, "s3cret-value\n", mode)
    with pytest.raises(ValueError, match=f"mpu.secret-file .*has mode {mode:04o}") as err:
        RunSettings.from_run_config({"wrapper": "mpu", "mpu.secret-file": str(path)})
    assert "chmod 600" in str(err.value) and "s3cret-value" not in str(err.value)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_secret_file_is_read_without_its_newline(tmp_path, mode):
    path = _secret_file(tmp_path, "s3cret value\n", mode)
    settings = RunSettings.from_run_config({"wrapper": "mpu", "mpu.secret-file": str(path)})
    assert given_secret(settings.mpu.secret_file) == "s3cret value"
    assert settings.as_dict()["mpu.secret-file"] == str(path)  # the path, never the secret
    assert "s3cret" not in repr(settings.as_dict())
    assert given_secret("") == ""  # unset: $FEDUNLEARN_MPU_SECRET or a fresh secret


def test_unusable_secret_files_are_named_and_refused(tmp_path):
    empty = _secret_file(tmp_path, "\n", 0o600)
    with pytest.raises(ValueError, match="is empty"):
        read_secret_file(empty)
    with pytest.raises(ValueError, match="absolute path"):
        read_secret_file("relative/secret")
    with pytest.raises(ValueError, match="cannot be opened: No such file"):
        read_secret_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        read_secret_file(tmp_path)
    binary = tmp_path / "binary"
    write_private_file(binary, b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_secret_file(binary)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    result: list[BaseException] = []
    reader = threading.Thread(
        target=lambda: result.append(pytest.raises(ValueError, read_secret_file, fifo).value)
    )
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading the secret from a FIFO blocked"
    assert "not a regular file" in str(result[0])


def test_private_file_is_0600_from_creation_and_never_overwritten(tmp_path, umask_zero):
    path = write_private_file(tmp_path / "key", b"private")
    assert _mode(path) == 0o600 and path.read_bytes() == b"private"
    with pytest.raises(FileExistsError, match="already exists; it is not overwritten"):
        write_private_file(path, b"other")
    assert path.read_bytes() == b"private"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):  # a planted link is not followed
        write_private_file(link, b"private")
    assert not (tmp_path / "elsewhere").exists()


WRITE_CUT_SHORT = """
import os, resource, sys
from pathlib import Path
from strategies.secret_files import write_private_file
os.umask(0)
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))  # the write fails after creation
try:
    write_private_file(Path(sys.argv[1]), b"x" * 4096)
except OSError as err:
    print("write failed:", err.strerror)
"""


def test_a_failed_write_never_leaves_a_readable_file(tmp_path):
    """The file exists between its creation and the failed write: its mode must already be
    0600 then (write-then-chmod would leave it 0666 under umask 0); the partial file goes."""
    path = tmp_path / "key"
    done = subprocess.run(
        [sys.executable, "-c", WRITE_CUT_SHORT, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "write failed: File too large" in done.stdout, done.stdout + done.stderr
    assert not path.exists()


CONFIG = {"wrapper": "mpu", "num-rounds": 3, "output-dir": "/a", "mpu.secret": ""}
MODEL = {"w": "float32[2]"}


def _checkpoint(folder, config=CONFIG) -> RunCheckpoint:
    return RunCheckpoint(folder, config_fingerprint(config, MODEL), config)


def test_secret_from_env_or_file_resumes_alike(tmp_path, monkeypatch):
    """A run started with $FEDUNLEARN_MPU_SECRET resumes with a file holding the same secret
    (and the file's path is not part of the fingerprint); another secret is refused."""
    monkeypatch.setenv(ENV, "shared-secret-4711")
    first = _checkpoint(tmp_path).mpu_secret(given_secret(""))
    monkeypatch.delenv(ENV)
    path = _secret_file(tmp_path, "shared-secret-4711\n", 0o600)
    moved = {**CONFIG, "mpu.secret-file": str(path)}
    assert config_fingerprint(moved, MODEL) == config_fingerprint(CONFIG, MODEL)
    assert _checkpoint(tmp_path, moved).mpu_secret(given_secret(str(path))) == first
    other = tmp_path / "other"
    write_private_file(other, b"another-secret")
    with pytest.raises(CheckpointError, match="another MPU secret.*mpu.secret-file"):
        _checkpoint(tmp_path).mpu_secret(given_secret(str(other)))
    assert first == b"shared-secret-4711"


def test_study_secrets_go_through_private_files(tmp_path):
    from simulations.mpu_study import study_secret_file

    path = study_secret_file(tmp_path, 1)
    assert _mode(path) == 0o600 and _mode(path.parent) & 0o077 == 0
    assert read_secret_file(path) == "fedunlearn-mpu-study-1"  # the same keys as before
    assert study_secret_file(tmp_path, 1) == path  # a rerun reuses it
    path.write_text("edited")
    with pytest.raises(ValueError, match="another secret than replicate 1's"):
        study_secret_file(tmp_path, 1)
