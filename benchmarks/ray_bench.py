"""Ray executor: on-policy wall time against the local executor, and `gkd ray score` under kill -9 of its workers.

    python -m benchmarks.run --only ray                  (the on-policy bench's run twice + ~10 killed score runs)
    python -m benchmarks.run --only ray --ray-parts kills        (the kills alone; the wall-time row is kept)
    python -m benchmarks.ray_bench WORK [--cycles 2 --points 3]     (a reduced look)

- `| ray vs local on-policy wall time |`: the on-policy bench's on-policy run (benchmarks/onpolicy_bench.py `_config`,
  lmbda=1, its held-out set) once with `executor=local` and once with `executor=ray ray_address=local` (three actors
  on this machine, each with all its cores: stages run one at a time), same machine, same config. Goal <= 1.15x.
  Each run's wall time is split into what it pays once (wall minus the cycles' stage seconds: process start, imports,
  Ray cluster and actors, setup, shutdown), its cycle 0 and the mean later cycle, and the Ray driver's own phases
  (OUT/ray/driver.jsonl), so a ratio that misses the goal shows whether the extra cost is per run or per cycle.
- `| ray score worker kills survived |`: `gkd ray score --num-shards 4` on the score bench's kind of rollouts (a tiny
  teacher, as benchmarks/faults.py does), the worker of a running task SIGKILLed at a seeded random moment of the
  run (benchmarks/faults.py's rule: uniform over the uninterrupted run's wall time), or as soon after it as one is
  alive (none between a task's end and the next one's start), a run that ends first run again at the same fraction of
  its own wall time (up to RETRIES times); survived = the command exits 0
  with every task done, the cache verifies, each key once and every row equal to an unsharded run's. Goal N / N.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["enforce_eager=true", "kv_cache_gib=0.05", "dtype=float32", "max_model_len=32", "part_rows=1",
          "batch_tokens=16"]
SHARDS = 4
ROWS = 64
RETRIES = 2  # runs of one kill point that may end before a worker is killed (each then run again, see score_kills)


def _gkd(*argv: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# -- on-policy wall time ----------------------------------------------------------------------------------------


def onpolicy_wall(work: Path, cycles: int = 6, spg: int = 2) -> dict:
    """The on-policy bench's on-policy run with each executor, as a `gkd onpolicy` command (a process each)."""
    from benchmarks.onpolicy_bench import _config

    work.mkdir(parents=True, exist_ok=True)
    out: dict = {"cycles": cycles, "steps_per_generation": spg}
    cores = os.cpu_count() or 1
    for executor, extra in (("local", {}), ("ray", {"executor": "ray", "ray_address": "local",
                                                     "ray_num_cpus": cores})):
        cfg = _config(work / executor, executor, 1.0, cycles, spg, cycles * 16, cache=str(work / executor / "cache"),
                      **extra)
        # floats written out plainly: YAML 1.1 reads 3e-05 as a string
        args = [f"{k}={'null' if v is None else format(v, '.12f').rstrip('0') if isinstance(v, float) else v}"
                for k, v in _flat(cfg).items()]
        t0 = time.perf_counter()
        res = _gkd("onpolicy", *args, cwd=work)
        if res.returncode != 0:
            raise RuntimeError(f"gkd onpolicy executor={executor} failed:\n{res.stderr[-3000:]}")
        wall = time.perf_counter() - t0
        run_dir = work / executor / executor
        state = json.loads((run_dir / "state.json").read_text())
        out[executor] = {"wall_s": round(wall, 1), "stage_seconds": _stage_seconds(state),
                         **_split(state, wall), "ray_actors": state["cycles"][str(cycles - 1)].get("ray_actors")}
        if (run_dir / "ray" / "driver.jsonl").exists():  # the Ray driver's own phases (pipeline/onpolicy/ray.py)
            out[executor]["driver_phases"] = json.loads((run_dir / "ray" / "driver.jsonl").read_text().splitlines()[-1])
    out["ratio"] = round(out["ray"]["wall_s"] / out["local"]["wall_s"], 3)
    return out


def _split(state: dict, wall: float) -> dict:
    """Where a run's wall time goes: the cycles (stage seconds; cycle 0 apart, the later ones as a mean per cycle)
    and the rest, paid once per run (process start, imports, cluster and actors, setup, shutdown)."""
    per = [sum(state["cycles"][str(c)]["seconds"].values()) for c in range(len(state["cycles"]))]
    later = per[1:] or per
    return {"cycle0_s": round(per[0], 1), "later_cycle_s": round(sum(later) / len(later), 1),
            "once_per_run_s": round(wall - sum(per), 1)}


def _flat(cfg) -> dict:
    """A loaded OnPolicyConfig as `key=value` overrides: the keys that differ from the defaults (stage sections as
    dotted keys)."""
    from dataclasses import fields

    from pipeline.onpolicy.config import OnPolicyConfig

    default = OnPolicyConfig()
    values = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in ("generate", "score", "train"):
            values.update({f"{f.name}.{k}": x for k, x in v.items()})
        elif v != getattr(default, f.name):
            values[f.name] = v
    return values


def _stage_seconds(state: dict) -> dict:
    total: dict[str, float] = {}
    for info in state["cycles"].values():
        for stage, s in info["seconds"].items():
            total[stage] = round(total.get(stage, 0.0) + s, 1)
    return total


# -- kill -9 of score workers -----------------------------------------------------------------------------------


def _rollouts(work: Path, teacher: Path) -> Path:
    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import rollout_row, write_rollouts

    rng = np.random.default_rng(0)
    rows = [rollout_row(prompt_id=f"q{i}", prompt_ids=rng.integers(3, 384, 5).tolist(),
                        completion_ids=rng.integers(3, 384, 8).tolist(), source="dataset") for i in range(ROWS)]
    write_rollouts(work / "rollouts" / "r-00000-of-00001.parquet", rows,
                   tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    return work / "rollouts"


def _worker_pids() -> list[int]:
    """Running `gkd ray score` task workers (process title `ray::gkd-score-I-of-N`) of this bench's own cluster:
    descendants of this process, which started it (`ray.init`), so another Ray run on a shared machine (a test
    session's cluster) is never a victim."""
    parents, titles = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                titles[int(d.name)] = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                parents[int(d.name)] = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    me = os.getpid()

    def ours(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == me:
                return True
            seen.add(pid)
            pid = parents.get(pid, 0)
        return False

    return [pid for pid, title in titles.items() if title.startswith("ray::gkd-score-") and ours(pid)]


def _kill_a_live_worker(proc: subprocess.Popen, rng: random.Random, poll_s: float = 0.05) -> tuple[int | None, float]:
    """SIGKILL one running task worker of `proc`'s run, waiting for one to exist: at the drawn moment the command
    may still be starting (imports, connecting, submitting) or between a task's end and its retry, when no
    `ray::gkd-score-` process is alive, and a kill skipped then is a point not measured (the 4 / 4 of #32).
    Returns the pid killed (None: the run ended with no live worker left) and the seconds waited for one."""
    t0 = time.perf_counter()
    while proc.poll() is None:
        victims = _worker_pids()
        if victims:
            pid = rng.choice(victims)
            try:
                os.kill(pid, signal.SIGKILL)
                return pid, time.perf_counter() - t0
            except ProcessLookupError:  # it ended between the listing and the kill: take the next live one
                continue
        time.sleep(poll_s)
    return None, time.perf_counter() - t0


def _rows(cache: Path) -> dict:
    from pipeline.store import TeacherCache

    return {s.key: (s.topk_ids.tobytes(), s.topk_logprobs.tobytes()) for s in TeacherCache.open(cache).iter_samples()}


def score_kills(work: Path, points: int = 10, seed: int = 0) -> dict:
    """`points` runs of `gkd ray score`, each with one worker SIGKILLed at a seeded random time of the run."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the cluster on 127.0.0.1: read at `import ray`
    import ray

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_teacher

    from pipeline.ray.cluster import runtime_env
    from pipeline.store import TeacherCache

    work.mkdir(parents=True, exist_ok=True)
    teacher = build_tiny_teacher(work / "teacher", scale=30.0, max_pos=64)
    rollouts = _rollouts(work, teacher)

    def args(cache: Path) -> list[str]:
        return ["--rollouts", str(rollouts), "--cache", str(cache), "--teacher", str(teacher), "--topk", "4", *ENGINE]

    ref = _gkd("score", *args(work / "unsharded"), cwd=work)
    if ref.returncode != 0:
        raise RuntimeError(ref.stderr[-3000:])
    want = _rows(work / "unsharded")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env())
    address = ray.get_runtime_context().gcs_address
    if not address.startswith("127.0.0.1:"):
        ray.shutdown()
        raise RuntimeError(f"the bench's Ray cluster is at {address}, not on 127.0.0.1 (Ray imported before this?)")
    rng = random.Random(seed)
    out: dict = {"points": points, "shards": SHARDS, "rows": ROWS, "runs": []}
    try:
        cmd = lambda cache: [sys.executable, "-m", "pipeline", "ray", "score", "--num-shards", str(SHARDS),  # noqa: E731
                             "--address", address, "--", *args(cache)]
        t0 = time.perf_counter()
        clean = subprocess.run(cmd(work / "clean"), capture_output=True, text=True, cwd=work,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        span = time.perf_counter() - t0
        out["uninterrupted_s"] = round(span, 1)
        if clean.returncode != 0:
            raise RuntimeError(clean.stderr[-3000:])
        for p in range(points):
            frac, length = rng.uniform(0.1, 0.9), span
            for attempt in range(RETRIES + 1):
                # a run that ended before its drawn moment (faster than the uninterrupted one: the machine's load
                # changed) is a point not measured: drawn again at the same fraction of that run's own duration
                cache = work / (f"kill-{p}" if attempt == 0 else f"kill-{p}-again-{attempt}")
                at = frac * length
                t1 = time.perf_counter()
                proc = subprocess.Popen(cmd(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)})
                time.sleep(at)
                killed, waited = _kill_a_live_worker(proc, rng)
                _, err = proc.communicate(timeout=1800)
                if killed is not None or attempt == RETRIES:
                    break
                length = time.perf_counter() - t1
            keys = []
            if (cache / "cache.json").exists():
                import pyarrow.parquet as pq

                c = TeacherCache.open(cache)
                keys = [k for s in c.shard_paths() for k in pq.read_table(s, columns=["key"]).column("key").to_pylist()]
            ok = (proc.returncode == 0 and len(keys) == len(set(keys)) == ROWS and TeacherCache.open(cache).verify() == []
                  and _rows(cache) == want)
            out["runs"].append({"at_s": round(at, 1), "waited_s": round(waited, 2), "killed_pid": killed,
                                "runs_ended_before_a_kill": attempt if killed is not None else attempt + 1,
                                "exit": proc.returncode, "survived": ok, "error": None if ok else err[-500:]})
    finally:
        ray.shutdown()
    out["killed"] = sum(1 for r in out["runs"] if r["killed_pid"])
    out["survived"] = sum(1 for r in out["runs"] if r["killed_pid"] and r["survived"])
    return out


PARTS = ("onpolicy", "kills")


def run(work: Path, cycles: int = 6, points: int = 10, *, parts: Sequence[str] = PARTS, kept: dict | None = None) -> dict:
    """The section's parts; one not in `parts` is taken from `kept` (the section's stored raw results, each part
    stamped with the run that measured it: `report.stored_raw`), so one part can be re-measured alone."""
    from benchmarks.report import measure_parts

    measure = {"onpolicy": lambda: onpolicy_wall(work / "onpolicy", cycles),
               "kills": lambda: score_kills(work / "kills", points)}
    return measure_parts("ray", "--ray-parts", measure, parts, kept or {})


def markdown(r: dict) -> str:
    on, k = r["onpolicy"], r["kills"]
    return "\n".join([
        "| row | result | local | ray | note |",
        "|---|---|---|---|---|",
        f"| ray vs local on-policy wall time | **{on['ratio']:.2f}×** | {on['local']['wall_s']} s | {on['ray']['wall_s']} s"
        f" | {on['cycles']} on-policy cycles of the on-policy bench; goal ≤ 1.15× |",
        f"| ray score worker kills survived | **{k['survived']} / {k['killed']}** | - | {k['uninterrupted_s']} s "
        f"uninterrupted | `gkd ray score --num-shards {k['shards']}`, kill -9 of a running task's worker at "
        f"{k['points']} seeded points ({k['killed']} killed: at each point the bench waits for a live worker, and "
        f"runs again a run that ended first: {sum(r.get('runs_ended_before_a_kill', 0) for r in k['runs'])} such); "
        "equal to an unsharded run row by row; goal N / N |",
        "",
        *(f"The {name} row is kept from an earlier run: measured by {r[part]['measured']}." for part, name in
          (("onpolicy", "wall time"), ("kills", "kills")) if r[part].get("measured")),
        "",
        "Stage seconds (whole run), local: " + json.dumps(on["local"]["stage_seconds"]) + "; ray: "
        + json.dumps(on["ray"]["stage_seconds"]) + ".",
        "",
        _where(on),
    ])


def _where(on: dict) -> str:
    """The ratio taken apart: what each executor pays once per run, in cycle 0 and in every later cycle."""
    lo, ra = on["local"], on["ray"]
    n = on["cycles"]
    phases = ", ".join(f"{k.removesuffix('_s')} {v} s" for k, v in ra.get("driver_phases", {}).items() if k != "pid")
    return (f"Where the time goes (local / ray): once per run (process, imports, setup, shutdown: wall minus the "
            f"cycles) {lo['once_per_run_s']} / {ra['once_per_run_s']} s; cycle 0 {lo['cycle0_s']} / {ra['cycle0_s']} s; "
            f"each later cycle {lo['later_cycle_s']} / {ra['later_cycle_s']} s (mean of {n - 1}). Ray driver: "
            f"{phases} (setup_s includes the actors' start-up). Per later cycle ray costs "
            f"{ra['later_cycle_s'] - lo['later_cycle_s']:+.1f} s against local; the rest of the difference, "
            f"{ra['wall_s'] - lo['wall_s'] - (n - 1) * (ra['later_cycle_s'] - lo['later_cycle_s']):+.1f} s, is paid "
            "once per run and in cycle 0.")


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="?", default=None)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--points", type=int, default=10)
    ap.add_argument("--only", choices=["onpolicy", "kills"])
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="ray-bench-"))
    if a.only == "kills":
        res = {"kills": score_kills(work / "kills", a.points)}
    elif a.only == "onpolicy":
        res = {"onpolicy": onpolicy_wall(work / "onpolicy", a.cycles)}
    else:
        res = run(work, a.cycles, a.points)
    print(json.dumps(res, indent=1, default=str))
    if "onpolicy" in res and "kills" in res:
        print(markdown(res))
