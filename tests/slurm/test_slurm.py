"""`gkd slurm` against a real local Slurm (the `slurm_cluster` fixture, tests/conftest.py) with real score tasks on a
tiny vLLM teacher.

    pytest -m slurm tests/slurm -s

Every scenario ends with a complete set of shards (`gkd score --status` exit 0), `gkd cache verify` clean and each
rollout's key exactly once in the cache. Tasks use 1 CPU each, so a 2-core node runs two at a time; scenarios that need no third task use N=2 (each
vLLM start-up costs 15 s on an idle 2-core box, minutes on a loaded one).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import killing
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline import pause
from pipeline.slurm.queue import ACTIVE, QueueUnreadable, answered_states, parse_array, task_states, wait
from pipeline.store import TeacherCache
from pipeline.store.rollouts import rollout_row, write_rollouts

pytestmark = pytest.mark.slurm

N = 3
ROWS = 16  # keys hash to tasks as 9/6/1 (N=3) and 10/6 (N=2): every task has work
TIMEOUT = 900  # per array; a loaded 2-core box needs minutes for a few vLLM start-ups
# each task starts a vLLM engine in ~10-15 s on an idle box: no compile, tiny KV cache, fp32
ENGINE = ["enforce_eager=true", "kv_cache_gib=0.05", "dtype=float32", "max_model_len=32", "part_rows=2",
          "batch_tokens=64"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from tiny_models import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"), scale=30.0, max_pos=64)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, teacher):
    from pipeline.store.fingerprint import tokenizer_fingerprint

    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("rollouts")
    rows = [rollout_row(prompt_id=f"q{i}", prompt_ids=rng.integers(3, 384, 5).tolist(),
                        completion_ids=rng.integers(3, 384, 8).tolist(), source="dataset") for i in range(ROWS)]
    write_rollouts(root / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    return root


@pytest.fixture
def run(tmp_path, teacher, rollouts, slurm_cluster):
    """One scenario: its own cache and log dir; helpers to call `gkd` as users do."""

    class Run:
        n = N
        cache = tmp_path / "cache"
        logs = tmp_path / "logs"
        args = ["--rollouts", str(rollouts), "--cache", str(cache), "--teacher", str(teacher), "--topk", "4", *ENGINE]

        @staticmethod
        def gkd(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True,
                                  cwd=tmp_path, env={**os.environ, **(env or {})})

        def slurm(self, command: str, *extra: str, pause_at: str | None = None) -> str:
            """`gkd slurm COMMAND`; `pause_at`: every task of the job stops itself there ($GKD_PAUSE_AT, which
            sbatch passes on to the job: pipeline/pause.py), once per attempt, until `_drive` lets it go on."""
            res = self.gkd("slurm", command, "--num-shards", str(self.n), "--cpus-per-task", "1", "--log-dir",
                           str(self.logs), *extra, "--", *self.args, env={pause.ENV: pause_at} if pause_at else None)
            assert res.returncode == 0, res.stderr
            return res.stdout.strip()

        def status(self) -> subprocess.CompletedProcess:
            return self.gkd("score", *self.args, "--num-shards", str(self.n), "--status")

        def markers(self) -> dict[str, tuple[int, bytes]]:
            return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (self.cache / "tasks").glob("*.done")}

        def log(self, job: str, index: int) -> str:
            return (self.logs / f"gkd-score-{job}_{index}.log").read_text()

        def assert_complete(self) -> None:
            st = self.status()
            assert st.returncode == 0, st.stdout + st.stderr
            verify = self.gkd("cache", "verify", str(self.cache))
            assert verify.returncode == 0, verify.stderr
            cache = TeacherCache.open(self.cache)
            keys = [k for p in cache.shard_paths() for k in pq.read_table(p, columns=["key"]).column("key").to_pylist()]
            assert len(keys) == len(set(keys)) == ROWS  # every rollout once: nothing lost, nothing scored twice
            assert len(self.markers()) == self.n

    return Run()


def _job_procs(job: str) -> dict[int, tuple[int, int, str]]:
    """The processes of array job `job` (the local cluster runs its jobs on this machine), by the Slurm variables
    in their environment: pid -> (array index, restart count, state letter; T: stopped at its pause point). Only this
    session's cluster's (its SLURM_CONF): another local cluster on the machine numbers its jobs from 1 too."""
    conf = os.environ["SLURM_CONF"].encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if (env.get(b"SLURM_ARRAY_JOB_ID") == job.encode() and env.get(b"SLURM_CONF") == conf
                and (state := killing.state(int(d.name))) is not None):
            found[int(d.name)] = (int(env[b"SLURM_ARRAY_TASK_ID"]), int(env.get(b"SLURM_RESTART_COUNT", b"0")), state)
    return found


def _stopped_tasks(job: str) -> set[int]:
    return {i for i, _, state in _job_procs(job).values() if state == "T"}


def _drive(job: str, hold=lambda index, restart: False, until=None, timeout: float = TIMEOUT):
    """Wait until `until()` is truthy (its value returned; the job must not end before) or, without `until`, until
    no task of the job is active (its final states returned). Meanwhile every process of the job stopped at its
    pause point is let go on (SIGCONT) unless `hold(array index, restart count)`: a held task waits, stopped, for
    the test, so what the test does to it lands exactly at that point however busy the machine. The deadline only
    bounds a hang."""
    deadline = time.monotonic() + timeout
    while True:
        states = answered_states(job)
        ended = bool(states) and not any(s in ACTIVE for s in states.values())
        if until is None and ended:
            return states
        if until is not None and (value := until()):
            return value
        assert not ended, f"job {job} ended before the state the test waits for: {states}"
        assert time.monotonic() < deadline, f"job {job}: not there after {timeout:.0f} s: {states}"
        for pid, (index, restart, state) in _job_procs(job).items():
            if state == "T" and not hold(index, restart):
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)


def _node_up(slurm_cluster) -> bool:
    return "down" not in slurm_cluster.node_state()


def _recorded(cluster, job: str, states: dict[int, str]) -> dict[int, str]:
    """The job's tasks as the cluster's job-completion log has them (LocalSlurm.finished), once it has as many as
    `states` (each record is written as its task ends; the deadline only bounds a hang)."""
    deadline = time.monotonic() + TIMEOUT
    while len(found := cluster.finished(job)) < len(states) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def test_array_completes(run, slurm_cluster):
    job = run.slurm("score")
    states = wait(job, TIMEOUT)
    assert states == {i: "COMPLETED" for i in range(N)}, states
    # what squeue forgets MinJobAge after the end, the job-completion log keeps: the same outcome, task by task
    assert _recorded(slurm_cluster, job, states) == states
    run.assert_complete()
    script = (run.logs / "gkd-score.sbatch").read_text()
    assert "#SBATCH --array=0-2" in script and "#SBATCH --requeue" in script
    for i in range(N):
        assert f"[score] task {i}/{N}" in run.log(job, i)
    # nothing missing: resubmit submits nothing
    res = run.gkd("slurm", "resubmit", "--num-shards", str(N), "--log-dir", str(run.logs), "--", *run.args)
    assert res.returncode == 0 and res.stdout == "" and "nothing to resubmit" in res.stderr, res.stderr


def test_cancelled_task_is_resubmitted_alone(run):
    run.n = 2
    job = run.slurm("score", pause_at="cache-commit:1")
    # task 1 held right after its first part (3 parts): cancelled mid-task, it cannot have finished
    _drive(job, hold=lambda i, _: i == 1, until=lambda: 1 in _stopped_tasks(job))
    subprocess.run(["scancel", f"{job}_1"], check=True)
    states = _drive(job, hold=lambda i, _: i == 1)  # task 0 goes on to its end
    assert states == {0: "COMPLETED", 1: "CANCELLED"}, states
    st = run.status()
    assert st.returncode == 1 and "--array=1\n" in st.stdout + "\n", st.stdout
    again = run.slurm("resubmit")
    assert set(wait(again, TIMEOUT)) == {1}  # only index 1 ran again
    assert "restart 0" in run.log(again, 1) and "[score] task 1/2" in run.log(again, 1)
    run.assert_complete()


@pytest.mark.slow  # CI: a cancelled task resubmitted alone (above); here the requeue of a failed node's tasks
def test_node_failure_requeues(run, slurm_cluster):
    run.n = 2
    job = run.slurm("score", pause_at="cache-commit:1")
    # the node fails while task 0 (and task 1 too where the node has a CPU for it) is held mid-task, right after
    # its first part: neither can have finished
    _drive(job, hold=lambda i, _: True, until=lambda: 0 in _stopped_tasks(job))
    killed = sorted(_stopped_tasks(job))
    node = slurm_cluster.node
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"], check=True)
    # ReturnToService=2: the node comes back when its slurmd re-registers (about a second here); resumed by hand if
    # that is slow (check=False: it may come back between the look and the command); then its state is waited on
    deadline = time.monotonic() + 60
    while not _node_up(slurm_cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not _node_up(slurm_cluster):
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    deadline = time.monotonic() + TIMEOUT
    while not _node_up(slurm_cluster):
        assert time.monotonic() < deadline, f"node {node} still down: {slurm_cluster.node_state()}"
        time.sleep(0.5)
    # the requeued attempts (restart 1) go on from their own pause; the first ones must die of the node failure
    states = _drive(job, hold=lambda _, restart: restart == 0)
    assert states == {i: "COMPLETED" for i in range(run.n)}, states
    for i in killed:  # the killed tasks ran again in the same job, the log shows both attempts
        log = run.log(job, i)
        assert "restart 0" in log and "restart 1" in log and "NODE FAILURE" in log, log[-2000:]
    run.assert_complete()


@pytest.mark.slow  # CI: a cancelled task resubmitted alone (above); here a whole array's, skipping finished tasks
def test_cancelled_array_resubmit_skips_finished(run):
    # rows per task 9/6/1, 2 per part: tasks 0 and 1 stop after their 2nd part, task 2 (1 part) never stops
    job = run.slurm("score", pause_at="cache-commit:2")
    # task 0 held mid-task until the cancel; the others go on until one has finished (its marker)
    _drive(job, hold=lambda i, _: i == 0, until=lambda: 0 in _stopped_tasks(job))
    done = _drive(job, hold=lambda i, _: i == 0, until=run.markers)
    subprocess.run(["scancel", job], check=True)
    states = wait(job, TIMEOUT)
    before = run.markers()
    assert before.keys() >= done.keys() and len(before) < N, (states, list(before))
    assert not any(name.endswith(f"-00000-of-{N:05d}.done") for name in before), list(before)  # task 0: cancelled
    st = run.status()
    missing = parse_array(re.search(r"--array=(\S+)", st.stdout).group(1))
    again = run.slurm("resubmit")
    final = wait(again, TIMEOUT)
    assert sorted(final) == sorted(missing) and set(final.values()) == {"COMPLETED"}, final
    after = run.markers()
    assert {k: after[k] for k in before} == before  # finished tasks' markers untouched: not redone
    assert sorted(p.name for p in run.logs.glob(f"gkd-score-{again}_*.log")) == [
        f"gkd-score-{again}_{i}.log" for i in sorted(missing)]
    run.assert_complete()


@pytest.mark.slow  # CI: the real trainer under Slurm's torchrun (below) checks the same rendezvous
def test_train_torchrun_one_node(tmp_path, slurm_cluster):
    """torchrun from Slurm's variables: 1 node, 1 process (the CPU case), rendezvous on the allocation's head."""
    out = tmp_path / "out"
    script = Path(__file__).with_name("_torchrun_env.py")
    res = subprocess.run([sys.executable, "-m", "pipeline", "slurm", "train", "--nodes", "1", "--nproc-per-node", "1",
                          "--cpus-per-task", "1", "--log-dir", str(tmp_path / "logs"), "--script", str(script),
                          "--", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    states = wait(job, TIMEOUT)  # a deadline for a hang only
    log = (tmp_path / "logs" / f"gkd-train-{job}.log").read_text()
    assert states == {-1: "COMPLETED"}, log[-3000:]
    env = json.loads((out / "rank0.json").read_text())
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0" and env["GROUP_RANK"] == "0"
    assert env["TORCHELASTIC_RUN_ID"] == job and env["SLURM_NNODES"] == "1" and env["allreduce"] == 1.0
    assert env["MASTER_PORT"] and slurm_cluster.node in log  # rendezvous on the first host of the allocation
    assert not any(s in ACTIVE for s in answered_states(job).values())


def test_train_step_under_slurm_torchrun(tmp_path, slurm_cluster):
    """The real trainer as a Slurm job (`gkd slurm train`, torchrun from Slurm's variables, 1 node, 1 process): two
    optimizer steps on a tiny cache, their metrics and the final checkpoint on disk, the job COMPLETED."""
    from tiny_cache import build_tiny, random_samples, score_into_cache
    from transformers import AutoConfig

    teacher, student = build_tiny(tmp_path / "teacher"), build_tiny(tmp_path / "student", seed=1)
    score_into_cache(teacher, tmp_path / "cache", random_samples(8, AutoConfig.from_pretrained(teacher).vocab_size))
    save = tmp_path / "run"
    args = [f"student={student}", f"cache=[{tmp_path / 'cache'}]", "micro_batch_size=2", "global_batch_size=4",
            "seq_length=32", "train_steps=2", "warmup_steps=1", "lr=1e-3", f"save_dir={save}", "progress=false"]
    res = subprocess.run([sys.executable, "-m", "pipeline", "slurm", "train", "--nodes", "1", "--nproc-per-node", "1",
                          "--cpus-per-task", "1", "--log-dir", str(tmp_path / "logs"), "--", *args],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    states = wait(job, TIMEOUT)  # a deadline for a hang only
    log = (tmp_path / "logs" / f"gkd-train-{job}.log").read_text()
    assert states == {-1: "COMPLETED"}, log[-3000:]
    assert _recorded(slurm_cluster, job, states) == states  # a plain job: index -1, as squeue gives it
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] > 0 and m["active_tokens"] > 0 for m in metrics)
    assert (save / "latest").read_text().strip() == "step_0000002"
    assert json.loads((save / "step_0000002" / "trainer.json").read_text())["step"] == 2


def test_a_queue_that_gives_no_answer_is_not_an_ended_job(slurm_cluster, tmp_path):
    """Was: any squeue failure read as "no task of the job active", so on a loaded machine, where the controller
    timed out a poll, the on-policy driver took a running score job for ended and failed the run. Now a job the
    controller does not know is an answer ({}), a controller that does not answer raises QueueUnreadable (the driver
    polls again: `SlurmDriver.settled`), and `answered_states` asks again until it answers or its time is up."""
    assert task_states("999999") == {}  # squeue: "Invalid job id specified"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = Path(slurm_cluster.env()["SLURM_CONF"]).read_text()
    dead = tmp_path / "slurm.conf"
    dead.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={port}", conf))
    env = {"SLURM_CONF": str(dead)}
    with pytest.raises(QueueUnreadable, match=r"squeue -j 1 \(exit 1\): .*Unable to contact slurm controller"):
        task_states("1", env)
    with pytest.raises(QueueUnreadable):
        answered_states("1", env, within_s=0)


def test_a_cluster_whose_pid_files_are_gone_is_still_found_running(slurm_cluster):
    """Was: a cluster knew its daemons only by their pid files, so after its folder was deleted under it (a killed
    suite, then `rm -rf /tmp/pytest-of-root`) a new cluster in the same recreated path started beside the old
    daemons, sharing their state directory and munge socket; stopping the orphans then broke the new cluster. Now
    the process table is read too: the live daemons are found, a start there is refused naming them."""
    from pipeline.slurm.local import LocalSlurm

    by_files = slurm_cluster.daemons()
    assert set(by_files) == {"munged", "slurmctld", "slurmd"}
    run = slurm_cluster.root / "run"
    hidden = run.with_name("run-hidden")
    run.rename(hidden)  # the pid files gone, the daemons alive (they do not reread them)
    try:
        again = LocalSlurm(slurm_cluster.root)
        assert again.daemons() == by_files
        with pytest.raises(RuntimeError, match=rf"already running under {re.escape(str(slurm_cluster.root))} .*"
                                               rf"slurmctld {by_files['slurmctld']}"):
            again.start()
        assert LocalSlurm(slurm_cluster.root.with_name(slurm_cluster.root.name + "x")).daemons() == {}
    finally:
        hidden.rename(run)
    assert slurm_cluster.daemons() == by_files  # untouched
