"""`gkd slurm` against a real local Slurm (the `slurm_cluster` fixture, tests/conftest.py) with real score tasks on a
tiny vLLM teacher.

    pytest -m slurm tests/slurm -s

Every scenario ends with a complete set of shards (`gkd score --status` exit 0), `gkd cache verify` clean and each
rollout's key exactly once in the cache. Tasks use 1 CPU each, so a 2-core node runs two at a time; scenarios that need no third task use N=2 (each
vLLM start-up costs 15 s on an idle 2-core box, minutes on a loaded one).
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.slurm.queue import ACTIVE, parse_array, task_states, wait
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
        def gkd(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True,
                                  cwd=tmp_path)

        def slurm(self, command: str, *extra: str) -> str:
            res = self.gkd("slurm", command, "--num-shards", str(self.n), "--cpus-per-task", "1", "--log-dir",
                           str(self.logs), *extra, "--", *self.args)
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


def _wait_for(cond, timeout: float = TIMEOUT, what: str = "condition"):
    end = time.time() + timeout
    while time.time() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def _running(job: str) -> list[int]:
    return [i for i, s in task_states(job).items() if s == "RUNNING"]


def test_array_completes(run):
    job = run.slurm("score")
    states = wait(job, TIMEOUT)
    assert states == {i: "COMPLETED" for i in range(N)}, states
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
    job = run.slurm("score")
    _wait_for(lambda: 1 in _running(job), what="task 1 running")
    subprocess.run(["scancel", f"{job}_1"], check=True)
    states = wait(job, TIMEOUT)
    assert states == {0: "COMPLETED", 1: "CANCELLED"}, states
    st = run.status()
    assert st.returncode == 1 and "--array=1\n" in st.stdout + "\n", st.stdout
    again = run.slurm("resubmit")
    assert set(wait(again, TIMEOUT)) == {1}  # only index 1 ran again
    assert "restart 0" in run.log(again, 1) and "[score] task 1/2" in run.log(again, 1)
    run.assert_complete()


def test_node_failure_requeues(run, slurm_cluster):
    run.n = 2
    job = run.slurm("score")
    _wait_for(lambda: _running(job), what="a running task")
    time.sleep(2)  # let it get into the engine start-up
    killed = _running(job)
    node = slurm_cluster.node
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"], check=True)
    try:
        # ReturnToService=2: the node comes back when its slurmd re-registers (about a second here); resume if not
        _wait_for(lambda: "down" not in slurm_cluster.node_state(), 20, "node back up")
    except TimeoutError:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=True)
    states = wait(job, TIMEOUT)
    assert states == {i: "COMPLETED" for i in range(run.n)}, states
    for i in killed:  # the killed tasks ran again in the same job, the log shows both attempts
        log = run.log(job, i)
        assert "restart 0" in log and "restart 1" in log and "NODE FAILURE" in log, log[-2000:]
    run.assert_complete()


def test_cancelled_array_resubmit_skips_finished(run):
    job = run.slurm("score")
    done = _wait_for(lambda: run.markers(), what="a finished task")
    subprocess.run(["scancel", job], check=True)
    states = wait(job, TIMEOUT)
    before = run.markers()
    assert before.keys() >= done.keys() and len(before) < N, (states, list(before))
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


def test_train_torchrun_one_node(tmp_path, slurm_cluster):
    """torchrun from Slurm's variables: 1 node, 1 process (the CPU case), rendezvous on the allocation's head."""
    out = tmp_path / "out"
    script = Path(__file__).with_name("_torchrun_env.py")
    res = subprocess.run([sys.executable, "-m", "pipeline", "slurm", "train", "--nodes", "1", "--nproc-per-node", "1",
                          "--cpus-per-task", "1", "--log-dir", str(tmp_path / "logs"), "--script", str(script),
                          "--", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    states = wait(job, 300)
    log = (tmp_path / "logs" / f"gkd-train-{job}.log").read_text()
    assert states == {-1: "COMPLETED"}, log[-3000:]
    env = json.loads((out / "rank0.json").read_text())
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0" and env["GROUP_RANK"] == "0"
    assert env["TORCHELASTIC_RUN_ID"] == job and env["SLURM_NNODES"] == "1" and env["allreduce"] == 1.0
    assert env["MASTER_PORT"] and slurm_cluster.node in log  # rendezvous on the first host of the allocation
    assert not any(s in ACTIVE for s in task_states(job).values())


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
    states = wait(job, 600)
    log = (tmp_path / "logs" / f"gkd-train-{job}.log").read_text()
    assert states == {-1: "COMPLETED"}, log[-3000:]
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] > 0 and m["active_tokens"] > 0 for m in metrics)
    assert (save / "latest").read_text().strip() == "step_0000002"
    assert json.loads((save / "step_0000002" / "trainer.json").read_text())["step"] == 2
