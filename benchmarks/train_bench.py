"""Trainer-side benchmarks: the loader (scored shards -> micro-batch tensors) and train-step tokens/s of the
embedded-default student (SmolLM2 6-layer, Megatron-Core, fp32, CPU), full and LoRA, on a real SmolLM2 top-64 cache.

    python -m benchmarks.run --only train

Packing is measured on two caches scored here by the real teacher (vLLM, top-64), both built from token lengths
that matter for padding, not from what the text says:
- **mixed**: reasoning-gym questions with their (short) answers beside prose pieces of 32 .. seq_length tokens, the
  spread of real SFT sets (short answers next to long traces or documents);
- **demo-like**: the demo's prompts (reasoning-gym basic_arithmetic + chain_sum in the chat template) with
  completions of 8 .. 64 tokens (the demo's max_tokens) cut from prose, the demo cache's length distribution
  without running the sampler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

K = 64


def _math_rows(tokenizer, tasks: tuple[str, ...], per_task: int, seed: int) -> list[tuple[str, list[int], list[int]]]:
    """(prompt id, chat-templated prompt ids, answer ids + end of turn) of reasoning-gym questions."""
    import reasoning_gym

    out = []
    for task in tasks:
        for i, e in enumerate(reasoning_gym.create_dataset(task, size=per_task, seed=seed)):
            msgs = [{"role": "user", "content": e["question"]}]
            prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": str(e["answer"])}],
                                                 tokenize=True, return_dict=False)
            out.append((f"{task}-{seed}-{i}", list(prompt), list(full[len(prompt):])))
    return out


def build_rollouts(out: Path, tokenizer, seq_length: int = 512, seed: int = 0) -> dict[str, Path]:
    """Rollout folders `mixed` and `demo` (see the module docstring)."""
    from benchmarks.score_bench import prose_text
    from pipeline.store.rollouts import rollout_row, write_rollouts

    rng = np.random.default_rng(seed)
    text, _ = prose_text()
    prose = tokenizer(text)["input_ids"]
    cursor = 0

    def cut(n: int) -> list[int]:
        nonlocal cursor
        if cursor + n > len(prose):
            cursor = 0
        cursor += n
        return prose[cursor - n : cursor]

    mixed = [rollout_row(prompt_id=pid, prompt_ids=p, completion_ids=c, source="dataset")
             for pid, p, c in _math_rows(tokenizer, ("basic_arithmetic", "chain_sum", "gsm_symbolic"), 60, seed)]
    for i in range(90):
        ids = cut(int(rng.integers(32, seq_length + 1)))
        mixed.append(rollout_row(prompt_id=f"prose-{i}", prompt_ids=ids[:1], completion_ids=ids[1:], source="dataset"))
    demo = [rollout_row(prompt_id=pid, prompt_ids=p, completion_ids=cut(int(rng.integers(8, 65))), source="student",
                        policy_version=0)
            for pid, p, _ in _math_rows(tokenizer, ("basic_arithmetic", "chain_sum"), 120, seed + 1)]
    dirs = {"mixed": out / "mixed", "demo": out / "demo"}
    write_rollouts(dirs["mixed"] / "r-00000-of-00001.parquet", mixed)
    write_rollouts(dirs["demo"] / "r-00000-of-00001.parquet", demo)
    return dirs


def build_caches(work: Path, seq_length: int = 512) -> dict[str, Path]:
    """Score the `mixed` and `demo` rollouts with the embedded teacher (one vLLM engine) into two caches."""
    from transformers import AutoTokenizer

    from pipeline.assets import teacher_dir
    from pipeline.engine import EngineArgs, open_engine
    from pipeline.score.run import ScoreConfig, score

    teacher = teacher_dir()
    dirs = build_rollouts(work / "train-rollouts", AutoTokenizer.from_pretrained(teacher), seq_length)
    caches = {name: work / f"cache-{name}" for name in dirs}
    args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=2049, kv_cache_gib=1.0,
                      max_num_batched_tokens=4096)
    with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        for name, rollouts in dirs.items():
            score(ScoreConfig(rollouts=str(rollouts), cache=str(caches[name]), teacher=str(teacher), topk=K,
                              max_model_len=2048, batch_tokens=4096), llm=llm)
    return caches


def run(cache: str | Path, work: Path, steps: int = 3, micro_batch_size: int = 8, seq_length: int = 512) -> dict:
    from pipeline.train.data import benchmark

    res = {"loader": benchmark([cache], micro_batch_size=micro_batch_size, seq_length=seq_length)}
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
    ])
