"""Before the first step: the checks that refuse a run before any expensive work, and the student, its optimizer and
the live teacher built on the chosen backend.

Checks (each before the model is built): the backend's keys (`check_backend`), images against a text-only student
(`check_images`), packing (`plan_packing`), what the caches hold against the loss (`check_cache_holds_loss`,
`check_cross_tokenizer`), a live teacher with another tokenizer (`live_xtok_setup`). Building: the student in DDP with
Megatron's or torch's optimizer and the shared LR schedule (`setup_model_and_optimizer`), the frozen live teacher
(`setup_live_teacher`). The loop (loop.py) calls them in that order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.assets import resolve_student
from pipeline.config import ConfigError
from pipeline.store import align
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.model_config import vocab_size
from pipeline.train.config import TrainConfig
from pipeline.train.data import xtok_rows
from pipeline.train.data.sources import TokenizerMismatchError, hidden_agreement, resolve_rollouts, resolve_sources
from pipeline.train.data.sources import image_rows as source_images
from pipeline.train.losses.fused import output_hidden_states
from pipeline.train.losses.xtok import XTOK_LOSSES
from pipeline.train.models import hf_model
from pipeline.train.models.families import read_hf_arch, resolve_backend
from pipeline.train.models.lora import apply_lora
from pipeline.train.models.optim import lr_scheduler, megatron_optimizer_config


def student_dir(cfg: TrainConfig) -> Path:
    """The student's HF folder (`default`: the embedded 6-layer student)."""

    return resolve_student(cfg.student)




def _init_sgd_state(opt: torch.optim.Optimizer, config=None) -> None:
    """Momentum buffers for every parameter (what torch's SGD creates on its first step), so a checkpoint's
    buffers have somewhere to load into."""
    for group in opt.param_groups:
        for p in group["params"]:
            if group.get("momentum", 0):
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))


def optimizer_state_bytes(optimizer, model) -> int:
    """Bytes of optimizer state this rank holds: the state tensors (Adam's two moments, SGD's momentum) and the
    main weights that are copies rather than the model's own parameters (bf16's fp32 masters). Step counters are
    not counted. With the distributed optimizer each rank holds its 1/DP shard of each."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)  # Megatron's wrappers hold the torch optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in own:
                    total += p.numel() * p.element_size()
                total += sum(v.numel() * v.element_size() for v in inner.state[p].values()
                             if torch.is_tensor(v) and v.dim() > 0)
    return total


def setup_model_and_optimizer(cfg: TrainConfig, hf_dir: Path, backend: str | None = None,
                              packing: bool | str | None = None):
    """(model, its data-parallel wrapper, optimizer, LR scheduler) of the student on `backend` (None: resolved from
    cfg.backend). megatron: GPTModel (HF weights) in Megatron DDP, Megatron's fp32 AdamW and its warmup + cosine LR
    scheduler; hf: the transformers model (hf_model.HFStudent) in torch DDP, the same update rule and schedule.
    `packing` (None: cfg.packing): "auto" lets the hf backend's build decide (`HFStudent.packing`).
    virtual_pipeline_model_parallel_size=V > 1: the model is this rank's V chunks (`megatron.ModelChunks`), the
    wrapper a list of V DDPs, one optimizer over all of them."""
    backend = backend or resolve_backend(hf_dir, cfg.backend, cfg.seq_length)[0]
    packing = cfg.packing if packing is None else packing
    if backend == "hf":
        lora = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) if cfg.lora_rank else None
        student = hf_model.build(hf_dir, lora=lora, seed=cfg.seed, fused_loss=cfg.fused_loss, packing=packing,
                                 precision=cfg.precision(), attention=cfg.attention, recompute=cfg.recompute)
        wrapped = hf_model.wrap_data_parallel(student, fsdp=cfg.fsdp)  # FSDP shards in place: before the optimizer
        optimizer, scheduler = hf_model.optimizer_and_scheduler(student, cfg)
        return student, wrapped, optimizer, scheduler
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    from pipeline.train.models.megatron import build_chunks, build_model, load_hf_weights

    bf16 = cfg.precision() == "bf16"
    kw = dict(params_dtype=torch.bfloat16 if bf16 else torch.float32, attention=cfg.attention,
              recompute=cfg.recompute)
    vpp = cfg.virtual_pipeline_model_parallel_size
    if vpp > 1:  # interleaved 1F1B: this rank's V chunks (models/megatron.py ModelChunks), one DDP each
        model = build_chunks(hf_dir, vpp, **kw)
        chunks = list(model)
    else:
        model = build_model(hf_dir, **kw)
        load_hf_weights(model, hf_dir)
        chunks = [model]
    if cfg.fused_loss and chunks[-1].post_process:  # only the last pipeline stage has the output layer
        output_hidden_states(chunks[-1])  # the loss applies the output layer (its weight stays in the model)
    spec = cfg.lora_spec()
    if spec is not None:
        apply_lora(model, spec, seed=cfg.seed)  # freezes the base: DDP and the optimizer see only the adapters
    ddps = []
    for chunk in chunks:
        config = chunk.config
        config.calculate_per_token_loss = True  # we normalise by the global count ourselves (module docstring)
        # Pipeline stages exchange [row width, rows, hidden] activations; padded rows are as wide as their
        # micro-batch's longest sample, so the schedule sends each tensor's shape first rather than assume seq_length.
        config.variable_seq_lengths = cfg.pipeline_model_parallel_size > 1
        if vpp > 1:
            # Interleaved: one p2p call can send to the next stage and to the previous one, which at P=2 are the same
            # rank. Megatron's batched p2p posts them as send_prev, send_next / recv_prev, recv_next on one group, so
            # the peer's receives pair with the wrong sends (activations taken for gradients); its unbatched p2p
            # sends each direction on its own group (what Megatron-LM runs interleaved with).
            config.batch_p2p_comm = False
        # DDP sums grads over DP ranks (per-token loss); num_tokens=None: no second normalisation.
        config.finalize_model_grads_func = lambda models, num_tokens, **kw: finalize_model_grads(models, None, **kw)
        wrapped = chunk
        if bf16:
            from megatron.core.transformer.module import Float16Module

            wrapped = Float16Module(config, chunk)  # bf16 inputs in, fp32 outputs out (last stage)
        ddps.append(DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer), wrapped))
    for chunk in chunks:  # the interleaved schedule enters every chunk's no_sync
        chunk.config.no_sync_func = ddps[0].no_sync if vpp == 1 else [d.no_sync for d in ddps]
    ddp = ddps[0] if vpp == 1 else ddps
    optimizer = get_megatron_optimizer(megatron_optimizer_config(cfg, bf16), ddps)
    if cfg.optimizer == "sgd":
        # Megatron gives SGD no init_state_fn, which loading a checkpoint calls to create the state it fills in.
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt.init_state_fn = _init_sgd_state
    return model, ddp, optimizer, lr_scheduler(optimizer, cfg)


def live_teacher_dir(cfg: TrainConfig) -> Path:
    """The folder of `teacher_live`, refused unless it is a Hugging Face model folder."""
    teacher_dir = Path(cfg.teacher_live)
    if not (teacher_dir / "config.json").exists():
        raise ConfigError(f"teacher_live: {teacher_dir} is not a Hugging Face model folder (no config.json)")
    return teacher_dir


def setup_live_teacher(cfg: TrainConfig, student_tokenizer: str, backend: str = "megatron",
                       packing: bool | None = None):
    """The frozen teacher of `teacher_live` on the student's backend, with its TP split and precision: HF weights,
    eval mode, no gradients, no DDP, no optimizer; it returns hidden states and the live reduction applies its
    output layer chunk by chunk. Refuses a teacher with another tokenizer before loading its weights, except with
    loss=uld|gold, which needs one (train/teacher/live_xtok.py)."""
    from pipeline.train.models.megatron import build_model, load_hf_weights

    teacher_dir = live_teacher_dir(cfg)
    fp = tokenizer_fingerprint(teacher_dir)
    # uld|gold: another tokenizer, checked before the model by live_xtok_setup (train/teacher/live_xtok.py aligns them)
    if fp != student_tokenizer and cfg.loss not in XTOK_LOSSES:
        raise TokenizerMismatchError(f"teacher_live {teacher_dir}: tokenizer {fp} differs from the student's "
                                     f"{student_tokenizer}; teacher ids would index the wrong tokens")
    if backend == "hf":
        return hf_model.build(teacher_dir, packing=bool(cfg.packing) if packing is None else packing,
                              precision=cfg.precision(), attention=cfg.attention,
                              trainable=False)
    dtype = torch.bfloat16 if cfg.precision() == "bf16" else torch.float32
    teacher = build_model(teacher_dir, params_dtype=dtype, attention=cfg.attention)
    load_hf_weights(teacher, teacher_dir)
    output_hidden_states(teacher)
    teacher.requires_grad_(False)
    return teacher.eval()


def check_backend(cfg: TrainConfig, backend: str, why: str, hf_dir: Path | None = None) -> None:
    """Refuse, before any process group or model, the keys the chosen backend has no meaning for (`why`: the
    reason it was chosen, `families.resolve_backend`), and a pipeline split the student's layers do not allow
    (`hf_dir`: its config.json)."""
    pp = cfg.pipeline_model_parallel_size
    if backend == "hf" and pp > 1:
        raise ConfigError(f"pipeline_model_parallel_size={pp}: the hf backend ({why}) has no pipeline parallelism "
                          "(it is Megatron-Core's); shard this student with fsdp=true (weights, gradients and "
                          "optimizer state over the data-parallel ranks), or train it on the Megatron backend")
    if backend == "megatron" and pp > 1 and hf_dir is not None:
        layers = read_hf_arch(hf_dir).num_layers
        if layers % pp:
            fits = [d for d in range(2, layers + 1) if layers % d == 0]
            raise ConfigError(f"pipeline_model_parallel_size={pp} does not divide the student's {layers} layers "
                              f"(num_hidden_layers in {hf_dir / 'config.json'}): every stage holds the same number "
                              f"of layers; use a divisor of {layers}"
                              + (f" ({', '.join(map(str, fits))})" if fits else " (only 1: no pipeline split)"))
        vpp, per_stage = cfg.virtual_pipeline_model_parallel_size, layers // pp
        if per_stage % vpp:
            fits = [d for d in range(2, per_stage + 1) if per_stage % d == 0]
            raise ConfigError(f"virtual_pipeline_model_parallel_size={vpp} does not divide the {per_stage} layers per "
                              f"stage (the student's {layers} layers / pipeline_model_parallel_size={pp}): every "
                              f"model chunk holds the same number of layers; use a divisor of {per_stage}"
                              + (f" ({', '.join(map(str, fits))})" if fits else " (only 1: no interleaving)")
                              + ", or another pipeline_model_parallel_size")
    if backend == "megatron" and cfg.fsdp:
        raise ConfigError(f"fsdp=true shards a transformers student; this one trains on Megatron-Core ({why}): use "
                          "use_distributed_optimizer=true there, or backend=hf")
    if backend == "hf" and cfg.use_distributed_optimizer:
        raise ConfigError(f"use_distributed_optimizer=true shards Megatron-Core's optimizer; this student trains on "
                          f"the hf backend ({why}): use fsdp=true there (weights, gradients and optimizer state "
                          "sharded), or backend=megatron")
    if backend == "hf" and cfg.tensor_model_parallel_size > 1:
        raise ConfigError(f"tensor_model_parallel_size={cfg.tensor_model_parallel_size}: the hf backend ({why}) has "
                          "no tensor parallelism; train it data-parallel (torchrun) or on the Megatron backend")
    if backend == "hf" and cfg.context_parallel_size > 1:
        raise ConfigError(f"context_parallel_size={cfg.context_parallel_size}: the hf backend ({why}) has no context "
                          "parallelism (it is Megatron's attention=sdpa module's); train this student with "
                          "context_parallel_size=1 (fsdp=true to shard it), or on the Megatron backend")
    if backend == "megatron" and cfg.backend == "auto" and (problem := cfg.megatron_lora_problem()):
        raise ConfigError(problem)  # backend=megatron: refused by cfg.validate already


def image_rows(cfg: TrainConfig) -> Path | None:
    """The first cache (or, with a live teacher, rollout shard) of this run whose rows carry images (None: none)."""
    if cfg.teacher_live is not None:
        return source_images(resolve_rollouts(cfg.rollouts, None))
    return source_images(resolve_sources([*cfg.cache, *cfg.teachers.values()], indexed=True))


def check_images(hf_dir: Path, images_at: Path | None) -> None:
    """Refuse, before the model is built, a text-only student given rows with images: it would train on their
    placeholder tokens without the pixels (on either backend, packed or not)."""
    if images_at is None or hf_model.is_vision(hf_dir):
        return
    model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type", "?")
    raise ConfigError(
        f"{images_at}: its rows carry images, but the student {hf_dir} is a text-only model ({model_type}): it would "
        "train on the images' placeholder tokens without their pixels. Train a vision-language student on it (a "
        "config.json with vision_config, e.g. Qwen2-VL, Qwen2.5-VL, Qwen3.5; backend=auto puts it on the hf "
        "backend), or score text-only rollouts into another cache for this student")


def plan_packing(cfg: TrainConfig, backend: str, images_at: Path | None, hf_dir: Path) -> tuple[bool | str, str]:
    """(packing, why) before the model is built: true and false as set (a true the model cannot honour is refused
    by the model's build, `hf_model.check_packing`); auto: padded for rows with images (a vision-language student
    computes its own positions per row), packed on Megatron-Core (its attention keeps packed samples apart), and
    "auto" left to the hf backend's build, which packs where `hf_model.packing_refusal` finds nothing."""
    if images_at is not None:
        if cfg.packing is True:
            model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type", "?")
            raise ConfigError(f"{images_at}: packing=true, but its rows carry images and the student {hf_dir} is a "
                              f"vision-language model ({model_type}), which computes its own positions per row from "
                              "the image grids (M-RoPE); set packing=false (or packing=auto, which pads them)")
        return False, (f"packing=false: {images_at}'s rows carry images" if cfg.packing is False else
                       f"auto: padded rows, {images_at}'s rows carry images (a vision-language student computes its "
                       "own positions per row)")
    if cfg.packing != "auto":
        return bool(cfg.packing), f"packing={str(bool(cfg.packing)).lower()}"
    if backend == "megatron":
        return True, "auto: packed, Megatron-Core keeps packed samples apart (document spans or the block mask)"
    return "auto", "auto: decided by the hf backend's probe"


def check_cache_holds_loss(cfg: TrainConfig) -> None:
    """Refuse a cache that holds less than the configured loss reads: a k = 0 cache (only the actual token's
    teacher logprob) cannot feed the GKD divergence (loss=gkd, or the dataset-sourced rows of loss=opd)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    # indexed: each cache's index is read (and checked) here first, so a stale or foreign index is refused before the
    # model (xtok_map, image_rows and the loader read it again)
    sources = resolve_sources(cfg.cache, indexed=True)
    check_cross_tokenizer(cfg, sources)
    if check_hidden_cache(cfg, sources):
        return
    for src in sources:
        if src.descriptor.k > 0:
            continue
        if cfg.loss == "gkd":
            raise ConfigError(f"{src.root}: a k = 0 cache holds only the actual token's teacher logprob; loss=gkd "
                              f"(topk_mode={cfg.topk_mode}) needs its top-k entries. Train with loss=opd, or score "
                              "with --topk >= 1")
        for path in src.shard_paths():
            dataset = pc.sum(pc.equal(pq.read_table(path, columns=["source"]).column("source"), "dataset")).as_py()
            if dataset:
                raise ConfigError(f"{path}: {dataset} dataset-sourced row(s); loss=opd trains them with the GKD "
                                  f"loss (topk_mode={cfg.topk_mode}), which needs top-k entries, and this cache has "
                                  "k = 0. Score them into a top-k cache, or leave them out")

def check_hidden_cache(cfg: TrainConfig, sources: list) -> bool:
    """Before any work, for hidden-state caches (store/hidden.py; False: none): one kind per run, the keys the exact
    loss (losses/exact.py) does not run under, and a student whose vocabulary is the teacher's. Every parallel layout
    runs it: TP splits it by vocabulary, CP's ranks take their positions' states, PP's last stage reads the whole
    micro-batch as every stage does."""
    first = hidden_agreement(sources)  # a hidden-state cache mixed with a top-k cache: refused, by file
    if first is None:
        return False
    where = first.root / "cache.json"
    if not cfg.fused_loss and not cfg.topk_from_hidden:
        raise ConfigError(f"{where}: a hidden-state cache trains through the fused output layer; drop "
                          "fused_loss=false (or read it as a top-k cache: topk_from_hidden=K)")
    if cfg.loss not in ("gkd", "opd") or cfg.teachers:
        raise ConfigError(f"{where}: a hidden-state cache trains loss=gkd or loss=opd from one cache (got loss="
                          f"{cfg.loss}{', teachers: ...' if cfg.teachers else ''}); cross-tokenizer losses and "
                          "routed teachers need top-k caches")
    student_cfg = student_dir(cfg) / "config.json"
    student_vocab = vocab_size(json.loads(student_cfg.read_text()))
    teacher_vocab = first.descriptor.vocab_size
    if student_vocab != teacher_vocab:
        raise ConfigError(f"{student_cfg}: vocab_size={student_vocab}, the teacher's is {teacher_vocab} ({where}): "
                          "the exact divergence pairs the two vocabularies token for token; train a student with the "
                          "teacher's vocabulary, or score a top-k cache (teacher_rows=topk) for this student")
    return True


def check_cross_tokenizer(cfg: TrainConfig, sources: list) -> None:
    """Before any work: loss=uld|gold needs a cross-tokenizer cache (spans, scored schema 1.3) and tokenizers that
    decode deterministically; a cross-tokenizer cache needs loss=uld|gold."""
    from transformers import AutoTokenizer

    cross = [s.descriptor for s in sources if s.descriptor.cross_tokenizer]
    root = sources[0].root if sources else Path(str(cfg.cache))
    if cfg.loss not in XTOK_LOSSES:
        if cross:
            raise ConfigError(f"{root}: a cross-tokenizer cache (rows in the teacher's tokens, with spans); train "
                              "it with loss=gold (or loss=uld)")
        return
    if len(cross) < len(sources):
        student = AutoTokenizer.from_pretrained(str(student_dir(cfg)))
        desc = next(s.descriptor for s in sources if not s.descriptor.cross_tokenizer)
        if desc.tokenizer_fingerprint == tokenizer_fingerprint(student):
            raise ConfigError(f"{root}: a same-tokenizer cache (the student's tokenizer is the teacher's): loss="
                              f"{cfg.loss} is for other tokenizers; this is plain GKD, train with loss=gkd")
        raise ConfigError(
            f"{root}: this cache has no spans (scored without cross_tokenizer, or before scored schema 1.3), so its "
            f"teacher rows cannot be aligned to the student's tokens; rescore the rollouts into a new cache: gkd score "
            f"--rollouts ROLLOUTS --cache NEW_CACHE --teacher TEACHER cross_tokenizer=true student_tokenizer="
            f"{student_dir(cfg)}")
    student = AutoTokenizer.from_pretrained(str(student_dir(cfg)))
    align.check_decode(student, f"student tokenizer {student_dir(cfg)}")
    align.check_decode(AutoTokenizer.from_pretrained(str(root / align.TEACHER_TOKENIZER)),
                       f"teacher tokenizer {root / align.TEACHER_TOKENIZER}")


def xtok_map(cfg: TrainConfig, tokenizer) -> np.ndarray | None:
    """The vocabulary map (store/align.py), built once from the student's tokenizer and the cache's copy of the
    teacher's: loss=gold; None for loss=uld (no entry is matched)."""
    from transformers import AutoTokenizer

    if cfg.loss != "gold":
        return None
    first = resolve_sources(cfg.cache, indexed=True)[0]
    root, desc = first.root, first.descriptor
    return align.vocab_map(tokenizer, AutoTokenizer.from_pretrained(str(root / align.TEACHER_TOKENIZER)),
                           desc.vocab_size)


def live_xtok_setup(cfg: TrainConfig, hf_dir: Path, tokenizer) -> xtok_rows.LiveXtok:
    """A live teacher with another tokenizer (loss=uld|gold teacher_live=DIR), checked before any work: its
    tokenizer differs from the student's (else plain GKD), both decode deterministically, every rollout round-trips
    (train/teacher/live_xtok.py); with the vocabulary map for loss=gold."""
    from transformers import AutoConfig

    teacher_dir = live_teacher_dir(cfg)
    if tokenizer_fingerprint(teacher_dir) == tokenizer_fingerprint(tokenizer):
        xtok_rows.refuse_same_tokenizer(teacher_dir, cfg.loss)
    xt = xtok_rows.open_live_xtok(hf_dir, teacher_dir, AutoConfig.from_pretrained(teacher_dir).vocab_size,
                                  AutoConfig.from_pretrained(hf_dir).vocab_size, cfg.loss == "gold")
    xtok_rows.check_rollouts(cfg.rollouts, xt)
    return xt
