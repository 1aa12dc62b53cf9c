"""Generate stage: prompts -> student rollouts, sampled with vLLM, written as one rollout shard per task.

    gkd generate                                            # configs/generate.yaml: SmolLM2 student, reasoning-gym
    gkd generate --config configs/generate.yaml n=8 temperature=0.7
    gkd generate --prompts data.jsonl --student runs/export/step-200 --out runs/rollouts/v200 policy_version=200
    gkd generate --prompts data.jsonl --student BASE --adapter LORA_DIR --out DIR --shard 3 --num-shards 8

The loop: load prompts -> keep this task's share (`assign_shard` over the prompt id, so the union of N tasks equals
an unsharded run) -> chat template once, ids straight to vLLM -> sample with a per-request seed derived from
(seed, prompt id), so a sample does not depend on batching, sharding or other prompts -> rows -> one atomic shard
`rollouts-IIIII-of-NNNNN.parquet`. A rerun of a finished task is a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.config import ConfigError, load_config, parse_overrides
from pipeline.engine import EngineArgs, engine_version, on_cpu, open_engine
from pipeline.generate.prompts import Prompt, PromptError, load_prompts, prompt_ids
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import assign_shard, rollout_row, shard_lock, shard_name, write_rollouts
from pipeline.store.shards import ShardError, is_complete, read_marker

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "generate.yaml"
CHUNK = 512  # prompts per vLLM call: bounds the request queue; per-request seeds make chunking invisible
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


@dataclass
class GenerateConfig:
    prompts: str = "reasoning-gym:basic_arithmetic?size=16&seed=0"
    prompt_field: str = "prompt"
    messages_field: str | None = None  # when set, used instead of prompt_field
    id_field: str | None = None  # default: the row index
    teacher_prompt_field: str | None = None  # OPSD: a text/chat field the teacher sees instead of the prompt
    tag_fields: list[str] = field(default_factory=list)  # fields copied into the rollout tags (routing)
    student: str | None = None  # HF folder or trainer export; null = the embedded SmolLM2 student
    adapter: str | None = None  # peft LoRA folder applied to `student` through vLLM's LoRARequest
    out: str = "runs/rollouts"
    shard: int | None = None  # default: $SLURM_ARRAY_TASK_ID, else 0
    num_shards: int = 1  # explicit: a resubmitted single array task sees SLURM_ARRAY_TASK_COUNT=1
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS
    seed: int = 0
    logprobs: bool = False  # store the student's (raw) logprob of each sampled token
    policy_version: int = 0  # trainer step of the student weights
    on_bad_prompt: str = "error"  # error | skip (empty, or longer than max_model_len - max_tokens)
    expect_tokenizer_fingerprint: str | None = None
    dtype: str | None = None  # null: float32 on CPU (vLLM's "auto" picks bfloat16 there), "auto" on GPU
    max_model_len: int | None = None
    kv_cache_gib: float = 2.0
    enforce_eager: bool = False  # skip torch.compile warm-up (~90 s on 2 CPU cores)
    tensor_parallel_size: int = 1

    def validate(self) -> list[str]:
        p = []
        if self.on_bad_prompt not in ("error", "skip"):
            p.append(f"on_bad_prompt: 'error' or 'skip', got {self.on_bad_prompt!r}")
        if self.num_shards < 1 or (self.shard is not None and not 0 <= self.shard < self.num_shards):
            p.append(f"shard {self.shard} is not in [0, num_shards={self.num_shards})")
        if self.n < 1 or self.max_tokens < 1:
            p.append("n and max_tokens must be >= 1")
        if not 0 < self.top_p <= 1 or self.temperature < 0:
            p.append("need 0 < top_p <= 1 and temperature >= 0")
        return p


@dataclass
class Result:
    rows: list[dict]
    texts: list[str]  # vLLM's detokenised completions, row-aligned (for checks; not stored)
    stats: dict[str, Any]


def request_seed(seed: int, prompt_id: str) -> int:
    """Seed of one prompt's request; vLLM gives its n samples seed + 0..n-1."""
    h = hashlib.blake2b(f"{seed}|{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (1 << 31)


def generate(llm: Any, tokenizer: Any, prompts: list[Prompt], cfg: GenerateConfig, *, lora: Any = None) -> Result:
    """Sample `cfg.n` completions per prompt with an open engine; bad prompts are refused or skipped per config."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    limit = llm.llm_engine.model_config.max_model_len - cfg.max_tokens
    todo: list[tuple[Prompt, list[int]]] = []
    skipped: Counter[str] = Counter()
    for p in prompts:
        ids = [] if p.empty else prompt_ids(tokenizer, p.messages)
        reason = "empty" if p.empty else "too_long" if len(ids) > limit else None
        if reason is None and p.teacher_messages == []:
            reason = "empty_teacher_prompt"
        if reason and cfg.on_bad_prompt == "error":
            if reason == "empty_teacher_prompt":
                what, fix = f"has an empty {cfg.teacher_prompt_field or 'teacher prompt'} field", "give it text"
            else:
                what = (f"is {reason.replace('_', ' ')} (field {cfg.messages_field or cfg.prompt_field!r}, {len(ids)} "
                        f"tokens, limit max_model_len - max_tokens = {limit})")
                fix = "give it text" if reason == "empty" else "raise max_model_len, lower max_tokens"
            raise PromptError(f"{cfg.prompts}: prompt {p.prompt_id!r} {what}; {fix}, or pass on_bad_prompt=skip to "
                              "skip and count it")
        if reason:
            skipped[reason] += 1
        else:
            todo.append((p, ids))

    rows, texts, finish = [], [], Counter()
    tokens, start = 0, time.perf_counter()
    bar = tqdm(total=len(todo), unit="prompt", desc="generate", disable=None)
    for lo in range(0, len(todo), CHUNK):
        chunk = todo[lo: lo + CHUNK]
        params = [
            SamplingParams(
                n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                stop_token_ids=list(cfg.stop_token_ids), seed=request_seed(cfg.seed, p.prompt_id),
                logprobs=0 if cfg.logprobs else None,  # 0 = only the sampled token's logprob
            )
            for p, _ in chunk
        ]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in chunk], params,
                               use_tqdm=False, lora_request=lora)
        for (p, ids), out in zip(chunk, outputs, strict=True):
            # the student sampled from its own prompt; the teacher will score its privileged one (OPSD)
            teacher = None if p.teacher_messages is None else prompt_ids(tokenizer, p.teacher_messages)
            for c in out.outputs:
                logprobs = None
                if cfg.logprobs:
                    logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                rows.append(rollout_row(
                    prompt_id=p.prompt_id, prompt_ids=ids, completion_ids=c.token_ids, source="student",
                    policy_version=cfg.policy_version, completion_logprobs=logprobs,
                    finish_reason=c.finish_reason, tags=p.tags, teacher_prompt_ids=teacher,
                ))
                texts.append(c.text)
                finish[c.finish_reason] += 1
                tokens += len(c.token_ids)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    seconds = time.perf_counter() - start
    stats = {
        "prompts": len(todo), "skipped": dict(skipped), "samples": len(rows), "tokens": tokens,
        "seconds": round(seconds, 2), "tok_s": round(tokens / max(seconds, 1e-9), 1), "finish": dict(finish),
    }
    return Result(rows, texts, stats)


def task_prompts(cfg: GenerateConfig, shard: int) -> list[Prompt]:
    prompts = load_prompts(cfg.prompts, prompt_field=cfg.prompt_field, messages_field=cfg.messages_field,
                           id_field=cfg.id_field, teacher_prompt_field=cfg.teacher_prompt_field,
                           tag_fields=cfg.tag_fields)
    return [p for p in prompts if assign_shard(p.prompt_id, cfg.num_shards) == shard]


def output_path(cfg: GenerateConfig, shard: int) -> Path:
    return Path(cfg.out) / f"{shard_name('rollouts', shard, cfg.num_shards)}.parquet"


def check_tokenizer(tokenizer: Any, cfg: GenerateConfig) -> str:
    """The student's tokenizer fingerprint; refuse a student whose tokenizer differs from the declared one."""
    fp = tokenizer_fingerprint(tokenizer)
    declared = [(f"expect_tokenizer_fingerprint={cfg.expect_tokenizer_fingerprint}", cfg.expect_tokenizer_fingerprint)]
    for p in sorted(Path(cfg.out).glob("*.parquet")):
        marker = read_marker(p) or {}
        declared.append((f"{p}.ok", marker.get("tokenizer_fingerprint")))
    for where, expected in declared:
        if expected and expected != fp:
            raise ConfigError(f"student tokenizer {fp} differs from the rollouts' tokenizer {expected} ({where}); "
                              "rollouts of different tokenizers cannot share a directory or a teacher cache")
    return fp


def run_task(llm: Any, tokenizer: Any, cfg: GenerateConfig, shard: int, *, lora: Any = None) -> Result:
    """One task: its share of the prompts -> one complete shard with the tokenizer fingerprint in its marker."""
    fp = check_tokenizer(tokenizer, cfg)
    result = generate(llm, tokenizer, task_prompts(cfg, shard), cfg, lora=lora)
    extra = {
        "tokenizer_fingerprint": fp, "student": str(cfg.student), "adapter": cfg.adapter,
        "policy_version": cfg.policy_version, "prompts": cfg.prompts, "shard": shard, "num_shards": cfg.num_shards,
        "seed": cfg.seed, "n": cfg.n, "temperature": cfg.temperature, "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens, "engine": engine_version(), **{k: result.stats[k] for k in ("skipped", "finish")},
    }
    write_rollouts(output_path(cfg, shard), result.rows, tokenizer_fingerprint=fp, extra=extra)
    return result


def parse_args(argv: list[str]) -> GenerateConfig:
    ap = argparse.ArgumentParser(prog="gkd generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help=f"YAML config (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[1])})")
    for flag in ("prompts", "student", "adapter", "out", "teacher-prompt-field"):
        ap.add_argument(f"--{flag}")
    for flag in ("shard", "num-shards", "n", "max-tokens", "seed", "policy-version"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--logprobs", action="store_true", default=None, help="store the student's token logprobs")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="any config key")
    args = ap.parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "overrides") and v is not None}
    return load_config(GenerateConfig, args.config or DEFAULT_CONFIG, {**flags, **parse_overrides(args.overrides)},
                       section="generate")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
        if cfg.shard is None:
            cfg.shard = int(os.environ.get("SLURM_ARRAY_TASK_ID", 0))
            if not 0 <= cfg.shard < cfg.num_shards:
                raise ConfigError(f"$SLURM_ARRAY_TASK_ID={cfg.shard} needs num_shards > {cfg.shard} (pass --num-shards)")
        path = output_path(cfg, cfg.shard)
        # One process per task and output: a second one (a resubmitted task overlapping a running one) is refused
        # at once, naming the first, instead of sampling everything again and failing at the write.
        with shard_lock(path, f"gkd generate task {cfg.shard}/{cfg.num_shards} into {cfg.out}"):
            if is_complete(path, "rollout"):
                print(f"gkd generate: {path} is complete; nothing to do")
                return 0
            result = _run(cfg)
    except (ConfigError, PromptError, FileNotFoundError, ShardError) as e:
        print(f"gkd generate: {e}", file=sys.stderr)
        return 2
    s = result.stats
    print(f"gkd generate: {path}: {s['prompts']} prompts ({sum(s['skipped'].values())} skipped {s['skipped']}), "
          f"{s['samples']} samples, {s['tokens']} tokens in {s['seconds']} s = {s['tok_s']} tok/s, "
          f"finish {s['finish']}")
    return 0


def _run(cfg: GenerateConfig) -> Result:
    """The task of `main`: tokenizer check, engine, samples, the shard."""
    if cfg.student is None:
        from pipeline.assets import student_dir

        cfg.student = str(student_dir())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.student)
    check_tokenizer(tokenizer, cfg)  # before the engine starts: fail in seconds, not minutes
    lora, max_rank = None, 16
    if cfg.adapter:
        import json

        from vllm.lora.request import LoRARequest

        rank = json.loads((Path(cfg.adapter) / "adapter_config.json").read_text())["r"]
        max_rank = next(r for r in LORA_RANKS if r >= rank)
        lora = LoRARequest("adapter", 1, str(cfg.adapter))
    engine = EngineArgs(
        model=cfg.student, dtype=cfg.dtype or ("float32" if on_cpu() else "auto"), max_model_len=cfg.max_model_len,
        kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size, enable_lora=lora is not None, max_lora_rank=max_rank,
    )
    with open_engine(engine) as llm:
        return run_task(llm, tokenizer, cfg, cfg.shard, lora=lora)


if __name__ == "__main__":
    raise SystemExit(main())
