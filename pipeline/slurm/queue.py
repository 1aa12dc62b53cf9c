"""Talking to Slurm and to the stages: submit a script, read task states, find the shards still missing.

    gkd slurm resubmit --num-shards 8 -- --rollouts R --cache C      # missing_shards -> submit(--array=missing)

Only `sbatch`, `squeue` and `scontrol` are used: clusters without slurmdbd have no `sacct`, and polling `squeue` notices
a finished job within a second where `sbatch --wait` takes much longer. Every function takes the environment
(`env`, e.g. {"SLURM_CONF": ...} for a local cluster) instead of reading global state.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from pipeline.errors import UserError
from pipeline.slurm.arrays import parse_array

__all__ = ["ACTIVE", "QueueUnreadable", "SlurmError", "active_indices", "active_jobs", "answered_states", "cancel",
           "check_script", "missing_shards", "parse_array", "submit", "task_states", "wait"]

ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING")


class SlurmError(UserError, RuntimeError):
    """A Slurm command failed; the message carries its stderr."""


class QueueUnreadable(SlurmError):
    """squeue gave no answer about a job (its controller busy or unreachable: seen as a socket time-out on a loaded
    2-core machine), which says nothing of the job's state: the caller asks again, never takes the job for ended."""


# squeue's words for a job it no longer knows (finished longer than MinJobAge ago): the one failure that is an answer
FORGOTTEN = "Invalid job id"


def _run(cmd: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)}: {(res.stderr or res.stdout).strip()}")
    return res


def submit(script: Path, array: str | None = None, env: dict[str, str] | None = None,
           dependency: str | None = None) -> str:
    """sbatch the script (command-line options override its #SBATCH lines); returns the job id."""
    cmd = ["sbatch", "--parsable"]
    if array:
        cmd.append(f"--array={array}")
    if dependency:
        cmd.append(f"--dependency={dependency}")
    out = _run([*cmd, str(script)], env).stdout.strip()
    return out.split(";")[0]  # "<id>" or "<id>;<cluster>"


def task_states(job_id: str, env: dict[str, str] | None = None) -> dict[int, str]:
    """{array index: state} of one array job (index -1 for a plain job); {} once Slurm has forgotten the job.
    QueueUnreadable when squeue failed otherwise."""
    res = _run(["squeue", "-h", "-r", "-j", job_id, "-t", "all", "-o", "%K %T"], env, check=False)
    if res.returncode != 0 and FORGOTTEN not in res.stderr:
        raise QueueUnreadable(f"squeue -j {job_id} (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-300:]}")
    states = {}
    for line in res.stdout.split("\n"):
        if line.strip():
            index, state = line.split()
            states[-1 if index == "N/A" else int(index)] = state
    return states


def active_indices(job_name: str, env: dict[str, str] | None = None) -> set[int]:
    """Array indices of this user's jobs named `job_name` that are queued or running (not to be submitted twice)."""
    res = _run(["squeue", "-h", "-r", "--me", f"--name={job_name}", "-t", ",".join(ACTIVE), "-o", "%K"], env)
    return {int(x) for x in res.stdout.split() if x.isdigit()}


def active_jobs(job_name: str, env: dict[str, str] | None = None) -> dict[str, dict[int, str]]:
    """This user's queued or running jobs named `job_name`: {job id: {array index (-1: plain job): state}}. Finds
    jobs whose ids were never recorded (a submitter killed between sbatch and writing the id down)."""
    res = _run(["squeue", "-h", "-r", "--me", f"--name={job_name}", "-t", ",".join(ACTIVE), "-o", "%F %K %T"], env)
    jobs: dict[str, dict[int, str]] = {}
    for line in res.stdout.split("\n"):
        if line.strip():
            job, index, state = line.split()
            jobs.setdefault(job, {})[-1 if index == "N/A" else int(index)] = state
    return jobs


def cancel(job_ids: list[str], env: dict[str, str] | None = None) -> None:
    """scancel these jobs (all their tasks); ids Slurm has forgotten are ignored."""
    if job_ids:
        _run(["scancel", *job_ids], env, check=False)


def check_script(script: Path, env: dict[str, str] | None = None) -> None:
    """`sbatch --test-only`: Slurm validates the script's options (partition, limits, gres...) without queueing
    anything. Raises SlurmError with sbatch's message."""
    _run(["sbatch", "--test-only", str(script)], env)


def answered_states(job_id: str, env: dict[str, str] | None = None, within_s: float = 300.0,
                    every: float = 1.0) -> dict[int, str]:
    """`task_states`, asked again while squeue gives no answer, for up to `within_s` (then QueueUnreadable)."""
    end = time.monotonic() + within_s
    while True:
        try:
            return task_states(job_id, env)
        except QueueUnreadable:
            if time.monotonic() > end:
                raise
            time.sleep(every)


def wait(job_id: str, timeout: float, env: dict[str, str] | None = None, every: float = 1.0) -> dict[int, str]:
    """Poll until no task of the job is active; returns the final states. Raises TimeoutError with the last ones."""
    end = time.time() + timeout
    while True:
        try:
            states = task_states(job_id, env)
        except QueueUnreadable:
            states = {}  # no answer this time: ask again (the timeout bounds a controller that never answers)
        if states and not any(s in ACTIVE for s in states.values()):
            return states
        if time.time() > end:
            raise TimeoutError(f"job {job_id} still active after {timeout:.0f} s: {states}")
        time.sleep(every)


def missing_shards(stage: str, stage_args: list[str], num_shards: int, python: str = sys.executable,
                   cwd: Path | None = None) -> list[int]:
    """Ask the stage itself which of its `num_shards` tasks are not done (`<stage> ... --status`: exit 0 = none,
    exit 1 = missing, printed as `--array=SPEC`). The stage owns the definition of done; we only parse."""
    cmd = [python, "-m", "pipeline", stage, *stage_args, "--num-shards", str(num_shards), "--status"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if res.returncode == 0:
        return []
    found = re.search(r"--array=(\S+)", res.stdout)
    if res.returncode != 1 or not found:
        raise SlurmError(f"`{stage} --status` failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-800:]}")
    return parse_array(found.group(1))
