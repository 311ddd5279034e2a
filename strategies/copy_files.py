"""MPU's published copies by reference: files the server writes for the nodes on its machine.

A simulated node runs on the server's machine (it declares ``shared-machine`` in its answer
to the node query, ``clients.client_app.query``), so instead of carrying a copy's weights in
the TRAIN message — m copies per node, every one built in the server's memory, then handed to
the simulation engine — the server writes each copy's weights that differ from θ_base to
``<output-dir>/mpu-copies/round-<r>/<name>-copy-<k>.safetensors`` one tensor at a time as it
draws them, and the message names the file (``model-file-<k>``) beside the hash of the copy
the node must rebuild (``model-sha256-<k>``). The node loads θ_base, puts the file's weights in
place and checks the hash (``clients.base_checkpoint.received_model``): a file changed on disk
is refused, naming the node and the file.

A deployed node never gets a file: it is sent its copies in the message as before. The files
are as secret as the copies in a message; they lie in the run's output folder, readable by
whoever can read that folder. The folder keeps the current round's files (a node may still be
reading them) and removes only files it wrote: the previous round's when a round begins,
everything when the run ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from fedunlearn.files import SafetensorsSubsetWriter

COPIES_DIR = "mpu-copies"


class CopyFiles:
    """Per-round folder of published copies (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._round_dir: Path | None = None
        self._written: list[Path] = []

    def begin_round(self, server_round: int) -> None:
        """Remove the previous round's files and start ``round-<server_round>`` (nothing to do
        when that round has begun already)."""
        round_dir = self.folder / f"round-{server_round}"
        if self._round_dir == round_dir:
            return
        self.clear()
        round_dir.mkdir(parents=True, exist_ok=True)
        self._round_dir = round_dir

    def writer(
        self, name: str, candidates: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> SafetensorsSubsetWriter:
        """A writer of ``<name>.safetensors`` in the round's folder, for some of
        ``candidates``' tensors (a failed write removes its file)."""
        if self._round_dir is None:
            raise RuntimeError("CopyFiles used before begin_round")
        path = self._round_dir / f"{name}.safetensors"
        writer = SafetensorsSubsetWriter(path, candidates)
        self._written.append(path)
        return writer

    def clear(self) -> None:
        """Remove every file this folder wrote (and the round and copy folders once empty)."""
        for path in self._written:
            path.unlink(missing_ok=True)
        self._written.clear()
        for folder in (self._round_dir, self.folder):
            if folder is not None and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        self._round_dir = None
