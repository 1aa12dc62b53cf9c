"""The generate stage's library: prompts -> student rollouts, sampled with vLLM, one rollout shard per task.

The entry (`gkd generate`, pipeline/generate/run.py) parses arguments and calls `run_generate`; the on-policy driver
and the demo call `sample_task` / `run_task` on engines they keep open.

The loop: load prompts -> keep this task's share (`assign_shard` over the prompt id, so the union of N tasks equals
an unsharded run) -> chat template once, ids straight to vLLM -> sample with a per-request seed derived from
(seed, prompt id), so a sample does not depend on batching, sharding or other prompts -> rows -> one atomic shard
`rollouts-IIIII-of-NNNNN.parquet`. A rerun of a finished task is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.assets import resolve_student
from pipeline.config import ConfigError
from pipeline.engine import EngineArgs, engine_version, on_cpu, open_engine
from pipeline.generate.prompts import (
    Prompt,
    PromptError,
    image_name,
    image_prompt_ids,
    load_prompts,
    prompt_ids,
    store_images,
    vision_processor,
)
from pipeline.store import images as image_store
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import assign_shard, rollout_row, shard_lock, shard_path, write_rollouts
from pipeline.store.shards import is_complete, read_marker

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
    # the prompts' images (paths relative to the prompt file, or datasets.Image bytes): a vision-language student
    # samples with them; stored in OUT/images/ and named by the rollouts (pipeline/store/images.py)
    image_field: str | None = None
    max_images_per_prompt: int = 3  # with image_field: vLLM's limit_mm_per_prompt
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
    pixels: dict[str, list] = {}  # prompt id -> its decoded images
    processor = None
    if any(p.images for p in prompts):  # the student's processor; a text-only student is refused, naming the field
        processor = vision_processor(cfg.student, ConfigError(
            f"image_field={cfg.image_field}: {cfg.student} is a text-only model (its config.json has no "
            "vision_config); sample image prompts with a vision-language student"))
    token = processor and image_store.image_token_id(json.loads((Path(cfg.student) / "config.json").read_text()))
    for p in prompts:
        ids = [] if p.empty else prompt_ids(tokenizer, p.messages)
        if p.images and not p.empty:
            if len(p.images) > cfg.max_images_per_prompt:
                raise PromptError(f"{cfg.prompts}: prompt {p.prompt_id!r} has {len(p.images)} images, more than "
                                  f"max_images_per_prompt={cfg.max_images_per_prompt}; raise it")
            pixels[p.prompt_id] = [image_store.decode(b, f"{cfg.prompts}: prompt {p.prompt_id!r}: image {i + 1}, "
                                                         f"{image_name(p, i)}") for i, b in enumerate(p.images)]
            ids = image_prompt_ids(processor, tokenizer, p.messages, pixels[p.prompt_id])
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
        requests = [TokensPrompt(prompt_token_ids=image_store.collapse(ids, token),
                                 multi_modal_data={"image": pixels[p.prompt_id]}) if p.prompt_id in pixels
                    else TokensPrompt(prompt_token_ids=ids) for p, ids in chunk]
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        for (p, ids), out in zip(chunk, outputs, strict=True):
            if p.prompt_id in pixels and list(out.prompt_token_ids) != ids:
                raise PromptError(f"{cfg.prompts}: prompt {p.prompt_id!r}: the engine expanded its images to "
                                  f"{len(out.prompt_token_ids)} prompt tokens, the student's processor to {len(ids)}; "
                                  "the engine and the processor of the student folder differ")
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
                    images=[image_store.image_hash(b) for b in p.images] if p.prompt_id in pixels else None,
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
                           tag_fields=cfg.tag_fields, image_field=cfg.image_field)
    return [p for p in prompts if assign_shard(p.prompt_id, cfg.num_shards) == shard]


def output_path(cfg: GenerateConfig, shard: int) -> Path:
    return shard_path(cfg.out, "rollouts", shard, cfg.num_shards)


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


def run_task(llm: Any, tokenizer: Any, cfg: GenerateConfig, shard: int, *, lora: Any = None,
             prompts: list[Prompt] | None = None, marker: dict | None = None) -> Result:
    """One task on an open engine: its share of the prompts (or `prompts`, already chosen by the caller) -> one
    complete shard with the tokenizer fingerprint in its marker (`marker`: more marker fields, or other values)."""
    fp = check_tokenizer(tokenizer, cfg)
    prompts = task_prompts(cfg, shard) if prompts is None else prompts
    result = generate(llm, tokenizer, prompts, cfg, lora=lora)
    extra = {
        "tokenizer_fingerprint": fp, "student": str(cfg.student), "adapter": cfg.adapter,
        "policy_version": cfg.policy_version, "prompts": cfg.prompts, "shard": shard, "num_shards": cfg.num_shards,
        "seed": cfg.seed, "n": cfg.n, "temperature": cfg.temperature, "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens, "engine": engine_version(), **{k: result.stats[k] for k in ("skipped", "finish")},
        **(marker or {}),
    }
    store_images(Path(cfg.out), prompts, result.rows)
    write_rollouts(output_path(cfg, shard), result.rows, tokenizer_fingerprint=fp, extra=extra)
    return result


def sample_task(cfg: GenerateConfig, shard: int, load_tokenizer: Callable[[], Any],
                engine: Callable[[], tuple[Any, Any]], *, prompts: list[Prompt] | None = None,
                marker: dict | None = None) -> Result | None:
    """One generate task with all of the stage's rules: the task's lock for the whole run (a second process of the
    same task and output is refused at once, naming the first), a complete shard is a no-op (None), the tokenizer
    is checked before the engine starts (fail in seconds, not minutes), then `run_task`. `engine()` returns the
    open engine and the LoRARequest to sample with (or None)."""
    path = output_path(cfg, shard)
    with shard_lock(path, f"gkd generate task {shard}/{cfg.num_shards} into {cfg.out}"):
        if is_complete(path, "rollout"):
            return None
        tokenizer = load_tokenizer()
        check_tokenizer(tokenizer, cfg)
        llm, lora = engine()
        return run_task(llm, tokenizer, cfg, shard, lora=lora, prompts=prompts, marker=marker)


def lora_rank_limit(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of rank `rank`: the smallest allowed value that holds it."""
    return next(r for r in LORA_RANKS if r >= max(rank, 1))


def engine_args(cfg: GenerateConfig, *, lora_rank: int | None = None) -> EngineArgs:
    """The sampler engine of a generate config (`lora_rank`: the adapter's rank, None: no LoRA)."""
    return EngineArgs(
        model=str(cfg.student), dtype=cfg.dtype or ("float32" if on_cpu() else "auto"),
        max_model_len=cfg.max_model_len, kv_cache_gib=cfg.kv_cache_gib, seed=cfg.seed,
        enforce_eager=cfg.enforce_eager, tensor_parallel_size=cfg.tensor_parallel_size,
        enable_lora=lora_rank is not None, max_lora_rank=16 if lora_rank is None else lora_rank_limit(lora_rank),
        extra={"limit_mm_per_prompt": {"image": cfg.max_images_per_prompt}} if cfg.image_field else {},
    )


def run_generate(cfg: GenerateConfig) -> Result | None:
    """`gkd generate`'s task `cfg.shard`: its own engine (with the adapter, if any); None when the shard was complete."""

    cfg.student = str(resolve_student(cfg.student))

    def load_tokenizer() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.student)

    with contextlib.ExitStack() as stack:
        def engine() -> tuple[Any, Any]:
            lora, rank = None, None
            if cfg.adapter:
                from vllm.lora.request import LoRARequest

                rank = json.loads((Path(cfg.adapter) / "adapter_config.json").read_text())["r"]
                lora = LoRARequest("adapter", 1, str(cfg.adapter))
            return stack.enter_context(open_engine(engine_args(cfg, lora_rank=rank))), lora

        return sample_task(cfg, cfg.shard, load_tokenizer, engine)
