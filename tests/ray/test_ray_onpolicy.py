"""`gkd onpolicy executor=ray` on the session's Ray cluster (tests/ray/conftest.py): the same training as the local
executor on the same config (the Slurm executor's equality test, for Ray), the engine actors started once per run and
reused by every cycle, and a driver SIGKILLed between cycles that resumes at the next cycle with the same result.

    pytest tests/ray/test_ray_onpolicy.py -s
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from onpolicy_helpers import build_models, overrides, start_and_kill
from safetensors.torch import load_file
from tolerance import assert_layout_close

from pipeline.config import load_config
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.run import run
from pipeline.onpolicy.state import State

pytestmark = pytest.mark.ray
SGD = dict(train_extra={"optimizer": "sgd"}, lr=0.3, min_lr=0.03)  # tests/tolerance.py, rule 1 (as the Slurm test)


def _cfg(models: dict, out: Path, **kw) -> OnPolicyConfig:
    # with the helpers' held-out prompts: the setup (held-out samples, their scores, the initial KL) runs on the
    # actors whose engines the cycles then reuse
    return load_config(OnPolicyConfig, None, overrides(models, out, **{**SGD, **kw}))


def _ray(address: str) -> dict:
    # 0.5 CPU each: the three actors fit the session's 2-CPU cluster beside nothing else
    return dict(executor="ray", ray_address=address, ray_num_cpus=0.5)


def _trained(out: Path, models: dict) -> dict:
    final = load_file(str(out / "exports" / "step-0000004" / "model.safetensors"))
    start = load_file(str(models["student"] / "model.safetensors"))
    return {k: v - start[k] for k, v in final.items()}


def _actors(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "ray" / "actors.jsonl").read_text().splitlines()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_models(tmp_path_factory.mktemp("onpolicy-models"))


@pytest.fixture(scope="module")
def local_run(models, tmp_path_factory) -> Path:
    from pipeline.onpolicy.engines import Engines

    out = tmp_path_factory.mktemp("local")
    engines = Engines()
    try:
        run(_cfg(models, out), engines)
    finally:
        engines.close()
    return out


def test_ray_executor_equals_local(models, local_run, ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    t0 = time.time()
    lines = run(_cfg(models, out, **_ray(ray_cluster)))
    print(f"\n[onpolicy-ray] setup + 2 cycles in {time.time() - t0:.0f} s", file=sys.stderr)
    assert [m["cycle"] for m in lines] == [-1, 0, 1] and all(m["on_policy"] and m["loss"] > 0 for m in lines[1:])
    ray_lines = {m["cycle"]: m for m in lines}
    local = [json.loads(x) for x in (local_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["cycle"] for m in local] == [-1, 0, 1]
    for m in local:
        got = ray_lines[m["cycle"]]
        # held-out KL of the initial student (setup) and after each cycle: the same held-out samples and scores
        assert abs(got["heldout_kl"] - m["heldout_kl"]) <= 1e-3 * abs(m["heldout_kl"]), (got, m)
        if m["cycle"] >= 0:
            assert got["samples"] == m["samples"]
            assert abs(got["loss"] - m["loss"]) <= 1e-3 * abs(m["loss"])  # per-cycle losses
    assert_layout_close(_trained(out, models), _trained(local_run, models), "trained weights")
    # three actors for the run, each started once; the setup and both cycles ran on the same ones, one engine start
    # each (the setup's held-out sampling and scoring opened the engines the cycles reused: no second open)
    started = _actors(out)
    assert sorted(a["role"] for a in started) == ["sampler", "teacher", "trainer"]
    cycles = State.load(out).cycles
    assert cycles["0"]["ray_actors"] == cycles["1"]["ray_actors"]
    seen = cycles["1"]["ray_actors"]
    assert {r: seen[r]["pid"] for r in seen} == {a["role"]: a["pid"] for a in started}
    assert seen["sampler"]["engine_starts"] == 1 and seen["teacher"]["engine_starts"] == 1
    assert cycles["1"]["sync_s"] > 0  # cycle 1's weights were reloaded into the running sampler
    phases = [json.loads(x) for x in (out / "ray" / "driver.jsonl").read_text().splitlines()]
    assert len(phases) == 1 and phases[0]["setup_s"] > 0 and phases[0]["cycles_s"] > 0, phases  # connect_s: ~0 here
    assert _wait_dead(started)  # ended with the run


@pytest.mark.slow  # CI: the Ray executor's strict equality (above) and the overlapped plan on the local executor
def test_overlapped_ray_run_equals_the_local_one(models, ray_cluster, tmp_path, monkeypatch):
    """max_staleness=1 on the three actors: the same plan (cycle.py) as the local executor's role processes, so the
    same samples and, within the tolerance of their thread counts, the same weights; cycle 1 sampled while cycle 0
    trained (the driver's record) and trained on one-version-old rows."""
    monkeypatch.chdir(tmp_path)
    local, out = tmp_path / "local", tmp_path / "ray"
    run(_cfg(models, local, max_staleness=1))
    lines = run(_cfg(models, out, max_staleness=1, **_ray(ray_cluster)))
    local_lines = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("staleness", {}).get("max") for m in lines] == [None, 0.0, 1.0]
    for got, want in zip(lines[1:], local_lines[1:], strict=True):
        assert got["samples"] == want["samples"] and got["staleness"] == want["staleness"]
        assert abs(got["loss"] - want["loss"]) <= 1e-3 * abs(want["loss"]), (got, want)
    assert_layout_close(_trained(out, models), _trained(local, models), "trained weights")
    tasks = State.load(out).cycles
    assert tasks["1"]["tasks"]["generate"]["dispatched"] < tasks["0"]["tasks"]["train"]["received"]


def _wait_dead(actors: list[dict], timeout: float = 600) -> bool:
    """Whether the actors' processes are all gone within `timeout` (a deadline for a hang only: Ray ends the actors
    of a dead driver, which on 2 busy cores takes a while)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(_alive(a["pid"]) for a in actors):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow  # CI: a killed driver's resume on the local and Slurm executors
def test_driver_killed_between_cycles_resumes(models, local_run, ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    values = overrides(models, out, **{**SGD, **_ray(ray_cluster)})
    args = [f"{k}={'null' if v is None else v}" for k, v in values.items()]
    # Killed right after cycle 0 was recorded: the driver's 6th state write (1: the setup, 2-6: cycle 0's export,
    # generate, score, train and eval; the actors write no state.json) stops it (GKD_PAUSE_AT), between the cycles.
    start_and_kill([sys.executable, "-m", "pipeline", "onpolicy", *args], tmp_path, tmp_path / "killed.log",
                   "onpolicy-state:6")
    first = _actors(out)
    killed = State.load(out)
    assert len(first) == 3 and (killed.cycle, killed.stage) == (1, "export"), (killed.cycle, killed.stage)
    assert killed.cycles["0"]["done"] == ["export", "generate", "score", "train", "eval"]
    assert not (out / "rollouts" / "cycle-0001").exists()  # nothing of cycle 1 ran
    assert _wait_dead(first), "the killed driver's actors outlived it"
    t0 = time.time()
    lines = run(_cfg(models, out, **_ray(ray_cluster)))
    print(f"\n[onpolicy-ray] resumed cycle 1 in {time.time() - t0:.0f} s", file=sys.stderr)
    assert [m["cycle"] for m in lines] == [-1, 0, 1]  # neither the setup nor cycle 0 redone
    cycles = State.load(out).cycles
    second = _actors(out)[3:]  # a fresh set for the second driver, used by cycle 1
    phases = [json.loads(x) for x in (out / "ray" / "driver.jsonl").read_text().splitlines()]
    assert len(phases) == 1 and phases[0]["pid"] == os.getpid()  # the killed driver logged nothing; this one did
    assert len(second) == 3 and {a["pid"] for a in second}.isdisjoint({a["pid"] for a in first})
    pids = {c: {a["pid"] for a in cycles[c]["ray_actors"].values()} for c in ("0", "1")}
    assert pids == {"0": {a["pid"] for a in first}, "1": {a["pid"] for a in second}}
    assert_layout_close(_trained(out, models), _trained(local_run, models), "trained weights")
    assert _wait_dead(second)


def test_bad_ray_settings_are_clear_errors_within_seconds(models, ray_cluster, tmp_path):
    """A request no node can hold (Ray would keep the actors pending forever) and an unreachable address: errors
    naming the resource / address and the fix, before any actor or engine starts."""
    from pipeline.ray.cluster import RayError

    # refused before any actor starts (no actors.jsonl, no ray folder), so no wait that could hang: not timed
    with pytest.raises(RayError, match=r"GPU=1 but no node of the cluster has that"):
        run(_cfg(models, tmp_path / "gpu", **{**_ray(ray_cluster), "ray_num_gpus": 1}))
    with pytest.raises(RayError, match=r"3 x CPU=1 must run at once but the cluster has only CPU=2"):
        run(_cfg(models, tmp_path / "cpu", **{**_ray(ray_cluster), "ray_num_cpus": 1}))
    assert not (tmp_path / "gpu" / "ray").exists() and not (tmp_path / "cpu" / "ray").exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    values = overrides(models, tmp_path / "addr", heldout_prompts=None, executor="ray", ray_address=f"127.0.0.1:{port}")
    res = subprocess.run([sys.executable, "-m", "pipeline", "onpolicy",
                          *(f"{k}={'null' if v is None else v}" for k, v in values.items())],
                         capture_output=True, text=True, cwd=tmp_path, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert res.returncode == 1 and f"no Ray cluster reachable at 127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
