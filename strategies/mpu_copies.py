"""The copies MPU publishes and the replies it reads back, as Flower records and files: a
record's tensors decoded one at a time, a published copy's arrays and digests, a copy written
to a file, the upload spool that keeps mapped-back updates as they are, and one copy's part
of a multi-copy reply."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedunlearn.merging import ClientUpdate
from fedunlearn.mpu import HarmonicUpload
from strategies.upload_spool import UploadSpool
from wire.arrays import array_tensor
from wire.delivery import state_sha256


class RecordTensors(Mapping[str, torch.Tensor]):
    """The tensors of an ArrayRecord decoded one at a time when asked for (none kept)."""

    def __init__(self, arrays: ArrayRecord) -> None:
        self._arrays = arrays

    def __getitem__(self, key: str) -> torch.Tensor:
        return array_tensor(self._arrays[key]).float()  # MPU works in float32

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __contains__(self, key: object) -> bool:
        return key in self._arrays


@dataclass(frozen=True)
class CopyFile:
    """One published copy written to a file: the weights that differ from θ_base, the hash
    of the whole copy a node rebuilds from them, and the file's tensor bytes."""

    path: Path
    sha256: str
    nbytes: int


@dataclass
class PublishedCopy:
    """One published copy as the Flower arrays it travels in (θ's order) and, where hashed,
    every tensor's :func:`~wire.delivery.weight_digest`."""

    arrays: dict[str, Array] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)

    def changed(self, base_digests: Mapping[str, str]) -> list[str]:
        """The tensors that differ from θ_base bit for bit: what a node holding θ_base needs."""
        if set(self.digests) != set(base_digests):
            raise ValueError("the copy's keys are not those of the base checkpoint")
        return [name for name in self.arrays if self.digests[name] != base_digests[name]]

    def sha256(self, base_digests: Mapping[str, str]) -> str:
        """:func:`~wire.delivery.state_sha256` of the whole copy (what the node rebuilds)."""
        return state_sha256({**base_digests, **self.digests})

    def record(self, keys: list[str]) -> ArrayRecord:
        """An ArrayRecord of ``keys`` holding the copy's own arrays (no bytes copied)."""
        record = ArrayRecord()
        for key in keys:
            record[key] = self.arrays[key]
        return record


class CopySpool(UploadSpool):
    """MPU's upload spool: :meth:`MpuStrategy.decode_reply` writes each copy's validated
    upload as it reads it (:meth:`UploadSpool.store_record`) and returns an update that maps
    them back from memory maps, which :meth:`store` hands on as it is."""

    def store(
        self, update: ClientUpdate, shapes: Mapping[str, tuple[int, ...]] | None
    ) -> ClientUpdate:
        if isinstance(update.task_vector, HarmonicUpload):
            return update
        return super().store(update, shapes)


def exact_tensors(
    state: Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    """The ``clean`` baseline's one copy, θ itself, as ``_tensors`` yields copies."""
    for name in state:
        weight = state[name]
        yield name, weight, [weight]


def copy_reply(content: RecordDict, k: int, node_id: int) -> RecordDict:
    """Copy k's part of a multi-copy reply as an ordinary single reply."""
    key = f"task_vector-{k}"
    if key not in content:
        raise ValueError(f"client {node_id}: reply has no {key!r} record (copy {k} missing)")
    for name in ("metrics", "info"):
        if name not in content:
            raise ValueError(f"client {node_id}: reply has no {name!r} record")
    out = RecordDict({"task_vector": content[key], "metrics": content["metrics"]})
    out["info"] = content["info"]
    if f"fisher-{k}" in content:
        out["fisher"] = content[f"fisher-{k}"]
    return out


def payload_nbytes(arrays: Iterable[Array]) -> int:
    """Payload bytes of Flower arrays (their values, without the serialisation's header)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays)
