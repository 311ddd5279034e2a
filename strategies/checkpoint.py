"""Crash safety for multi-round runs: the server state after every finished round, on disk.

``RunCheckpoint`` keeps, in one folder (``<output-dir>/checkpoint/`` by default), only the
last finished round:

* ``weights.safetensors``: the global weights after that round (safetensors metadata holds
  the round and a random ``nonce`` that ties the file to its ``state.json``);
* ``state.json``: the round, the nonce, the config fingerprint, the run config (without
  secrets) and ``extra`` — what results.json needs about the finished rounds;
* ``mpu-secret`` (MPU runs only, permissions 0600): the fresh server secret of a run whose
  ``mpu-secret`` was empty — so that a resumed run draws the same noise and
  reparameterisations — or, when the secret was given (run config or
  ``$FEDUNLEARN_MPU_SECRET``), only a keyed check value of it (never the secret itself).
  The secret is never written to results.json or to the log.

Saving is atomic: both files are first written to temporary names and fsynced, then moved into
place with ``os.replace`` (weights first, then ``state.json``). A crash before the weights move
leaves the previous round's pair; a crash between the two moves leaves the new weights and the
fsynced ``state.json.tmp`` of the same nonce, which ``load`` rolls forward. A loaded
checkpoint is therefore always one finished round, never a mix of two.

A checkpoint belongs to one run configuration: ``config_fingerprint`` hashes the run config
minus the keys that cannot change the weights (``output-dir``, ``cache-dir``, the secret,
``resume``, ``num-rounds`` — a run may be extended by more rounds), plus the model's weight
names, shapes and dtypes. ``load`` refuses a checkpoint of another fingerprint with an error
that names the differing keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedunlearn.mpu import DEFAULT_SECRET_ENV_VAR, ServerSecret, derive_seed

CHECKPOINT_DIR = "checkpoint"
WEIGHTS_FILE = "weights.safetensors"
STATE_FILE = "state.json"
SECRET_FILE = "mpu-secret"
FORMAT_VERSION = 1
# run-config keys that cannot change the weights a round produces
FINGERPRINT_EXCLUDED = ("output-dir", "cache-dir", "mpu-secret", "resume", "num-rounds")

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointError",
    "RunCheckpoint",
    "config_fingerprint",
    "model_structure",
]


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used (another config, another secret, broken files)."""


def model_structure(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Weight name → ``dtype[shape]``: what the fingerprint knows about the model (the weights'
    values are not hashed; a different checkpoint at the same ``model-path`` is not noticed)."""
    return {name: f"{t.dtype}{list(t.shape)}" for name, t in sorted(state.items())}


def _fingerprint_input(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in sorted(config) if k not in FINGERPRINT_EXCLUDED}


def config_fingerprint(config: Mapping[str, Any], model: Mapping[str, str] | None = None) -> str:
    """sha256 of the run config (minus ``FINGERPRINT_EXCLUDED``) and the model structure."""
    payload = {"config": _fingerprint_input(config), "model": dict(model or {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s contents to disk (after a writer that does not fsync, e.g. safetensors)."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create ``path`` afresh with permissions ``mode``, write ``data`` and fsync it."""
    path.unlink(missing_ok=True)  # a leftover of a crash may have other permissions
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), mode)  # exactly ``mode``, whatever the umask
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


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

    # ---- rounds ----------------------------------------------------------------------------

    def save(
        self, server_round: int, state_dict: Mapping[str, torch.Tensor], extra: dict[str, Any]
    ) -> None:
        """Atomically replace the checkpoint by round ``server_round``'s weights and ``extra``
        (JSON-serialisable)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        nonce = secrets.token_hex(16)
        weights_tmp = self.folder / f"{WEIGHTS_FILE}.tmp"
        state_tmp = self.folder / f"{STATE_FILE}.tmp"
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in state_dict.items():
            t = t.detach().cpu().contiguous()
            if t.numel() and t.data_ptr() in seen:  # tied weights: safetensors wants copies
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        save_file(tensors, str(weights_tmp), metadata={"round": str(server_round), "nonce": nonce})
        fsync_file(weights_tmp)
        record = {
            "format": FORMAT_VERSION,
            "round": int(server_round),
            "nonce": nonce,
            "fingerprint": self.fingerprint,
            "config": self.config,
            "extra": extra,
        }
        _write_bytes(state_tmp, json.dumps(record, indent=1, allow_nan=False).encode())
        os.replace(weights_tmp, self.weights_path)
        fsync_dir(self.folder)
        os.replace(state_tmp, self.state_path)
        fsync_dir(self.folder)

    def _read_state(self, path: Path) -> dict[str, Any] | None:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and "nonce" in record else None

    def _weights_nonce(self) -> str | None:
        try:
            with safe_open(str(self.weights_path), framework="pt") as handle:
                return (handle.metadata() or {}).get("nonce")
        except Exception:  # noqa: BLE001 — missing or unreadable file: no usable weights
            return None

    def load(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """``(round, weights, extra)`` of the last finished round, or None when there is none.

        Raises ``CheckpointError`` when the checkpoint belongs to another configuration or its
        files do not belong together."""
        record = self._read_state(self.state_path)
        pending = self._read_state(self.folder / f"{STATE_FILE}.tmp")
        weights_nonce = self._weights_nonce()
        if pending is not None and pending["nonce"] == weights_nonce:
            # crash between the two replaces: the new weights are in place, finish the save
            os.replace(self.folder / f"{STATE_FILE}.tmp", self.state_path)
            fsync_dir(self.folder)
            record = pending
        if record is None:
            return None
        if record["nonce"] != weights_nonce:
            raise CheckpointError(
                f"the checkpoint in {self.folder} is inconsistent ({WEIGHTS_FILE} does not "
                f"belong to {STATE_FILE}); remove the folder or start afresh with resume=false"
            )
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

    def clear(self) -> None:
        """Remove the checkpoint and the stored secret (a fresh start)."""
        if self.folder.is_dir():
            shutil.rmtree(self.folder)

    # ---- the MPU server secret -------------------------------------------------------------

    def mpu_secret(self, explicit: str = "", env_var: str = DEFAULT_SECRET_ENV_VAR) -> ServerSecret:
        """The MPU server secret of this run, the same before and after a restart.

        ``explicit`` (``mpu-secret``) or ``$env_var`` when set — the folder then keeps only a
        keyed check value, and a restart with another secret is refused; otherwise the fresh
        secret stored in ``mpu-secret`` (0600) by the first start, or a new one (256 random
        bits, hex-encoded) that is stored there now."""
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
                        "resume with the same mpu-secret (or $FEDUNLEARN_MPU_SECRET), or set "
                        "resume=false to start afresh"
                    )
                return secret
            self._write_secret_file({"kind": "given", "check": check})
            return secret
        if stored is not None:
            if stored.get("kind") != "fresh":
                raise CheckpointError(
                    f"the checkpoint in {self.folder} was made with a given MPU secret: set the "
                    "same mpu-secret (or $FEDUNLEARN_MPU_SECRET) to resume, or resume=false"
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
            raise CheckpointError(
                f"{self.secret_path} is unreadable ({type(err).__name__})"
            ) from None
        return record if isinstance(record, dict) else None

    def _write_secret_file(self, record: dict[str, str]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f"{SECRET_FILE}.tmp"
        _write_bytes(tmp, json.dumps(record).encode(), mode=0o600)
        os.replace(tmp, self.secret_path)
        fsync_dir(self.folder)


def _secret_check(secret: bytes) -> str:
    """A keyed check value of the secret (to recognise it again; it does not reveal it)."""
    return f"{derive_seed(secret, 'checkpoint-secret-check'):016x}"
