"""A forget domain of top-k Fisher uploads, pooled without decoding each member.

FIRM pools the Fishers of a forget domain's clients, ``F̄_g = ((F_1 + F_2) + …) / n``.  When
every member uploaded a top-k Fisher (a packed mask and the kept values), the merge needs two
things from ``F̄_g``, and neither needs the members decoded one by one:

* its scale and threshold, from its values at the union of the members' masks (every other
  entry is 0 in every member): :func:`~fedunlearn.merging.native.pool_kept`;
* its entries, slice by slice inside the merge kernel: :class:`PooledTopkSlices` spreads and
  adds the n members' kept values in one pass over their masks and writes one decoded slice,
  where decoding each member would write n slices for the kernel to read back and add.

Both use the merges' own float32 operations in the same order, so the merged weights are bit
for bit those of the n decoded Fishers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import native
from .lazy import Flat, FlatSlices, KeptEntries


class PooledTopkSlices(FlatSlices):
    """``F̄_g`` of top-k Fishers (their :class:`KeptEntries`), decoded span by span in one
    pass (:func:`~fedunlearn.merging.native.pool_unmask_span`)."""

    def __init__(self, members: Sequence[KeptEntries], numel: int) -> None:
        super().__init__(numel)
        self._members = list(members)

    def decode(self, start: int, stop: int) -> torch.Tensor:
        out = self.scratch(stop - start)
        if not native.pool_unmask_span(self._members, start, out):
            raise RuntimeError("the C functions that pooled these Fishers are no longer loaded")
        return out


@dataclass(frozen=True)
class PooledTopk:
    """A domain's pooled Fisher: ``kept``, its values at the union of the members' masks (in
    entry order), and ``slices``, the whole of it decoded on demand."""

    kept: torch.Tensor
    slices: PooledTopkSlices


def pooled_topk(sources: Sequence[Flat]) -> PooledTopk | None:
    """The pooled Fisher of ``sources`` where every one is a top-k upload decoded on demand
    (a :class:`FlatSlices` with :meth:`~FlatSlices.kept` entries) and the C functions pool
    them; else None (the merge decodes each member)."""
    entries = [f.kept() if isinstance(f, FlatSlices) else None for f in sources]
    members = [e for e in entries if e is not None]
    if len(members) != len(entries):
        return None
    numel = sources[0].numel()
    kept = native.pool_kept(members, numel)
    if kept is None:
        return None
    return PooledTopk(kept, PooledTopkSlices(members, numel))
