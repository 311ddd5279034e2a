"""Chunked element-wise helpers shared by the fused merges (FIRM base, TIES, FULM).

The merges walk every weight tensor in slices of :data:`CHUNK` entries, so that all the
temporaries of one slice stay in the cache and no temporary of the size of the whole tensor is
allocated.  Every element-wise operation is the one the whole-tensor formulation performs, in
the same order, so the merged values are unchanged; only the float64 sums behind reported norms
and damages are accumulated slice by slice (a different summation order, equal to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")

#: Entries per slice (1 MiB of float32).
CHUNK = 1 << 18
#: Worker pools by thread count, created on first use and kept (starting threads costs ~1 ms).
_POOLS: dict[int, ThreadPoolExecutor] = {}


def spans(numel: int, chunk: int = CHUNK) -> Iterator[slice]:
    """Consecutive slices of at most ``chunk`` entries covering ``range(numel)``."""
    for start in range(0, numel, chunk):
        yield slice(start, min(start + chunk, numel))


@contextmanager
def _single_threaded_ops() -> Iterator[None]:
    """Run torch operators with one intra-op thread inside the block (restored afterwards)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def map_spans(
    fn: Callable[[slice], T], numel: int, device: torch.device, chunk: int = CHUNK
) -> list[T]:
    """``[fn(span) for span in spans(numel, chunk)]``, the spans spread over the intra-op threads.

    On the CPU with several torch threads, every span runs single-threaded in one of that
    many worker threads (the operators release the GIL), instead of every small operator
    splitting its span over all threads: no per-operator barrier, so a busy machine that
    pre-empts one thread does not stall the others.  ``fn`` must only write to its own span.
    The results come back in span order, so reductions over them are deterministic (and do not
    depend on the thread count).  While the workers run, torch's intra-op thread count is 1
    process-wide (restored afterwards).
    """
    threads = torch.get_num_threads()
    if threads <= 1 or numel <= chunk or device.type != "cpu":
        return [fn(span) for span in spans(numel, chunk)]
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="merge-slices")
    with _single_threaded_ops():
        return list(pool.map(fn, spans(numel, chunk)))


def below(threshold: torch.Tensor | float) -> float:
    """The largest float of the threshold's dtype below ``threshold`` (``-inf`` stays ``-inf``).

    ``x > below(t)`` is ``x >= t`` for every ``x`` of that dtype (a strict comparison, which
    the merge kernels use for their thresholds).
    """
    t = torch.as_tensor(threshold)
    if math.isinf(float(t)) and float(t) < 0:
        return -math.inf
    return float(torch.nextafter(t, t.new_full((), -math.inf)))
