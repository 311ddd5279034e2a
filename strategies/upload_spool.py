"""The streaming server's store: each validated upload goes to disk as it is read.

``MergeStrategy`` (``upload.stream = true``, the default) writes every client's validated
upload parts — task vector and Fisher, in whatever compact form the client sent them — to
``<output-dir>/uploads-spool/round-<r>/node-<id>.safetensors``, drops the arrays from the
reply message, and hands the merge a :class:`~fedunlearn.merging.ClientUpdate` whose tensors
are decoded from a memory map of that file one weight at a time
(:class:`~fedunlearn.upload_codec.DecodedTensors`). A merge that walks the weights one by one
(all of the project's do) then holds one dense tensor per client instead of every upload.

A top-k Fisher's mask is written inflated (``<key>::topk_bits``, one bit per entry, instead
of the deflated ``topk_mask`` the client sent): validation inflated it once already, and a
merge then reads the bits straight from the memory map instead of inflating every mask again.

The spool keeps the last round's files (``save-uploads`` and the MPU harmonic aggregation read
them after the round) and removes only files it wrote itself: the previous round's folder when
a new round starts, everything when the run ends.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from fedunlearn.files import safetensors_layout
from fedunlearn.merging import ClientUpdate
from fedunlearn.upload_codec import DecodedTensors, inflate_mask, part_name, split_part

SPOOL_DIR = "uploads-spool"
_PREFIXES = ("task_vector", "fisher")


def _parts(
    tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]] | None
) -> dict[str, torch.Tensor]:
    """Upload parts of a decoded record (as received, top-k masks inflated), or a dense
    mapping's tensors."""
    if not isinstance(tensors, DecodedTensors):
        return {name: t.contiguous() for name, t in tensors.items()}
    out = {}
    for name, part in tensors.parts():
        key, kind = split_part(name)
        if kind == "topk_mask" and shapes is not None and key in shapes:
            size = (math.prod(shapes[key]) + 7) // 8
            out[part_name(key, "topk_bits")] = inflate_mask(key, part, size)
        else:
            out[name] = part.contiguous()
    return out


class SpooledFile:
    """A spooled file read one tensor at a time. The header is read once and the file kept
    open; each read maps only that tensor's bytes (a private, copy-on-write map, so the file is
    never written) and the tensor it returns keeps the map alive: its pages are released with
    it. (One map of the whole file kept open would keep every page read through it resident in
    the process, so the server's memory would grow by every upload it merged; opening the file
    for each read parsed its header every time, and a ``numpy.memmap`` per read resolved the
    path again: thousands of reads of a 210-weight upload.)"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries = safetensors_layout(path)
        self._fd: int | None = os.open(path, os.O_RDONLY)

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        size = entry.stop - entry.start
        if size == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._fd is None:
            raise ValueError(f"{self.path}: the spool was cleared; {name!r} cannot be read")
        start = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self._fd, entry.stop - start, offset=start, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mapped, dtype=torch.uint8, offset=entry.start - start)
        if entry.start % entry.dtype.itemsize:  # not aligned for its dtype: an aligned copy
            flat = flat.clone()
        return flat.view(entry.dtype).view(entry.shape)

    def close(self) -> None:
        """Close the file (tensors read from it stay valid: each holds its own map)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


class UploadSpool:
    """Per-round folder of uploads on disk (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._round_dir: Path | None = None
        self._handles: list[SpooledFile] = []

    def begin_round(self, server_round: int) -> None:
        """Forget the previous round's files and start ``round-<server_round>`` (nothing to do
        when that round has begun already)."""
        round_dir = self.folder / f"round-{server_round}"
        if self._round_dir == round_dir:
            return
        self.clear()
        self._round_dir = round_dir
        self._round_dir.mkdir(parents=True, exist_ok=True)

    def store(
        self, update: ClientUpdate, shapes: Mapping[str, tuple[int, ...]] | None
    ) -> ClientUpdate:
        """Write ``update``'s upload parts to its file; the same update, read from disk."""
        tensors = {f"task_vector/{k}": v for k, v in _parts(update.task_vector, shapes).items()}
        if update.fisher is not None:
            tensors.update({f"fisher/{k}": v for k, v in _parts(update.fisher, shapes).items()})
        handle = self._write(update.node_id, tensors)
        del tensors
        records: dict[str, list[str]] = {prefix: [] for prefix in _PREFIXES}
        for name in handle.keys():
            prefix, part = name.split("/", 1)
            records[prefix].append(part)

        def record(prefix: str) -> DecodedTensors:
            return DecodedTensors(
                records[prefix], lambda part: handle.get_tensor(f"{prefix}/{part}"), shapes
            )

        return ClientUpdate(
            node_id=update.node_id,
            role=update.role,
            domain=update.domain,
            num_examples=update.num_examples,
            task_vector=record("task_vector"),
            fisher=record("fisher") if update.fisher is not None else None,
        )

    def store_state(self, node_id: int, state: Mapping[str, torch.Tensor]) -> DecodedTensors:
        """Write a client's weights (a FedAvg reply) to its file; the same weights, read from
        disk one tensor at a time."""
        handle = self._write(node_id, {k: v.contiguous() for k, v in state.items()})
        return DecodedTensors(handle.keys(), handle.get_tensor)

    def store_record(
        self, node_id: int, record: str, parts: Mapping[str, torch.Tensor]
    ) -> Callable[[str], torch.Tensor]:
        """Write one uploaded record's flat parts as received (MPU: one copy's task vector or
        Fisher, ``record`` its name) to ``node-<node_id>-<record>.safetensors``; a reader of
        one part from a memory map of that file."""
        handle = self._write(f"{node_id}-{record}", {k: v.contiguous() for k, v in parts.items()})
        return handle.get_tensor

    def _write(self, node_id: int | str, tensors: dict[str, torch.Tensor]) -> SpooledFile:
        """Save ``tensors`` as ``node-<node_id>.safetensors`` (atomically); its reader."""
        if self._round_dir is None:
            raise RuntimeError("UploadSpool used before begin_round")
        path = self._round_dir / f"node-{node_id}.safetensors"
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial))
        os.replace(partial, path)
        handle = SpooledFile(path)
        self._handles.append(handle)
        return handle

    def clear(self) -> None:
        """Remove every round folder this spool wrote (and the spool folder once empty)."""
        for handle in self._handles:
            handle.close()
        self._handles.clear()
        if self._round_dir is not None and self._round_dir.is_dir():
            for path in self._round_dir.glob("node-*.safetensors"):
                path.unlink()
            for path in self._round_dir.glob("node-*.partial"):
                path.unlink()
            if not any(self._round_dir.iterdir()):
                self._round_dir.rmdir()
        self._round_dir = None
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()
