"""Stop a command at an exact point of its work, so that a kill -9 lands there however busy the machine is.

    GKD_PAUSE_AT=checkpoint:2 gkd train ...      # stops itself (SIGSTOP) right after its 2nd checkpoint is complete

A kill test that watched for a file and then sent SIGKILL raced the command: on a loaded machine the watcher may not
be scheduled before the command has moved on, or finished (seen: a 4-step `gkd train` ran to its end between two
50 ms polls). Here the command itself stops, with every thread, at the named point, after what that point
completes is on disk and before anything after it; the test waits for the stopped state (`/proc/PID/stat` 'T'),
then sends SIGKILL (a stopped process dies of it at once) or SIGCONT to let it go on. Nothing else changes: without
the variable each point is one dictionary look-up.

The points, each counted per process from 1 (`NAME:N` stops at the N-th time `NAME` is reached; `NAME` alone at
the first; several comma-separated):
- `cache-commit`: a scored shard is published in a teacher cache (shard, marker, index line) and the cache's commit
  lock is released again (pipeline/store/cache.py), so a stopped writer holds up no other writer.
- `rollout-shard`: a rollout shard and its marker are written (pipeline/store/rollouts.py): a generate or import part.
- `shard-temporary`: a shard's data is fsynced in its temporary file, not yet renamed (pipeline/store/shards.py): a
  kill here leaves the temporary that the next writer of that shard removes.
- `checkpoint`: a training checkpoint is complete, its marker written (pipeline/train/checkpoint.py).
- `train-step`: an optimizer step is done and rank 0 has flushed its metrics.jsonl line, before that step's
  checkpoint if it has one (pipeline/train/loop.py): a kill here lands mid-run, between two checkpoints.
- `onpolicy-state`: the on-policy driver saved its resume state (pipeline/onpolicy/state.py).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

ENV = "GKD_PAUSE_AT"
POINTS = ("cache-commit", "rollout-shard", "shard-temporary", "checkpoint", "train-step", "onpolicy-state")

_reached: Counter[str] = Counter()
_lock = threading.Lock()  # points are reached from several threads (the score stage's part writer, the engine's)


def _wanted() -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
        name, _, n = item.partition(":")
        if name not in POINTS or (n and not n.isdigit()):
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: {item!r} is not POINT[:N] with POINT one of {POINTS}")
        out[name] = int(n or 1)
    return out


def point(name: str) -> None:
    """The work before this line is complete on disk: stop this process here if $GKD_PAUSE_AT asks for it."""
    assert name in POINTS, name
    if ENV not in os.environ:
        return
    with _lock:
        _reached[name] += 1
        stop = _wanted().get(name) == _reached[name]
    if stop:
        # Raised at this thread, not sent to the process: a process-directed SIGSTOP wakes the main thread to act on
        # it, and until that thread is scheduled the caller runs on past its point (measured: 7 times in 20 on one
        # core; CI saw the score stage's part writer commit one part more). Raised here, the caller stops on its
        # way back from the syscall and takes every other thread with it; SIGCONT resumes, SIGKILL ends it.
        signal.raise_signal(signal.SIGSTOP)
