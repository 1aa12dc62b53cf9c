"""The score stage's config: `ScoreConfig` (one score task), its validation, and the names its fields take
(LOGPROB_MODES, DTYPES).

A leaf of pipeline/score: besides the store's codec rules it reads only the served teacher's URL check
(score/served/access.py), itself a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.score.served.access import url_problems
from pipeline.store.codec import CodecError, check_top_p
from pipeline.store.codec import params as codec_params
from pipeline.store.hidden import DTYPES as HIDDEN_DTYPES
from pipeline.store.hidden import key_mode

TEACHER_ROWS = ("topk", "hidden")  # what a scored position stores: sparse top-k logprobs, or the final hidden state

LOGPROB_MODES = ("raw_logprobs", "processed_logprobs")
# vLLM's spellings of the scoring dtypes -> one name each ("auto" is refused: it resolves per machine and model).
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
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
    # A served teacher (score/served/): a vLLM OpenAI-compatible server scores instead of an engine in this
    # process; `teacher` then only supplies the tokenizer and config.json (its weights are not read)
    teacher_url: str | None = None  # e.g. http://HOST:PORT/v1
    teacher_model: str | None = None  # the served model name (--served-model-name); null: the server's only model
    served_inflight_tokens: int = 16384  # tokens of requests at the server at once (keeps its scheduler fed)
    served_concurrency: int = 16  # HTTP requests at once (one rollout each)
    served_retries: int = 12  # per request, by the openai client: timeouts, connection errors, 408/409/429/5xx
    served_timeout_s: float = 600.0  # per request
    # The variable holding the server's API key (sent as a bearer token; the key is never a config value, so it is
    # never written with one); null: OPENAI_API_KEY, then VLLM_API_KEY (score/served/access.py `api_key_from_env`).
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
    # topk: the teacher's top-k logprobs per position (the default). hidden: its final hidden state per position
    # and its output layer once (pipeline/store/hidden.py): the exact teacher, any temperature and divergence at
    # train time; `topk` is then not read (the rows keep the actual token's rank and logprob: k = 0).
    teacher_rows: str = "topk"
    hidden_dtype: str = "bfloat16"  # teacher_rows=hidden: how the hidden states are stored (bfloat16 | float32)
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
    def hidden(self) -> bool:
        return self.teacher_rows == "hidden"

    @property
    def stored_k(self) -> int:
        """The k of the stored rows (and of the content key): 0 in a hidden-state cache."""
        return 0 if self.hidden else self.topk

    @property
    def key_mode(self) -> str:
        """The logprob-mode part of the content key (a hidden row's names its kind and dtype too)."""
        return key_mode(self.logprob_mode, self.hidden_dtype) if self.hidden else self.logprob_mode

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
        if self.teacher_rows not in TEACHER_ROWS:
            p.append(f"teacher_rows must be one of {TEACHER_ROWS}, got {self.teacher_rows!r}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            p.append(f"hidden_dtype must be one of {tuple(HIDDEN_DTYPES)}, got {self.hidden_dtype!r}")
        if self.hidden:
            for key, bad in (("teacher_url", self.teacher_url), ("teacher_adapter", self.teacher_adapter),
                             ("cross_tokenizer", self.cross_tokenizer), ("topp", self.topp is not None)):
                if bad:
                    p.append(f"teacher_rows=hidden scores with an in-process vLLM engine on one HF folder, same "
                             f"tokenizer, fixed rows: drop {key} (or score with teacher_rows=topk)")
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
