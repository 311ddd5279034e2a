"""The processes a deployment started, found through ``/proc`` (Linux)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


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
