"""The dp2u server's stage cache: finished stage models on disk, reused across runs.

An entry is ``<folder>/<key>/``: ``model.safetensors``, ``info.json`` and ``manifest.json``
(their sizes and sha256), plus the evaluations cached next to them (``eval-<key>.json``,
written by the pipeline). Saves build the entry in a unique temporary folder, fsync it and
move it into place, holding the advisory lock ``<folder>/.stage-cache.lock`` so that two runs
saving at once do not collide (an intact entry another run saved meanwhile is kept).

``load`` verifies the entry against its manifest: a damaged one (WARNING naming the file)
counts as missing, so that stage is trained again and its entry — only that one, with its
cached evaluations of the old weights — is replaced. An entry written before manifests (no
``manifest.json``) is adopted — its manifest written once — when its weights load and are
finite, and retrained otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fedunlearn.files import build_entry, cached_entry_ok, waiting_lock

WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "info.json"
KIND = "dp2u stage"
LOCK_FILE = ".stage-cache.lock"

logger = logging.getLogger(__name__)


class StageCache:
    """Finished stage models on disk (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @staticmethod
    def key(**fields: Any) -> str:
        payload = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def _intact(self, key: str) -> bool:
        return cached_entry_ok(
            self.folder / key, INFO_FILE, KIND, _check_legacy_entry, (WEIGHTS_FILE, INFO_FILE)
        )

    def load(self, key: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """``(weights, info)`` of the intact entry ``key``, or None (missing or damaged)."""
        if not (self.folder / key / INFO_FILE).is_file():
            return None
        with waiting_lock(self.folder / LOCK_FILE, "dp2u stage cache"):
            if not self._intact(key):
                return None
        path = self.folder / key
        return load_file(str(path / WEIGHTS_FILE)), json.loads((path / INFO_FILE).read_text())

    def save(self, key: str, state: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
        """Store entry ``key`` durably, unless an intact one is there already."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with waiting_lock(self.folder / LOCK_FILE, "dp2u stage cache"):
            if self._intact(key):
                logger.info("dp2u stage %s was saved by another run meanwhile: kept", key)
                return
            build_entry(
                self.folder / key,
                INFO_FILE,
                KIND,
                lambda tmp: _write_entry(tmp, state, info),
                stale=("eval-*.json",),
            )


def _write_entry(folder: Path, state: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS_FILE))
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, default=str))


def _check_legacy_entry(folder: Path) -> None:
    """Raise unless the entry's info parses and its weights load and are finite."""
    json.loads((folder / INFO_FILE).read_text())
    for name, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{folder / WEIGHTS_FILE}: {name} holds non-finite values")
