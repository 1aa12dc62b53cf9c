"""Overlapped on-policy runs killed -9 (issue 47): `| overlapped on-policy kills survived |`.

    python -m benchmarks.run --only overlapkills          (~25 min on 2 CPU cores)

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

Only the local executor: the Ray and Slurm executors' overlapped runs are checked against the local one in
tests/ray/test_ray_onpolicy.py and tests/onpolicy/test_onpolicy_slurm.py (the Slurm driver also killed there, in the
strict order), not killed here.
"""

from __future__ import annotations

import json
import os
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
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _command(models: dict, out: Path) -> list[str]:
    from onpolicy_helpers import overrides

    values = overrides(models, out, max_staleness=1, generate_seed=None)
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


def _kill_once(models: dict, out: Path, role: str, point: str) -> list[str]:
    """Stop the command at `point`, SIGKILL the process that stopped; what went wrong (nothing: [])."""
    import killing

    from pipeline.lifetime import descendants, survivors

    bad = []
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = killing.start(_command(models, out), point, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT)
        try:
            stopped = killing.wait_stopped(proc, deadline_s=2 * killing.DEADLINE_S)
            below = descendants(proc.pid)
            if (stopped == proc.pid) != (role == "driver"):
                bad.append(f"the process that stopped at {point} is not the {role}'s")
            os.kill(stopped, 9)
            rc = proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    if role == "driver":
        rc_ok = rc == -9
    else:
        rc_ok = rc == 1 and f"the {role} process died during" in text and "Traceback" not in text
    if not rc_ok:
        bad.append(f"exit {rc} after the kill (want {'-9' if role == 'driver' else 1} naming the {role}): "
                   f"{text[-800:]}")
    if left := survivors(below, wait_s=600):
        bad.append(f"{len(left)} process(es) of the killed command left")
    return bad


def run(work: Path, points: list[tuple[str, str]] = POINTS) -> dict:
    from onpolicy_helpers import build_models

    work.mkdir(parents=True, exist_ok=True)
    models = build_models(work / "models")
    t0 = time.time()
    ref = work / "reference"
    done = subprocess.run(_command(models, ref), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the reference run failed:\n{done.stderr[-3000:]}")
    expected, ref_s = _outcome(ref), time.time() - t0
    done_points = []
    for i, (role, point) in enumerate(points):
        t = time.time()
        out = work / f"kill-{i:02d}"
        bad = _kill_once(models, out, role, point)
        again = subprocess.run(_command(models, out), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=3600)
        if again.returncode:
            bad.append(f"the rerun exited {again.returncode}: {again.stderr[-800:]}")
        else:
            got = _outcome(out)
            bad += [f"{name} differ from the uninterrupted run's" for name in ("weights", "last_export", "keys", "rows")
                    if got[name] != expected[name]]
            if got["steps"] != expected["steps"]:
                bad.append(f"trainer steps {got['steps']} (want {expected['steps']}: each once)")
        done_points.append({"role": role, "point": point, "survived": not bad, "problems": bad,
                       "seconds": round(time.time() - t, 1)})
    return {"executor": "local", "max_staleness": 1, "reference_s": round(ref_s, 1), "points": done_points,
            "killed": len(done_points), "survived": sum(p["survived"] for p in done_points),
            "reference": {"last_export": expected["last_export"], "keys": len(expected["keys"]),
                          "rows": len(expected["rows"]), "steps": expected["steps"]}}


def markdown(res: dict) -> str:
    by_role: dict[str, list[str]] = {}
    for p in res["points"]:
        by_role.setdefault(p["role"], []).append(p["point"] + ("" if p["survived"] else " (FAILED)"))
    where = "; ".join(f"{role}: {', '.join(pts)}" for role, pts in by_role.items())
    ref = res["reference"]
    lines = [
        "| row | result | goal |", "|---|---|---|",
        f"| overlapped on-policy kills survived | {res['survived']}/{res['killed']} (local executor, max_staleness=1, "
        f"2 cycles x 2 steps, real tiny vLLM engines; kill -9 at {where}; each rerun's final weights bit-identical "
        f"to the uninterrupted run's ({ref['last_export']}), the same {ref['keys']} cache keys and {ref['rows']} "
        f"rollout rows by key, steps {ref['steps']} each once, no process left) | all |",
    ]
    fails = [f"- {p['role']} at {p['point']}: {'; '.join(p['problems'])}" for p in res["points"] if not p["survived"]]
    return "\n".join(lines + ([""] + fails if fails else []))


if __name__ == "__main__":
    import tempfile

    out = run(Path(tempfile.mkdtemp(prefix="gkd-overlapkills-")))
    print(json.dumps(out, indent=1))
    print(markdown(out))
