"""pipeline/lifetime.py: what a command starts dies with it after kill -9 (a multiprocessing spawn worker, as vLLM and
Megatron start them, a forked worker, a `python -m pipeline ...`-style subprocess, and one that never imports the
package), and a process the command did not start is
left alone. Checked on real processes through /proc (tests/processes.py), not on the module's own bookkeeping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.lifetime import descendants, survivors

REPO = Path(__file__).resolve().parents[1]

# The "command": marks itself as pipeline.errors.command does, starts a spawn worker and a subprocess that import the
# package, and waits to be killed. Its children only sleep: nothing but the watch can end them. Each child that watches
# for itself touches READY/<name> once its watch runs (at `import pipeline`, or at the fork), so the test kills the
# command when all are watching, not after a guessed delay.
COMMAND = """
import multiprocessing as mp, pathlib, subprocess, sys, time
from pipeline import lifetime

def sleep(name):
    pathlib.Path(sys.argv[1], name).touch()  # the spawn child re-imported the package; the fork child ran the hook
    time.sleep(600)

if __name__ == "__main__":
    lifetime.mark_command()
    mp.get_context("spawn").Process(target=sleep, args=("spawn",)).start()
    mp.get_context("fork").Process(target=sleep, args=("fork",)).start()  # as a data loader's workers: no import
    subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time, pipeline; pathlib.Path(sys.argv[1]).touch(); "
                      "time.sleep(600)", sys.argv[1] + "/subprocess"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # never imports pipeline: the watchdog's
    print("ready", flush=True)
    time.sleep(600)
"""
READY = ("spawn", "fork", "subprocess")


def _launch(tmp_path: Path, name: str, code: str, *args: str) -> subprocess.Popen:
    """`code` as a command of its own (this package importable, no command's mark inherited), stdout piped."""
    script = tmp_path / name
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GKD_PARENT_PID", None)
    return subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, text=True)


def _wait_for(what: str, ready, deadline_s: float = 600.0) -> None:
    """Wait until `ready()`; the deadline only bounds a hang (2 loaded cores start a python in seconds, not minutes)."""
    deadline = time.monotonic() + deadline_s
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not after {deadline_s:.0f} s"
        time.sleep(0.1)


def test_children_die_with_a_killed_command(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    proc = _launch(tmp_path, "command.py", COMMAND, str(ready))
    below: dict[int, int] = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        _wait_for("the three watching children", lambda: all((ready / n).exists() for n in READY))

        def all_up() -> bool:  # the four children and the watchdog (each a python process)
            nonlocal below
            below = {p: s for p, s in descendants(proc.pid).items()
                     if Path(f"/proc/{p}/cmdline").read_bytes().count(b"python")}
            return len(below) >= 5

        _wait_for("the four children and the watchdog", all_up)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert survivors(below, wait_s=300) == [], "a child outlived its killed command"


def test_a_process_the_command_did_not_start_is_left_alone(tmp_path):
    """The variable inherited by a process whose parent is another (a Slurm job: sbatch exports the environment of
    `gkd slurm`, which has long exited): no watch, and it runs to its end."""
    code = "import pipeline, threading; print([t.name for t in threading.enumerate()])"
    for marker in (str(os.getpid()), "999999999"):  # the command alive; the command gone
        env = {**os.environ, "PYTHONPATH": str(REPO), "GKD_PARENT_PID": marker}
        out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{code}'; true"], env=env, capture_output=True,
                             text=True, timeout=1800)
        assert out.returncode == 0 and "gkd-parent-watch" not in out.stdout and "MainThread" in out.stdout, out


# The command starts a child that never imports the package and is SIGKILLed at once, before its watchdog's next look
# (once a second) can have seen the child; and a daemon started without the command's pid in its environment (as
# pipeline/slurm/local.py starts Slurm's, which detach as daemons do: a double fork, so the daemon is the reaper's
# child, never the command's), which is meant to outlive it. It prints its watchdog's pid first (its only child then:
# Popen returns after the exec), so the test can wait for the watchdog to have acted and exited.
QUICK = """
import os, signal, subprocess, sys
from pipeline import lifetime

lifetime.mark_command()
(watchdog,) = lifetime.descendants(os.getpid())
daemon = subprocess.run([sys.executable, "-c", "import os, sys, time; os.fork() and os._exit(0); os.setsid(); "
                         "print(os.getpid(), flush=True); os.dup2(os.open(os.devnull, os.O_WRONLY), 1); time.sleep(600)"],
                        env={k: v for k, v in os.environ.items() if k != lifetime.ENV}, stdout=subprocess.PIPE,
                        text=True).stdout
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(watchdog, child.pid, daemon.strip(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_started_just_before_the_kill_dies_and_a_daemon_without_the_mark_lives(tmp_path):
    proc = _launch(tmp_path, "quick.py", QUICK)
    watchdog, child, daemon = (int(x) for x in proc.stdout.readline().split())
    proc.wait(timeout=120)
    procs = {p: s for p in (watchdog, child, daemon) if (s := _start_ticks(p)) is not None}
    try:
        assert survivors({child: procs[child]}, wait_s=300) == [], "a child started just before the kill outlived it"
        # the watchdog exits once it has killed what it found: after that, nothing kills the daemon any more
        assert survivors({watchdog: procs[watchdog]}, wait_s=300) == [], "the watchdog did not finish"
        assert _start_ticks(daemon) == procs[daemon], "the unmarked daemon was killed with the command"
    finally:
        survivors(procs, wait_s=0)


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None
