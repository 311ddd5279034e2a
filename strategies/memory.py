"""The server process's resident memory: its peak so far, and the peak of one phase.

Linux keeps one high-water mark per process: ``VmHWM``, which is also what ``getrusage``
reports as ``ru_maxrss`` while the process runs. Restarting it for a phase
(:func:`reset_phase_peak`) would make the run's peak forget everything before the phase, so
the mark is read first and the larger of the marks is kept here.
"""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
#: the process's peak before its latest phase reset (bytes): the kernel no longer knows it
_before_resets = {"peak": 0}


def peak_rss_bytes() -> int:
    """The process's peak resident memory since it started: ``ru_maxrss`` (Linux: KiB), or the
    peak before a phase reset where that was larger."""
    since_reset = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(since_reset, _before_resets["peak"])


def reset_phase_peak() -> bool:
    """Restart the kernel's resident high-water mark (``VmHWM``) so that :func:`phase_peak_bytes`
    measures from now; False where the kernel does not allow it (then the peak is since start).
    The peak so far is kept for :func:`peak_rss_bytes`."""
    _before_resets["peak"] = peak_rss_bytes()
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def phase_peak_bytes() -> int:
    """``VmHWM``: the peak resident memory since :func:`reset_phase_peak` (or since start)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()
