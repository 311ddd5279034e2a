"""Flat weights decoded slice by slice inside a merge, never as a whole tensor.

A compact upload (LoRA factors, a top-k Fisher) decodes to a dense tensor of the weight's size.
Decoding every client's tensor of a weight before the merge reads them writes as many dense
tensors as the dense merge reads, and reads them back: a compact merge then moves about twice
the memory of the dense one.  A :class:`FlatSlices` instead hands the merge the decoded
entries of one slice at a time (:data:`~fedunlearn.merging._chunks.CHUNK` entries, small
enough to stay in the cache between the decode and the merge's arithmetic).

It stands in for the flat float32 tensor it decodes to wherever the merges slice their inputs:
``x[a:b]`` decodes entries ``a`` to ``b``, a strided slice (a selection's sample) decodes chunk
by chunk and keeps the positions asked for, ``x.reshape(-1)`` and ``x.to(cpu)`` are ``x``, and
``numel()``, ``dtype`` and ``device`` describe the tensor.  The decoded values are bit-identical
to the whole tensor's decode (tested for each form), so a merge's result does not change.

A mapping of weights provides them through a ``flat_slices(key)`` method (as
``fedunlearn.upload_codec.DecodedTensors`` does for factors and top-k uploads; ``None`` for a
weight it holds densely); :func:`flat_source` asks for one and falls back to the tensor.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ._chunks import CHUNK, map_spans


@dataclass(frozen=True)
class KeptEntries:
    """A flat tensor that is 0 except where a packed mask sets a bit (entry j: bit j % 8 of byte
    j // 8): ``values`` (float32) in entry order there, ``firsts[c]`` of them used by the
    entries before chunk ``c`` (of :data:`CHUNK` entries)."""

    packed: torch.Tensor
    values: torch.Tensor
    firsts: list[int]


class FlatSlices(ABC):
    """The flat float32 entries of one weight, decoded on demand span by span (module doc)."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, numel: int) -> None:
        self._numel = numel
        self._scratch = threading.local()

    def scratch(self, numel: int) -> torch.Tensor:
        """Flat float32 memory for a decode of ``numel`` entries: this thread's buffer of this
        object, reused by its next decode (warm pages instead of fresh ones, which cost a page
        fault per 4 KiB). So a decoded slice is valid until the next decode of the same object
        in the same thread: read it, or copy it, before asking for another."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch.buffer = torch.empty(numel, dtype=torch.float32)
        return buffer[:numel]

    def numel(self) -> int:
        """Entries of the flat tensor."""
        return self._numel

    def reshape(self, *shape: int) -> FlatSlices:
        """``reshape(-1)``: itself (it is flat already)."""
        if tuple(shape) not in ((-1,), (self._numel,)):
            raise ValueError(f"decoded slices are flat; cannot reshape to {shape}")
        return self

    def to(self, device: torch.device | str) -> FlatSlices:
        """Itself: it decodes on the CPU."""
        if torch.device(device).type != "cpu":
            raise ValueError("decoded slices live on the CPU")
        return self

    @abstractmethod
    def decode(self, start: int, stop: int) -> torch.Tensor:
        """The flat float32 entries ``[start, stop)`` (``start`` a multiple of 8, as every span
        of :data:`CHUNK` entries is), in :meth:`scratch` memory."""

    def __getitem__(self, span: slice) -> torch.Tensor:
        if not isinstance(span, slice):
            raise TypeError("decoded slices are read by slices of entries")
        start, stop, step = span.indices(self._numel)
        if step == 1:
            return self.decode(start, max(start, stop))
        if step < 1:
            raise ValueError("decoded slices are read forwards")

        def picked(chunk: slice) -> torch.Tensor:
            # the first wanted position in this chunk, counted from the chunk's start
            first = max(chunk.start, start)
            first += (start - first) % step
            if first >= min(chunk.stop, stop):
                return torch.empty(0, dtype=self.dtype)
            end = min(chunk.stop, stop)
            return self.pick(chunk, slice(first - chunk.start, end - chunk.start, step))

        return torch.cat(map_spans(picked, self._numel, self.device, chunk=CHUNK))

    def kept(self) -> KeptEntries | None:
        """The mask and values of a tensor that is 0 outside a mask (a top-k Fisher); None
        for one decoded otherwise."""
        return None

    def pick(self, chunk: slice, picks: slice) -> torch.Tensor:
        """The entries ``picks`` (counted from the chunk's start) of one :data:`CHUNK`-aligned
        chunk, in new memory; by default the chunk decoded and the entries copied out (a
        subclass may find them without decoding the rest)."""
        return self.decode(chunk.start, chunk.stop)[picks].clone()


#: a merge input: a tensor, or slices decoded on demand
Flat = torch.Tensor | FlatSlices


def flat_source(values: Mapping[str, torch.Tensor], key: str) -> Flat:
    """Weight ``key`` of ``values`` as slices decoded on demand where the mapping offers them
    (a ``flat_slices(key)`` method returning a :class:`FlatSlices`), else the tensor itself."""
    flat_slices = getattr(values, "flat_slices", None)
    sliced = flat_slices(key) if callable(flat_slices) else None
    return values[key] if sliced is None else sliced
