"""Fused merge kernels: one formulation, run compiled on whole tensors or eagerly slice by slice.

Each merge writes its per-tensor arithmetic once, as a *kernel*: a function of flat input
tensors (and 0-d parameter tensors) that returns ``(outputs, sums)`` — full-length outputs and
a 1-D float64 tensor of the sums behind the merge's report.  :func:`run_kernel` runs it

* **compiled** (``torch.compile``, inductor's C++ backend on the CPU) on whole tensors: every
  element-wise step and every reduction of the kernel becomes one loop over the entries, so a
  merge reads each input about once instead of once per PyTorch operator (FIRM base goes from
  about 50 eager operator passes per merged entry to one fused loop);
* **eagerly**, slice by slice (:data:`~fedunlearn.merging._chunks.CHUNK` entries, spread over
  the intra-op threads), when no C++ compiler is available, the input is small (compiling
  costs seconds per input layout, more than a small merge), the tensors are not on the CPU,
  or ``$FEDUNLEARN_MERGE_KERNELS=eager``.

Both run the same element-wise operations in the same order, so the merged values are
bit-identical; only the float64 report sums are added in a different order (equal to
rounding).  ``$FEDUNLEARN_MERGE_KERNELS`` is ``auto`` (default: compiled for merges of at
least :data:`COMPILE_MIN_ENTRIES` entries per client), ``compiled`` (always, where a compiler
exists) or ``eager``.  Compiled kernels are cached by inductor on disk
(``$TORCHINDUCTOR_CACHE_DIR``), so a second process with the same input layout starts faster.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ._chunks import CHUNK, map_spans, spans
from .base import TensorMeta, described
from .lazy import Flat, FlatSlices
from .native import pooled_bracket_counts

#: Environment variable choosing the kernels: ``auto``, ``compiled`` or ``eager``.
MODE_ENV = "FEDUNLEARN_MERGE_KERNELS"
MODES = ("auto", "compiled", "eager")
#: ``auto`` compiles merges whose tensors hold at least this many entries per client in total.
COMPILE_MIN_ENTRIES = 1 << 24

#: Entries per compiled call of :func:`run_kernel` on inputs decoded slice by slice (16 chunks,
#: 16 MB per decoded input: each call costs about 0.6 ms of dispatch; on one Llama-2-7B layer
#: (2 forget + 2 retain clients, 2-core EPYC, best of 4, interleaved) 16 chunks merged in
#: 1.43-1.55 s against 1.57-1.81 s for 4 chunks, 1.51-1.87 s for 32 and 2.5 s for 64).
DECODE_SLICE = CHUNK * 16

#: Entries per compiled call of :func:`bracket_counts`.
COUNT_SLICE = 1 << 22

#: Inductor settings of the compiled kernels.  By default inductor writes out (``realizes``) an
#: intermediate read by more than 4 later operations and re-reads it in a loop of its own; in
#: FULM's kernel that made four extra full-length float32 buffers and five loops per tensor
#: (the centroids, counts and norms of the clusters), against two without the limit
#: (101 ms vs 58 ms per 14336x1024 tensor of 7 bf16 clients on the 2-core EPYC).  The merged
#: values are the same bits; only the float64 report sums are added in another order.
_INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "realize_reads_threshold": 1000
}

Kernel = Callable[..., tuple[tuple[torch.Tensor, ...], torch.Tensor]]


def mode() -> str:
    """The kernel mode from ``$FEDUNLEARN_MERGE_KERNELS`` (``auto`` when unset)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"${MODE_ENV} must be one of {', '.join(MODES)}; got {value!r}")
    return value


@functools.cache
def compiler_available() -> bool:
    """Whether inductor finds a C++ compiler for CPU kernels (checked once per process)."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception:  # no compiler, or an inductor that cannot build here: run eagerly
        return False
    return True


def use_compiled(
    client_tensors: Sequence[torch.Tensor], min_entries: int = COMPILE_MIN_ENTRIES
) -> bool:
    """Whether a merge of these tensors (one client's, every merged weight) compiles.

    ``auto`` compiles from ``min_entries`` entries in total (the projection, which passes over
    its coordinates tens of times, sets a lower bar than the one-pass merges).
    """
    metas = [(tuple(t.shape), t.dtype, t.device) for t in client_tensors]
    return _compiles(metas, min_entries)


def use_compiled_for(values: Mapping[str, torch.Tensor], keys: Sequence[str]) -> bool:
    """:func:`use_compiled` for one client's tensors ``values[key]`` of ``keys``, sized without
    decoding them (:func:`~fedunlearn.merging.base.described`)."""
    return _compiles([described(values, key) for key in keys], COMPILE_MIN_ENTRIES)


def _compiles(metas: Sequence[TensorMeta], min_entries: int) -> bool:
    chosen = mode()
    if not metas or chosen == "eager" or metas[0][2].type != "cpu":
        return False
    if not compiler_available():
        return False
    entries = sum(math.prod(shape) for shape, _, _ in metas)
    return chosen == "compiled" or entries >= min_entries


@functools.cache
def _compiled(kernel: Kernel) -> Kernel:
    return torch.compile(kernel, dynamic=True, options=_INDUCTOR_OPTIONS)


def _slice_args(args: Any, span: slice) -> Any:
    """``args`` with every flat (1-D) tensor cut to ``span`` and every :class:`FlatSlices`
    decoded there; 0-d parameters stay as they are."""

    def cut(x: Any) -> Any:
        flat = isinstance(x, FlatSlices) or isinstance(x, torch.Tensor) and x.dim() == 1
        return x[span] if flat else x

    return pytree.tree_map(cut, args)


def _decodes_slices(args: Any) -> bool:
    """Whether some input of ``args`` is decoded slice by slice (a :class:`FlatSlices`)."""
    return any(isinstance(x, FlatSlices) for x in pytree.tree_leaves(args))


def run_kernel(
    kernel: Kernel, args: Sequence[Any], numel: int, device: torch.device, compiled: bool
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``kernel(*args)`` on flat tensors of ``numel`` entries: compiled whole, or eager by slices.

    Eagerly, the first slice runs in this thread (it fixes the outputs' dtypes), the others in
    :func:`~fedunlearn.merging._chunks.map_spans`; the per-slice sums are added in slice order.
    Inputs decoded on demand (:class:`~fedunlearn.merging.lazy.FlatSlices`) are decoded slice
    by slice in the same loop, so no whole decoded tensor is ever written.
    """
    if compiled and numel > 0:
        if _decodes_slices(args):
            return _run_compiled_decoding(kernel, args, numel, device)
        return _compiled(kernel)(*args)
    first = slice(0, min(CHUNK, numel))
    head, first_sums = kernel(*_slice_args(args, first))
    outs = tuple(torch.empty(numel, dtype=h.dtype, device=device) for h in head)

    def work(span: slice) -> torch.Tensor:
        part, part_sums = (head, first_sums) if span == first else kernel(*_slice_args(args, span))
        for out, p in zip(outs, part, strict=True):
            out[span] = p
        return part_sums

    parts = map_spans(work, numel, device)
    return outs, functools.reduce(torch.add, parts, torch.zeros_like(first_sums))


def _run_compiled_decoding(
    kernel: Kernel, args: Sequence[Any], numel: int, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The compiled ``kernel`` on slices of :data:`DECODE_SLICE` entries, whose
    :class:`FlatSlices` inputs are decoded first; after the first slice (which fixes the
    outputs' dtypes) the compiled kernel writes its outputs straight into the whole outputs'
    slices (:func:`_written`). The per-slice sums are added in slice order."""
    slices = list(spans(numel, DECODE_SLICE))
    head, head_sums = _compiled(kernel)(*_slice_args(args, slices[0]))
    outs = tuple(torch.empty(numel, dtype=h.dtype, device=device) for h in head)
    for out, h in zip(outs, head, strict=True):
        out[slices[0]] = h
    into = cast(Callable[..., torch.Tensor], _compiled(_written(kernel)))
    sums = [head_sums]
    for span in slices[1:]:
        sums.append(into(tuple(out[span] for out in outs), *_slice_args(args, span)))
    return outs, functools.reduce(torch.add, sums)


@functools.cache
def _written(kernel: Kernel) -> Callable[..., torch.Tensor]:
    """``kernel`` writing its outputs into ``outs`` (slices of the whole outputs), returning
    its sums: compiled, the outputs' loop stores into those slices directly."""

    def into(outs: tuple[torch.Tensor, ...], *args: Any) -> torch.Tensor:
        parts, sums = kernel(*args)
        for out, part in zip(outs, parts, strict=True):
            out.copy_(part)
        return sums

    return into


def mean_of(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(p_1 + … + p_n) / n`` in float32, summed in order (a lone part is only widened)."""
    acc = parts[0].to(torch.float32)
    for p in parts[1:]:
        acc = acc + p.to(torch.float32)
    return acc / len(parts) if len(parts) > 1 else acc


def kept_above(x: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """``where(x > lower, x, 0)``: with ``lower`` the float below a threshold, ``x >=`` it."""
    return torch.where(x > lower, x, 0.0)


def sq64(x: torch.Tensor) -> torch.Tensor:
    """``Σ x²`` in float64 (a 0-d tensor)."""
    x64 = x.to(torch.float64)
    return (x64 * x64).sum()


def nonzero64(x: torch.Tensor) -> torch.Tensor:
    """Number of non-zero entries, as a 0-d float64 tensor."""
    return (x != 0).sum().to(torch.float64)


#: Input dtypes of :func:`bracket_counts`' pooled means.
_FUSABLE = (torch.float16, torch.bfloat16, torch.float32)


def bracket_kernel(
    parts: list[torch.Tensor], magnitude: bool, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Counting pass of a top-k selection on one slice: ``((key − lo,), [max v, #{key > hi}])``.

    The values ``v`` are the float32 mean of ``parts`` (a pooled Fisher, or a lone one) with
    keys their bit patterns (``-0.0`` read as ``0.0``), or with ``magnitude`` the entries of
    the one float32 part, keyed by the bit patterns of ``|part|`` (then ``max v`` is 0; 16-bit
    magnitudes are ranked by a histogram instead, see :func:`~.selection.kth_largest`).
    ``lo <= hi`` are non-negative int32 keys; ``key − lo`` fits int32, and read as unsigned it
    is ``<= hi − lo`` exactly for the keys in the bracket.
    """
    if magnitude:
        x = parts[0]
        keys = x.view(torch.int32) & 0x7FFFFFFF
        top = torch.zeros((), dtype=torch.float64, device=x.device)
    else:
        v = mean_of(parts)
        keys = v.view(torch.int32).clamp(min=0)
        top = v.max().to(torch.float64)
    return (keys - lo,), torch.stack([top, (keys > hi).sum().to(torch.float64)])


def fusable(dtype: torch.dtype) -> bool:
    """Whether :func:`bracket_counts` pools inputs of ``dtype`` (16- and 32-bit floats)."""
    return dtype in _FUSABLE


def _in_bracket(offsets: np.ndarray, width: int, span: slice) -> np.ndarray:
    """The offsets (``key − lo``) in ``span`` that are ``<= width`` read as unsigned."""
    part = offsets[span]
    return part[part.view(np.uint32) <= width]


def bracket_counts(
    parts: Sequence[Flat],
    magnitude: bool,
    bounds: tuple[int, int],
    *,
    native: bool = True,
) -> tuple[torch.Tensor, int, np.ndarray]:
    """``(max v, #{key > hi}, the keys in [lo, hi])`` over flat ``parts``, slice by slice.

    With ``native``, counted by the C function of :mod:`~fedunlearn.merging.native`
    (one pass, only the candidates written) where it is built and takes the parts; otherwise
    keys and values as in :func:`bracket_kernel`, compiled, on slices of :data:`COUNT_SLICE`
    entries (each call costs a fixed fraction of a millisecond), and the candidates (a few per
    cent of the entries) picked from each slice's offsets by numpy (about 6x faster than
    torch's boolean indexing), part by part over the threads.  Both give the same keys.
    """
    counted = pooled_bracket_counts(parts, magnitude, bounds) if native else None
    if counted is not None:
        return counted
    lo, hi = bounds
    lo_t, hi_t = (torch.tensor(b, dtype=torch.int32) for b in bounds)
    maxima, above, candidates = [], 0, []
    fn = _compiled(bracket_kernel)
    d = parts[0].numel()
    for start in range(0, d, COUNT_SLICE):
        span = slice(start, min(start + COUNT_SLICE, d))
        (offsets,), sums = fn([p[span] for p in parts], magnitude, lo_t, hi_t)
        maxima.append(sums[0])
        above += int(sums[1])
        off = offsets.numpy()
        candidates += map_spans(
            functools.partial(_in_bracket, off, hi - lo), off.size, offsets.device
        )
    keys = np.concatenate(candidates).astype(np.int64) + lo
    return torch.stack(maxima).max().to(torch.float32), above, keys
