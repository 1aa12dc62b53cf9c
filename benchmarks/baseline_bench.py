"""Is a cache worth it? The cached trainer against a live teacher (`gkd train teacher_live=...`) on the same
micro-batches, and the measured break-even: after how many student runs the one teacher pass has paid for itself.

    python -m benchmarks.run --only baselines

Embedded teacher (SmolLM2-135M-Instruct, 30 layers) and student (its 6-layer copy), fp32, CPU. One prose corpus of
96 rollouts x 256 tokens (one Parquet row group in the rollout shard and in the cache, in the same order, so the
loader's seeded order gives both runs the same micro-batches). Measured in this process's run:
- S: the whole score stage for the corpus (`gkd score` wall seconds: fingerprints, engine start, scoring, writes);
- C and L: a trainer step's seconds from the cache and with the live teacher (median of the steady steps, the two
  runs interleaved over `rounds` rounds);
- a "student run" is one epoch over the corpus (every sample trained on once): steps_per_run = corpus samples /
  samples per step. The cache costs S once; the live teacher costs (L − C) · steps_per_run more per run, so the
  cache is cheaper from N* = S / ((L − C) · steps_per_run) runs on (for E epochs per run, divide N* by E).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.score_bench import build_rollouts
from pipeline.assets import student_dir, teacher_dir
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score

ROOT = Path(__file__).resolve().parents[1]


def _train(args: list[str], save: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "pipeline", "train", *args, f"save_dir={save}", "progress=false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def run(work: Path, rounds: int = 2, steps: int = 4, micro_batch_size: int = 4, seq_length: int = 512) -> dict:
    from transformers import AutoTokenizer

    teacher, student = teacher_dir(), student_dir()
    dirs = build_rollouts(work / "rollouts", AutoTokenizer.from_pretrained(teacher), prose_tokens=96 * 256,
                          math_samples=2)
    t0 = time.perf_counter()
    summary = score(ScoreConfig(rollouts=str(dirs["prose"]), cache=str(work / "cache"), teacher=str(teacher),
                                topk=64, max_model_len=1024, kv_cache_gib=1.0, enforce_eager=True))
    score_wall = time.perf_counter() - t0
    common = [f"student={student}", f"micro_batch_size={micro_batch_size}", f"global_batch_size={micro_batch_size}",
              f"seq_length={seq_length}", f"train_steps={steps}", "warmup_steps=1", f"save_interval={steps}"]
    variants = {"cached": [f"cache=[{work / 'cache'}]"],
                "live": [f"teacher_live={teacher}", f"rollouts=[{dirs['prose']}]", "cache=[]", "teacher_live_topk=64"]}
    step_s: dict[str, list[float]] = {v: [] for v in variants}
    metrics: dict[str, list[dict]] = {}
    for r in range(rounds):
        for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):  # interleaved: shared-CPU noise hits both
            metrics[v] = _train(common + variants[v], work / f"{v}-{r}")
            step_s[v] += [m["step_seconds"] for m in metrics[v][1:]]  # the first step warms up
    cached, live = statistics.median(step_s["cached"]), statistics.median(step_s["live"])
    same = [m["active_tokens"] for m in metrics["cached"]] == [m["active_tokens"] for m in metrics["live"]]
    samples = summary["rows"]
    per_step = statistics.mean(m["samples"] for m in metrics["cached"])
    steps_per_run = samples / per_step
    extra = (live - cached) * steps_per_run
    return {"teacher": str(teacher), "student": str(student), "score_seconds": score_wall,
            "score_engine_seconds": summary.get("score_seconds"), "corpus_samples": samples,
            "corpus_tokens": summary["tokens"], "cached_step_s": cached, "live_step_s": live, "steps_s": step_s,
            "ratio": live / cached, "same_micro_batches": same, "samples_per_step": per_step,
            "steps_per_run": steps_per_run, "live_extra_seconds_per_run": extra,
            "break_even_runs": score_wall / extra if extra > 0 else None,
            "micro_batch_size": micro_batch_size, "seq_length": seq_length, "rounds": rounds}


def markdown(res: dict) -> str:
    n = res["break_even_runs"]
    return "\n".join([
        "| cache vs live teacher (SmolLM2-135M teacher, 6-layer student, fp32 CPU) | result | goal |",
        "|---|---|---|",
        f"| cached vs live-teacher step time | **{res['ratio']:.2f}×** (live {res['live_step_s']:.2f} s vs cached "
        f"{res['cached_step_s']:.2f} s per step, median of the steady steps of {res['rounds']} interleaved runs each; "
        f"same micro-batches: {'yes' if res['same_micro_batches'] else 'NO'}) | ≥ 2.0× |",
        f"| break-even student runs | **{n:.2f}** runs of one epoch (the teacher pass: {res['score_seconds']:.0f} s for "
        f"{res['corpus_samples']} samples / {res['corpus_tokens']} scored tokens, engine start included; the live "
        f"teacher adds {res['live_extra_seconds_per_run']:.0f} s per run of {res['steps_per_run']:.1f} steps) | (report) |"
        if n is not None else "| break-even student runs | never: the live step was not slower | (report) |",
        "",
        "N* = S / ((L − C) · steps per run): from the second run on, every run from the cache saves the live "
        "teacher's forward passes; a run of E epochs reaches break-even after N*/E runs.",
    ])
