"""The train stage's config: `TrainConfig` (every key of `gkd train` and `train:` in a recipe) and its validation.

A leaf of the train package: the trainer, the metrics and the on-policy driver import it; it imports none of them.
The launch's process count is the caller's to give (`validate(world_size=...)`: the entry reads torchrun's
WORLD_SIZE), never read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.train.data.loader import batch_split_problem
from pipeline.train.losses.reference import loss_arg_problems
from pipeline.train.losses.xtok import XTOK_LOSSES
from pipeline.train.models.families import BACKENDS
from pipeline.train.models.lora import LoRASpec, resolve_targets

LOSSES = ("gkd", "opd", *XTOK_LOSSES)


@dataclass
class TrainConfig:
    student: str = "default"  # HF folder (any causal LM; see README); "default" = the SmolLM2 6-layer student
    # megatron: Megatron-Core (llama, mistral, qwen2, qwen3: TP, its DDP and optimizer); hf: transformers (any
    # AutoModelForCausalLM: Qwen3.5, Gemma, Phi, MoE, ...; pipeline/train/models/hf_model.py); auto: megatron where it maps
    # the family exactly, else hf (families.resolve_backend). The first log line and trainer.json say which.
    backend: str = "auto"
    cache: list[str] = field(default_factory=lambda: ["runs/cache"])  # cache dirs and/or shard files
    # A live teacher instead of a cache (pipeline/train/teacher/live.py): an HF folder of the student's tokenizer,
    # run frozen in the trainer on every micro-batch of `rollouts` (rollout dirs/shards); then cache must be [].
    # With loss=gold|uld a teacher of another tokenizer, run on its own tokens (pipeline/train/teacher/live_xtok.py).
    teacher_live: str | None = None
    rollouts: list[str] = field(default_factory=list)
    teacher_live_topk: int = 64  # k of the live teacher's rows (a cache's k is the one it was scored with)
    # A hidden-state cache (gkd score teacher_rows=hidden) read as a top-k cache of this k: each micro-batch's teacher
    # top-k and tail are computed from its states (as the live teacher's are), so the top-k losses (topk_mode
    # tail|renorm) train from it. 0: the exact full-vocabulary loss (pipeline/train/losses/exact.py).
    topk_from_hidden: int = 0
    # Several teachers routed by tag (then cache must be []): {TAG: CACHE_DIR, default: CACHE_DIR}; each sample is
    # taken from the cache of its rollout tag `teacher_tag_key` (or `default`), with an optional KD loss weight
    # per teacher (default 1); on_unrouted: error (name the tag) | skip (count the samples in the metrics)
    teachers: dict = field(default_factory=dict)
    teacher_tag_key: str = "data_source"
    teacher_weights: dict = field(default_factory=dict)
    on_unrouted: str = "error"
    seed: int = 1234
    micro_batch_size: int = 8  # rows per micro-batch; with packing a token budget of micro_batch_size * seq_length
    global_batch_size: int = 16  # = micro_batch_size * grad-accum steps * data-parallel size (in rows)
    seq_length: int = 512  # longer samples are truncated (tokens past it and their teacher rows dropped)
    # Pack several samples per row of seq_length tokens, each attending only to itself (pipeline/train/data/packing.py);
    # false: one sample per row, padded to the micro-batch's longest. auto: packed where the student keeps packed
    # samples apart (Megatron-Core always; the hf backend by hf_model.packing_refusal), padded otherwise and for image
    # caches; the first log lines and trainer.json (`packing`, `packing_why`) say which (`plan_packing`).
    packing: bool | str = "auto"
    train_steps: int = 100
    lr: float = 1.0e-4
    min_lr: float = 1.0e-5
    warmup_steps: int = 10  # linear from 0 (Megatron's convention: step 1 runs at lr 0), then cosine to min_lr
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    optimizer: str = "adam"  # adam (AdamW, betas 0.9/0.95) | sgd (momentum 0.9: an update linear in the gradient)
    # gkd: the GKD divergence on the teacher's top-k (beta, temperature, topk_mode) at every position.
    # opd: sampled-token on-policy distillation on student-sourced rows (pipeline/train/losses/reference.py `opd_loss`: reads
    # only the actual token's teacher logprob, so any k works, k = 0 included); dataset-sourced rows in the same run
    # get the GKD loss above (refused on a k = 0 cache, which has no top-k for them).
    # uld | gold: cross-tokenizer distillation from a cross-tokenizer cache (gkd score cross_tokenizer=true):
    # pipeline/train/losses/xtok.py, over the aligned spans; gold also matches equal token strings of both
    # vocabularies (JSD there, beta below) and weighs the parts gold_matched_weight / gold_unmatched_weight (null
    # both: TRL's adaptive weights, matched ids / teacher vocabulary). Fused output layer only; TP, DP and packing work.
    loss: str = "gkd"
    # opd on rows that carry the sampler's logprobs (scored 1.5's completion_logprobs: `gkd generate --logprobs`,
    # on-policy runs with max_staleness >= 1): each position's term weighted by min(s(y) / sampler(y), opd_is_cap),
    # truncated importance sampling for samples of older weights (reference.py `opd_advantage`). null: no weights.
    opd_is_cap: float | None = 2.0
    gold_matched_weight: float | None = None
    gold_unmatched_weight: float | None = None
    # 0 forward KL, 1 reverse KL, else generalised JSD. null: the loss's default (`kd_beta`): 0.5 for gkd/opd,
    # 0 for gold (forward KL on the matched ids, see `kd_beta`); uld has no β.
    beta: float | None = None
    temperature: float = 1.0
    topk_mode: str = "tail"  # tail | renorm (see pipeline/train/losses/reference.py)
    # The loss applies the output layer itself, chunk by chunk: no [tokens, vocab] logits (pipeline/train/losses/fused.py).
    # false: Megatron's output layer makes the full logits and pipeline/train/losses/reference.py takes them (the reference).
    fused_loss: bool = True
    # bf16 mixed precision (Megatron's Float16Module; fp32 main weights and grads in the optimizer; the loss in fp32
    # within each chunk). null: on where CUDA is available, off on CPU (where it works, for tests and laptops).
    bf16: bool | None = None
    # Megatron's distributed optimizer: optimizer state (Adam's moments, SGD's momentum, bf16's fp32 main weights)
    # sharded over the data-parallel ranks, ~1/DP of it per rank (metric optimizer_state_bytes); CPU and GPU.
    # Checkpoints keep it sharded and resume at another DP size, not at another TP (docs/architecture.md).
    use_distributed_optimizer: bool = False
    # backend=hf under torchrun: FSDP2 (fully_shard per decoder layer) shards weights, gradients and optimizer state
    # over the data-parallel ranks instead of replicating them (DDP), for students that do not fit one device.
    fsdp: bool = False
    sft_alpha: float = 0.0  # weight of CE on dataset-sourced samples
    # Weight of the distillation term (loss=gkd). 0 with sft_alpha > 0: a plain cross-entropy step on the dataset
    # rows through the same loader, loop and fused output layer, the teacher rows read but not used: the SFT
    # baseline a distillation step is compared with (benchmarks/exact_bench.py).
    kd_alpha: float = 1.0
    tensor_model_parallel_size: int = 1
    # Context parallelism (pipeline/train/parallel/context_parallel.py; Megatron backend, attention=sdpa): each sequence split
    # over this many ranks in zig-zag chunks, keys and values all-gathered for attention, for sequences whose
    # activations do not fit one device. World = tensor_model_parallel_size x context_parallel_size x data-parallel;
    # seq_length must be a multiple of 2 x context_parallel_size.
    context_parallel_size: int = 1
    # Pipeline parallelism (Megatron backend; docs/architecture.md, "Pipeline parallelism"): the student's layers split
    # into this many stages, Megatron-Core's 1F1B schedule; the first stage embeds the tokens, the last runs the output
    # layer and the loss on the cached teacher rows, only activations cross stages. World = tensor x context x
    # pipeline x data-parallel; it must divide num_hidden_layers. Combinations not supported yet are refused by name
    # (`pipeline_problems`).
    pipeline_model_parallel_size: int = 1
    # Interleaved 1F1B (Megatron-Core's own schedule): each pipeline rank holds this many model chunks of
    # num_hidden_layers / (P x V) layers (virtual stages), which shrinks the pipeline bubble from (P-1)/M to
    # (P-1)/(V·M) of a step for M micro-batches. Needs P > 1, V dividing the layers per stage, and M (global batch /
    # micro batch / data-parallel size) a multiple of P.
    virtual_pipeline_model_parallel_size: int = 1
    # sdpa: torch's fused attention kernels (flash / memory-efficient on GPU, flash on CPU); local: Megatron's unfused
    # DotProductAttention (materialises [heads, seq, seq] scores). See pipeline/train/models/attention.py.
    attention: str = "sdpa"
    recompute: str = "none"  # none | selective (core attention) | full (every layer): activation memory for compute
    # LoRA (pipeline/train/models/lora.py): lora_rank > 0 trains adapters on the frozen student; checkpoints hold the
    # adapter only. Dotted keys work too: lora.rank=16 lora.alpha=32 lora.targets=[qkv,proj]
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    save_dir: str = "runs/train"
    save_interval: int = 50
    log_dir: str | None = None  # metrics.jsonl + TensorBoard; default: save_dir
    exit_after: int | None = None  # stop (with a checkpoint) after this many steps of this invocation (Slurm limits)
    # Start the data at this global sample position instead of the checkpoint's, and accept a checkpoint made on
    # other shards: the on-policy driver (pipeline/onpolicy) trains each cycle on a new data set.
    data_position: int | None = None
    window_rows: int = 512  # shuffle window of the loader (~2 windows of decoded rows are held in memory)
    prefetch: int = 2  # micro-batches decoded ahead in a background thread
    progress: bool = True  # tqdm bar on rank 0

    @property
    def kd_beta(self) -> float:
        """The β the loss runs with: `beta` as set, else the loss's default. GKD's is 0.5 (the GKD paper's JSD).
        GOLD's is 0 (forward KL on the matched ids): the JSD's (1 − β)·s·log(s/m) term pays the student to shrink
        mass the teacher does not share, and on GOLD's merged vectors that is the student's own text at split spans
        (docs/architecture.md, cross-tokenizer); forward KL has no such term and is the classical offline
        distillation objective on fixed teacher answers. Measured in BENCHMARKS.md (xtok): β 0 vs 0.5 against SFT,
        confirmed on a held-out split and student init not used to pick it."""
        if self.beta is not None:
            return float(self.beta)
        return 0.0 if self.loss in XTOK_LOSSES else 0.5

    def validate(self, world_size: int = 1) -> list[str]:
        """Every problem of this config, for a launch of `world_size` processes (torchrun's WORLD_SIZE, read by the
        entry: the data-parallel split is checked before any process group exists)."""
        p = []
        for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_steps", "save_interval",
                     "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size", "window_rows"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1, got {getattr(self, name)}")
        world = world_size
        tp, cp = max(1, self.tensor_model_parallel_size), max(1, self.context_parallel_size)
        if world % tp:
            p.append(f"tensor_model_parallel_size {tp} does not divide the {world} processes (WORLD_SIZE); launch a "
                     f"multiple of {tp} processes or change tensor_model_parallel_size")
        elif world % (tp * cp):
            p.append(f"context_parallel_size {cp} x tensor_model_parallel_size {tp} = {tp * cp} does not divide the "
                     f"{world} processes (WORLD_SIZE); launch a multiple of {tp * cp} processes or change "
                     "context_parallel_size")
        pp = max(1, self.pipeline_model_parallel_size)
        if not world % (tp * cp) and world % (tp * cp * pp):
            p.append(f"pipeline_model_parallel_size {pp} x tensor_model_parallel_size {tp} x context_parallel_size "
                     f"{cp} = {tp * cp * pp} does not divide the {world} processes (WORLD_SIZE); launch a multiple of "
                     f"{tp * cp * pp} processes or change pipeline_model_parallel_size")
        dp = max(1, world // (tp * cp * pp))
        why = (f" (WORLD_SIZE {world} / tensor_model_parallel_size {tp}"
               f"{f' / context_parallel_size {cp}' if cp > 1 else ''}"
               f"{f' / pipeline_model_parallel_size {pp}' if pp > 1 else ''})")
        if problem := batch_split_problem(self.global_batch_size, max(1, self.micro_batch_size), dp, why):
            p.append(problem)
        elif (vpp := self.virtual_pipeline_model_parallel_size) > 1 and pp > 1:
            m = self.global_batch_size // (max(1, self.micro_batch_size) * dp)
            if m < pp or m % pp:
                fit = pp * max(1, -(-m // pp)) * max(1, self.micro_batch_size) * dp
                p.append(f"virtual_pipeline_model_parallel_size={vpp}: {m} micro-batches a step (global_batch_size "
                         f"{self.global_batch_size} / micro_batch_size {self.micro_batch_size} / {dp} data-parallel "
                         f"ranks) is {'fewer than' if m < pp else 'not a multiple of'} pipeline_model_parallel_size={pp}: the interleaved schedule "
                         f"runs micro-batches in groups of {pp} per model chunk; set global_batch_size={fit}, or "
                         "virtual_pipeline_model_parallel_size=1")
        if cp > 1 and self.seq_length % (2 * cp):
            up = -(-self.seq_length // (2 * cp)) * 2 * cp
            p.append(f"seq_length {self.seq_length} is not a multiple of 2 x context_parallel_size = {2 * cp} (each "
                     f"sequence is cut into {2 * cp} zig-zag chunks); set seq_length to a multiple of {2 * cp}, e.g. "
                     f"{up}")
        if cp > 1 and self.attention == "local":
            p.append(f"context_parallel_size={cp} needs attention=sdpa (its keys and values are gathered over the "
                     "context-parallel ranks); Megatron's attention=local has context parallelism only through "
                     "Transformer Engine. Set attention=sdpa, or context_parallel_size=1")
        p += loss_arg_problems(self.kd_beta, self.temperature, self.topk_mode, mode_key="topk_mode")
        if self.loss not in LOSSES:
            p.append(f"loss must be gkd, opd, uld or gold, got {self.loss!r}")
        if self.loss in XTOK_LOSSES:
            if self.teacher_live is not None and self.context_parallel_size > 1:
                p.append(f"loss={self.loss} with teacher_live runs the teacher on whole samples: use "
                         "context_parallel_size=1")
            if not self.fused_loss:
                p.append(f"loss={self.loss} runs in the fused output layer only: drop fused_loss=false")
            if self.teachers:
                p.append(f"loss={self.loss} reads one cross-tokenizer cache: drop teachers (routing)")
        if (self.gold_matched_weight is None) != (self.gold_unmatched_weight is None):
            p.append("gold_matched_weight and gold_unmatched_weight are set together (both null: adaptive weights)")
        if self.opd_is_cap is not None and (isinstance(self.opd_is_cap, bool)
                                            or not isinstance(self.opd_is_cap, (int, float)) or self.opd_is_cap < 1):
            p.append(f"opd_is_cap must be a number >= 1 (the importance weights' truncation; null: no weights), got "
                     f"{self.opd_is_cap!r}")
        if self.loss == "opd" and self.teacher_live is not None:
            p.append("loss=opd reads the cached actual-token teacher logprobs; teacher_live computes a top-k only")
        if self.attention not in ("sdpa", "local"):
            p.append(f"attention must be sdpa or local, got {self.attention!r}")
        if self.recompute not in ("none", "selective", "full"):
            p.append(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.teacher_live is not None and self.cache:
            p.append("cache and teacher_live are mutually exclusive: a cache already holds the teacher's rows (drop "
                     "teacher_live), or score live from rollouts (teacher_live=DIR rollouts=[DIR] cache=[])")
        if self.teacher_live is not None and not self.rollouts:
            p.append("teacher_live needs rollouts=[DIR ...]: the rollout shards whose tokens the live teacher scores")
        if self.rollouts and self.teacher_live is None:
            p.append("rollouts are read only with teacher_live=DIR; to train from a cache, score them with gkd score")
        if self.teachers and (self.cache or self.teacher_live is not None):
            p.append("teachers replaces cache and teacher_live: pass cache=[] with teachers={TAG: CACHE, ...}")
        if any(not isinstance(v, str) or not v for v in self.teachers.values()):
            p.append(f"teachers: every value must be a cache directory, got {self.teachers!r}")
        unknown = sorted(set(self.teacher_weights) - set(self.teachers))
        if unknown:
            p.append(f"teacher_weights: {', '.join(unknown)} is not a key of teachers ({', '.join(self.teachers)})")
        if any(not isinstance(w, (int, float)) or w < 0 for w in self.teacher_weights.values()):
            p.append(f"teacher_weights must be numbers >= 0, got {self.teacher_weights!r}")
        if self.on_unrouted not in ("error", "skip"):
            p.append(f"on_unrouted must be error or skip, got {self.on_unrouted!r}")
        if self.teacher_live is None and not self.cache and not self.teachers:
            p.append("cache: give at least one cache directory or shard (or teacher_live=DIR with rollouts, or "
                     "teachers={TAG: CACHE})")
        if self.topk_from_hidden < 0:
            p.append(f"topk_from_hidden must be >= 0 (0: the exact loss), got {self.topk_from_hidden}")
        if self.teacher_live_topk < 1:
            p.append("teacher_live_topk must be >= 1")
        if self.optimizer not in ("adam", "sgd"):
            p.append(f"optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.sft_alpha < 0:
            p.append("sft_alpha must be >= 0")
        if self.kd_alpha < 0:
            p.append(f"kd_alpha must be >= 0, got {self.kd_alpha}")
        elif self.kd_alpha != 1 and self.loss != "gkd":
            p.append(f"kd_alpha weighs the loss=gkd divergence; loss={self.loss} takes none: drop kd_alpha")
        elif self.kd_alpha == 0 and self.sft_alpha == 0:
            p.append("kd_alpha=0 with sft_alpha=0 trains on nothing: set sft_alpha > 0 (SFT on the dataset rows)")
        if not 0 <= self.min_lr <= self.lr:
            p.append("need 0 <= min_lr <= lr")
        if self.warmup_steps < 0 or (self.warmup_steps and self.warmup_steps >= self.train_steps):
            p.append("warmup_steps must be 0 or less than train_steps (Megatron's scheduler needs decay steps)")
        if self.exit_after is not None and self.exit_after < 1:
            p.append("exit_after must be >= 1")
        if self.data_position is not None and self.data_position < 0:
            p.append("data_position must be >= 0")
        if self.use_distributed_optimizer and self.optimizer != "adam":
            p.append(f"use_distributed_optimizer=true needs optimizer=adam, got optimizer={self.optimizer} "
                     "(Megatron-Core's DistributedOptimizer takes Adam only); set optimizer=adam, or "
                     "use_distributed_optimizer=false")
        if self.lora_rank < 0:
            p.append("lora_rank must be >= 0 (0: train all weights)")
        if self.packing not in (True, False, "auto"):
            p.append(f"packing must be true, false or auto, got {self.packing!r}")
        if self.backend not in BACKENDS:
            p.append(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        p += self.pipeline_problems()
        if self.lora_rank > 0:
            if self.lora_alpha <= 0:
                p.append("lora_alpha must be > 0")
            if self.backend == "megatron" and (problem := self.megatron_lora_problem()):
                p.append(problem)  # auto: train() asks once the family is known; hf checks them on the model
        return p

    def pipeline_problems(self) -> list[str]:
        """What pipeline_model_parallel_size > 1 does not run with yet, each by name with the reason (issue 48's first
        cut: packed or padded rows, the fused or unfused GKD or OPD loss with SFT, routed teachers, recompute, tied
        embeddings, bf16, TP, CP and DP; then LoRA, the distributed optimizer and hidden-state caches)."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if vpp > 1 and pp <= 1:
            return [f"virtual_pipeline_model_parallel_size={vpp} interleaves model chunks over pipeline stages, but "
                    f"pipeline_model_parallel_size={pp}; set pipeline_model_parallel_size > 1 (e.g. 2), or "
                    "virtual_pipeline_model_parallel_size=1"]
        if pp <= 1:
            return []
        head = f"pipeline_model_parallel_size={pp}"
        fix = "; or pipeline_model_parallel_size=1"
        refused = [
            (self.lora_rank > 0 and self.virtual_pipeline_model_parallel_size > 1,
             f"with lora_rank={self.lora_rank} and virtual_pipeline_model_parallel_size="
             f"{self.virtual_pipeline_model_parallel_size}: an adapter's checkpoint holds one model, not interleaved "
             "model chunks (not supported yet); set virtual_pipeline_model_parallel_size=1 (LoRA runs under plain "
             "pipeline parallelism) or lora_rank=0"),
            (self.teacher_live is not None, "with teacher_live: the live teacher would run beside the whole student on "
             "every rank, but only the last stage holds the loss; score the rollouts into a cache (gkd score) and "
             "train from it"),
            (self.loss in XTOK_LOSSES, f"with loss={self.loss}: the cross-tokenizer losses under pipeline parallelism "
             "are not supported yet (their span rows are untested across stages); use loss=gkd"),
        ]
        return [f"{head} {why}{fix}" for bad, why in refused if bad]

    def megatron_lora_problem(self) -> str | None:
        """What is wrong with lora_targets on a Megatron-Core student (its layer names only), or None."""
        if self.lora_rank == 0:
            return None
        try:
            resolve_targets(self.lora_targets)
        except ValueError as e:
            return f"{e} (backend=hf takes any linear layer's name)"
        return None

    def precision(self) -> str:
        """'bf16' or 'fp32' for this machine (bf16: null means on where CUDA is available)."""
        on = torch.cuda.is_available() if self.bf16 is None else self.bf16
        return "bf16" if on else "fp32"

    def lora_spec(self):
        """The LoRASpec of this run, or None for full fine-tuning."""
        if self.lora_rank == 0:
            return None
        return LoRASpec(self.lora_rank, self.lora_alpha, resolve_targets(self.lora_targets))
