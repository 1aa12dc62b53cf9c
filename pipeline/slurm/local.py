"""A throw-away single-node Slurm (munged + slurmctld + slurmd) under one directory, for tests and laptops.

    python -m pipeline.slurm.local_run start runs/slurm-local     # prints `export SLURM_CONF=...` (local_run.py)
    python -m pipeline.slurm.local_run stop runs/slurm-local      # stops exactly the daemons started there
    scripts/local_slurm.sh start|stop [DIR]                       # the same from a shell

Debian's packages (slurmctld slurmd slurm-client munge, 22.05) run as root without systemd or cgroups
(proctrack/linuxproc, task/none). The settings that make it fast (docs/dependencies.md, "A local Slurm"): requeue
waits `cred_expire` (default 120 s, here 10), the scheduler runs every `sched_interval` (here 2 s), KillWait 2 s instead of
30 between SIGTERM and SIGKILL, ReturnToService=2 so a node set DOWN comes back when its slurmd re-registers.
Everything (conf, munge key and socket, state, spool, logs, pid files) lives under the directory; TCP ports are
picked free, so several clusters can coexist on one machine. Client commands find the cluster via $SLURM_CONF.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import lifetime

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why (tests skip with it)."""


def ensure_installed(timeout: float = 600) -> float:
    """Install Debian's Slurm packages if a binary is missing; returns seconds spent (0 when already there)."""
    if all(shutil.which(b) for b in BINARIES):
        return 0.0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(f"Slurm binaries missing and cannot install {' '.join(PACKAGES)} (needs root + apt-get)")
    t0 = time.time()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True, timeout=timeout).returncode != 0:
        # a fresh image has no package lists yet: update once, then retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout)
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {r.stderr.strip()[-500:]}")
    return time.time() - t0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_line() -> str:
    """This machine's NodeName line as slurmd measures it (CPUs, sockets, RealMemory): a node configured with more
    than it has would be drained on registration."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if line.startswith("NodeName="))


@dataclass
class LocalSlurm:
    """One cluster rooted at `root`. `start()` then `stop()`; `env()` is what client commands need."""

    root: Path
    partition: str = "debug"

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node(self) -> str:
        return node_line().split()[0].split("=", 1)[1]

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def jobcomp_log(self) -> Path:
        """Where slurmctld records each ended job (`jobcomp/filetxt`): read by `finished`."""
        return self.root / "log" / "jobcomp.log"

    def pid_files(self) -> dict[str, Path]:
        run = self.root / "run"
        return {"slurmd": run / "slurmd.pid", "slurmctld": run / "slurmctld.pid", "munged": run / "munged.pid"}

    def write_config(self) -> None:
        r = self.root
        for d in ("etc", "run", "log", "state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
            (r / d).chmod(0o700)  # munged refuses keys/sockets in group/world-writable directories
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            key.chmod(0o400)
        ctld_port, slurmd_port = _free_ports(2)
        host = socket.gethostname().split(".")[0]
        pids = self.pid_files()
        self.conf.write_text(
            "\n".join(
                [
                    "# written by pipeline/slurm/local.py: a throw-away single-node cluster",
                    "ClusterName=gkdlocal",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # requeue/launch wait for credentials to expire (default 120 s)
                    f"AuthInfo=socket={r / 'munge' / 'munge.socket'},cred_expire=10",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={pids['slurmctld']}",
                    f"SlurmdPidFile={pids['slurmd']}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    # no cgroups in a container: track processes by parent pid, bind nothing
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    # no slurmdbd/sacct: final job states go to a text log instead
                    "JobCompType=jobcomp/filetxt",
                    f"JobCompLoc={self.jobcomp_log}",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "SchedulerType=sched/builtin",
                    "SchedulerParameters=sched_interval=2",
                    # CPUs are the consumable; memory is not, so a job without --mem does not take the whole node
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    "KillWait=2",
                    "MinJobAge=600",  # finished jobs stay visible to squeue/scontrol (we have no sacct)
                    "SlurmdTimeout=30",
                    "InactiveLimit=0",
                    f"{node_line()} State=UNKNOWN",
                    f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self, timeout: float = 300) -> None:
        """Write the config, start the three daemons, wait until the node is idle."""
        ensure_installed()
        if live := self.daemons():
            pids = ", ".join(f"{name} {pid}" for name, pid in live.items())
            raise RuntimeError(f"a local Slurm is already running under {self.root} ({pids}); stop it first: "
                               f"python -m pipeline.slurm.local_run stop {self.root}")
        self.write_config()
        r, pids = self.root, self.pid_files()
        # The daemons outlive this command by design: without the command's pid in their environment, so its
        # watchdog does not take them for its orphans (pipeline/lifetime.py).
        env = {k: v for k, v in {**os.environ, **self.env()}.items() if k != lifetime.ENV}
        daemons = [
            ["munged", "-f", f"--key-file={r / 'munge' / 'munge.key'}", f"--socket={r / 'munge' / 'munge.socket'}",
             f"--pid-file={pids['munged']}", f"--log-file={r / 'log' / 'munged.log'}",
             f"--seed-file={r / 'munge' / 'munged.seed'}"],
            # -c: no state from an earlier cluster in this dir; -i: ignore unreadable state
            ["slurmctld", "-c", "-i", "-f", str(self.conf)],
            ["slurmd", "-f", str(self.conf)],
        ]
        for cmd in daemons:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode != 0:
                self.stop()
                raise SlurmUnavailable(f"{cmd[0]} failed to start: {(res.stderr or res.stdout).strip()[-500:]}")
            name = cmd[0]
            if not _wait(lambda name=name: _read_pid(pids[name]) is not None, 120):  # generous: a loaded machine
                self.stop()
                raise SlurmUnavailable(f"{name} wrote no pid file; see {r / 'log'}")
        if not _wait(lambda: self.node_state() == "idle", timeout):
            state = self.node_state()
            self.stop()
            raise SlurmUnavailable(f"node not idle after {timeout:.0f} s (state {state!r}); see {r / 'log'}")

    def node_state(self) -> str:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env={**os.environ, **self.env()},
                             capture_output=True, text=True)
        return res.stdout.strip().split("\n")[0] if res.returncode == 0 else ""

    def daemons(self) -> dict[str, int]:
        """The live daemons of this cluster, by name: from their pid files, and from the process table for a daemon
        whose pid file is gone (the folder was deleted under a live cluster). Such a daemon still holds the cluster's
        paths: a new cluster in the same folder would share its state directory and munge socket."""
        found = {name: pid for name, p in self.pid_files().items() if _alive(pid := _read_pid(p))}
        for pid, argv in _processes():
            name = Path(argv[0]).name
            if name in self.pid_files() and name not in found and any(f"{self.root}/" in a for a in argv[1:]):
                found[name] = pid
        return found

    def finished(self, job_id: str) -> dict[int, str]:
        """{array index (-1: a plain job): state} of the job's ended tasks, from the cluster's job-completion log
        (JobCompLoc, written as each task ends): squeue forgets an ended job after MinJobAge, this log keeps it, so
        a check after a long (or slowed) run reads its jobs' outcomes here. A requeued task's last record wins."""
        log = self.jobcomp_log
        ended: dict[int, str] = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            rec = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if rec.get("ArrayJobId") == job_id:
                ended[int(rec["ArrayTaskId"])] = rec["JobState"]
            elif "ArrayJobId" not in rec and rec.get("JobId") == job_id:
                ended[-1] = rec["JobState"]
        return ended

    def running(self) -> list[str]:
        return list(self.daemons())

    def stop(self, timeout: float = 60) -> None:
        """Stop this cluster's daemons (and only those: found by pid file or by a command line naming root):
        slurmd, slurmctld, then munged. Job processes still running on the node are killed by slurmd on shutdown."""
        live = self.daemons()
        for name, path in self.pid_files().items():
            pid = live.get(name)
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGTERM)
                if not _wait(lambda pid=pid: not _alive(pid), timeout):
                    os.kill(pid, signal.SIGKILL)
            path.unlink(missing_ok=True)


def _processes() -> list[tuple[int, list[str]]]:
    """(pid, argv) of every live process this user can read."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = d.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            except OSError:  # ended while we looked
                continue
            if argv and _alive(int(d.name)):
                out.append((int(d.name), argv))
    return out


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout: float, every: float = 0.2) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())
