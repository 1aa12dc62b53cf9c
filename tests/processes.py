"""The processes of a command, read from /proc: what a kill test snapshots before its SIGKILL and asserts gone after
(pipeline/lifetime.py: no process outlives its command). Imported by name (tests/conftest.py puts tests/ on sys.path)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in clock ticks) of a live pid, else None. The start time tells a reused pid apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live process below `pid` (children, their children, ...): pid -> start time."""
    stats = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := _stat(int(p.name)))}
    below, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, start) in stats.items():
            if ppid == parent and child not in below:
                below[child] = start
                todo.append(child)
    return below


def survivors(procs: dict[int, int], wait_s: float = 60.0) -> list[int]:
    """The processes of `procs` (from `descendants`) still alive (zombies count as gone) after up to `wait_s`; the
    survivors are then SIGKILLed, so a failing test leaves nothing behind either."""
    def alive() -> list[int]:
        return [p for p, start in procs.items() if (s := _stat(p)) and s[2] == start and s[1] != "Z"]

    deadline = time.monotonic() + wait_s
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
