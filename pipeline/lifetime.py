"""No process outlives its command: what a `gkd` command starts dies with it, also when the command is kill -9'd.

A SIGKILLed process runs no cleanup, so it cannot take its children down; each child watches its parent instead.
`mark_command()` (run by `pipeline.errors.command`, i.e. at the start of every entry's `main`) puts the command's
pid into the environment, which every process it starts inherits. `watch_parent()` (run by `pipeline/__init__.py`,
so in every process that imports the package: multiprocessing's spawn children re-import the parent's `__main__`,
`pipeline.cli`; the `python -m pipeline STAGE` subprocesses of the on-policy driver and the demo; forked children
through `os.register_at_fork`) starts a daemon thread in a process whose parent is that command: once the parent is
gone (the child is re-parented), the child SIGKILLs itself, and its own children, which it marked in turn, follow it
the same way. `gkd` marks itself too (pipeline/cli.py), for the commands without `errors.command`. A child that
never imports the package (a third-party spawn worker: multiprocessing re-imports no `pkg.__main__`, so `python -m
pipeline train`'s spawn worker, by its timing dist_checkpointing's (megatron/core/dist_checkpointing/strategies
use the spawn context), and its resource tracker stayed; an exec'd tool) is caught by the
command's watchdog, a small process `mark_command` starts once per process (see `watchdog`); one started too
shortly before the kill for the watchdog to have seen it is found after the command's death by what it inherited
(re-parented beside the watchdog, started after the command, the command's pid in its environment; seen: a
`gkd train` killed 6 s after its start on a loaded machine left two processes). A daemon meant to outlive its
command is started without that variable (the local Slurm's, pipeline/slurm/local.py).

A watch thread rather than prctl(PR_SET_PDEATHSIG): the kernel sends that signal when the parent *thread* that
started the child exits (prctl(2), "the parent" is the creating thread), which would kill a child that a worker
thread of a live command started. SIGKILL rather than SIGTERM: the command is already dead, every write is atomic
(temporary name, then rename, marker last), so nothing is left to flush, and a signal handler (vLLM installs
some) must not keep the orphan alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ENV = "GKD_PARENT_PID"  # the pid of the nearest `gkd` process above this one
POLL_S = 0.5


_WATCHDOG_OF: list[int] = []  # the pid whose watchdog this process started (one per process)


def mark_command() -> None:
    """Make this process the parent that the processes it starts from now on watch, and start its watchdog."""
    os.environ[ENV] = str(os.getpid())
    if os.getpid() in _WATCHDOG_OF or not Path("/proc/self/stat").exists():
        return
    _WATCHDOG_OF.append(os.getpid())
    # A child that never imports this package (a multiprocessing spawn worker of third-party code: spawn re-imports
    # no `pkg.__main__`; its resource tracker; an exec'd tool) cannot watch for itself. A small separate process
    # does it for the command: it notes the command's processes once a second and, once the command is gone, kills
    # those still alive and what they started since. Exec'd, not forked: a fork of a process with threads may hang.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
            f"from pipeline.lifetime import watchdog; watchdog({os.getpid()}, {_stat(os.getpid())[2]})")
    subprocess.Popen([sys.executable, "-S", "-c", code], env={**os.environ, ENV: ""}, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def watchdog(pid: int, start: int, poll_s: float = 1.0) -> None:
    """The command `pid` (started at `start`, clock ticks) is this process's parent: note its processes while it
    lives; once it is gone, SIGKILL every one of them still alive, and their own descendants."""
    me, seen = os.getpid(), {}
    while os.getppid() == pid and (s := _stat(pid)) and s[2] == start:
        seen = {p: t for p, t in {**seen, **descendants(pid)}.items() if p != me and _started(p) == t}
        time.sleep(poll_s)
    # A process the command started in the last poll interval was never seen; orphaned now, it is found by what it
    # inherited: re-parented to the same reaper as this watchdog (init or a subreaper), started after the command,
    # with the command's pid in its environment. (A daemon meant to outlive its command is started without it:
    # pipeline/slurm/local.py.)
    seen.update(_orphans(pid, start, os.getppid(), me))
    for p in list(seen):
        seen.update(descendants(p))  # what they started since the last look (they are alive: found below them)
    for p, t in seen.items():
        if p != me and _started(p) == t:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _orphans(pid: int, start: int, reaper: int, me: int) -> dict[int, int]:
    """Live children of `reaper` started at or after `start` whose environment names `pid` as their command."""
    mark = f"{ENV}={pid}".encode()
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me or not (s := _stat(int(d.name))):
            continue
        if s[0] != reaper or s[2] < start or s[1] == "Z":
            continue
        try:
            if mark in (d / "environ").read_bytes().split(b"\0"):
                out[int(d.name)] = s[2]
        except OSError:  # gone, or another user's
            continue
    return out


def _started(pid: int) -> int | None:
    s = _stat(pid)
    return s[2] if s and s[1] != "Z" else None


def watch_parent(poll_s: float = POLL_S) -> None:
    """In a child of a marked command: die with it (see the module docstring); elsewhere nothing."""
    want = os.environ.get(ENV, "")
    if not want.isdigit() or int(want) == os.getpid():
        return
    parent = int(want)
    # Only a direct child watches. A process whose parent is another one inherited the variable through it (a
    # shell, a Slurm job: sbatch exports the submitting environment; a Ray worker) and may rightly outlive the
    # command that set it, so it is left alone, even when that pid is gone. The cost: a child whose parent dies in
    # the second between its start and this import is re-parented before it looks, and is not caught.
    if os.getppid() != parent:
        return
    mark_command()  # this child's own children watch it in turn
    threading.Thread(target=_watch, args=(parent, poll_s), name="gkd-parent-watch", daemon=True).start()


def _after_fork() -> None:
    """A forked child (multiprocessing's fork start method, a data loader's workers) imports nothing and inherits no
    thread: start its watch here when its parent is the marked process."""
    if os.environ.get(ENV, "") == str(os.getppid()):
        watch_parent()


os.register_at_fork(after_in_child=_after_fork)  # (subprocess's fork + exec runs no such hook; exec'd children
# that import the package start their watch at the import)


def _watch(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)


# -- the processes of a command, read from /proc: what a kill test or the faults bench snapshots right before its
# SIGKILL (after it, an orphan can no longer be found by its parent) and counts afterwards
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
