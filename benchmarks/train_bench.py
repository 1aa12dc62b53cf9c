"""Trainer-side benchmarks: the loader (scored shards -> micro-batch tensors) and train-step tokens/s of the
embedded-default student (SmolLM2 6-layer, Megatron-Core, fp32, CPU), full and LoRA, on a real SmolLM2 top-64 cache.

    python -m benchmarks.run --only train
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run(cache: str | Path, work: Path, steps: int = 3, micro_batch_size: int = 8, seq_length: int = 512) -> dict:
    from benchmarks import step_bench
    from pipeline.train.data import benchmark

    res = {"loader": benchmark([cache], micro_batch_size=micro_batch_size, seq_length=seq_length)}
    res["compute"] = step_bench.run(cache)  # attention backend; our step vs a plain transformers loop
    for name, extra in (("train", []), ("train_lora", ["lora.rank=16", "lora.alpha=32"])):
        save = work / f"{name}-bench"
        cmd = [sys.executable, "-m", "pipeline", "train", "student=default", f"cache=[{cache}]",
               f"micro_batch_size={micro_batch_size}", f"global_batch_size={micro_batch_size}",
               f"seq_length={seq_length}", f"train_steps={steps}", "warmup_steps=1", f"save_dir={save}",
               f"save_interval={steps}", "progress=false", *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = [json.loads(line) for line in open(save / "metrics.jsonl")]
        steady = metrics[1:] or metrics  # the first step includes one-off warm-up
        res[name] = {"steps": len(metrics), "micro_batch_size": micro_batch_size, "seq_length": seq_length,
                     "tokens_per_s": sum(m["tokens_per_s"] for m in steady) / len(steady),
                     "checkpoint_bytes": sum(f.stat().st_size for f in (save / f"step_{steps:07d}").rglob("*")
                                             if f.is_file())}
    return res


def markdown(res: dict) -> str:
    from benchmarks import step_bench

    ld, tr = res["loader"], res["train"]
    return "\n".join([
        "| trainer side (real SmolLM2 top-64 cache) | tokens/s | goal |",
        "|---|---|---|",
        f"| loader: scored shards → micro-batch tensors (k={ld['k']}, one core, no prefetch thread, "
        f"{ld['epochs']} epochs of {ld['samples']} samples, each decoded afresh) | "
        f"{ld['tokens_per_s']:.0f} ({ld['scored_tokens_per_s']:.0f} scored) | ≥ 1,000,000 |",
        f"| train step, SmolLM2 6-layer student, micro-batch {tr['micro_batch_size']}, seq ≤ {tr['seq_length']}, fp32 CPU | "
        f"{tr['tokens_per_s']:.0f} | (report) |",
        f"| same, LoRA rank 16 on all linear layers (base frozen) | {res['train_lora']['tokens_per_s']:.0f} "
        f"({res['train_lora']['tokens_per_s'] / tr['tokens_per_s']:.2f}× full) | (report) |",
        "",
        f"Checkpoint size (model + optimizer state): full {tr['checkpoint_bytes'] / 2**20:.0f} MiB, LoRA "
        f"{res['train_lora']['checkpoint_bytes'] / 2**20:.1f} MiB (adapter and its Adam moments only).",
        "",
        "| trainer compute (SmolLM2 6-layer student, fp32 CPU, benchmarks/step_bench.py) | ratio | goal |",
        "|---|---|---|",
        *step_bench.markdown(res["compute"]),
    ])
