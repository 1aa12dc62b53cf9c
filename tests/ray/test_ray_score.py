"""`gkd ray score|generate` on the session's real Ray cluster (tests/ray/conftest.py) with real vLLM score tasks on
a tiny teacher: 4 shard tasks equal an unsharded `gkd score` key by key, also when a worker is SIGKILLed mid-task
(Ray retries it; the retry keeps the parts written before the kill); a rerun launches only missing tasks; bad input
is a clear error, refused before any task is launched.

    pytest tests/ray/test_ray_score.py -s
"""

from __future__ import annotations

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
from full_disk import leftovers

from pipeline import pause
from pipeline.store import TeacherCache
from pipeline.store.rollouts import rollout_row, write_rollouts
from pipeline.store.shards import marker_path

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[2]
N = 4
ROWS = 48  # ~12 per task: with part_rows=1 each task writes a part per row, a window to kill it mid-task
# each task starts a vLLM engine in ~10-15 s on an idle box: no compile, tiny KV cache, fp32; one row per batch, so
# sharded and unsharded runs make the same forwards (bit-equal rows)
ENGINE = ["enforce_eager=true", "kv_cache_gib=0.05", "dtype=float32", "max_model_len=32", "part_rows=1",
          "batch_tokens=16"]
TIMEOUT = 900  # a deadline for a hang only: each task starts an engine, on 2 busy cores


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


def _gkd(*argv: str, cwd: Path, timeout: float = TIMEOUT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _args(rollouts: Path, cache: Path, teacher: Path) -> list[str]:
    return ["--rollouts", str(rollouts), "--cache", str(cache), "--teacher", str(teacher), "--topk", "4", *ENGINE]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, teacher, rollouts) -> Path:
    """One uninterrupted `gkd score` task: the reference."""
    tmp = tmp_path_factory.mktemp("unsharded")
    res = _gkd("score", *_args(rollouts, tmp / "cache", teacher), cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "cache"


def _samples(cache: Path) -> dict:
    c = TeacherCache.open(cache)
    keys = [k for p in c.shard_paths() for k in pq.read_table(p, columns=["key"]).column("key").to_pylist()]
    assert len(keys) == len(set(keys)), "a key was written twice"
    return {s.key: s for s in c.iter_samples()}


def _assert_equal_by_key(cache: Path, reference: Path) -> None:
    got, want = _samples(cache), _samples(reference)
    assert got.keys() == want.keys() and len(got) == ROWS
    for key, s in got.items():
        for field in ("topk_ids", "topk_logprobs", "actual_logprobs", "actual_ranks"):
            np.testing.assert_array_equal(getattr(s, field), getattr(want[key], field), err_msg=field)
    assert TeacherCache.open(cache).verify() == []
    assert leftovers(cache) == [] and not list(cache.rglob("*.lock"))  # no temporary file, no lock left


PAUSE = 3  # every score worker stops itself (GKD_PAUSE_AT) right after its 3rd committed part (of ~12)


def _score_workers() -> dict[int, tuple[int, str]]:
    """The Ray workers running a `gkd-score-I-of-N` task (Ray sets the process title to `ray::<task name>`):
    pid -> (I, state letter)."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                title = (d / "cmdline").read_bytes().split(b"\0")[0].decode()
            except (OSError, UnicodeDecodeError):
                continue
            m = re.fullmatch(rf"ray::gkd-score-(\d+)-of-{N}", title)
            if m and (state := killing.state(int(d.name))) is not None:
                found[int(d.name)] = (int(m.group(1)), state)
    return found


def _parts(cache: Path, task: int) -> list[str]:
    """The complete parts (marker written) task `task` has published."""
    shards = cache / "shards"
    return sorted(p.name[: -len(".parquet")] for p in shards.glob(f"scored-*-{task:05d}-of-{N:05d}-p*.parquet")
                  if marker_path(p).exists())


def test_ray_score_survives_a_killed_worker_and_equals_unsharded(ray_cluster, teacher, rollouts, unsharded, tmp_path):
    """The first score worker to stop at its pause point is SIGKILLed there (mid-task, 3 parts published, no task
    marker), every other stop is let go on (the other tasks, and the retry of the killed one): the workers are not
    descendants of the `gkd ray` command, so they are found by their Ray process title, but they wait, stopped,
    for the test, so no poll can come too late."""
    cache = tmp_path / "cache"
    args = _args(rollouts, cache, teacher)
    cmd = [sys.executable, "-m", "pipeline", "ray", "score", "--num-shards", str(N), "--address", ray_cluster,
           "--max-retries", "2", "--", *args]
    t0 = time.time()
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        # runtime_env hands $GKD_PAUSE_AT to the workers (pipeline/ray/cluster.py); the command itself commits nothing
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO), pause.ENV: f"cache-commit:{PAUSE}"})
        killed = None
        try:
            deadline = time.monotonic() + 3 * TIMEOUT  # the whole command: 4 tasks and a retry, 2 at a time
            while proc.poll() is None:
                assert time.monotonic() < deadline, "gkd ray score did not end\n" + log.read_text()[-3000:]
                for pid, (i, state) in _score_workers().items():
                    if state != "T":
                        continue
                    if killed is None:
                        killed = (i, _parts(cache, i))  # stopped: nothing more of it can appear
                        os.kill(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGCONT)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert killed is not None, "no score worker stopped at its pause point\n" + text[-3000:]
    assert proc.returncode == 0, text[-3000:]
    print(f"\n[ray] 4 score tasks, task {killed[0]} killed, in {time.time() - t0:.0f} s", file=sys.stderr)
    _assert_equal_by_key(cache, unsharded)
    # the retry resumed after the killed attempt's last complete part: the parts published before the kill are
    # its marker's first parts, kept as they were, and the retry added the rest
    assert len(killed[1]) == PAUSE, killed
    marker = next((cache / "tasks").glob(f"*-{killed[0]:05d}-of-{N:05d}.done"))
    parts = json.loads(marker.read_text())["parts"]
    assert parts[:PAUSE] == killed[1] and len(parts) > PAUSE, (parts, killed)
    assert f"task {killed[0]}/{N} done" in text and "all 4 tasks done" in text
    # a rerun finds every task done and starts nothing (not even a connection)
    again = _gkd("ray", "score", "--num-shards", str(N), "--address", ray_cluster, "--", *args, cwd=tmp_path)
    assert again.returncode == 0 and "all 4 tasks are done; nothing to run" in again.stderr, again.stderr
    # task 1's output lost (marker and parts): the rerun launches task 1 alone; the others' markers are untouched
    lost = next((cache / "tasks").glob(f"*-00001-of-{N:05d}.done"))
    for p in json.loads(lost.read_text())["parts"]:
        for f in (cache / "shards" / f"{p}.parquet", marker_path(cache / "shards" / f"{p}.parquet")):
            f.unlink()
    lost.unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in (cache / "tasks").glob("*.done")}
    again = _gkd("ray", "score", "--num-shards", str(N), "--address", ray_cluster, "--", *args, cwd=tmp_path)
    assert again.returncode == 0 and "1 of 4 tasks (--array=1)" in again.stderr, again.stderr[-3000:]
    assert "task 1/4 done" in again.stderr and "task 0/4" not in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (cache / "tasks").glob("*.done") if p.name in kept} == kept
    _assert_equal_by_key(cache, unsharded)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_input_is_a_clear_error_within_seconds(ray_cluster, teacher, rollouts, tmp_path):
    args = _args(rollouts, tmp_path / "cache", teacher)
    port = _free_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        # refused by the probe, before Ray tries to connect (Ray's own connection error reads differently)
        res = _gkd("ray", "score", "--num-shards", "2", "--address", address, "--", *args, cwd=tmp_path)
        assert res.returncode == 2 and f"no Ray cluster reachable at {address}" in res.stderr, res.stderr
        assert "--address local" in res.stderr and "Traceback" not in res.stderr
    # a resource no node has: Ray would wait forever; refused before any task is launched (the timeout of `_gkd`
    # bounds a hang only)
    res = _gkd("ray", "score", "--num-shards", "2", "--num-gpus", "1", "--address", ray_cluster, "--", *args,
               cwd=tmp_path)
    assert res.returncode == 2 and "GPU=1" in res.stderr and "no node of the cluster has that" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "tasks (--array=" not in res.stderr
    res = _gkd("ray", "score", "--num-shards", "2", "--num-cpus", "64", "--address", ray_cluster, "--", *args,
               cwd=tmp_path)
    assert res.returncode == 2 and "CPU=64" in res.stderr and "CPU=2" in res.stderr, res.stderr
    res = _gkd("ray", "score", "--num-shards", "2", "--address", ray_cluster, "--", *args, "--shard", "1",
               cwd=tmp_path)
    assert res.returncode == 2 and "must not set --shard" in res.stderr, res.stderr
    # a task that fails on its own input is reported with the stage's message, not retried, exit 1
    res = _gkd("ray", "generate", "--num-shards", "2", "--address", ray_cluster, "--", "--prompts",
               str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "gen"), cwd=tmp_path)
    assert res.returncode == 1 and "2 of 2 tasks missing (--array=0-1)" in res.stderr, res.stderr[-3000:]
    assert "missing.jsonl" in res.stderr and "rerun the same command" in res.stderr
    # no Ray in this Python: the message says how to install it
    code = ("import sys; sys.modules['ray'] = None; from pipeline.cli import main; "
            f"raise SystemExit(main(['ray', 'score', '--num-shards', '2', '--', *{args!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=TIMEOUT,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "Ray is not installed" in res.stderr and "[ray]" in res.stderr, res.stderr
    assert not (tmp_path / "cache").exists()  # nothing ran
