"""The processes a deployment started, found through ``/proc`` (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulations.run_local import stop_process


def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session id, start time) of a live process, ``None`` if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] = state (field 3 of stat), [1] = ppid, [3] = session, [19] = starttime
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs (zombies don't)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[3] == start_time and stat[0] not in ("Z", "X")


def process_family(roots: Sequence[int]) -> dict[int, int]:
    """``{pid: start time}`` of ``roots``, their descendants and their sessions' members.

    Flower's helpers (``flower-superexec``, ServerApp / ClientApp processes) may start their
    own sessions, so the tree is followed through parent ids as well as session ids.
    """
    stats = {pid: s for pid in _all_pids() if (s := _proc_stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    sessions = set(roots)  # a session outlives its leader: members are found even then
    roots = [r for r in roots if r in stats]
    found: dict[int, int] = {}
    stack = list(roots) + [pid for pid, s in stats.items() if s[2] in sessions]
    while stack:
        pid = stack.pop()
        if pid in found or pid not in stats:
            continue
        found[pid] = stats[pid][3]
        stack.extend(children.get(pid, []))
    return found


class ProcessGroup:
    """The processes a deployment started, and every process they started in turn.

    :meth:`stop` ends them all by PID, newest first, even those that left their process
    group (Flower's helpers start their own sessions).
    """

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.tracked: dict[int, int] = {}  # pid -> start time of everything seen started

    def popen(self, command: list[str], log_file: Path, **kwargs: Any) -> subprocess.Popen:
        """Start ``command`` in its own session, its output appended to ``log_file``."""
        with open(log_file, "ab") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
            )
        return self.adopt(process)

    def adopt(self, process: subprocess.Popen) -> subprocess.Popen:
        """Add a process started elsewhere (it is stopped with the others)."""
        self.started.append(process)
        self.track()
        return process

    def track(self) -> None:
        """Remember every process started so far and its descendants (for :meth:`stop`)."""
        self.tracked.update(process_family([p.pid for p in self.started]))

    def survivors(self) -> list[int]:
        """PIDs of processes of this group that still run."""
        return [pid for pid, start in self.tracked.items() if process_alive(pid, start)]

    def stop(self, grace: float = 15.0) -> list[int]:
        """Stop everything, newest first: SIGTERM, then SIGKILL. Returns the survivors."""
        self.track()
        for process in reversed(self.started):
            stop_process(process, grace=grace)
        # helpers that left the process group (own sessions, reparented): by PID
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = self.survivors()
            for pid in alive:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
            while alive and time.monotonic() < deadline:
                time.sleep(0.2)
                alive = self.survivors()
            if not alive:
                break
        return self.survivors()
