"""Overlapped on-policy runs killed -9 (issue 47): `| overlapped on-policy kills survived |`.

    python -m benchmarks.run --only overlapkills          (~60 min on 2 CPU cores)

A reference run: `gkd onpolicy max_staleness=1` (2 cycles of 2 steps, the on-policy tests' tiny random models and
real vLLM engines, local executor: the sampler, the teacher and the trainer in processes of their own), not
interrupted. Then, each into a fresh folder, the same command stopped at one point of its work and SIGKILLed there:
the driver at its k-th state write, the trainer at an optimizer step or a checkpoint, the sampler at a rollout shard,
the teacher at a cache commit (pipeline/pause.py: the process stops itself at the point, so the kill lands exactly
there however busy the machine; the points are a fixed list over every role, not drawn at random, so a rerun of the
bench kills at the same places). A role killed: the driver must exit 1 naming it, with no traceback. Then the command
runs again to its end. A point survives when, after the kill, no process of the command is left, and after the rerun
the final weights equal the reference's bit for bit, the cache holds the reference's keys, the rollouts the
reference's rows by key, and the trainer's metrics.jsonl has each step once.

What is deterministic once stages overlap: which weights sample each cycle (max(0, c - N), a fixed lag), so the
rollouts, the teacher rows, the training data and the weights; what is not: which task finishes first, so the order
of state.json's task records, the times, and at which cycle a given k-th state write falls.

The Ray and the Slurm executor (`EXECUTORS`): the same, on a single-machine Ray cluster and a throw-away local
Slurm (pipeline/slurm/local.py) this bench starts and stops, each with an uninterrupted reference run of its own
(their weights equal the local executor's only within the tolerance of their thread counts: tests/ray,
tests/onpolicy/test_onpolicy_slurm.py), killed at fewer points (`EXECUTOR_POINTS`: the driver mid-overlap, and each
role once). A role there is not a child of the driver: a Ray actor, or a Slurm job's process; the one stopped at the
point is found by its state and its $GKD_PAUSE_AT among all processes (on Slurm, in its role's job). A killed Ray
role: the driver exits 1 naming the actor's death; a killed Slurm job: exit 1 naming the failed job and its log; a
killed Slurm driver leaves its jobs running by design (the rerun adopts them by name), so for it "no process left" is
checked after the rerun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "onpolicy")]  # the tests' tiny models and kill helpers

# (role that stops itself, pause point): every role, early and mid-overlap
POINTS = [
    ("driver", "onpolicy-state:2"), ("driver", "onpolicy-state:4"), ("driver", "onpolicy-state:6"),
    ("driver", "onpolicy-state:8"),
    ("trainer", "train-step:1"), ("trainer", "train-step:3"), ("trainer", "checkpoint:1"),
    ("sampler", "rollout-shard:2"), ("sampler", "rollout-shard:3"),
    ("teacher", "cache-commit:2"), ("teacher", "cache-commit:3"),
]
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: the bench's Ray cluster is on 127.0.0.1, and a driver without it maps that
# address to the host's own, where nothing listens (pipeline/ray/cluster.py)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
EXECUTORS = ("local", "ray", "slurm")
PARTS = EXECUTORS  # the section's parts (--overlapkills-parts)
# the other executors: the driver mid-overlap (after setup and a few tasks recorded), and each role once. A Ray actor
# lives through the run (its points count over it, as a local role process's); a Slurm job is a process per task, so
# its points count from 1 in each job (the first task to reach one is killed; the others are let go on).
# On Slurm a role's point must fall before its task's output is whole: a task killed after it finds the driver
# carrying on (its outcome is read from the outputs on disk, docs/dependencies.md), with exit 0. So the sampler is
# stopped with its first rollout shard in the temporary, not yet renamed (`shard-temporary:1`: the cycle's generate
# tasks write the run's first shards), and the teacher scores one row per part (score.part_rows=1: a task commits
# several), stopped at its first commit. Seen on 2026-12-07 with rollout-shard:1: the task had written its only shard.
EXECUTOR_POINTS = {"ray": [("driver", "onpolicy-state:5"), ("trainer", "train-step:3"), ("sampler", "rollout-shard:3"),
                           ("teacher", "cache-commit:3")],
                   "slurm": [("driver", "onpolicy-state:6"), ("trainer", "train-step:1"),
                             ("sampler", "shard-temporary:1"), ("teacher", "cache-commit:1")]}
SLURM_STAGE = {"sampler": "generate", "teacher": "score", "trainer": "train"}  # the job a Slurm role's point is in
# SGD and fixed threads as in the executor tests; Slurm without held-out prompts (a setup job of its own)
EXTRA = {"local": {}, "ray": {"ray_num_cpus": 0.5},
         "slurm": {"slurm_poll_s": 0.5, "slurm_stage_timeout_s": 900.0, "heldout_prompts": None, "part_rows": 1}}


def _command(models: dict, out: Path, executor: str = "local", cluster: dict | None = None) -> list[str]:
    from onpolicy_helpers import overrides

    values = overrides(models, out, max_staleness=1, generate_seed=None, **EXTRA[executor],
                       **({"executor": executor} if executor != "local" else {}), **(cluster or {}))
    return [sys.executable, "-m", "pipeline.cli", "onpolicy",
            *(f"{k}={'null' if v is None else v}" for k, v in values.items())]


def _outcome(out: Path) -> dict:
    """What a run left: final weights' digest, cache keys, rollout rows by key, the trainer's steps."""
    import hashlib

    import pyarrow.parquet as pq

    from pipeline.store import TeacherCache
    from pipeline.store.rollouts import iter_rollouts, rollout_shards

    weights = sorted((out / "exports").glob("step-*/model.safetensors"))
    cache = TeacherCache.open(out / "cache")
    keys = sorted(k for p in cache.shard_paths() for k in pq.read_table(p, columns=["key"])["key"].to_pylist())
    rows = {}
    for d in sorted((out / "rollouts").iterdir()):
        for r in iter_rollouts(rollout_shards(d)):
            rows[(d.name, r["sample_id"])] = (r["prompt_ids"], r["completion_ids"], r["policy_version"])
    steps = [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    return {"weights": hashlib.sha256(weights[-1].read_bytes()).hexdigest() if weights else None,
            "last_export": weights[-1].parent.name if weights else None, "keys": keys, "rows": rows, "steps": steps}


def _environ(pid: int | str) -> dict[bytes, bytes]:
    """A process's environment as it was started ({} once it is gone)."""
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def _paused(point: str) -> list[int]:
    """Every process (of any parent: a Ray actor, a Slurm job) started with $GKD_PAUSE_AT=`point`."""
    want = point.encode()
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and _environ(d.name).get(b"GKD_PAUSE_AT") == want]


def _stopped_anywhere(proc: subprocess.Popen, point: str, deadline_s: float) -> int:
    """The first process started with $GKD_PAUSE_AT=`point` that has stopped itself there (killing.wait_stopped
    looks among the command's descendants only; a Ray actor or a Slurm job is none)."""
    import killing

    deadline = time.monotonic() + deadline_s
    while True:
        if stopped := next((p for p in _paused(point) if killing.state(p) == "T"), None):
            return stopped
        if proc.poll() is not None:
            raise RuntimeError(f"the command ended (exit status {proc.returncode}) before reaching {point}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the command did not reach {point} in {deadline_s:.0f} s")
        time.sleep(0.05)


def _slurm_job(pid: int) -> str:
    """The Slurm job name a process runs in ($SLURM_JOB_NAME; the driver names each stage's job)."""
    return _environ(pid).get(b"SLURM_JOB_NAME", b"").decode()


def _gone(point: str, wait_s: float) -> list[int]:
    """The processes started with $GKD_PAUSE_AT=`point` still alive after up to `wait_s` (a hang bound only)."""
    import killing

    deadline = time.monotonic() + wait_s
    while (left := [p for p in _paused(point) if killing.state(p) not in (None, "Z")]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _wait_letting_others_go(proc: subprocess.Popen, point: str, killed: int, timeout_s: float = 1800) -> int:
    """Wait for the killed command's exit while letting go on (SIGCONT) every other process stopped at `point`: the
    other tasks of a Slurm array job (one process each) reach the same point, and the driver reports the killed task
    only once every task of its job has ended. The deadline only bounds a hang."""
    import killing

    deadline = time.monotonic() + timeout_s
    while (rc := proc.poll()) is None:
        for pid in _paused(point):
            if pid != killed and killing.state(pid) == "T":
                os.kill(pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        time.sleep(0.5)
    return rc


def _kill_once(models: dict, out: Path, role: str, point: str, executor: str = "local",
               cluster: dict | None = None, env: dict | None = None) -> list[str]:
    """Stop the command at `point`, SIGKILL the process that stopped; what went wrong (nothing: [])."""
    import killing

    from pipeline.lifetime import descendants, survivors

    bad = []
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = killing.start(_command(models, out, executor, cluster), point, cwd=ROOT, env=env or ENV, stdout=f,
                             stderr=subprocess.STDOUT)
        try:
            if executor == "local" or role == "driver":
                stopped = killing.wait_stopped(proc, deadline_s=2 * killing.DEADLINE_S)
            else:
                stopped = _stopped_anywhere(proc, point, 2 * killing.DEADLINE_S)
            below = descendants(proc.pid)
            if (stopped == proc.pid) != (role == "driver") or (
                    executor == "slurm" and role != "driver"
                    and not _slurm_job(stopped).endswith(f"-{SLURM_STAGE[role]}")):
                bad.append(f"the process that stopped at {point} is not the {role}'s")
            os.kill(stopped, 9)
            rc = _wait_letting_others_go(proc, point, stopped)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    if role == "driver":
        rc_ok = rc == -9
    else:
        said = {"local": f"the {role} process died during", "ray": "state is saved, rerun the same command",
                "slurm": "rerun the same command"}[executor]
        rc_ok = rc == 1 and said in text and "Traceback" not in text
    if not rc_ok:
        bad.append(f"exit {rc} after the kill (want {'-9' if role == 'driver' else 1} naming the {role}): "
                   f"{text[-800:]}")
    if left := survivors(below, wait_s=600):
        bad.append(f"{len(left)} process(es) of the killed command left")
    if not (executor == "slurm" and role == "driver") and (left := _gone(point, 600)):
        bad.append(f"{len(left)} process(es) of the killed command's {executor} roles left")
    return bad


def _measure(work: Path, executor: str, points: list[tuple[str, str]], cluster: dict | None = None,
             env: dict | None = None) -> dict:
    """One executor's reference run, then each point killed and rerun (module doc)."""
    from onpolicy_helpers import build_models

    env = env or ENV
    work.mkdir(parents=True, exist_ok=True)
    models = build_models(work / "models")
    t0 = time.time()
    ref = work / "reference"
    done = subprocess.run(_command(models, ref, executor, cluster), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the {executor} reference run failed:\n{done.stderr[-3000:]}")
    expected, ref_s = _outcome(ref), time.time() - t0
    done_points = []
    for i, (role, point) in enumerate(points):
        t = time.time()
        out = work / f"kill-{i:02d}"
        bad = _kill_once(models, out, role, point, executor, cluster, env)
        again = subprocess.run(_command(models, out, executor, cluster), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=3600)
        if again.returncode:
            bad.append(f"the rerun exited {again.returncode}: {again.stderr[-800:]}")
        else:
            got = _outcome(out)
            bad += [f"{name} differ from the uninterrupted run's" for name in ("weights", "last_export", "keys", "rows")
                    if got[name] != expected[name]]
            if got["steps"] != expected["steps"]:
                bad.append(f"trainer steps {got['steps']} (want {expected['steps']}: each once)")
        if executor == "slurm" and role == "driver" and (left := _gone(point, 600)):
            bad.append(f"{len(left)} process(es) of the killed driver's jobs left after the rerun")
        done_points.append({"role": role, "point": point, "survived": not bad, "problems": bad,
                            "seconds": round(time.time() - t, 1)})
    return {"executor": executor, "max_staleness": 1, "reference_s": round(ref_s, 1), "points": done_points,
            "killed": len(done_points), "survived": sum(p["survived"] for p in done_points),
            "reference": {"last_export": expected["last_export"], "keys": len(expected["keys"]),
                          "rows": len(expected["rows"]), "steps": expected["steps"]}}


def _on_ray(work: Path) -> dict:
    """The Ray points on a single-machine cluster started (and stopped) here, as tests/ray/conftest.py does."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only: read at `import ray`
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    import ray

    from pipeline.ray.cluster import runtime_env

    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        if not address.startswith("127.0.0.1:"):
            raise RuntimeError(f"the bench's Ray cluster is at {address}, not on 127.0.0.1 (Ray imported before this?)")
        # the drivers' environment as it is now: ray.init put the cluster's token where its clients look
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return _measure(work, "ray", EXECUTOR_POINTS["ray"], {"ray_address": address}, env)
    finally:
        ray.shutdown()


def _on_slurm(work: Path) -> dict:
    """The Slurm points on a throw-away local Slurm (its daemons started and stopped here)."""
    from pipeline.slurm.local import LocalSlurm

    cluster = LocalSlurm(work / "cluster")
    cluster.start()
    try:
        return _measure(work, "slurm", EXECUTOR_POINTS["slurm"], env={**ENV, **cluster.env()})
    finally:
        cluster.stop()


def run(work: Path, parts=PARTS, kept: dict | None = None) -> dict:
    """The executors in `parts` measured, the others kept from `kept` (the section's stored raw results:
    `report.measure_parts`); stored results from before the parts (the local executor's alone) count as local."""
    from benchmarks.report import measure_parts

    kept = kept or {}
    if "points" in kept:  # stored_raw stamped its top-level dicts, here the reference's: the stamp is the run's
        kept = {"local": {**kept, "measured": kept.get("reference", {}).pop("measured", None)}}
    measure = {"local": lambda: _measure(work / "local", "local", POINTS), "ray": lambda: _on_ray(work / "ray"),
               "slurm": lambda: _on_slurm(work / "slurm")}
    return measure_parts("overlapkills", "--overlapkills-parts", measure, parts, kept)


def markdown(res: dict) -> str:
    parts = [res[e] for e in PARTS]
    killed, survived = sum(p["killed"] for p in parts), sum(p["survived"] for p in parts)

    def where(part: dict) -> str:
        by_role: dict[str, list[str]] = {}
        for p in part["points"]:
            by_role.setdefault(p["role"], []).append(p["point"] + ("" if p["survived"] else " (FAILED)"))
        return "; ".join(f"{role}: {', '.join(pts)}" for role, pts in by_role.items())

    each = ", ".join(f"{p['executor']} {p['survived']}/{p['killed']}" for p in parts)
    ref = parts[0]["reference"]
    lines = [
        "| row | result | goal |", "|---|---|---|",
        f"| overlapped on-policy kills survived | {survived}/{killed} ({each}; max_staleness=1, 2 cycles x 2 steps, "
        "real tiny vLLM engines; each rerun's final weights bit-identical to its executor's uninterrupted run's "
        f"({ref['last_export']}), the same cache keys and rollout rows by key, every trainer step once, no process "
        "left) | all |",
        "",
        *(f"- {p['executor']}: kill -9 at {where(p)}" + (f" (measured by {p['measured']})" if p.get("measured") else "")
          for p in parts),
    ]
    fails = [f"- {part['executor']}, {p['role']} at {p['point']}: {'; '.join(p['problems'])}"
             for part in parts for p in part["points"] if not p["survived"]]
    return "\n".join(lines + ([""] + fails if fails else []))


if __name__ == "__main__":
    import tempfile

    out = run(Path(tempfile.mkdtemp(prefix="gkd-overlapkills-")))
    print(json.dumps(out, indent=1))
    print(markdown(out))
