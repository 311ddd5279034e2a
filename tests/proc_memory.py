"""The test process's resident memory (Linux ``/proc/self``), for tests that bound what one
step adds at its peak: restart the high-water mark, run the step, read the mark."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def restart_peak() -> int:
    """Restart the resident high-water mark ``VmHWM``; the resident bytes now (``VmRSS``)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")
    return status_bytes("VmRSS")


def peak_added_since(start: int) -> int:
    """``VmHWM`` − ``start``: the most the process held above ``start`` since the restart."""
    return status_bytes("VmHWM") - start
