"""Compact uploads decoded slice by slice inside a merge (:mod:`fedunlearn.merging.lazy`).

:class:`FactorSlices` rebuilds entries ``[a, b)`` of Δθ = (B @ A) · s from the rows of B that
hold them, :class:`TopkSlices` spreads a top-k Fisher's kept values over the set bits of its
packed mask between ``a`` and ``b``, starting at the value that the set bits before ``a`` have
used (counted once per chunk when the slices are made).  Both give, bit for bit, the entries of
the whole tensor that ``fedunlearn.upload_codec.decode_tensor`` writes (tested for every kind of
span): a kept value lands where the mask puts it whatever the slicing, and a row of B @ A is the
same sum of r products whichever rows are multiplied with it, as long as the BLAS takes the same
path for both products, which MKL does from four rows on (a block here has at least
:data:`MIN_ROWS`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedunlearn.merging import native
from fedunlearn.merging._chunks import CHUNK
from fedunlearn.merging.lazy import FlatSlices, KeptEntries

#: fewest rows of B multiplied at once (fewer where the weight has fewer)
MIN_ROWS = 8


#: Smallest |a·b| over the non-zero entries of A and B for which (B @ (A·s)) = (B @ A)·s bit for
#: bit with s a power of two (see :func:`scales_exactly`), and the largest r·max|a|·max|b|·s.
_SMALLEST_PRODUCT, _LARGEST_SUM = 2.0**-70, 2.0**120
#: Fewest entries of a weight for which :class:`FactorSlices` checks that (the check costs a
#: few dispatches per weight, more than scaling a small weight's decoded entries saves).
PRESCALE_MIN_ENTRIES = 1 << 20


def _magnitude_range(t: torch.Tensor) -> tuple[float, float]:
    """The smallest non-zero and the largest |entry| of ``t`` (0, 0 when all are 0)."""
    magnitude = t.abs()
    low, high = (float(v) for v in torch.aminmax(magnitude))
    if low == 0.0 and high > 0.0:
        low = float(magnitude[magnitude > 0].min())
    return low, high


def scales_exactly(lora_b: torch.Tensor, lora_a: torch.Tensor, scaling: float) -> bool:
    """Whether ``B @ (A·s)`` equals ``(B @ A)·s`` bit for bit (float32), so that the scaling
    can be applied once to A instead of to every decoded entry.

    True when s is a power of two and every value the product forms stays in float32's normal
    range: multiplying by 2^k then changes no rounding, of a product, an FMA or a sum. Every
    non-zero product |a·b| is at least 2^-70, so it and every sum of such products (rounded
    or not) is a multiple of 2^-118 (the product of their last places), hence 0 or at least
    2^-118, never subnormal; and r·max|a|·max|b|·s stays below 2^120, far from overflow.
    """
    mantissa, _ = math.frexp(scaling)
    if mantissa != 0.5:
        return False
    (a_low, a_high), (b_low, b_high) = _magnitude_range(lora_a), _magnitude_range(lora_b)
    if a_high == 0.0 or b_high == 0.0:
        return True  # every product is 0
    smallest = a_low * b_low * min(scaling, 1.0)
    largest = a_high * b_high * lora_a.shape[0] * max(scaling, 1.0)
    return smallest >= _SMALLEST_PRODUCT and largest < _LARGEST_SUM


class FactorSlices(FlatSlices):
    """Δθ = (B @ A) · s of a (d_out × d_in) weight, decoded row block by row block (the scaling
    applied to A once where that gives the same bits: :func:`scales_exactly`)."""

    def __init__(self, lora_b: torch.Tensor, lora_a: torch.Tensor, scaling: float) -> None:
        self._b, self._a = lora_b.float(), lora_a.float()
        self._scaling = scaling
        self._columns = int(self._a.shape[1])
        super().__init__(int(self._b.shape[0]) * self._columns)
        large = self.numel() >= PRESCALE_MIN_ENTRIES
        if scaling != 1.0 and large and scales_exactly(self._b, self._a, scaling):
            self._a, self._scaling = self._a * scaling, 1.0

    def decode(self, start: int, stop: int) -> torch.Tensor:
        first_row, end_row = start // self._columns, -(-stop // self._columns)
        # at least MIN_ROWS rows: MKL multiplies one to three rows by another path, whose
        # sums are rounded differently from the whole product's
        end_row = max(end_row, min(first_row + MIN_ROWS, int(self._b.shape[0])))
        first_row = min(first_row, max(0, end_row - MIN_ROWS))
        offset = first_row * self._columns
        rows = self.scratch((end_row - first_row) * self._columns)
        product = rows.view(end_row - first_row, self._columns)
        torch.mm(self._b[first_row:end_row], self._a, out=product)
        if self._scaling != 1.0:
            product.mul_(self._scaling)
        return rows[start - offset : stop - offset]


class TopkSlices(FlatSlices):
    """A top-k Fisher: ``values`` (float32, index order) over the set bits of ``packed``."""

    def __init__(self, packed: torch.Tensor, values: torch.Tensor, numel: int) -> None:
        super().__init__(numel)
        self._packed = packed.contiguous()
        self._values = values.float().contiguous().reshape(-1)
        counts = native.mask_counts(self._packed, numel, CHUNK)
        if counts is None:
            counts = [self._count(s, min(s + CHUNK, numel)) for s in range(0, numel, CHUNK)]
        #: values used by the set bits before each chunk, then the total
        self.firsts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()

    @property
    def marked(self) -> int:
        """Set bits of the mask (to check against the values sent)."""
        return int(self.firsts[-1])

    def _bits(self, start: int, stop: int) -> np.ndarray:
        """The mask bits of entries ``[start, stop)`` (``start`` a multiple of 8) as booleans."""
        data = self._packed[start // 8 : -(-stop // 8)].numpy()
        return np.unpackbits(data, count=stop - start, bitorder="little").view(np.bool_)

    def _count(self, start: int, stop: int) -> int:
        return int(np.count_nonzero(self._bits(start, stop)))

    def kept(self) -> KeptEntries:
        """Its packed mask, values and the values used before each chunk."""
        return KeptEntries(self._packed, self._values, self.firsts)

    def pick(self, chunk: slice, picks: slice) -> torch.Tensor:
        """The chunk's entries ``picks`` from the mask bits and the values alone (a sample of a
        few entries per chunk costs a count of the set bits before them, not a decode)."""
        first = self.firsts[chunk.start // CHUNK]
        picked = native.unmask_at(self._packed, self._values, first, chunk.start, picks)
        return super().pick(chunk, picks) if picked is None else picked

    def decode(self, start: int, stop: int) -> torch.Tensor:
        chunk_start = start - start % CHUNK
        first = self.firsts[chunk_start // CHUNK] + (
            self._count(chunk_start, start) if start > chunk_start else 0
        )
        out = self.scratch(stop - start)
        if native.unmask_span(self._packed, self._values, first, start, out) is None:
            bits = self._bits(start, stop)
            array = out.numpy()
            array.fill(0.0)
            taken = int(np.count_nonzero(bits))
            array[bits] = self._values[first : first + taken].numpy()
        return out
