"""pipeline/pause.py: the thread that reaches a pause point stops there, whichever thread it is."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import killing

TESTS = Path(__file__).resolve().parent

# A worker thread reaches the point while the main thread sleeps in a futex wait: the layout in which the score
# stage's part writer commits (the engine's thread is the main one). Past the point the worker writes a file, which
# must never appear. Both threads on one core, the main one at SCHED_IDLE: as on a loaded machine, the main thread
# gets the core only once the worker stops, so a stop that waits for the main thread to act on it (the
# process-directed SIGSTOP this replaced) lets the worker run on every time.
_CHILD = """
import os, sys, threading, time
from pathlib import Path
from pipeline import pause
os.sched_setaffinity(0, {0})
def worker():
    time.sleep(0.2)  # sets the scene only: the main thread asleep in join() first
    pause.point("cache-commit")
    for n in range(int(sys.argv[2])):  # its next pieces of work (the part writer: the next parts), each marked
        if n % 1000 == 0:
            Path(sys.argv[1]).write_text("ran past its pause point")
t = threading.Thread(target=worker)
t.start()
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the main thread only (0: the calling thread)
t.join()
"""


def _wait_all_stopped(pid: int, deadline_s: float = killing.DEADLINE_S) -> list[str]:
    """The state letter of each thread of `pid` once all are stopped (T), or at the deadline (a hang bound only)."""
    deadline = time.monotonic() + deadline_s
    while True:
        states = killing.thread_states(pid)
        if set(states) == {"T"} or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def test_a_worker_thread_stops_at_its_point_not_after_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    past = []
    for i in range(5):
        out = tmp_path / f"past-{i}"
        proc = killing.start([sys.executable, "-c", _CHILD, str(out), str(10**9)], "cache-commit:1", env=env)
        try:
            assert killing.wait_stopped(proc) == proc.pid
            # every thread of it follows (a state, waited on: a thread still runnable when the stop began shows R
            # until the scheduler gives it the core to stop on, which a loaded machine delays; it runs no code of
            # its own meanwhile)
            states = _wait_all_stopped(proc.pid)
            assert len(states) >= 2 and set(states) == {"T"}, states
        finally:
            killing.kill(proc)
        past += [i] if out.exists() else []
    assert past == [], f"the worker ran past its pause point in runs {past}"


def test_a_stopped_command_goes_on_after_sigcont(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    out = tmp_path / "past"
    proc = killing.start([sys.executable, "-c", _CHILD, str(out), "1"], "cache-commit", env=env)
    try:
        killing.wait_stopped(proc)
        assert not out.exists()
        killing.resume(proc)
        assert proc.wait(timeout=killing.DEADLINE_S) == 0  # the worker went on, wrote its file and ended
        assert out.read_text() == "ran past its pause point"
    finally:
        if proc.poll() is None:
            killing.kill(proc)
