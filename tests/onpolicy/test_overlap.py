"""Overlapped on-policy cycles on the local executor (max_staleness=1): the sampler, the teacher and the trainer in
processes of their own, with real engines on tiny models. The staleness each cycle trained on is read from its rows,
the overlap from the driver's record, and a driver or a role killed mid-overlap resumes to the same weights.
(max_staleness=0 is the strict order: tests/onpolicy/test_onpolicy_run.py and the executor equality tests.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import killing
import pytest
import torch
from onpolicy_helpers import overrides, start_and_kill
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.lifetime import descendants, survivors
from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.run import run
from pipeline.onpolicy.state import State
from pipeline.store.rollouts import iter_rollouts, rollout_shards

REPO = Path(__file__).resolve().parents[2]
# fresh sampling seeds per cycle (seed + cycle): cycle 1, sampled with the same weights as cycle 0 at staleness 1,
# would otherwise repeat cycle 0's samples exactly, and the teacher would have nothing new to score
STALE = {"max_staleness": 1, "generate_seed": None}


def _cfg(models: dict, out: Path, **kw) -> OnPolicyConfig:
    return load_config(OnPolicyConfig, None, overrides(models, out, **{**STALE, **kw}))


def _args(models: dict, out: Path) -> list[str]:
    values = overrides(models, out, **STALE)
    return [sys.executable, "-m", "pipeline.cli", "onpolicy",
            *(f"{k}={'null' if v is None else v}" for k, v in values.items())]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "exports" / "step-0000004" / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train_steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def overlapped(models, tmp_path_factory) -> Path:
    """The uninterrupted 2-cycle run at max_staleness=1 that the killed runs are compared with."""
    out = tmp_path_factory.mktemp("overlapped")
    run(_cfg(models, out))
    return out


def test_staleness_1_trains_on_one_version_old_samples_and_overlaps(overlapped):
    lines = [json.loads(x) for x in (overlapped / "metrics.jsonl").read_text().splitlines()]
    assert [m["cycle"] for m in lines] == [-1, 0, 1]
    # cycle 1 was sampled with the weights cycle 0 started from (step 0), while cycle 0 trained
    assert [m["policy_version"] for m in lines[1:]] == [0, 0]
    rows = list(iter_rollouts(rollout_shards(overlapped / "rollouts" / "cycle-0001")))
    assert rows and {r["policy_version"] for r in rows} == {0}
    # the staleness each cycle trained on, read from its view's rows: 0 then 1 version (never more than N = 1)
    assert lines[1]["staleness"] == {"min": 0.0, "mean": 0.0, "max": 0.0}
    assert lines[2]["staleness"] == {"min": 1.0, "mean": 1.0, "max": 1.0}
    assert all(m["loss"] > 0 for m in lines[1:]) and lines[-1]["heldout_kl"] < lines[0]["heldout_kl"]
    state = State.load(overlapped)
    assert (state.cycle, state.stage) == (2, "export")
    assert all(state.cycles[c]["done"] and set(state.cycles[c]["done"]) == set(STAGES) for c in ("0", "1"))
    tasks = {c: state.cycles[c]["tasks"] for c in ("0", "1")}
    # the driver handed cycle 1's generate to the sampler before cycle 0's train came back: both were in flight
    assert tasks["1"]["generate"]["dispatched"] < tasks["0"]["train"]["received"]
    roles = {t["role"] for c in tasks.values() for t in c.values()}
    assert roles == {"sampler", "teacher", "trainer"}
    assert _train_steps(overlapped) == [1, 2, 3, 4]
    # and each train step, in optimizer steps (2 a cycle): cycle 1's rows come from step 0's weights, 2 steps back
    train = [json.loads(x) for x in (overlapped / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["staleness"]["min"], m["staleness"]["max"]) for m in train] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_driver_killed_mid_overlap_resumes_to_the_same_weights(models, overlapped, tmp_path):
    # the driver's 5th state write: the setup and 4 tasks recorded (cycle 0's export, cycle 1's export, and two
    # of the tasks racing after them), with the sampler or the teacher busy: the kill lands mid-overlap
    start_and_kill(_args(models, tmp_path), REPO, tmp_path / "killed.log", "onpolicy-state:5")
    killed = State.load(tmp_path)
    recorded = {(c, s) for c, info in killed.cycles.items() for s in info["done"]}
    assert len(recorded) == 4, recorded
    run(_cfg(models, tmp_path))
    assert _same(_weights(tmp_path), _weights(overlapped))
    assert _train_steps(tmp_path) == [1, 2, 3, 4]  # nothing trained twice
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["cycle"] for m in lines] == [-1, 0, 1]


# slow (`make test-slow`, 2-3 min each on 2 cores): CI checks the overlapped resume with the driver killed (above)
@pytest.mark.slow
@pytest.mark.parametrize("role,pause_at", [
    ("trainer", "train-step:3"),  # cycle 1's first optimizer step: mid-train
    ("sampler", "rollout-shard:3"),  # the held-out samples, cycle 0's, then cycle 1's rollout shard written
    ("teacher", "cache-commit:3"),  # the held-out part, cycle 0's, then cycle 1's part committed
])
def test_a_role_killed_mid_overlap_resumes_to_the_same_weights(models, overlapped, tmp_path, role, pause_at):
    """kill -9 of one role process, stopped at a point of its own work: the driver ends with a message naming the
    role, nothing it started survives, and a rerun gives the same weights with nothing trained twice."""
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = killing.start(_args(models, tmp_path), pause_at, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT)
        try:
            stopped = killing.wait_stopped(proc, deadline_s=2 * killing.DEADLINE_S)
            assert stopped != proc.pid  # the role process stopped itself, not the driver
            below = descendants(proc.pid)
            os.kill(stopped, 9)
            rc = proc.wait(timeout=1800)  # a hang bound only
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert rc == 1 and f"the {role} process died during" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    left = survivors(below, wait_s=600)  # a hang bound: engines die slowly on 2 busy cores
    assert not left, f"processes of the failed command survived it: {left}"
    if role == "trainer":
        assert _train_steps(tmp_path) == [1, 2, 3]  # step 3 is in no checkpoint: redone
    run(_cfg(models, tmp_path))
    assert _same(_weights(tmp_path), _weights(overlapped))
    assert _train_steps(tmp_path) == [1, 2, 3, 4]  # the lost step's line replaced, nothing trained twice


def test_a_role_process_that_dies_mid_task_ends_the_run_naming_it(models, tmp_path):
    """The driver's side of a role's death (the kills above are `slow`): real spawned role processes, one of which
    exits in the middle of its task; waiting on it raises RoleDied naming the role and the task, and closing ends
    every role process. (`dict` stands in for the engines, which no task here uses.)"""
    from pipeline.onpolicy import local
    from pipeline.onpolicy.cycle import Task
    from pipeline.onpolicy.stages import Workspace

    cfg = _cfg(models, tmp_path / "out")
    roles = local.RoleProcesses(cfg, Workspace.open(cfg), dict)
    try:
        for pool in roles.pools.values():  # each role process started (a deadline for a hang only)
            pool.submit(os.getpid).result(timeout=1800)
        procs = {p.pid: p for pool in roles.pools.values() for p in pool._processes.values()}
        assert len(procs) == 3
        roles.futures[roles.pools["teacher"].submit(os._exit, 9)] = (Task(1, "score"), "teacher")
        with pytest.raises(local.RoleDied, match=r"^the teacher process died during cycle 1 score \(killed, or out of "
                                                 r"memory\); state is saved, rerun the same command to continue$"):
            roles.wait()
    finally:
        roles.close()
    assert not [pid for pid, p in procs.items() if p.is_alive()]


class _StandIn:
    """A module-level (picklable) engines stand-in, as a benchmark's replayed engines are."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


def test_role_processes_build_their_engines_with_the_factory_given(models, tmp_path):
    """run_local's `role_engines` reaches each role process's initializer (benchmarks/overlap_bench.py replays
    engines through it); checked on the initializer itself, without starting processes."""
    import functools
    import pickle

    from pipeline.onpolicy import local

    factory = functools.partial(_StandIn, "replayed")
    pickle.dumps(factory)  # it travels to spawned processes
    threads = torch.get_num_threads()
    try:
        local._role_init(_cfg(models, tmp_path / "out"), "sampler", threads, factory)
        assert isinstance(local._HOST["engines"], _StandIn) and local._HOST["engines"].tag == "replayed"
    finally:
        local._HOST.clear()
        torch.set_num_threads(threads)


def test_opd_at_staleness_1_keeps_the_samplers_logprobs_for_its_importance_weights(models, tmp_path):
    """loss=opd at max_staleness=1 (importance-weighted, losses/reference.py `opd_advantage`): the sampler records
    its logprob of every token it sampled, the teacher's cache keeps them with each row, and the trainer's
    micro-batches carry them on their labels; the trainer trains cycle 1 on samples one version old."""
    import pyarrow.parquet as pq

    from pipeline.train.data.loader import ScoredLoader

    run(_cfg(models, tmp_path, loss="opd"))
    sampled = {}
    for cycle in (0, 1):
        for r in iter_rollouts(rollout_shards(tmp_path / "rollouts" / f"cycle-{cycle:04d}")):
            lp = r["completion_logprobs"]
            assert lp is not None and len(lp) == len(r["completion_ids"]) and max(lp) <= 0
            sampled[r["sample_id"]] = lp
    kept = 0
    for shard in sorted((tmp_path / "cache" / "shards").glob("*.parquet")):
        table = pq.read_table(shard, columns=["sample_id", "source", "completion_logprobs"])
        for sid, source, lp in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
            if sid in sampled:  # the held-out set's rows (scored for the held-out KL) are sampled too
                assert source == "student" and lp == pytest.approx(sampled[sid], abs=0, rel=1e-7)
                kept += 1
    assert kept == len(sampled)
    view = tmp_path / "views" / "cycle-0001"
    mb = ScoredLoader([view], micro_batch_size=4, seq_length=320, seed=0, actual=True).micro_batch(0)
    recorded = mb.behavior.logprobs[mb.loss_mask]
    assert recorded.numel() and bool(recorded.isfinite().all())  # every trained position has its weight's input
    train = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["staleness"]["min"], m["staleness"]["max"]) for m in train] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert all(m["jsd"] == 0.0 and math.isfinite(m["opd"]) for m in train)
