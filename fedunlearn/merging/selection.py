"""Top-α thresholds in about one read pass: the k-th largest entry of a tensor
(docs/algorithms.md, "TIES, AVG and SUM", "FIRM base merge").

FIRM keeps the entries of ``F̃`` that are ``>=`` the k-th largest normalised Fisher value, TIES
(and FULM inside each cluster) the entries of ``τ_i`` whose magnitude is ``>=`` the k-th largest
``|τ_i|``.  ``torch.kthvalue`` finds that value exactly but costs many passes over the tensor.
:func:`kth_largest` returns exactly the same value after one counting pass.  It works on integer
keys that order like the floats: the bit pattern of ``|x|`` (magnitudes), or the bit pattern
with the magnitude bits flipped for negative values (signed values):

1. the keys of a strided sample of ``_SAMPLE`` entries place a bracket ``[lo, hi]`` around the
   sample's k-th largest, ``_MARGIN_SIGMAS`` binomial standard deviations of the sample rank wide;
2. one pass over the tensor, in chunks that stay in the cache, counts the keys ``> hi`` and
   collects the keys in ``[lo, hi]`` (the candidates, a few per cent of the entries);
3. if the k-th largest lies in the bracket it is the ``(k − #{> hi})``-th largest candidate
   (``numpy.partition``, an introselect, on the candidates); otherwise (a sample that
   misrepresents the tensor) the k-th largest of all keys, still in linear time.  (Unlike
   ``torch.kthvalue``, whose quickselect is quadratic on reverse-sorted input.)

The key of the k-th largest entry is exact, so ties are resolved as ``torch.kthvalue`` resolves
them: the value is the same whatever the multiplicities (``-0.0`` and ``0.0`` are equal values
with different keys; either may come back).  The input must be finite (the merges validate their
inputs).  Tensors off the CPU, and small ones, go straight to ``torch.kthvalue``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from ._chunks import map_spans

#: Entries sampled to place the bracket.
_SAMPLE = 1 << 16
#: Tensors with at most this many entries go straight to ``torch.kthvalue``.
SMALL = 1 << 17
#: Half-width of the bracket in binomial standard deviations of the sample rank (plus a floor).
_MARGIN_SIGMAS = 5.0
_MARGIN_FLOOR = 8
#: Entries per chunk of the counting pass.
CHUNK = 1 << 18
#: Lowest bracket key of the selections of values ``>= 0`` and magnitudes: the smallest
#: positive float (every key below it is a zero).
_ZERO_FLOOR = 1
#: Integer type with the width of each floating dtype (the keys are its bit patterns).
_INT_OF = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
#: 16-bit dtypes whose magnitude selections count a histogram of all keys instead.
_HISTOGRAMMED = (torch.float16, torch.bfloat16)
_MAGNITUDE_16 = 0x7FFF
_NUMPY_INT = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


#: How the integer keys are made from the bit patterns: of signed values (the magnitude bits of
#: negatives flipped), of ``|x|`` (the sign bit cleared), or of values known to be ``>= 0`` (the
#: bit patterns themselves, which already order like the floats; ``-0.0`` orders below ``0.0``).
KeyKind = Literal["signed", "magnitude", "nonnegative"]


def _key_kind(magnitude: bool, nonnegative: bool) -> KeyKind:
    return "magnitude" if magnitude else "nonnegative" if nonnegative else "signed"


def _keys(bits: np.ndarray, kind: KeyKind) -> np.ndarray:
    """Integer keys in the order of the floats whose bit patterns are ``bits`` (see KeyKind)."""
    if kind == "nonnegative":
        return bits
    top = np.iinfo(bits.dtype).max  # every bit but the sign bit
    if kind == "magnitude":
        return bits & top
    return bits ^ ((bits >> (bits.dtype.itemsize * 8 - 1)) & top)


def _from_key(key: int, kind: KeyKind, dtype: torch.dtype) -> torch.Tensor:
    """The 0-d tensor of ``dtype`` whose key is ``key`` (inverse of :func:`_keys`)."""
    bits = np.array([key], dtype=_NUMPY_INT[_INT_OF[dtype]])
    if kind == "signed":
        bits = _keys(bits, kind)  # flipping the magnitude bits of a negative is an involution
    return torch.from_numpy(bits).view(dtype)[0].clone()


def sample_positions(d: int) -> slice:
    """The strided positions of a tensor of ``d`` entries whose keys place the bracket."""
    step = max(1, d // _SAMPLE) | 1  # odd: a power-of-two row length cannot alias with it
    return slice(step // 2, None, step)


def _bracket(keys_of: np.ndarray, k: int, d: int, kind: KeyKind) -> tuple[int, int]:
    """``(lo, hi)``: sample key order statistics that bracket the k-th largest key."""
    return _bracket_of_sample(_keys(keys_of[sample_positions(d)], kind), k, d, kind)


def _bracket_of_sample(sample: np.ndarray, k: int, d: int, kind: KeyKind) -> tuple[int, int]:
    """``(lo, hi)`` from the keys ``sample`` of the entries at :func:`sample_positions`.

    For values ``>= 0`` and magnitudes the bracket starts at :data:`_ZERO_FLOOR` at the
    lowest: the zeros (key 0, or below it for ``-0.0``) are never candidates, since a sparse
    tensor's zeros would otherwise fill the bracket (a decoded top-k Fisher is 90 % zeros,
    with its k-th largest entry just above them); when the k-th largest lies below the
    bracket then, it is a zero (see :func:`_kth_of_candidates`).
    """
    n = sample.size
    centre = k * n / d
    margin = _MARGIN_SIGMAS * math.sqrt(n * (k / d) * (1.0 - k / d)) + _MARGIN_FLOOR
    top = math.floor(centre - margin)  # 0-based rank from the top
    bottom = math.ceil(centre + margin)
    info = np.iinfo(sample.dtype)
    wanted = [n - 1 - r for r in (top, bottom) if 0 <= r < n]
    part = np.partition(sample, wanted) if wanted else sample
    hi = int(part[n - 1 - top]) if 0 <= top < n else int(info.max)
    lo = int(part[n - 1 - bottom]) if 0 <= bottom < n else int(info.min)
    if kind != "signed":
        lo = max(lo, _ZERO_FLOOR)
        hi = max(hi, lo)
    return lo, hi


def _count_and_collect(bits: np.ndarray, lo: int, hi: int, kind: KeyKind) -> tuple[int, np.ndarray]:
    """``(#{key > hi}, keys in [lo, hi])`` in one chunked pass over ``bits``."""
    above = 0
    parts = []
    for start in range(0, bits.size, CHUNK):
        keys = _keys(bits[start : start + CHUNK], kind)
        above += int(np.count_nonzero(keys > hi))
        inside = keys >= lo
        inside &= keys <= hi
        parts.append(keys[inside])
    return above, np.concatenate(parts)


class StreamedKthLargest:
    """:func:`kth_largest` of a float tensor that is being written chunk by chunk.

    Made from the tensor's values at :func:`sample_positions` (computed by the caller before
    the tensor itself), it counts each finished chunk while that is still in the cache
    (:meth:`count`, pure: chunks may be counted in any thread, in any order) and then returns
    exactly ``kth_largest(whole, k)`` from the counts (:meth:`result`), without another pass
    over the tensor unless the sample missed.
    """

    def __init__(
        self,
        sample: torch.Tensor,
        k: int,
        d: int,
        *,
        magnitude: bool = False,
        nonnegative: bool = False,
    ):
        self.k, self.kind, self.dtype = k, _key_kind(magnitude, nonnegative), sample.dtype
        bits = sample.contiguous().view(_INT_OF[sample.dtype]).numpy()
        self.lo, self.hi = _bracket_of_sample(_keys(bits, self.kind), k, d, self.kind)

    def count(self, chunk: torch.Tensor) -> tuple[int, np.ndarray]:
        """``(#{key > hi}, keys in [lo, hi])`` of one contiguous CPU chunk."""
        bits = chunk.view(_INT_OF[self.dtype]).numpy()
        return _count_and_collect(bits, self.lo, self.hi, self.kind)

    def key_bounds(self) -> tuple[int, int]:
        """The bracket ``(lo, hi)`` as non-negative keys, for values ``>= 0`` and magnitudes.

        For the fused counting pass (:func:`~fedunlearn.merging.kernels.bracket_counts`),
        which counts the bit patterns of the values with ``-0.0`` read as ``0.0`` (the two are
        equal values, so the k-th largest value does not change).
        """
        if self.kind == "signed":
            raise ValueError("key_bounds is for the selections of values >= 0 and magnitudes")
        return self.lo, self.hi

    def result_of_keys(
        self, whole: Callable[[], torch.Tensor], above: int, candidates: np.ndarray
    ) -> torch.Tensor:
        """:meth:`result` from the count of keys above the bracket and the keys inside it.

        ``whole`` makes the tensor whose keys were counted (called only if the sample missed).
        """

        def bits() -> np.ndarray:
            return whole().reshape(-1).contiguous().view(_INT_OF[self.dtype]).numpy()

        cand = candidates.astype(_NUMPY_INT[_INT_OF[self.dtype]])
        return _kth_of_candidates(bits, self.k, (above, self.lo), cand, self.kind, self.dtype)

    def result(
        self,
        whole: torch.Tensor | Callable[[], torch.Tensor],
        counts: list[tuple[int, np.ndarray]],
    ) -> torch.Tensor:
        """The k-th largest entry of ``whole``, the tensor whose chunks gave ``counts``.

        ``whole`` may be a function that makes the tensor: it is only called if the sample
        missed (the tensor itself need not be kept while it is counted).
        """
        above = sum(a for a, _ in counts)
        cand = np.concatenate([c for _, c in counts])

        def bits() -> np.ndarray:
            tensor = whole() if callable(whole) else whole
            return tensor.reshape(-1).view(_INT_OF[self.dtype]).numpy()

        return _kth_of_candidates(bits, self.k, (above, self.lo), cand, self.kind, self.dtype)


def _kth_of_candidates(
    bits: Callable[[], np.ndarray],
    k: int,
    counted: tuple[int, int],
    cand: np.ndarray,
    kind: KeyKind,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The k-th largest entry from ``counted`` = (the count above the bracket, its lowest
    key) and the keys inside it.

    ``bits`` gives the bit patterns of the whole tensor, needed only if the sample missed.
    """
    above, lo = counted
    if k > above + cand.size and kind != "signed" and lo == _ZERO_FLOOR:
        return _from_key(0, kind, dtype)  # below a bracket that starts above the zeros
    if not above < k <= above + cand.size:  # the sample missed: select among all keys
        above, cand = 0, _keys(bits(), kind)
    pos = cand.size - (k - above)  # ascending position of the answer among the candidates
    return _from_key(int(np.partition(cand, pos)[pos]), kind, dtype)


def magnitude_histogram(flat: torch.Tensor) -> torch.Tensor:
    """How many entries of a flat 16-bit CPU tensor have each of the 2¹⁵ magnitudes (int64).

    One counting pass (``torch.bincount`` of the magnitude bits, slice by slice over the
    threads).  A 16-bit float has only 2¹⁵ magnitudes, so this ranks them all exactly; for
    values ``>= 0`` the magnitude is the value (``-0.0`` is counted as ``0.0``, an equal value).
    """

    def counts(span: slice) -> torch.Tensor:
        return torch.bincount(flat[span].view(torch.int16) & _MAGNITUDE_16, minlength=1 << 15)

    # slices of 2^21 entries: fewer 2^15-bin histograms to clear and add than with CHUNK
    parts = map_spans(counts, flat.numel(), flat.device, chunk=1 << 21)
    return functools.reduce(torch.add, parts)


def kth_of_histogram(histogram: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The k-th largest magnitude (0-d ``dtype``) counted by :func:`magnitude_histogram`."""
    from_top = histogram.flip(0).cumsum(0)  # from_top[i]: entries with key >= 2¹⁵ − 1 − i
    key = (1 << 15) - 1 - int(torch.searchsorted(from_top, k))
    return _from_key(key, "magnitude", dtype)


def histogrammed(x: torch.Tensor) -> bool:
    """Whether ``x``'s magnitude selections go through :func:`magnitude_histogram`."""
    return x.dtype in _HISTOGRAMMED and x.device.type == "cpu" and x.numel() > SMALL


def kth_largest(
    x: torch.Tensor, k: int, *, magnitude: bool = False, nonnegative: bool = False
) -> torch.Tensor:
    """The k-th largest entry of ``x`` (of ``|x|`` with ``magnitude``), as a 0-d tensor.

    Exactly ``torch.kthvalue(v.reshape(-1), d − k + 1).values`` with ``v = x`` (``x.abs()``) and
    ``d = x.numel()``, in the dtype of ``x``.  ``x`` must be a finite floating tensor (float16,
    bfloat16, float32 or float64) and ``1 <= k <= d``.  ``nonnegative`` is the caller's promise
    that no entry is below 0 (a Fisher diagonal): the bit patterns are then the keys as they
    are, which saves the work of ordering negatives (with a negative entry the result is
    wrong).
    """
    if x.dtype not in _INT_OF:
        raise TypeError(f"kth_largest needs a 16/32/64-bit floating tensor, got {x.dtype}")
    d = x.numel()
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise ValueError(f"k must be an int in [1, {d}] (the number of entries), got {k!r}")
    flat = x.detach().reshape(-1)
    if d <= SMALL or flat.device.type != "cpu":
        values = flat.abs() if magnitude else flat
        return torch.kthvalue(values, d - k + 1).values
    if histogrammed(flat) and (magnitude or nonnegative):
        return kth_of_histogram(magnitude_histogram(flat), k, x.dtype)
    kind = _key_kind(magnitude, nonnegative)
    bits = flat.view(_INT_OF[x.dtype]).numpy()
    lo, hi = _bracket(bits, k, d, kind)
    above, cand = _count_and_collect(bits, lo, hi, kind)
    return _kth_of_candidates(lambda: bits, k, (above, lo), cand, kind, x.dtype)
