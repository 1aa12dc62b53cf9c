"""Faults, counted: kill -9 at seeded points in `gkd score`, `gkd generate` and `gkd train`, and the full-disk,
concurrent-writer and bad-input tests run and tallied. Writes the `faults` section of BENCHMARKS.md.

    python -m benchmarks.faults [--points 20] [--seed 0] [--only kill,tests]      (make faults)

Kill -9: a reference run of each command (the real CLI, a subprocess) gives the expected output and its wall time
T. Then, into a fresh output folder, the same command is started and SIGKILLed after a seeded delay drawn uniformly
from [0, T] (so points fall in start-up, mid-run and at the final writes), restarted and killed again at a new
draw, until a start finishes by itself; then a new folder, until `points` kills. After every kill what a reader
sees must be consistent (score: the cache verifies, no key twice; generate: no rollout shard or a complete one;
train: `latest` names a complete checkpoint); after the finishing start the output must equal the reference by key
(score: top-k ids and logprobs of every key; generate: every rollout row; train: each step's loss once and the
final checkpoint's tensors, bit for bit), with no temporary left visible. A point survives when both hold.

The models are the tests' tiny random Llamas (tests/tiny_models.py): the faults do not depend on model size, and
each start of vLLM or Megatron costs seconds, not minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.report import Stamp, old_sections, section, write_benchmarks
from pipeline.lifetime import descendants, survivors
from pipeline.store import TeacherCache, read_cache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import iter_rollouts, rollout_row, rollout_shards, write_rollouts
from pipeline.store.shards import verify_shard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models, tiny_cache: the tests' tiny random models

MAX_LEN, K = 96, 8
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


# -- the three commands: set-up, command line, what a reader sees, what the output is ---------------------------


def setup(work: Path, rows: int = 60, train_steps: int = 12) -> dict:
    """Tiny teacher = sampling student (vLLM), `rows` rollouts to score (parts of 2 rows), 32 prompts to sample
    twice each, a cache and a student for `train_steps` steps with a checkpoint every 2."""
    import numpy as np
    from tiny_cache import build_tiny, random_samples, score_into_cache
    from tiny_models import build_tiny_teacher
    from transformers import AutoConfig

    teacher = build_tiny_teacher(work / "teacher", scale=30.0, max_pos=128)
    rng = np.random.default_rng(0)
    write_rollouts(work / "rollouts" / "r-00000-of-00001.parquet", [
        rollout_row(prompt_id=f"q{i}", prompt_ids=rng.integers(3, 384, 4).tolist(),
                    completion_ids=rng.integers(3, 384, 20).tolist(), source="dataset") for i in range(rows)
    ], tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"the cat sat on {i} mats"}) + "\n"
                                                for i in range(32)))
    model, student = build_tiny(work / "model"), build_tiny(work / "student", seed=1)
    score_into_cache(model, work / "cache", random_samples(24, AutoConfig.from_pretrained(model).vocab_size))
    return {"teacher": teacher, "student": student, "work": work, "train_steps": train_steps}


def command(name: str, s: dict, out: Path) -> list[str]:
    gkd = [sys.executable, "-m", "pipeline", name]
    if name == "score":
        return [*gkd, "--rollouts", str(s["work"] / "rollouts"), "--cache", str(out), "--teacher", str(s["teacher"]),
                "--topk", str(K), f"max_model_len={MAX_LEN}", "part_rows=2", "batch_tokens=40", "enforce_eager=true",
                "kv_cache_gib=0.05"]
    if name == "generate":
        return [*gkd, "--prompts", str(s["work"] / "prompts.jsonl"), "--student", str(s["teacher"]), "--out", str(out),
                "--n", "2", "--max-tokens", "16", "--shard", "0", "--num-shards", "1", "kv_cache_gib=0.25",
                "enforce_eager=true", "max_model_len=128"]
    return [*gkd, f"student={s['student']}", f"cache=[{s['work'] / 'cache'}]", "micro_batch_size=2",
            "global_batch_size=4", "seq_length=32", f"train_steps={s['train_steps']}", "save_interval=2", "lr=1e-3", "warmup_steps=1",
            f"save_dir={out}", "progress=false", "prefetch=1"]


def _stray(out: Path) -> list[str]:
    """Temporaries a finished run left behind (a dot-prefixed file or folder with .tmp- or .partial)."""
    return sorted(str(p) for p in out.rglob(".*") if ".tmp-" in p.name or p.name.endswith(".partial"))


def consistent(name: str, out: Path) -> list[str]:
    """What a reader sees right after a kill: problems, [] when consistent."""
    if not out.exists():
        return []
    if name == "score":
        if not (out / "cache.json").exists():
            return []
        cache = TeacherCache.open(out)
        keys = [k for p in cache.shard_paths() for k in _keys(p)]
        return cache.verify() + (["a key twice"] if len(keys) != len(set(keys)) else [])
    if name == "generate":
        return [f"{p}: {e}" for p in rollout_shards(out) for e in verify_shard(p, "rollout")]
    latest = out / "latest"
    if latest.exists() and not (out / latest.read_text() / "trainer.json").exists():
        return [f"{latest} names {latest.read_text()}, which is not a complete checkpoint"]
    return []


def _keys(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["key"])["key"].to_pylist()


def output(name: str, out: Path) -> dict:
    """The output by key, for comparison with the reference."""
    if name == "score":
        return {s.key: (s.topk_ids.tobytes(), s.topk_logprobs.tobytes()) for s in read_cache(out)}
    if name == "generate":
        rows = sorted(json.dumps(r, sort_keys=True, default=str) for r in iter_rollouts(rollout_shards(out)))
        return {"rows": rows, "n": len(rows)}
    step = out / (out / "latest").read_text()
    losses = [(m["step"], m["loss"]) for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    tensors = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step.iterdir())
               if p.is_file() and p.name != "trainer.json" and not p.name.startswith(".")}
    return {"losses": losses, "tensors": tensors, "latest": step.name}


# -- kill -9 ------------------------------------------------------------------------------------------------------


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:  # a file, not a pipe: a child blocked on a full pipe would skew the kill points
        return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f)


def kill_points(name: str, s: dict, work: Path, points: int, seed: int) -> dict:
    """`points` SIGKILLs of command `name` at seeded delays; see the module docstring."""
    t0 = time.time()
    ref = work / f"{name}-ref"
    done = subprocess.run(command(name, s, ref), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"reference {name} run failed:\n{done.stderr[-3000:]}")
    wall, expected = time.time() - t0, output(name, ref)
    rng = random.Random(f"{seed}-{name}")
    killed, survived, groups, failures, left, seen = 0, 0, 0, [], 0, 0
    while killed < points:
        out, group_points, bad = work / f"{name}-g{groups}", [], []
        log = work / f"{name}-g{groups}.stderr"
        groups += 1
        while True:
            proc = _start(command(name, s, out), log)
            delay = rng.uniform(0.0, wall)
            below, until = {}, time.monotonic() + delay
            while proc.poll() is None and time.monotonic() < until:  # its processes, seen while they live
                below.update(descendants(proc.pid))
                time.sleep(0.1)
            if proc.poll() is None:
                below.update(descendants(proc.pid))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed += 1
                stayed = survivors(below, wait_s=120)  # (then killed, so that the next start is not slowed)
                left, seen = left + len(stayed), seen + len(below)
                if stayed:
                    bad.append(f"after the kill at {delay:.2f} s: {len(stayed)} process(es) of it still alive")
                group_points.append(round(delay, 2))
                bad += [f"after the kill at {delay:.2f} s: {p}" for p in consistent(name, out)]
                if killed >= points:  # the last point: finish this group without more kills
                    proc = _start(command(name, s, out), log)
                    proc.wait(timeout=1200)
                else:
                    continue
            if proc.returncode:
                bad.append(f"a start exited {proc.returncode}: {log.read_text()[-2000:]}")
            break
        if group_points:
            if output(name, out) != expected:
                bad.append("the output differs from the uninterrupted run's")
            if stray := _stray(out):
                bad.append(f"temporaries left: {stray[:3]}")
            survived += 0 if bad else len(group_points)
            failures += [f"{name} kills at {group_points} s: {b}" for b in bad]
    return {"command": name, "killed": killed, "survived": survived, "groups": groups, "reference_s": round(wall, 1),
            "processes_left": left, "processes_seen": seen,
            "failures": failures, "seconds": round(time.time() - t0, 1)}


# -- the fault tests, run and counted ------------------------------------------------------------------------------

# row -> pytest node ids (paths relative to the repository); not counted: the catalogue's own consistency check and
# test_refusals.py's growing-cache case (a reader during writes, not a bad input)
TEST_GROUPS = {
    "full-disk cases survived": ["tests/test_full_disk.py::test_import_on_a_full_disk",
                                 "tests/score/test_score.py::test_full_disk_mid_run_then_rerun_equals_uninterrupted",
                                 "tests/train/test_checkpoint_full_disk.py"],
    "concurrent-writer cases survived": ["tests/store/test_locks.py",
                                         "tests/score/test_score.py::test_two_score_jobs_on_one_cache",
                                         "tests/generate/test_generate_run.py::test_cli_end_to_end_and_rerun_is_a_no_op"],
    "bad inputs refused cleanly": ["tests/test_bad_inputs.py", "tests/train/test_refusals.py"],
}


def run_tests(work: Path) -> dict:
    out = {}
    for row, nodes in TEST_GROUPS.items():
        xml = work / f"{row.split()[0]}.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *nodes,
                        "-k", "not every_catalogue_row and not cache_growing"], env=ENV, cwd=ROOT, capture_output=True, timeout=3600)
        cases = ET.parse(xml).getroot().iter("testcase")
        res = {"passed": 0, "failed": [], "skipped": []}
        for c in cases:
            name = f"{c.get('classname')}::{c.get('name')}"
            if c.find("skipped") is not None:
                res["skipped"].append(name)
            elif c.find("failure") is not None or c.find("error") is not None:
                res["failed"].append(name)
            else:
                res["passed"] += 1
        out[row] = res
    return out


# -- the section ---------------------------------------------------------------------------------------------------


def run(work: Path, points: int | dict[str, int] = 20, seed: int = 0, only: tuple[str, ...] = ("kill", "tests"),
        small: bool = False) -> dict:
    """`points`: kills per command (or a dict command -> kills); `small`: the CI version's smaller workloads."""
    work.mkdir(parents=True, exist_ok=True)
    per = points if isinstance(points, dict) else dict.fromkeys(("score", "generate", "train"), points)
    res: dict = {"points": per, "seed": seed}
    if "kill" in only:
        s = setup(work, rows=24, train_steps=6) if small else setup(work)
        res["kill"] = [kill_points(name, s, work, n, seed) for name, n in per.items()]
    if "tests" in only:
        res["tests"] = run_tests(work)
    return res


def markdown(res: dict) -> str:
    lines = ["| measure | result | detail |", "|---|---|---|"]
    if "kill" in res:
        cells = "; ".join(f"{k['command']} {k['killed']} / {k['survived']}" for k in res["kill"])
        detail = "; ".join(f"{k['command']}: {k['groups']} output folders, kills at U(0, {k['reference_s']} s)"
                           for k in res["kill"])
        lines.append(f"| kill -9 points survived | {cells} (points killed / points whose rerun matched) | {detail} |")
    for row, r in res.get("tests", {}).items():
        total = r["passed"] + len(r["failed"])
        skipped = f"; {len(r['skipped'])} skipped (needs root)" if r["skipped"] else ""
        lines.append(f"| {row} | {r['passed']} / {total} | tests: {', '.join(TEST_GROUPS[row])}{skipped} |")
    failures = [f for k in res.get("kill", []) for f in k["failures"]]
    failures += [f"{row}: {n}" for row, r in res.get("tests", {}).items() for n in r["failed"]]
    if failures:
        lines += ["", "Failures:", "", *(f"- {f}" for f in failures)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=20, help="kill -9 points per command")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="kill,tests", help="kill, tests or both")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = ap.parse_args()
    command_line = "python -m benchmarks.faults" + (f" --points {args.points}" if args.points != 20 else "") + (
        f" --seed {args.seed}" if args.seed else "") + (f" --only {args.only}" if args.only != "kill,tests" else "")
    stamp = Stamp.now(command_line)
    work = Path(tempfile.mkdtemp(prefix="gkd-faults-"))
    try:
        res = run(work, args.points, args.seed, tuple(args.only.split(",")))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # each kill point leaves a cache and checkpoints behind
    sections = old_sections(Path(args.out))
    sections["faults"] = section("faults", markdown(res), res, stamp)
    write_benchmarks(Path(args.out), sections)
    print(markdown(res))
    ok = all(not k["failures"] for k in res.get("kill", [])) and all(not r["failed"] for r in res.get("tests", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
