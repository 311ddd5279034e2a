"""The server's peak memory survives the per-round reset of the kernel's high-water mark."""

import numpy as np

from fedunlearn.allocator import return_freed_memory
from strategies.memory import peak_rss_bytes, phase_peak_bytes, reset_phase_peak


def _touch(n_bytes: int) -> None:
    block = np.ones(n_bytes, dtype=np.uint8)  # every page written: resident
    assert int(block[::4096].sum()) == len(range(0, n_bytes, 4096))
    del block


def test_the_run_peak_counts_what_came_before_a_phase_reset():
    """Resetting VmHWM for a round's peak also resets ``ru_maxrss`` (the kernel keeps one
    mark): the run's peak (``server_peak_rss_mb``) read after a round came out below the
    evaluation's peak before it (1.78 GB reported, 2.24 GB sampled, SmolLM2)."""
    return_freed_memory()
    big = 300 * 2**20
    _touch(big)
    peak_before = peak_rss_bytes()
    assert reset_phase_peak(), "the test needs Linux's /proc/self/clear_refs"
    assert phase_peak_bytes() < peak_before - big // 2  # the kernel forgot the block
    assert peak_rss_bytes() >= peak_before  # the run did not
    _touch(big // 3)
    assert phase_peak_bytes() < peak_before <= peak_rss_bytes()
