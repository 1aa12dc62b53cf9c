"""Kill a command at an exact point of its work, on a machine as busy as it gets (pipeline/pause.py).

    proc = start(cmd, "checkpoint:2", env=env)      # the command stops itself right after its 2nd checkpoint
    wait_stopped(proc)                              # waits on that state, not on a clock
    kill(proc)                                      # SIGKILL, as a user's kill -9

A test that polled for a file and then sent SIGKILL raced the command: on a loaded machine the poller may not run
before the command has written more, or finished. Stopped, the command cannot move on, so what the test asserts
about the kill point holds exactly. The deadline only bounds a hang: a command that never reaches its point, or
ends before it, fails the test with its exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from pipeline import pause

DEADLINE_S = 900.0  # generous: the slowest command a test stops starts an engine on 2 shared cores first


def start(cmd: list[str], pause_at: str, *, env: dict | None = None, **popen: object) -> subprocess.Popen:
    """`cmd` in a session of its own (so that `kill(proc, group=True)` reaches all it started) with
    $GKD_PAUSE_AT=`pause_at`."""
    env = {**(os.environ if env is None else env), pause.ENV: pause_at}
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.Popen(cmd, env=env, start_new_session=True, **popen)


def _state_of(stat: Path) -> str | None:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D, T stopped, Z zombie, ...), None when it is gone."""
    return _state_of(Path(f"/proc/{pid}/stat"))


def thread_states(pid: int) -> list[str | None]:
    """The state letter of each thread of `pid` (its main thread's is `state(pid)`)."""
    return [_state_of(t / "stat") for t in Path(f"/proc/{pid}/task").iterdir()]


def stopped_in(pid: int) -> int | None:
    """`pid` or the first of its descendants that is stopped (SIGSTOP), else None."""
    from pipeline.lifetime import descendants

    for p in (pid, *descendants(pid)):
        if state(p) == "T":
            return p
    return None


def wait_stopped(proc: subprocess.Popen, deadline_s: float = DEADLINE_S) -> int:
    """Wait until the command, or a process it started, has stopped itself at its pause point; that pid."""
    deadline = time.monotonic() + deadline_s
    while (pid := stopped_in(proc.pid)) is None:
        rc = proc.poll()
        assert rc is None, f"the command ended (exit status {rc}) before reaching its pause point ${pause.ENV}"
        assert time.monotonic() < deadline, f"the command did not reach its pause point in {deadline_s:.0f} s"
        time.sleep(0.05)
    return pid


def kill(proc: subprocess.Popen, *, group: bool = False) -> None:
    """SIGKILL the command (`group`: and every process of its session), and reap it."""
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=120)


def resume(proc: subprocess.Popen, pid: int | None = None) -> None:
    """SIGCONT the stopped process: it goes on from its pause point (the point is counted, so it stops no more)."""
    os.kill(pid or proc.pid, signal.SIGCONT)
