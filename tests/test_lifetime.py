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
# package, and waits to be killed. Its children only sleep: nothing but the watch can end them.
COMMAND = """
import multiprocessing as mp, subprocess, sys, time
from pipeline import lifetime

def sleep():
    time.sleep(600)

if __name__ == "__main__":
    lifetime.mark_command()
    mp.get_context("spawn").Process(target=sleep).start()
    mp.get_context("fork").Process(target=sleep).start()  # as a data loader's workers: no import, no thread inherited
    subprocess.Popen([sys.executable, "-c", "import pipeline, time; time.sleep(600)"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # never imports pipeline: the watchdog's
    print("ready", flush=True)
    time.sleep(600)
"""


def _launch(tmp_path: Path, name: str, code: str) -> subprocess.Popen:
    """`code` as a command of its own (this package importable, no command's mark inherited), stdout piped."""
    script = tmp_path / name
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GKD_PARENT_PID", None)
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)


def test_children_die_with_a_killed_command(tmp_path):
    proc = _launch(tmp_path, "command.py", COMMAND)
    below: dict[int, int] = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120  # the four children and the watchdog up (each a python process)
        while time.monotonic() < deadline and len(below) < 5:
            below = {p: s for p, s in descendants(proc.pid).items()
                     if Path(f"/proc/{p}/cmdline").read_bytes().count(b"python")}
            time.sleep(0.1)
        assert len(below) >= 5, below  # + the watchdog
        time.sleep(2)  # their imports done (the watch starts at `import pipeline`)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert survivors(below, wait_s=30) == [], "a child outlived its killed command"


def test_a_process_the_command_did_not_start_is_left_alone(tmp_path):
    """The variable inherited by a process whose parent is another (a Slurm job: sbatch exports the environment of
    `gkd slurm`, which has long exited): no watch, and it runs to its end."""
    code = "import pipeline, threading; print([t.name for t in threading.enumerate()])"
    for marker in (str(os.getpid()), "999999999"):  # the command alive; the command gone
        env = {**os.environ, "PYTHONPATH": str(REPO), "GKD_PARENT_PID": marker}
        out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{code}'; true"], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "gkd-parent-watch" not in out.stdout and "MainThread" in out.stdout, out


# The command starts a child that never imports the package and is SIGKILLed at once, before its watchdog's next look
# (once a second) can have seen the child; and a daemon started without the command's pid in its environment (as
# pipeline/slurm/local.py starts Slurm's), which is meant to outlive it.
QUICK = """
import os, signal, subprocess, sys
from pipeline import lifetime

lifetime.mark_command()
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          env={k: v for k, v in os.environ.items() if k != lifetime.ENV})
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, daemon.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_started_just_before_the_kill_dies_and_a_daemon_without_the_mark_lives(tmp_path):
    proc = _launch(tmp_path, "quick.py", QUICK)
    child, daemon = (int(x) for x in proc.stdout.readline().split())
    proc.wait(timeout=60)
    procs = {p: s for p in (child, daemon) if (s := _start_ticks(p)) is not None}
    try:
        assert survivors({child: procs[child]}, wait_s=30) == [], "a child started just before the kill outlived it"
        time.sleep(3)  # the watchdog has acted by now (it polls once a second)
        assert _start_ticks(daemon) == procs[daemon], "the unmarked daemon was killed with the command"
    finally:
        survivors(procs, wait_s=0)


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None
