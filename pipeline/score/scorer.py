"""Score stage, the library: rollouts -> the teacher's sparse top-k logprobs in the content-keyed cache.

`score(cfg)` runs one score task (`ScoreConfig`); `pipeline/score/run.py` is its command line (`gkd score`).

One sample's path: rollout row (prompt_ids + completion_ids) -> input_ids x_0..x_{L-1}, P = len(prompt_ids) ->
content key -> (skipped if cached) -> vLLM prompt_logprobs: entry j >= 1 is the teacher distribution of x_j given
x_<j (entry 0 is empty) -> positions j = P..L-1 stored as top-k ids/logprobs, the actual token's rank/logprob and the
tail -> a part shard `scored-<tag>-<task>-pNNNN.parquet` -> the task marker `tasks/<tag>-<task>.done`, written last.

Privileged-context teacher (OPSD): a rollout with `teacher_prompt_ids` T is scored on T + completion (the engine's
positions |T|..) and stored as the student sees it, input_ids = prompt + completion with first_scored = P, so the
trainer pairs stored row i (completion token i, given T and the completion before it) with the student's logits on
prompt + completion at the same completion token. Its content key covers T.

A rerun skips scored keys (so a killed task resumes where its last complete part ended) and a finished task is a
no-op. Rows go to tasks by a hash of their content key, so identical sequences always meet in the same task.
"""

from __future__ import annotations

import array
import contextlib
import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import assets
from pipeline.config import ConfigError
from pipeline.engine import (
    ARRAY_LOGPROBS_FLAG,
    ArrayPromptLogprobs,
    EngineArgs,
    array_prompt_logprobs,
    engine_version,
    open_engine,
)
from pipeline.errors import UserError
from pipeline.score.adapter import merged_teacher
from pipeline.score.served import ServedTeacher, reconcile_probe, url_problems
from pipeline.score.writer import BatchWriter
from pipeline.slurm.arrays import array_spec, shard_index
from pipeline.store import Descriptor, TeacherCache, align
from pipeline.store import images as image_store
from pipeline.store.cache import DESCRIPTOR
from pipeline.store.codec import CodecError, check_top_p
from pipeline.store.codec import params as codec_params
from pipeline.store.fingerprint import (
    FINGERPRINT_SCHEME,
    adapter_fingerprint,
    check_tokenizer_files,
    teacher_fingerprint,
    tokenizer_fingerprint,
)
from pipeline.store.model_config import vocab_size as model_vocab_size
from pipeline.store.rollouts import (
    assign_shard,
    first_scored,
    iter_rollouts,
    rollout_key,
    rollout_shards,
    tokenizer_mismatches,
)
from pipeline.store.schema import check_arrow_schema, load_schema
from pipeline.store.shards import ShardError, read_marker
from pipeline.store.tasks import (
    missing_score_tasks,
    rollouts_tag,
    task_done,
    task_lock,
    task_marker,
    task_name,
    write_result,
)

LOGPROB_MODES = ("raw_logprobs", "processed_logprobs")
# vLLM's spellings of the scoring dtypes -> one name each ("auto" is refused: it resolves per machine and model).
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
# engine_extra options that only change scheduling, memory or placement, never the logprobs of a sequence; every
# other engine_extra option is part of the cache's identity (`scoring_numerics`), so an unknown one cannot mix.
NEUTRAL_ENGINE_OPTIONS = frozenset({
    "block_size", "cpu_offload_gb", "disable_log_stats", "distributed_executor_backend", "enable_prefix_caching",
    "max_num_seqs", "max_seq_len_to_capture", "pipeline_parallel_size", "seed", "swap_space",
})
# ScoreConfig keys that engine_extra must not override (they are passed to vLLM already)
_OWN_KEYS = ("dtype", "logprobs_mode", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization",
             "max_num_batched_tokens", "enforce_eager", "model", "tokenizer", "max_logprobs", "enable_lora")


@dataclass
class ScoreConfig:
    rollouts: str = "runs/rollouts"
    cache: str = "runs/cache"
    teacher: str = "default"  # an HF folder; "default" = SmolLM2-135M-Instruct built by pipeline.assets
    teacher_adapter: str | None = None  # a peft LoRA folder on top of `teacher`, merged for scoring (score/adapter.py)
    merge_dir: str | None = None  # where the merged teacher is written (needs one base's size); null: $TMPDIR
    # A served teacher (score/served.py): a vLLM OpenAI-compatible server scores instead of an engine in this
    # process; `teacher` then only supplies the tokenizer and config.json (its weights are not read)
    teacher_url: str | None = None  # e.g. http://HOST:PORT/v1
    teacher_model: str | None = None  # the served model name (--served-model-name); null: the server's only model
    served_inflight_tokens: int = 16384  # tokens of requests at the server at once (keeps its scheduler fed)
    served_concurrency: int = 16  # HTTP requests at once (one rollout each)
    served_retries: int = 12  # per request, by the openai client: timeouts, connection errors, 408/409/429/5xx
    served_timeout_s: float = 600.0  # per request
    # The variable holding the server's API key (sent as a bearer token; the key is never a config value, so it is
    # never written with one); null: OPENAI_API_KEY, then VLLM_API_KEY (score/served.py `api_key_from_env`).
    teacher_api_key_env: str | None = None
    topk: int = 64  # k; with topp the cap of the kept entries; 0: only the actual token's logprob and rank
    topp: float | None = None  # variable k: keep the fewest top entries with teacher mass >= topp (None: fixed k)
    min_k: int | None = None  # with topp: at least this many per position (default 1)
    score_prompt: bool = False  # score every position from x_1 on, not just the completion
    # Routing (several teachers): score only the rollouts whose tags[tag_key] is one of `tags` ([] = all of them)
    tags: list[str] = field(default_factory=list)
    tag_key: str = "data_source"
    shard: int | None = None  # gkd score: default $SLURM_ARRAY_TASK_ID (read by score/run.py), else 0
    num_shards: int = 1  # explicit: a resubmitted single array index sees SLURM_ARRAY_TASK_COUNT=1
    on_overlong: str = "error"  # error | skip
    logprob_mode: str = "raw_logprobs"
    codec: str = "rank-grid-esc"  # rank-grid-esc: compact, logprobs within 1/64 nat | exact-f32: lossless, larger
    # vLLM engine pass-through
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.85
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    # Image rollouts: the engine's limit_mm_per_prompt; null: the most images of a rollout this task scores (an
    # engine handed in, e.g. the on-policy driver's, was opened with its own)
    max_images_per_prompt: int | None = None
    batch_tokens: int = 8192  # token budget of one vLLM call
    part_rows: int = 512  # rows per output part: bounds memory, and what a killed task loses
    # engine batches waiting for the writer thread (score/writer.py), which extracts, encodes and writes them while
    # the engine scores the next; 0: all of that in the engine's thread, between its calls (same shards, slower)
    write_queue: int = 2
    engine_extra: dict = field(default_factory=dict)
    # Cross-tokenizer scoring (pipeline/store/align.py): rollouts tokenized by another tokenizer than the teacher's
    # are decoded to text, retokenized by the teacher and stored per teacher token with character spans and the
    # alignment to the student's tokens (scored schema 1.3). Opt-in: without it such rollouts are refused.
    cross_tokenizer: bool = False
    student_tokenizer: str | None = None  # a folder with the rollouts' tokenizer (its fingerprint must be theirs)
    on_mismatch: str = "skip"  # a sample whose text does not round-trip: skip (reported, counted) | error

    @property
    def resolved_min_k(self) -> int | None:
        return (1 if self.min_k is None else self.min_k) if self.topp is not None else self.min_k

    def validate(self) -> list[str]:
        p = []
        if self.topk < 0:
            p.append(f"topk must be >= 0, got {self.topk}")
        try:
            check_top_p(self.topk, self.topp, self.resolved_min_k)
            codec_params(self.codec, self.topp)
        except CodecError as e:
            p.append(str(e))
        if self.num_shards < 1:
            p.append(f"num_shards must be >= 1, got {self.num_shards}")
        if self.shard is not None and not 0 <= self.shard < self.num_shards:
            p.append(f"shard {self.shard} is outside [0, num_shards={self.num_shards})")
        if self.on_overlong not in ("error", "skip"):
            p.append(f"on_overlong must be 'error' or 'skip', got {self.on_overlong!r}")
        if self.logprob_mode not in LOGPROB_MODES:
            p.append(f"logprob_mode must be one of {LOGPROB_MODES}, got {self.logprob_mode!r}")
        if any(not isinstance(t, str) or not t for t in self.tags):
            p.append(f"tags must be non-empty strings (--tags math,code), got {self.tags!r}")
        if self.max_images_per_prompt is not None and self.max_images_per_prompt < 1:
            p.append(f"max_images_per_prompt must be >= 1 (or null: from the rollouts), got {self.max_images_per_prompt}")
        if self.batch_tokens < 1 or self.part_rows < 1:
            p.append("batch_tokens and part_rows must be >= 1")
        if self.write_queue < 0:
            p.append(f"write_queue must be >= 0 (0: no writer thread), got {self.write_queue}")
        if self.dtype not in DTYPES:
            p.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}: the scoring dtype is part of the "
                     "cache's identity, so name it ('auto' resolves differently per machine and model)")
        if self.teacher_url is not None:
            p += url_problems(self.teacher_url)
            if self.teacher_adapter:
                p.append("teacher_adapter cannot be applied to a served teacher: serve the merged model instead")
            if min(self.served_inflight_tokens, self.served_concurrency) < 1 or self.served_retries < 0 \
                    or self.served_timeout_s <= 0:
                p.append("served_inflight_tokens and served_concurrency must be >= 1, served_retries >= 0, "
                         "served_timeout_s > 0")
        elif self.teacher_model is not None:
            p.append("teacher_model names a served model: pass teacher_url too (--teacher-url http://HOST:PORT/v1)")
        if self.on_mismatch not in ("skip", "error"):
            p.append(f"on_mismatch must be 'skip' or 'error', got {self.on_mismatch!r}")
        if self.cross_tokenizer:
            if not self.student_tokenizer:
                p.append("cross_tokenizer=true needs student_tokenizer=DIR (the folder of the tokenizer the rollouts "
                         "were made with: the student's)")
            if self.score_prompt:
                p.append("cross_tokenizer=true scores completions only: drop score_prompt")
            if self.teacher_url:
                p.append("cross_tokenizer=true scores with an in-process teacher only: drop teacher_url")
        elif self.student_tokenizer:
            p.append("student_tokenizer is read with cross_tokenizer=true only: add it, or drop student_tokenizer")
        for key in sorted(set(self.engine_extra) & set(_OWN_KEYS)):
            p.append(f"engine_extra.{key}: set the score key {key.replace('logprobs_mode', 'logprob_mode')} instead")
        return p


class ScoreInputError(UserError, ValueError):
    """Bad rollouts: the message names the samples and the fix."""


class TeacherOutputError(UserError, ValueError):
    """The engine returned logprobs that cannot be stored (NaN, inf): the message names the sample and the fix."""


def scoring_numerics(cfg: ScoreConfig) -> dict[str, str]:
    """The engine settings that change the stored logprobs (besides teacher, k and logprob mode, which are
    descriptor fields of their own): the cache's `numerics`. Settings that change only the order of float sums
    (tensor_parallel_size, batch sizes, eager vs compiled) are not in it: vLLM is not batch-invariant anyway, so the
    same engine gives other last bits for another batch composition; they stay far below the codec's 1/64 nat."""
    extra = dict(cfg.engine_extra)
    out = {"dtype": DTYPES.get(cfg.dtype, cfg.dtype), "quantization": str(extra.pop("quantization", None) or "none"),
           "kv_cache_dtype": str(extra.pop("kv_cache_dtype", None) or "auto")}
    for key in sorted(set(extra) - NEUTRAL_ENGINE_OPTIONS):
        out[f"engine_extra.{key}"] = json.dumps(extra[key], sort_keys=True)
    return out


def check_engine_numerics(llm, numerics: dict[str, str]) -> None:
    """An engine handed in (the on-policy driver's) must score as this config says, or the cache would mix."""
    model_config = getattr(llm, "model_config", None) or llm.llm_engine.model_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    quant = str(getattr(model_config, "quantization", None) or "none")
    found = {"dtype": dtype, "quantization": quant}
    wrong = [f"{k}: engine has {found[k]!r}, the score config {numerics[k]!r}" for k in found if found[k] != numerics[k]]
    if wrong:
        raise ConfigError("the engine passed to score() does not score as configured: " + "; ".join(wrong))


def check_rollout_tokenizer(paths: list[Path], teacher_tokenizer: str, teacher: Path,
                            student_tokenizer: str | None = None) -> None:
    """Refuse rollouts whose ids come from another tokenizer than the teacher's (or, cross-tokenizer, than the
    configured student tokenizer's), or that do not say which one: the same vocab size with another mapping passes
    the vocab-range check and poisons the cache silently."""
    if student_tokenizer is not None:
        wrong = [f"{p} ({fp})" for p, fp in tokenizer_mismatches(paths, student_tokenizer)]
        if wrong:
            raise ScoreInputError(
                f"{len(wrong)} rollout shard(s) were not tokenized by student_tokenizer ({student_tokenizer}): "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; point student_tokenizer at the folder of "
                "the tokenizer that made them")
        return
    for p in paths:
        try:
            schema = pq.read_schema(p)
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{p}: not a readable Parquet file ({e}); delete it and its .ok marker and rerun the "
                             "task that wrote it") from e
        check_arrow_schema(schema, "rollout", p)  # a newer schema major: refused before any teacher work
    wrong = tokenizer_mismatches(paths, teacher_tokenizer)
    other = [f"{p} ({fp})" for p, fp in wrong if fp is not None]
    unknown = [p for p, fp in wrong if fp is None]
    if other:
        raise ScoreInputError(
            f"{len(other)} rollout shard(s) were tokenized by another tokenizer than the teacher's ({teacher}: "
            f"{teacher_tokenizer}): {', '.join(other[:5])}{' ...' if len(other) > 5 else ''}; the teacher scores "
            "token ids, so rollouts must be tokenized with its tokenizer (the student's must be the same one), or "
            "scored across tokenizers: cross_tokenizer=true student_tokenizer=DIR (docs/architecture.md, "
            "\"Cross-tokenizer distillation\")"
        )
    if unknown:
        raise ScoreInputError(
            f"{len(unknown)} rollout shard(s) record no tokenizer fingerprint: {', '.join(map(str, unknown[:5]))}"
            f"{' ...' if len(unknown) > 5 else ''}; write them with `gkd import` / `gkd generate`, or through "
            "pipeline.store.rollouts.write_rollouts(..., tokenizer_fingerprint=tokenizer_fingerprint(TOKENIZER))"
        )


# -- rows --------------------------------------------------------------------------------------------------------


@dataclass
class CrossTokenizer:
    """A cross-tokenizer score task's two tokenizers (pipeline/store/align.py) and their fingerprints."""

    student: Any
    teacher: Any
    student_fp: str
    teacher_fp: str
    mismatched: list[str] = field(default_factory=list)  # "sample: why" of the rows that do not round-trip

    @property
    def key(self) -> tuple[str, str]:
        return (self.teacher_fp, self.student_fp)


def cross_row(r: dict, cross: CrossTokenizer) -> dict | str:
    """A rollout as a cross-tokenizer row's fields (teacher ids as input_ids, spans), or why it cannot be one."""
    got = align.retokenize(cross.student, cross.teacher, r["prompt_ids"], r["completion_ids"])
    if isinstance(got, str):
        return got
    student_ids = np.asarray(r["prompt_ids"] + r["completion_ids"], np.int32)
    return {"input_ids": got.teacher_ids.astype(np.int32), "first_scored": got.teacher_first,
            "engine_ids": got.teacher_ids, "engine_first": got.teacher_first,
            "student_ids": student_ids, "student_first": len(r["prompt_ids"]),
            "teacher_char_ends": got.teacher_ends, "student_char_ends": got.student_ends,
            "span_student": got.span_student, "span_teacher": got.span_teacher}


def select_rows(
    cfg: ScoreConfig, rollouts: list[Path], teacher_fp: str, shard: int, vocab_size: int, max_len: int, counts: dict,
    image_token: int | None = None, cross: CrossTokenizer | None = None,
) -> list[dict]:
    """This task's rows, deduplicated by content key; bad input refused (or skipped and counted) before any work.
    `max_len` is the longest sequence the engine can score.

    A row with `teacher_prompt_ids` (OPSD) is scored on teacher_prompt_ids + completion_ids (`engine_ids`, its
    completion from `engine_first` on) and stored as the student sees it: input_ids = prompt_ids + completion_ids,
    first_scored = len(prompt_ids), so stored row i is still the teacher's distribution of completion token i."""
    rows: dict[str, dict] = {}
    too_big, overlong, privileged, pictured = [], [], [], []
    wanted = set(cfg.tags)
    for r in iter_rollouts(rollouts):
        if wanted and r["tags"].get(cfg.tag_key) not in wanted:
            counts["other_tags"] = counts.get("other_tags", 0) + 1  # another teacher's (or no teacher's) rows
            continue
        ids = np.asarray(r["prompt_ids"] + r["completion_ids"], dtype=np.int64)
        first = first_scored(r, cfg.score_prompt)
        teacher_prompt = r.get("teacher_prompt_ids")
        if teacher_prompt is not None and (cfg.score_prompt or not teacher_prompt):
            privileged.append(r["sample_id"])
            continue
        # the store's rule (rollouts.rollout_key): which rows are scored, under which content key
        key = rollout_key(r, teacher_fp, cfg.topk, cfg.logprob_mode, score_prompt=cfg.score_prompt,
                          cross=None if cross is None else cross.key)
        if key is None:
            counts["empty"] = counts.get("empty", 0) + 1
            continue
        if r.get("images"):
            problem = image_row_problem(r, image_token, cfg)
            if problem:
                pictured.append(f"sample {r['sample_id']}: {problem}")
                continue
        if cross is not None and (teacher_prompt is not None or r.get("images")):
            raise ScoreInputError(f"sample {r['sample_id']}: cross_tokenizer=true scores text rollouts without a "
                                  "privileged teacher prompt or images; score those with a same-tokenizer teacher")
        if assign_shard(key, cfg.num_shards) != shard or key in rows:
            continue
        if cross is not None:  # the teacher's tokens of the rollout's text, its spans (store/align.py)
            extra = cross_row(r, cross)
            if isinstance(extra, str):
                cross.mismatched.append(f"sample {r['sample_id']}: {extra}")
                counts["no_round_trip"] = counts.get("no_round_trip", 0) + 1
                continue
            if len(extra["engine_ids"]) > max_len:
                if cfg.on_overlong == "skip":
                    counts["overlong"] = counts.get("overlong", 0) + 1
                    continue
                overlong.append(r["sample_id"])
            rows[key] = {**r, "key": key, **extra}
            continue
        engine_ids, engine_first = ids, first
        if teacher_prompt is not None:
            engine_ids = np.asarray(teacher_prompt + r["completion_ids"], dtype=np.int64)
            engine_first = len(teacher_prompt)
        if max(ids.max(), engine_ids.max()) >= vocab_size or min(ids.min(), engine_ids.min()) < 0:
            too_big.append(r["sample_id"])
        if len(engine_ids) > max_len:
            if cfg.on_overlong == "skip":
                counts["overlong"] = counts.get("overlong", 0) + 1
                continue
            overlong.append(r["sample_id"])
        rows[key] = {**r, "key": key, "input_ids": ids.astype(np.int32), "first_scored": first,
                     "engine_ids": engine_ids, "engine_first": engine_first}
    if cross is not None and cross.mismatched and cfg.on_mismatch == "error":
        raise ScoreInputError(
            f"{cfg.rollouts}: {len(cross.mismatched)} rollout(s) do not round-trip through the text (decode, then "
            "encode gives other ids, so no exact alignment exists): " + "; ".join(cross.mismatched[:5])
            + (" ..." if len(cross.mismatched) > 5 else "") + "; pass on_mismatch=skip to skip and report them")
    if privileged:
        raise ScoreInputError(
            f"{len(privileged)} rollout(s) carry a teacher_prompt_ids that "
            + ("score_prompt cannot score (the teacher's prompt positions are not the student's)"
               if cfg.score_prompt else "is empty (the first completion token would have no context)")
            + f": {', '.join(privileged[:10])}" + (" ..." if len(privileged) > 10 else "")
            + ("; score them without score_prompt" if cfg.score_prompt else "; rebuild them with a non-empty teacher prompt")
        )
    if pictured:
        raise ScoreInputError(f"{cfg.rollouts}: {len(pictured)} rollout(s) with images cannot be scored: "
                              + "; ".join(pictured[:5]) + (" ..." if len(pictured) > 5 else ""))
    if too_big:
        raise ScoreInputError(
            f"{cfg.rollouts}: {len(too_big)} rollout(s) hold token ids (prompt_ids/completion_ids) outside the "
            f"teacher's vocabulary [0, {vocab_size}) — were they tokenized with another tokenizer? Re-create them "
            f"with the teacher's tokenizer (gkd import --tokenizer / gkd generate); sample ids: {', '.join(too_big[:10])}"
            + (" ..." if len(too_big) > 10 else "")
        )
    if overlong:
        raise ScoreInputError(
            f"{cfg.rollouts}: {len(overlong)} rollout(s) are longer than {max_len} tokens (max_model_len; a privileged "
            f"teacher prompt counts instead of the prompt): {', '.join(overlong[:10])}"
            + (" ..." if len(overlong) > 10 else "")
            + "; raise max_model_len or pass on_overlong=skip to skip and count them"
        )
    return list(rows.values())


def image_row_problem(row: dict, image_token: int | None, cfg: ScoreConfig) -> str | None:
    """Why a rollout with images cannot be scored as it is (None: it can): a text-only teacher, more images than
    the engine's limit, placeholders that are not one run per image, an image token in the completion, score_prompt
    (image placeholder positions carry no teacher distribution to store)."""
    n = len(row["images"])
    if image_token is None:
        return (f"it has {n} image(s), and the teacher is a text-only model (its config.json has no vision_config); "
                "score it with a vision-language teacher, or re-import the rows without --image-field")
    if cfg.max_images_per_prompt is not None and n > cfg.max_images_per_prompt:
        return (f"{n} images, more than max_images_per_prompt={cfg.max_images_per_prompt} (vLLM's "
                "limit_mm_per_prompt); raise it")
    if cfg.score_prompt:
        return "score_prompt=true cannot score a prompt with images (its placeholder positions); score without it"
    if image_token in row["completion_ids"]:
        return f"its completion holds the image token {image_token}; only prompts carry images"
    found = len(image_store.runs(row["prompt_ids"], image_token))
    if found != n:
        return (f"its prompt_ids hold {found} run(s) of the image token {image_token} for {n} image(s); re-import it "
                "with the teacher's processor")
    return None


def check_image_alignment(rows: list[dict], teacher: Path, image_token: int, rollouts: Path) -> None:
    """Before any engine work: every image of these rows loads, and the teacher's processor expands it to exactly
    as many placeholder tokens as the rollout holds (the student's processor made them). A mismatch is refused
    naming the sample, both counts and the likely cause."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(teacher)
    placeholder = getattr(processor, "image_token", None) or processor.tokenizer.decode([image_token])
    counts: dict[str, int] = {}
    for r in rows:
        images = r["images"]
        need = [h for h in images if h not in counts]
        for h, img in zip(need, image_store.load(rollouts, need, sample=r["sample_id"]), strict=True):
            ids = processor(text=[placeholder], images=[img])["input_ids"][0]
            counts[h] = int(sum(1 for t in ids if int(t) == image_token))
        for i, ((_, length), h) in enumerate(zip(image_store.runs(r["prompt_ids"], image_token), images, strict=True)):
            if length != counts[h]:
                raise ScoreInputError(
                    f"{rollouts}: sample {r['sample_id']}: image {i + 1} ({h}) has {length} placeholder tokens in the "
                    f"rollout (the student's processor) but the teacher's processor ({teacher}) expands it to "
                    f"{counts[h]}: another processor version, other max_pixels/min_pixels, or another template. "
                    "Re-import the rollouts with a processor that expands images as the teacher's does; nothing "
                    "was scored")


def token_batches(rows: list[dict], budget: int) -> list[list[dict]]:
    """Consecutive batches whose total length (of what the engine scores: `engine_ids` where a row has them) stays
    within the token budget (a longer row goes alone)."""
    batches, cur, used = [], [], 0
    for r in rows:
        n = len(r.get("engine_ids", r["input_ids"]))
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(r)
        used += n
    if cur:
        batches.append(cur)
    return batches


def _array(values, code: str, dtype) -> np.ndarray:
    """A vLLM output list (Python ints or floats) as an array: through `array.array`, ~25 % faster than
    `np.asarray` on lists (the same C casts; measured 19 vs 25 ns an entry), the larger part of this stage's
    per-token work at k=64 (k + 1 ids and logprobs per position)."""
    if isinstance(values, list):
        return np.frombuffer(array.array(code, values), dtype)
    return np.asarray(values, dtype=dtype)


def extract(flat, ids: np.ndarray, first: int, k: int) -> dict:
    """vLLM flat prompt logprobs of one sequence -> arrays for positions first..L-1.

    Each position j >= 1 holds entry 0 = the actual token x_j with its true rank, then ranks 1..k. (Should an
    engine drop the duplicate when x_j is itself in the top-k, the position has k entries and x_j is found there.)
    """
    if isinstance(flat, ArrayPromptLogprobs):
        return _extract_arrays(flat, ids, first, k)
    start = _array(flat.start_indices[first:], "q", np.int64)
    end = _array(flat.end_indices[first:], "q", np.int64)
    tok = _array(flat.token_ids, "q", np.int64)
    lp = _array(flat.logprobs, "f", np.float32)
    n = len(ids) - first
    if len(start) != n or np.any(end - start < k):
        raise RuntimeError(f"engine returned {len(start)} positions / short top-k rows; expected {n} x {k}+1")
    if np.all(end - start == k + 1):  # the common case, vectorised
        idx = start[:, None] + np.arange(1, k + 1)[None, :]
        actual_lp = lp[start]
        ranks = np.fromiter(map(flat.ranks.__getitem__, start.tolist()), np.int64, n)  # not all k + 1 per position
        if np.any(tok[start] != ids[first:]):
            raise RuntimeError("engine's actual-token entries do not match the input ids (alignment broken)")
        return {"topk_ids": tok[idx], "topk_logprobs": lp[idx], "actual_ranks": ranks, "actual_logprobs": actual_lp}
    top_ids = np.empty((n, k), np.int64)
    top_lp = np.empty((n, k), np.float32)
    actual_lp = np.empty(n, np.float32)
    ranks = np.empty(n, np.int64)
    for i, (s, e) in enumerate(zip(start, end, strict=True)):
        top_ids[i], top_lp[i] = tok[e - k : e], lp[e - k : e]
        hit = np.flatnonzero(top_ids[i] == ids[first + i])
        if e - s == k + 1:
            actual_lp[i], ranks[i] = lp[s], flat.ranks[s]
        elif hit.size:
            actual_lp[i], ranks[i] = top_lp[i, hit[0]], hit[0] + 1
        else:
            raise RuntimeError(f"position {first + i}: the actual token is missing from the engine output")
    return {"topk_ids": top_ids, "topk_logprobs": top_lp, "actual_ranks": ranks, "actual_logprobs": actual_lp}


def _extract_arrays(flat: ArrayPromptLogprobs, ids: np.ndarray, first: int, k: int) -> dict:
    """`extract` for the engine core's arrays (pipeline/engine.py): the same dict, dtypes and checks."""
    tok, lp, ranks = (a[first - 1:] for a in flat.arrays())  # row r: position r + 1
    n = len(ids) - first
    if first < 1 or len(tok) != n or tok.shape[1] != k + 1:
        raise RuntimeError(f"engine returned {len(tok)} positions of {tok.shape[1]} entries from position {first}; "
                           f"expected {n} x {k}+1")
    if np.any(tok[:, 0] != ids[first:]):
        raise RuntimeError("engine's actual-token entries do not match the input ids (alignment broken)")
    return {"topk_ids": tok[:, 1:].astype(np.int64), "topk_logprobs": np.ascontiguousarray(lp[:, 1:]),
            "actual_ranks": ranks.astype(np.int64), "actual_logprobs": lp[:, 0].copy()}


# -- the stage ---------------------------------------------------------------------------------------------------


def cache_fingerprint_scheme(cache: str | Path) -> int:
    """How the teacher fingerprint of the cache at `cache` was computed (a new cache: the current scheme), so a run
    adding rows to an old cache computes the fingerprint its keys were made with."""
    path = Path(cache) / DESCRIPTOR
    if not path.is_file():
        return FINGERPRINT_SCHEME
    return Descriptor.read(path).teacher_fingerprint_scheme


def resolve_teacher(name: str | Path | None) -> Path:
    """The score stage's teacher folder (`default` / null: the embedded one, pipeline.assets), checked to be one."""
    path = assets.resolve_teacher(name)
    if not (path / "config.json").exists():
        raise ConfigError(f"teacher: {path} is not a Hugging Face model folder (no config.json)")
    check_tokenizer_files(path)
    return path


def status(cfg: ScoreConfig) -> int:
    """Print which of the num_shards tasks are not done, as a ready `--array=` list; exit 1 if any."""
    paths = rollout_shards(cfg.rollouts)
    tag = rollouts_tag(paths, cfg.tags, cfg.tag_key)
    root = Path(cfg.cache)
    missing = missing_score_tasks(root, tag, cfg.num_shards)
    if not missing:
        print(f"all {cfg.num_shards} score tasks of rollouts {cfg.rollouts} ({tag}) are done")
        return 0
    print(f"{len(missing)} of {cfg.num_shards} score tasks missing; resubmit with:\n--array={array_spec(missing)}")
    return 1


def score(cfg: ScoreConfig, llm=None) -> dict:
    """Run one score task; returns its summary. `llm` lets a caller (tests, the on-policy driver) reuse an engine.
    A second process of the same task (same rollouts, shard and num_shards) is refused while the first runs."""
    with contextlib.ExitStack() as locks:
        return _score(cfg, llm, locks)


@dataclass
class _Task:
    """What `_open_task` found before any rollout is read: the teacher (folder, engine length, or a server), the
    rollout shards, the cache it scores into."""

    teacher: Path
    paths: list[Path]
    cross: CrossTokenizer | None
    vocab_size: int
    image_token: int | None
    engine_len: int
    served: Any
    teacher_fp: str
    cache: TeacherCache
    t0: float  # when the task's work began (the summary's seconds)


def _open_task(cfg: ScoreConfig, llm) -> _Task:
    """The checks before any work, cheap ones first, then the teacher's fingerprint and the cache (created, or
    opened and compared with this run's descriptor)."""
    problems = cfg.validate()  # also for configs built in code (the on-policy driver's), not only loaded ones
    if problems:
        raise ConfigError("; ".join(problems))
    teacher = resolve_teacher(cfg.teacher)
    t0 = time.time()
    from transformers import AutoConfig, AutoTokenizer

    # Cheap checks first: the rollouts' tokenizer against the teacher's, before the weights are even hashed.
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tok_fp = tokenizer_fingerprint(tokenizer)
    paths = rollout_shards(cfg.rollouts)
    if not paths:
        raise ScoreInputError(f"{cfg.rollouts}: no complete rollout shards (*.parquet with a .ok marker)")
    cross = cross_tokenizers(cfg, tokenizer, tok_fp, teacher) if cfg.cross_tokenizer else None
    check_rollout_tokenizer(paths, tok_fp, teacher, None if cross is None else cross.student_fp)
    numerics = scoring_numerics(cfg)
    if llm is not None:
        check_engine_numerics(llm, numerics)
    if cfg.teacher_adapter:
        if llm is not None:
            raise ConfigError("teacher_adapter cannot score through an engine passed to score(): the stage merges the "
                              "adapter into a temporary teacher folder and opens its own engine on it (llm=None)")
        if not (Path(cfg.teacher_adapter) / "adapter_config.json").exists():
            raise ConfigError(f"teacher_adapter: {cfg.teacher_adapter} is not a peft LoRA folder (no adapter_config.json)")
    teacher_config = AutoConfig.from_pretrained(teacher)
    vocab_size = model_vocab_size(teacher_config)
    if cfg.topk > vocab_size:  # before cache.json is written (it would record the k) and before any engine starts
        raise ConfigError(f"topk={cfg.topk} is above the teacher's vocabulary ({teacher}/config.json: vocab_size="
                          f"{vocab_size}); choose --topk <= {vocab_size} (a top-k beyond it holds no more tokens)")
    image_token = image_store.image_token_id(json.loads((teacher / "config.json").read_text()))
    engine_len = engine_length(cfg, teacher_config)
    served = probe = scheme = None
    if cfg.teacher_url:
        if llm is not None:
            raise ConfigError("teacher_url: a served teacher scores through its server, not an engine passed to score()")
        served, teacher_fp, probe, teacher_name, engine_name = _served_teacher(cfg, teacher, tokenizer, vocab_size,
                                                                              engine_len, image_token)
    else:
        scheme = cache_fingerprint_scheme(cfg.cache)
        teacher_fp = teacher_fingerprint(teacher, scheme)  # from the fingerprint record when the files are unchanged
        if cfg.teacher_adapter:
            teacher_fp = adapter_fingerprint(teacher_fp, cfg.teacher_adapter)  # base weights + adapter config/weights

        teacher_name = str(teacher) + (f" + adapter {cfg.teacher_adapter}" if cfg.teacher_adapter else "")
        engine_name = engine_version()

    descriptor = Descriptor(
        teacher_fingerprint=teacher_fp,
        tokenizer_fingerprint=tok_fp,
        k=cfg.topk,
        logprob_mode=cfg.logprob_mode,
        teacher=teacher_name,
        vocab_size=vocab_size,
        engine=engine_name,
        numerics=numerics,
        codec=codec_params(cfg.codec, cfg.topp),
        topp=None if cfg.topp is None else float(cfg.topp),
        min_k=cfg.resolved_min_k,
        teacher_probe=probe,
        fingerprint_scheme=scheme,
        **({} if cross is None else {"student_tokenizer_fingerprint": cross.student_fp,
                                     "schema_version": load_schema("scored").version}),
    )
    cache = TeacherCache.create_or_open(cfg.cache, descriptor)  # refuses another teacher/tokenizer/k/numerics first
    if cross is not None:
        store_teacher_tokenizer(cache.root, tokenizer)
    return _Task(teacher, paths, cross, vocab_size, image_token, engine_len, served, teacher_fp, cache, t0)


def _score(cfg: ScoreConfig, llm, locks: contextlib.ExitStack) -> dict:
    shard = shard_index(cfg.shard, cfg.num_shards)  # the entry (score/run.py) resolved $SLURM_ARRAY_TASK_ID
    task = _open_task(cfg, llm)
    cache, cross = task.cache, task.cross
    tag = rollouts_tag(task.paths, cfg.tags, cfg.tag_key)
    name = task_name(tag, shard, cfg.num_shards)
    locks.enter_context(task_lock(cache.root, name))  # also shows a read-only cache before any teacher work
    if task_done(cache.root, name):
        print(f"[score] task {shard}/{cfg.num_shards} of rollouts {tag} is already done: nothing to do")
        return {"done_before": True, "teacher_forwards": 0}

    counts: dict[str, int] = {}
    rows = select_rows(cfg, task.paths, task.teacher_fp, shard, task.vocab_size, task.engine_len - 1, counts,
                       task.image_token, cross)
    if cross is not None and cross.mismatched:  # reported per sample (on_mismatch=skip; error raised above)
        print(f"[score] {len(cross.mismatched)} rollout(s) skipped, their text does not round-trip: "
              + "; ".join(cross.mismatched[:10]) + (" ..." if len(cross.mismatched) > 10 else ""), file=sys.stderr)
    have = cache.keys()
    todo = [r for r in rows if r["key"] not in have]
    pictured = [r for r in todo if r.get("images")]
    if pictured:  # a served teacher's server expands them too: checked again per row against its answer
        check_image_alignment(pictured, task.teacher, task.image_token, Path(cfg.rollouts))
    counts["cached"] = len(rows) - len(todo)
    prior_parts = sorted(p.name[: -len(".parquet")] for p in cache.shard_dir.glob(f"{name}-p*.parquet") if read_marker(p))

    summary = {"task": name, "rows": len(rows), "scored": 0, "tokens": 0, "teacher_forwards": 0, "skipped": counts}
    if cross is not None:
        summary["mismatched"] = cross.mismatched
    parts = list(prior_parts)
    if todo:
        _score_rows(cfg, llm, task, todo, name, parts, counts, shard, summary)
        summary["scored"] = len(todo)
    _finish_task(cfg, cache, name, shard, summary, counts, parts, prior_parts, task.t0, rows, todo)
    return summary


def _score_rows(cfg: ScoreConfig, llm, task: _Task, todo: list[dict], name: str, parts: list[str], counts: dict,
                shard: int, summary: dict) -> None:
    """Score `todo` through the task's engine (or server); the writer thread publishes its parts as it goes."""
    from tqdm import tqdm

    stack = contextlib.ExitStack()
    if task.served is not None:
        engine = task.served
    else:
        engine = stack.enter_context(_in_process_teacher(
            cfg, task.teacher, llm, task.engine_len, image_token=task.image_token,
            max_images=max((len(r.get("images") or ()) for r in todo), default=0)))
    total_tokens = sum(len(r["engine_ids"]) for r in todo)
    out = _Parts(task.cache, name, parts, counts, cfg, task.teacher if task.served is None else cfg.teacher_url)
    writer = BatchWriter(out.add, cfg.write_queue)
    with stack:
        bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"score {shard}/{cfg.num_shards}", file=sys.stderr)
        t_score = time.time()
        with out.part_writer.running():  # part i is encoded and committed while the batches of part i + 1 are extracted
            with writer.running():  # batch i is extracted while the engine scores batch i + 1
                for batch, flats in engine.score_batches(token_batches(todo, cfg.batch_tokens)):
                    summary["teacher_forwards"] += len(batch)
                    summary["tokens"] += sum(len(r["input_ids"]) - r["first_scored"] for r in batch)
                    writer.put((batch, flats))
                    bar.update(sum(len(r["engine_ids"]) for r in batch))
            out.flush()  # the last, partial part: only when every batch was scored and handled
        bar.close()
        summary["score_seconds"] = time.time() - t_score


def _finish_task(cfg: ScoreConfig, cache: TeacherCache, name: str, shard: int, summary: dict, counts: dict,
                 parts: list[str], prior_parts: list[str], t0: float, rows: list[dict], todo: list[dict]) -> None:
    """The task's marker (its summary, written last: the task is done) and its one line of report."""
    new_parts = [p for p in parts if p not in prior_parts]
    nbytes = sum((cache.shard_dir / f"{p}.parquet").stat().st_size for p in new_parts)
    summary.update(
        parts=parts,
        seconds=time.time() - t0,
        bytes_per_token=round(nbytes / summary["tokens"], 1) if summary["tokens"] else None,
    )
    write_result(task_marker(cache.root, name), summary)
    tok_s = summary["tokens"] / summary["score_seconds"] if summary.get("score_seconds") else 0.0
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
    print(
        f"[score] task {shard}/{cfg.num_shards}: scored {summary['scored']} samples ({summary['tokens']} tokens, "
        f"{tok_s:.0f} tok/s, {summary['bytes_per_token'] or '-'} B/token), skipped {skipped}, "
        f"teacher forwards {summary['teacher_forwards']}"
        + ("" if todo else " — no rows assigned to this task" if not rows else " — everything was already cached")
    )


def cross_tokenizers(cfg: ScoreConfig, tokenizer, tok_fp: str, teacher: Path) -> CrossTokenizer:
    """The student's tokenizer of a cross-tokenizer task, checked before any work: another tokenizer than the
    teacher's, and both decoding deterministically (store/align.py `check_decode`)."""
    from transformers import AutoTokenizer

    path = Path(cfg.student_tokenizer)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ConfigError(f"student_tokenizer: {path} holds no tokenizer (tokenizer.json); pass the student's model "
                          "or tokenizer folder")
    student = AutoTokenizer.from_pretrained(path)
    student_fp = tokenizer_fingerprint(student)
    if student_fp == tok_fp:
        raise ConfigError(f"cross_tokenizer=true, but student_tokenizer {path} is the teacher's tokenizer ({teacher}): "
                          "the rows would be plain same-tokenizer rows; drop cross_tokenizer and student_tokenizer")
    align.check_decode(student, f"student_tokenizer {path}")
    align.check_decode(tokenizer, f"teacher tokenizer {teacher}")
    return CrossTokenizer(student, tokenizer, student_fp, tok_fp)


def store_teacher_tokenizer(root: Path, tokenizer) -> None:
    """Keep the teacher's tokenizer in a cross-tokenizer cache (written once, staged and renamed): the trainer
    builds the vocabulary map from it and the student's, so the cache is enough without the teacher's folder."""
    import shutil
    import tempfile

    target = root / align.TEACHER_TOKENIZER
    if target.exists():
        return
    staged = Path(tempfile.mkdtemp(prefix=".teacher_tokenizer.", dir=root))
    try:
        tokenizer.save_pretrained(staged)
        staged.rename(target)
    except OSError:
        if not target.exists():  # another task won the race: theirs is the same tokenizer (the descriptor says)
            raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)


class InProcessTeacher:
    """The score loop's engine for a vLLM `LLM` in this process: one `generate` call per token batch."""

    def __init__(self, llm, k: int, *, image_root: Path | None = None, image_token: int | None = None,
                 arrays: bool = True) -> None:
        from vllm import SamplingParams

        self.llm = llm
        # Prompt logprobs as the engine core's arrays, not Python lists (pipeline/engine.py): vLLM's pythonising
        # would cost more than all of this stage's own work behind a fast teacher.
        extra = {ARRAY_LOGPROBS_FLAG: True} if arrays and array_prompt_logprobs() else None
        self.params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False, flat_logprobs=True,
                                     extra_args=extra)
        self.image_root, self.image_token = image_root, image_token

    def score_batches(self, batches: Iterable[list[dict]]) -> Iterator[tuple[list[dict], list]]:
        """Each batch with its rows' flat prompt logprobs (vLLM's FlatLogprobs), in order. A row with images goes
        to vLLM with one placeholder per image and the pixels (`multi_modal_data`); vLLM expands the placeholders
        with the teacher's processor, and that expansion must be the rollout's, token for token."""
        from vllm.inputs import TokensPrompt

        for batch in batches:
            prompts = []
            for r in batch:
                if r.get("images"):
                    pixels = image_store.load(self.image_root, r["images"], sample=r["sample_id"])
                    prompts.append(TokensPrompt(prompt_token_ids=image_store.collapse(r["engine_ids"], self.image_token),
                                                multi_modal_data={"image": pixels}))
                else:
                    prompts.append(TokensPrompt(prompt_token_ids=r["engine_ids"].tolist()))
            outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
            for r, out in zip(batch, outputs, strict=True):
                if r.get("images"):
                    check_expansion(r, out.prompt_token_ids, self.image_token)
            yield batch, [out.prompt_logprobs for out in outputs]


def check_expansion(row: dict, teacher_ids: Sequence[int], image_token: int, by: str = "engine") -> None:
    """The teacher engine's sequence (its processor's expansion of the images) against the stored one; `by` names
    who expanded them (the in-process engine, or a served teacher's server)."""
    ours = np.asarray(row["engine_ids"])
    theirs = np.asarray(list(teacher_ids))
    if len(ours) == len(theirs) and np.array_equal(ours, theirs):
        return
    mine = [n for _, n in image_store.runs(ours, image_token)]
    seen = [n for _, n in image_store.runs(theirs, image_token)]
    raise TeacherOutputError(
        f"sample {row['sample_id']}: the teacher's {by} expanded its images to {seen} placeholder tokens "
        f"({len(theirs)} tokens in all), the rollout holds {mine} ({len(ours)}): the student's and the teacher's "
        "processors differ (version, max_pixels/min_pixels, template); nothing of this part was written")


@contextlib.contextmanager
def _in_process_teacher(cfg: ScoreConfig, teacher: Path, llm, engine_len: int, *, image_token: int | None = None,
                        max_images: int = 0) -> Iterator[InProcessTeacher]:
    """The engine handed in, or one opened on the teacher (merged with its adapter first, if any) and closed after."""
    vision = {"image_root": Path(cfg.rollouts), "image_token": image_token}
    if llm is not None:
        yield InProcessTeacher(llm, cfg.topk, **vision)
        return

    with contextlib.ExitStack() as stack:
        model_dir = teacher
        if cfg.teacher_adapter:
            model_dir = stack.enter_context(merged_teacher(teacher, cfg.teacher_adapter, dtype=DTYPES[cfg.dtype],
                                                           parent=cfg.merge_dir))
        engine = stack.enter_context(open_teacher_engine(cfg, model_dir, engine_len, max_images=max_images))
        yield InProcessTeacher(engine, cfg.topk, **vision)


def engine_length(cfg: ScoreConfig, teacher_config: Any) -> int:
    """The engine's max_model_len for scoring sequences of up to `cfg.max_model_len` tokens. vLLM must fit one
    sampled token after the scored sequence, so the engine gets max_model_len + 1 where the model's positions allow
    it: a sequence of exactly max_model_len tokens is then scorable."""
    text_config = teacher_config.get_text_config() if hasattr(teacher_config, "get_text_config") else teacher_config
    max_pos = int(getattr(text_config, "max_position_embeddings", cfg.max_model_len + 1) or cfg.max_model_len + 1)
    return min(cfg.max_model_len + 1, max_pos)


def teacher_engine_args(cfg: ScoreConfig, model_dir: str | Path, engine_len: int, *, max_images: int = 0) -> EngineArgs:
    """The in-process teacher engine of a score config: the one rule `gkd score` and the on-policy driver share.
    `max_images` > 0 (or the config's max_images_per_prompt): a vision-language teacher's `limit_mm_per_prompt`."""
    images = cfg.max_images_per_prompt or max_images
    return EngineArgs(
        model=str(model_dir),
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=cfg.dtype,
        max_model_len=engine_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_gib=cfg.kv_cache_gib,
        max_num_batched_tokens=cfg.max_num_batched_tokens or max(cfg.batch_tokens, engine_len),
        enforce_eager=cfg.enforce_eager,
        extra={**cfg.engine_extra, **({"limit_mm_per_prompt": {"image": images}} if images else {})},
    )


def open_teacher_engine(cfg: ScoreConfig, model_dir: str | Path, engine_len: int, *, max_images: int = 0):
    """A context manager: the teacher engine of `cfg`, with the logprob settings scoring needs (max_logprobs = k)."""
    return open_engine(teacher_engine_args(cfg, model_dir, engine_len, max_images=max_images),
                       max_logprobs=cfg.topk, logprobs_mode=cfg.logprob_mode)


def _served_teacher(cfg: ScoreConfig, teacher: Path, tokenizer, vocab_size: int, engine_len: int,
                    image_token: int | None = None):
    """The served teacher's engine and identity (score/served.py), checked against the server and against an
    existing cache before the cache is touched: (engine, fingerprint, probe, descriptor teacher, engine name). A
    vision-language teacher sends rollouts' images with their ids, its expansion checked as in process."""
    served = ServedTeacher(cfg.teacher_url, cfg.teacher_model, cfg.topk, inflight_tokens=cfg.served_inflight_tokens,
                           concurrency=cfg.served_concurrency, retries=cfg.served_retries,
                           timeout_s=cfg.served_timeout_s, api_key_env=cfg.teacher_api_key_env,
                           image_token=image_token, image_root=Path(cfg.rollouts), check_expansion=check_expansion)
    info = served.describe(vocab_size, tokenizer)
    served_len = info["max_model_len"]
    if served_len is not None and int(served_len) < engine_len:
        raise ConfigError(
            f"teacher_url: {cfg.teacher_url} serves {served.model!r} with max_model_len {served_len}, but scoring "
            f"sequences of up to max_model_len={engine_len - 1} tokens needs {engine_len} (one sampled token after "
            f"them): restart the server with --max-model-len {engine_len}, or score with max_model_len={int(served_len) - 1}")
    fingerprint = reconcile_probe(cfg.cache, info["fingerprint"], info["probe"])
    return (served, fingerprint, info["probe"], f"served {served.model} at {cfg.teacher_url} (tokenizer {teacher})",
            f"vllm {info['version']} (OpenAI server)")


class _Parts:
    """The writer's side of the score loop: engine outputs -> checked rows -> parts of `part_rows` rows. `parts`
    (the task's part names, prior ones first) and `counts` are the caller's, updated in place."""

    def __init__(self, cache: TeacherCache, name: str, parts: list[str], counts: dict, cfg: ScoreConfig,
                 teacher: Path | str) -> None:
        self.cache, self.name, self.parts, self.counts, self.cfg, self.teacher = cache, name, parts, counts, cfg, teacher
        self.pending: list[dict] = []
        # A part's encoding and commit lasts as long as ~50 batches' extraction: in a thread of its own (behind a
        # queue of one part, as arrays), so the batch queue keeps draining meanwhile instead of filling and holding
        # the engine for the whole commit. Serial (write_queue=0): inline.
        self.part_writer = BatchWriter(self.write, 1 if cfg.write_queue else 0)

    def add(self, item: tuple[list[dict], list]) -> None:
        batch, flats = item
        for r, flat in zip(batch, flats, strict=True):
            # engine positions engine_first.. = the stored rows first_scored.. (the same completion tokens)
            got = extract(flat, r["engine_ids"], r["engine_first"], self.cfg.topk)
            check_finite(got, r, self.teacher, self.cfg)
            self.pending.append({**r, **got})
        while len(self.pending) >= self.cfg.part_rows:
            self.part_writer.put(self.pending[: self.cfg.part_rows])
            self.pending = self.pending[self.cfg.part_rows :]

    def flush(self) -> None:
        if self.pending:
            self.part_writer.put(self.pending)
            self.pending = []

    def write(self, rows: list[dict]) -> None:
        """Encode and publish one part; its index is taken here, when the parts before it are written (a part whose
        keys another writer published meanwhile takes none)."""
        self.parts += _write_part(self.cache, self.name, len(self.parts), rows, self.counts, Path(self.cfg.rollouts))


def _write_part(cache: TeacherCache, name: str, index: int, rows: list[dict], counts: dict,
                image_root: Path) -> list[str]:
    """Publish one part without the keys another writer published meanwhile; [] when nothing was left."""
    part = f"{name}-p{index:04d}"
    for h in sorted({h for r in rows for h in (r.get("images") or ())}):  # the files before the rows that name them
        cache.add_image(image_store.read(image_root, h))
    info, dropped = cache.add_rows(part, rows, extra={"task": name})
    if dropped:
        counts["cached_meanwhile"] = counts.get("cached_meanwhile", 0) + dropped
    return [part] if info is not None else []


def check_finite(got: dict, row: dict, teacher: Path, cfg: ScoreConfig) -> None:
    """Refuse NaN/inf logprobs before they reach the cache (the codec would store garbage or fail later)."""
    for name in ("topk_logprobs", "actual_logprobs"):
        values = np.asarray(got[name]).reshape(len(got[name]), -1)
        bad = np.flatnonzero(~np.isfinite(values).all(1))
        if bad.size:
            raise TeacherOutputError(
                f"{teacher}: the engine returned {values[bad[0]][~np.isfinite(values[bad[0]])][0]} in {name} for "
                f"sample {row['sample_id']} of {cfg.rollouts} at position {row['first_scored'] + int(bad[0])} "
                f"({bad.size} position(s)); nothing of this part was written. The teacher's weights hold non-finite "
                f"values or overflow in dtype={cfg.dtype}: check the model folder, or score with dtype=float32")
