"""The server process's resident memory: its peak so far, and the peak of one phase."""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_rss_bytes() -> int:
    """The process's peak resident memory since it started (``ru_maxrss``; Linux: KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_phase_peak() -> bool:
    """Restart the kernel's resident high-water mark (``VmHWM``) so that :func:`phase_peak_bytes`
    measures from now; False where the kernel does not allow it (then the peak is since start)."""
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
