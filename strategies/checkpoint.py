"""Crash safety for multi-round runs: the server state after every finished round, on disk.

``RunCheckpoint`` keeps, in one folder (``<output-dir>/checkpoint/`` by default), only the
last finished round:

* ``fedunlearn-checkpoint.json`` (the marker): written first, into an empty or new folder; it
  lists the files the checkpoint writes. A folder without it, or with other files than those
  (and their temporary files), is not the project's: it is refused (``CheckpointError``
  naming the path), never written to and never deleted;
* ``weights.safetensors``: the global weights after that round (safetensors metadata holds
  the round and a random ``nonce`` that ties the file to its ``state.json``);
* ``state.json``: the round, the nonce, the weights' sha256, the config fingerprint, the run
  config (without secrets) and ``extra`` — what results.json needs about the finished rounds;
* ``mpu-secret`` (MPU runs only, permissions 0600): the fresh server secret of a run whose
  ``mpu.secret`` was empty — so that a resumed run draws the same noise and
  reparameterisations — or, when the secret was given (``mpu.secret-file`` or
  ``$FEDUNLEARN_MPU_SECRET``), only a keyed check value of it (never the secret itself); with
  the sha256 of its contents. The secret is never written to results.json or to the log.

Saving is atomic: both files are first written to unique temporary names
(``.<name>.tmp-<pid>-<random>``) and fsynced, then moved into place with ``os.replace``
(weights first, then ``state.json``). A crash before the weights move leaves the previous
round's pair; a crash between the two moves leaves the new weights and the fsynced temporary
``state.json`` of the same nonce, which ``load`` rolls forward. A loaded checkpoint is
therefore always one finished round, never a mix of two.

A damaged checkpoint (``state.json`` unparsable, a file missing, weights whose sha256 differs
from ``state.json``'s) raises ``CheckpointError`` naming the file; nothing is deleted.
``clear`` (``resume=false``) removes only the files the marker lists.

A checkpoint belongs to one run configuration: ``config_fingerprint`` hashes the run config
minus the keys that cannot change the weights (``output-dir``, ``model.cache-dir``, the secret,
``resume``, ``num-rounds`` — a run may be extended by more rounds), plus the model's weight
names, shapes and dtypes. ``load`` refuses a checkpoint of another fingerprint with an error
that names the differing keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedunlearn.files import (
    fsync_dir,
    fsync_file,
    save_safetensors_streamed,
    sha256_file,
    temp_path,
    temp_target,
    write_file_atomic,
    write_new_file,
)
from fedunlearn.mpu import DEFAULT_SECRET_ENV_VAR, ServerSecret, derive_seed

CHECKPOINT_DIR = "checkpoint"
MARKER_FILE = "fedunlearn-checkpoint.json"
MARKER_KIND = "fedunlearn run checkpoint"
WEIGHTS_FILE = "weights.safetensors"
STATE_FILE = "state.json"
SECRET_FILE = "mpu-secret"
CHECKPOINT_FILES = (WEIGHTS_FILE, STATE_FILE, SECRET_FILE)
FORMAT_VERSION = 2
# run-config keys that cannot change the weights a round produces
# (the secret file's path neither: a resume may read the same secret from elsewhere)
FINGERPRINT_EXCLUDED = (
    "output-dir",
    "model.cache-dir",
    "mpu.secret",
    "mpu.secret-file",
    "resume",
    "num-rounds",
)

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointError",
    "RunCheckpoint",
    "config_fingerprint",
    "model_structure",
]


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used (another config, another secret, broken files, a
    folder the project did not write)."""


def model_structure(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Weight name → ``dtype[shape]``: what the fingerprint knows about the model (the weights'
    values are not hashed; a different checkpoint at the same ``model.path`` is not noticed)."""
    return {name: f"{t.dtype}{list(t.shape)}" for name, t in sorted(state.items())}


def _fingerprint_input(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in sorted(config) if k not in FINGERPRINT_EXCLUDED}


def config_fingerprint(config: Mapping[str, Any], model: Mapping[str, str] | None = None) -> str:
    """sha256 of the run config (minus ``FINGERPRINT_EXCLUDED``) and the model structure."""
    payload = {"config": _fingerprint_input(config), "model": dict(model or {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class RunCheckpoint:
    """The last finished round of a run in ``folder`` (see the module docstring).

    Parameters
    ----------
    folder : Path
        Where the checkpoint lives (``<output-dir>/checkpoint``).
    fingerprint : str
        ``config_fingerprint`` of this run; ``load`` refuses a checkpoint with another one.
    config : Mapping[str, Any] | None (default: None)
        The run config (without secrets), stored in ``state.json`` so that a mismatch can name
        the keys that differ.
    """

    def __init__(
        self, folder: Path, fingerprint: str, config: Mapping[str, Any] | None = None
    ) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.config = dict(config or {})

    @property
    def weights_path(self) -> Path:
        return self.folder / WEIGHTS_FILE

    @property
    def state_path(self) -> Path:
        return self.folder / STATE_FILE

    @property
    def secret_path(self) -> Path:
        return self.folder / SECRET_FILE

    @property
    def marker_path(self) -> Path:
        return self.folder / MARKER_FILE

    # ---- the folder ------------------------------------------------------------------------

    def claim(self) -> None:
        """Make ``folder`` this project's checkpoint folder, or check that it is one.

        A missing or empty folder gets the marker. Raises ``CheckpointError`` (touching
        nothing) for a folder without the marker that holds anything, and for a marked folder
        that holds files the marker does not list."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.marker_path.is_file():
            if any(self.folder.iterdir()):
                raise CheckpointError(
                    f"{self.folder} exists and is not a fedunlearn checkpoint folder (it has no "
                    f"{MARKER_FILE}); it is never written to or deleted: move it away or choose "
                    "another output-dir"
                )
            marker = {"kind": MARKER_KIND, "format": FORMAT_VERSION, "files": CHECKPOINT_FILES}
            write_file_atomic(self.marker_path, json.dumps(marker, indent=1).encode())
        listed = {MARKER_FILE, *self._listed_files()}
        foreign = sorted(
            p.name
            for p in self.folder.iterdir()
            if p.is_symlink()
            or not p.is_file()
            or (p.name not in listed and temp_target(p.name) not in listed)
        )
        if foreign:
            raise CheckpointError(
                f"{self.folder} holds files the checkpoint did not write ({', '.join(foreign)}); "
                "they are never deleted: move them away or choose another output-dir"
            )

    def _listed_files(self) -> set[str]:
        try:
            marker = json.loads(self.marker_path.read_text())
            return set(marker["files"]) & set(CHECKPOINT_FILES)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{self.marker_path} is unreadable ({type(err).__name__}); the folder is left "
                "as it is: delete it by hand or choose another output-dir"
            ) from None

    def clear(self) -> None:
        """Remove what this checkpoint wrote — the files its marker lists and their temporary
        files — after ``claim`` (a fresh start; anything else in the folder is refused)."""
        if not self.folder.exists():
            return
        self.claim()
        listed = self._listed_files()
        for path in self.folder.iterdir():
            if path.name in listed or temp_target(path.name) in {MARKER_FILE, *listed}:
                path.unlink()
        fsync_dir(self.folder)

    def _damaged(self, path: Path, problem: str) -> CheckpointError:
        return CheckpointError(
            f"the checkpoint file {path} {problem}. Nothing was deleted; to start afresh set "
            f"resume=false (removes only the checkpoint's own files in {self.folder}), or choose "
            "another output-dir"
        )

    # ---- rounds ----------------------------------------------------------------------------

    def save(
        self, server_round: int, state_dict: Mapping[str, torch.Tensor], extra: dict[str, Any]
    ) -> None:
        """Atomically replace the checkpoint by round ``server_round``'s weights and ``extra``
        (JSON-serialisable)."""
        if not self.marker_path.is_file():
            self.claim()
        nonce = secrets.token_hex(16)
        weights_tmp, state_tmp = temp_path(self.weights_path), temp_path(self.state_path)
        # written one tensor at a time (tied weights are stored under each of their names)
        layout = {name: (t.dtype, tuple(t.shape)) for name, t in state_dict.items()}
        save_safetensors_streamed(
            weights_tmp,
            layout,
            state_dict.__getitem__,
            metadata={"round": str(server_round), "nonce": nonce},
        )
        fsync_file(weights_tmp)
        record = {
            "format": FORMAT_VERSION,
            "round": int(server_round),
            "nonce": nonce,
            "weights_sha256": sha256_file(weights_tmp),
            "fingerprint": self.fingerprint,
            "config": self.config,
            "extra": extra,
        }
        write_new_file(state_tmp, json.dumps(record, indent=1, allow_nan=False).encode())
        os.replace(weights_tmp, self.weights_path)
        fsync_dir(self.folder)
        os.replace(state_tmp, self.state_path)
        fsync_dir(self.folder)

    def _read_state(self, path: Path) -> dict[str, Any] | None:
        """``path``'s record, None when the file does not exist; raises when it is damaged."""
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise self._damaged(path, f"is unreadable ({type(err).__name__}: {err})") from None
        if not isinstance(record, dict) or not {"nonce", "round", "weights_sha256"} <= set(record):
            raise self._damaged(path, "is not a checkpoint state (nonce, round, sha256 missing)")
        return record

    def _weights_nonce(self) -> str | None:
        if not self.weights_path.exists():
            return None
        try:
            with safe_open(str(self.weights_path), framework="pt") as handle:
                return (handle.metadata() or {}).get("nonce")
        except Exception as err:  # noqa: BLE001 — safetensors raises its own error types
            raise self._damaged(self.weights_path, f"is unreadable ({err})") from None

    def _roll_forward(self, weights_nonce: str | None) -> None:
        """Finish a save that crashed between its two moves; remove other temporary files."""
        for path in sorted(self.folder.iterdir()):
            if temp_target(path.name) == STATE_FILE and weights_nonce is not None:
                try:
                    pending = json.loads(path.read_text())
                except (OSError, ValueError):
                    pending = None  # a temporary file cut short by the crash: not the one
                if isinstance(pending, dict) and pending.get("nonce") == weights_nonce:
                    os.replace(path, self.state_path)
                    fsync_dir(self.folder)
                    continue
            if temp_target(path.name) in CHECKPOINT_FILES:
                path.unlink()

    def verified_state(self) -> dict[str, Any] | None:
        """``state.json``'s record of the last finished round, its weights checked against it
        (sha256), or None when no round was saved. Does not check the fingerprint (that needs
        the model): cheap enough to run before any model is loaded.

        Raises ``CheckpointError`` when the folder is not the project's, and when its files
        are damaged or do not belong together."""
        if not self.folder.exists():
            return None
        self.claim()
        weights_nonce = self._weights_nonce()
        self._roll_forward(weights_nonce)
        record = self._read_state(self.state_path)
        if record is None:
            if weights_nonce is not None:
                raise self._damaged(self.state_path, f"is missing (next to {WEIGHTS_FILE})")
            return None
        if weights_nonce is None:
            raise self._damaged(self.weights_path, f"is missing (listed in {STATE_FILE})")
        if record["nonce"] != weights_nonce:
            raise self._damaged(
                self.weights_path, f"does not belong to {STATE_FILE} (inconsistent nonces)"
            )
        if sha256_file(self.weights_path) != record["weights_sha256"]:
            raise self._damaged(self.weights_path, f"differs from the sha256 in {STATE_FILE}")
        return record

    def load(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """``(round, weights, extra)`` of the last finished round, or None when there is none.

        Raises ``CheckpointError`` as ``verified_state`` does, and when the checkpoint belongs
        to another configuration."""
        record = self.verified_state()
        if record is None:
            return None
        self._check_fingerprint(record)
        weights = load_file(str(self.weights_path))
        return int(record["round"]), weights, dict(record.get("extra", {}))

    def _check_fingerprint(self, record: Mapping[str, Any]) -> None:
        if record.get("fingerprint") == self.fingerprint:
            return
        old = _fingerprint_input(record.get("config", {}))
        new = _fingerprint_input(self.config)
        differing = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        what = (
            "run-config keys "
            + ", ".join(f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in differing)
            if differing
            else "the model (weight names, shapes or dtypes)"
        )
        raise CheckpointError(
            f"{self.folder} holds a checkpoint (round {record.get('round')}) of another run "
            f"configuration: {what} differ. Use another output-dir, or set resume=false to "
            "delete the checkpoint and start afresh"
        )

    # ---- the MPU server secret -------------------------------------------------------------

    def mpu_secret(self, explicit: str = "", env_var: str = DEFAULT_SECRET_ENV_VAR) -> ServerSecret:
        """The MPU server secret of this run, the same before and after a restart.

        ``explicit`` (read from ``mpu.secret-file``) or ``$env_var`` when set — the folder
        then keeps only a keyed check value, and a restart with another secret is refused;
        otherwise the fresh secret stored in the file ``mpu-secret`` (0600) by the first start, or a
        new one (256 random bits, hex-encoded) that is stored there now."""
        given = explicit or os.environ.get(env_var, "")
        stored = self._read_secret_file()
        if given:
            secret = ServerSecret(given.encode("utf-8"))
            check = _secret_check(secret)
            if stored is not None:
                known = (
                    stored.get("check")
                    if stored.get("kind") == "given"
                    else _secret_check(ServerSecret(str(stored.get("secret", "")).encode()))
                )
                if known != check:
                    raise CheckpointError(
                        f"the checkpoint in {self.folder} was made with another MPU secret; "
                        "resume with the same mpu.secret-file (or $FEDUNLEARN_MPU_SECRET), or "
                        "set resume=false to start afresh"
                    )
                return secret
            self._write_secret_file({"kind": "given", "check": check})
            return secret
        if stored is not None:
            if stored.get("kind") != "fresh":
                raise CheckpointError(
                    f"the checkpoint in {self.folder} was made with a given MPU secret: set the "
                    "same mpu.secret-file (or $FEDUNLEARN_MPU_SECRET) to resume, or "
                    "resume=false"
                )
            return ServerSecret(str(stored["secret"]).encode("utf-8"))
        fresh = secrets.token_hex(32)
        self._write_secret_file({"kind": "fresh", "secret": fresh})
        return ServerSecret(fresh.encode("utf-8"))

    def _read_secret_file(self) -> dict[str, Any] | None:
        try:
            record = json.loads(self.secret_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise self._damaged(self.secret_path, f"is unreadable ({type(err).__name__})") from None
        if not isinstance(record, dict) or record.pop("sha256", None) != _record_sha256(record):
            raise self._damaged(self.secret_path, "differs from its sha256")
        return record

    def _write_secret_file(self, record: dict[str, str]) -> None:
        if not self.marker_path.is_file():
            self.claim()
        data = {**record, "sha256": _record_sha256(record)}
        write_file_atomic(self.secret_path, json.dumps(data).encode(), mode=0o600)


def _record_sha256(record: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _secret_check(secret: bytes) -> str:
    """A keyed check value of the secret (to recognise it again; it does not reveal it)."""
    return f"{derive_seed(secret, 'checkpoint-secret-check'):016x}"
