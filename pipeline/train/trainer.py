"""The train stage's library: a student distilled from a teacher cache of sparse top-k logprobs (GKD), on one of two
backends: Megatron-Core, or transformers (hf_model.py) for the families Megatron-Core does not map (families.py).

The entry (`gkd train`, `torchrun -m pipeline.train.run`) is pipeline/train/run.py: argparse + `main` over `train`.

The loop is written out (torchtune recipe / Megatron pretrain_gpt style): setup -> steps -> checkpoint.
One sample's path: cached row -> `data.ScoredLoader.micro_batch` (rolled labels, aligned teacher rows) ->
`forward_step` (student logits) -> `loss_func` (GKD divergence + SFT CE) -> Megatron's forward-backward schedule.

Normalisation: every micro-batch's loss is its SUM over active positions divided by the GLOBAL count of active
positions of the step (all micro-batches, all data-parallel ranks), counted before the step, so the per-token loss
does not depend on how the global batch is split. Hence `calculate_per_token_loss=True` (the schedule leaves the
loss as returned and DDP sums gradients instead of averaging) and a finalize hook that does not rescale again.
Context parallelism (context_parallel.py) keeps this rule: the counts are taken on the whole micro-batches (all CP
ranks of a replica hold the same), each CP rank's loss sums its own chunks' positions, and both the reported sums and
DDP's gradient sum run over the data-parallel x context-parallel group.

Resume: `gkd train` with the same save_dir continues from `save_dir/latest` (model, optimizer, LR scheduler, RNG,
data position) and reproduces an uninterrupted run bit-for-bit on CPU.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline import pause
from pipeline.assets import resolve_student
from pipeline.config import ConfigError, to_dict
from pipeline.store import align
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.shards import atomic_write_bytes
from pipeline.train import metrics
from pipeline.train.config import TrainConfig
from pipeline.train.data import xtok_rows
from pipeline.train.data.loader import ScoredLoader, batch_split_problem
from pipeline.train.data.sources import TokenizerMismatchError, resolve_rollouts, resolve_sources
from pipeline.train.data.sources import image_rows as source_images
from pipeline.train.losses.fused import fused_gkd_loss, output_hidden_states, output_weight
from pipeline.train.losses.reference import gkd_loss, opd_loss, vocab_parallel_ce
from pipeline.train.losses.xtok import XTOK_LOSSES, fused_xtok_loss, gold_weights
from pipeline.train.models import hf_model
from pipeline.train.models.families import resolve_backend
from pipeline.train.models.lora import apply_lora
from pipeline.train.models.optim import lr_scheduler, megatron_optimizer_config
from pipeline.train.parallel import context_parallel
from pipeline.train.teacher import live_xtok
from pipeline.train.teacher.live import teacher_topk


def student_dir(cfg: TrainConfig) -> Path:
    """The student's HF folder (`default`: the embedded 6-layer student)."""

    return resolve_student(cfg.student)


# ---------------------------------------------------------------- setup


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
    `packing` (None: cfg.packing): "auto" lets the hf backend's build decide (`HFStudent.packing`)."""
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

    from pipeline.train.models.megatron import build_model, load_hf_weights

    bf16 = cfg.precision() == "bf16"
    model = build_model(hf_dir, params_dtype=torch.bfloat16 if bf16 else torch.float32, attention=cfg.attention,
                        recompute=cfg.recompute)
    load_hf_weights(model, hf_dir)
    if cfg.fused_loss:
        output_hidden_states(model)  # the loss applies the output layer (its weight stays in the model)
    spec = cfg.lora_spec()
    if spec is not None:
        apply_lora(model, spec, seed=cfg.seed)  # freezes the base: DDP and the optimizer see only the adapters
    config = model.config
    config.calculate_per_token_loss = True  # we normalise by the global count ourselves (module docstring)
    # DDP sums grads over DP ranks (per-token loss); num_tokens=None: no second normalisation.
    config.finalize_model_grads_func = lambda models, num_tokens, **kw: finalize_model_grads(models, None, **kw)
    wrapped = model
    if bf16:
        from megatron.core.transformer.module import Float16Module

        wrapped = Float16Module(config, model)  # bf16 inputs in, fp32 outputs out (last stage)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer), wrapped)
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(megatron_optimizer_config(cfg, bf16), [ddp])
    if cfg.optimizer == "sgd":
        # Megatron gives SGD no init_state_fn, which loading a checkpoint calls to create the state it fills in.
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt.init_state_fn = _init_sgd_state
    return model, ddp, optimizer, lr_scheduler(optimizer, cfg)


def setup_live_teacher(cfg: TrainConfig, student_tokenizer: str, backend: str = "megatron",
                       packing: bool | None = None):
    """The frozen teacher of `teacher_live` on the student's backend, with its TP split and precision: HF weights,
    eval mode, no gradients, no DDP, no optimizer; it returns hidden states and the live reduction applies its
    output layer chunk by chunk. Refuses a teacher with another tokenizer before loading its weights, except with
    loss=uld|gold, which needs one (train/teacher/live_xtok.py)."""
    from pipeline.train.models.megatron import build_model, load_hf_weights

    teacher_dir = Path(cfg.teacher_live)
    if not (teacher_dir / "config.json").exists():
        raise ConfigError(f"teacher_live: {teacher_dir} is not a Hugging Face model folder (no config.json)")
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


# ---------------------------------------------------------------- one micro-batch


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module."""
    while hasattr(model, "module"):
        model = model.module
    return model


def loss_func(batch, counts: tuple[float, float], cfg: TrainConfig, vocab_size: int, gpt, output_tensor: torch.Tensor):
    """(loss for backward, active count, reported sums). `counts` = global (KD, SFT) active counts of the step.

    `output_tensor` is the final hidden states with `fused_loss` (the loss applies the output layer itself, chunk
    by chunk: pipeline/train/losses/fused.py), the logits otherwise. loss=opd: the student-sourced positions take the
    sampled-token estimator instead of the GKD divergence, normalised by the same global count of all positions.
    Routed (`teachers`): one loss call per teacher present, on its positions only (both losses gather the masked
    rows, so the split costs no extra output-layer work), its KD term weighted by teacher_weights[name].

    The report: named sums (pipeline/train/metrics.py, summed over micro-batches and ranks by the loop): the
    four loss terms, the weighted KD sum, and per routed teacher its KD sum and KD count."""
    names = sorted(cfg.teachers)
    if batch.teacher_route is None or not names:
        loss, kd_n, t = _loss_terms(batch, batch.loss_mask, 1.0, counts, cfg, vocab_size, gpt, output_tensor)
        return loss, kd_n.int(), {**t, metrics.WEIGHTED_KD_SUM: t[metrics.KD_SUM]}
    dev = batch.loss_mask.device

    def zero() -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=dev)

    loss, kd_n = 0.0, 0
    report = {name: zero() for name in (*metrics.TERMS, metrics.WEIGHTED_KD_SUM)}
    for name in names:
        report[metrics.teacher_kd_sum(name)], report[metrics.teacher_kd_count(name)] = zero(), zero()
    present = [i for i in range(len(names)) if bool((batch.teacher_route == i).any())] or [None]
    for i in present:
        mask = batch.loss_mask if i is None else batch.loss_mask & (batch.teacher_route == i)
        w = 1.0 if i is None else float(cfg.teacher_weights.get(names[i], 1.0))
        part, n, t = _loss_terms(batch, mask, w, counts, cfg, vocab_size, gpt, output_tensor)
        loss, kd_n = loss + part, kd_n + n
        for name in metrics.TERMS:
            report[name] = report[name] + t[name]
        report[metrics.WEIGHTED_KD_SUM] = report[metrics.WEIGHTED_KD_SUM] + w * t[metrics.KD_SUM]
        if i is not None:
            report[metrics.teacher_kd_sum(names[i])] = t[metrics.KD_SUM]
            report[metrics.teacher_kd_count(names[i])] = torch.as_tensor(float(n), dtype=torch.float64, device=dev)
    return loss, torch.as_tensor(kd_n).int(), report


def _loss_terms(batch, mask, kd_scale: float, counts, cfg: TrainConfig, vocab_size: int, gpt, output_tensor):
    """(loss, active count, the named float64 sums `metrics.terms`) of the positions in `mask` (SFT: those
    of dataset-sourced samples; loss=opd: OPD on the student-sourced ones), KD and OPD scaled by `kd_scale` (a
    routed teacher's weight)."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    sft_mask = batch.sft_mask & mask if cfg.sft_alpha > 0 else None  # dataset-sourced rows' loss positions only
    kd_weight, sft_weight = kd_scale / max(counts[0], 1.0), cfg.sft_alpha / max(counts[1], 1.0)
    kd_mask, opd_mask = mask, None
    if cfg.loss == "opd":  # student-sourced positions: OPD; dataset-sourced ones (loss_mask & dataset): GKD
        kd_mask, opd_mask = batch.sft_mask & mask, mask & ~batch.sft_mask
    teacher = dict(teacher_tail=batch.teacher_tail, teacher_valid=batch.teacher_valid)
    opd_sum = opd_kl = torch.zeros((), device=output_tensor.device, dtype=torch.float64)
    if cfg.loss in XTOK_LOSSES:  # cross-tokenizer spans (xtok_loss.py): SFT on every completion position
        matched = batch.xtok_matched
        weights = gold_weights(int(matched.sum()) if matched is not None else 0, batch.xtok_teacher_vocab,
                               cfg.gold_matched_weight, cfg.gold_unmatched_weight)
        out = fused_xtok_loss(
            output_tensor, output_weight(gpt), batch.labels, mask, batch.span_head, batch.teacher_ids,
            batch.teacher_logprobs, batch.teacher_valid, batch.teacher_tail, kind=cfg.loss, matched=matched,
            weights=weights, beta=cfg.kd_beta, sft_mask=batch.sft_mask if cfg.sft_alpha > 0 else None,
            kd_weight=kd_weight, sft_weight=sft_weight, vocab_size=vocab_size, tp_group=tp_group)
        return out.loss, out.kd_count, metrics.terms(out.kd_sum, out.sft_sum, opd_sum, opd_kl)
    if cfg.fused_loss:
        out = fused_gkd_loss(
            output_tensor, output_weight(gpt), batch.teacher_ids, batch.teacher_logprobs, kd_mask,
            beta=cfg.kd_beta, temperature=cfg.temperature, mode=cfg.topk_mode, **teacher, labels=batch.labels,
            sft_mask=sft_mask, kd_weight=kd_weight, sft_weight=sft_weight, tp_group=tp_group, vocab_size=vocab_size,
            opd_mask=opd_mask, teacher_actual=batch.teacher_actual, opd_weight=kd_weight,
        )
        loss, kd_sum, sft_sum = out.loss, out.kd_sum, out.sft_sum
        kd_n = out.kd_count + out.opd_count
        if opd_mask is not None:
            opd_sum, opd_kl = out.opd_sum, out.opd_kl_sum
    else:
        logits = output_tensor.float()
        # Megatron pads the vocab to a multiple of TP; `vocab_size` makes the loss ignore those columns without the
        # extra [T, V] copy a masked_fill would keep alive (the schedule holds on to output_tensor).
        if batch.teacher_ids.shape[-1] or bool(kd_mask.any()):
            kd_sum, kd_n = gkd_loss(
                logits, batch.teacher_ids, batch.teacher_logprobs, kd_mask, beta=cfg.kd_beta,
                temperature=cfg.temperature, mode=cfg.topk_mode, **teacher, tp_group=tp_group, vocab_size=vocab_size,
            )
        else:  # k = 0 rows (loss=opd, student-sourced only): no divergence to compute
            kd_sum, kd_n = logits.new_zeros(()), torch.zeros((), dtype=torch.long, device=logits.device)
        loss = kd_weight * kd_sum
        if opd_mask is not None:
            opd_sum, opd_n, opd_kl = opd_loss(logits, batch.labels, batch.teacher_actual, opd_mask, tp_group,
                                              vocab_size=vocab_size)
            loss, kd_n = loss + kd_weight * opd_sum, kd_n + opd_n
        sft_sum = torch.zeros((), device=logits.device)
        if sft_mask is not None:
            sft_sum, _ = vocab_parallel_ce(logits, batch.labels, sft_mask, tp_group, vocab_size=vocab_size)
            loss = loss + sft_weight * sft_sum
    return loss, kd_n, metrics.terms(kd_sum, sft_sum, opd_sum, opd_kl)


def model_inputs(batch, cfg: TrainConfig, model) -> dict:
    """The model's forward keywords besides input_ids, per backend: how packed rows keep their samples apart.
    megatron: positions, and document spans (sdpa) or a block-diagonal mask (local), `attention.attention_inputs`;
    hf: per-sample positions and a block-diagonal mask, `hf_model.inputs`. Padded rows: the causal default."""
    student = _unwrap(model)
    if hf_model.is_hf(student):  # the implementation the model was built with (hf_model.build: sdpa or eager)
        impl = student.base().config._attn_implementation
        return {**hf_model.inputs(batch.doc_ids, batch.position_ids, batch.packed, impl),
                **hf_model.vision_inputs(student, batch.input_ids, batch.images, batch.keys)}
    from pipeline.train.models.attention import attention_inputs

    if batch.images and any(batch.images):
        raise ConfigError(f"the cache rows of {batch.keys[0]} carry images, but the Megatron backend's students are "
                          "text-only; train a vision-language student on this cache (backend=auto puts it on the hf "
                          "backend)")
    return {"position_ids": batch.position_ids, **attention_inputs(batch.doc_ids, batch.packed, cfg.attention)}


def rank_inputs(batch, cfg: TrainConfig, model):
    """(the part of `batch` this rank computes, the model's forward keywords): the whole micro-batch and
    `model_inputs`; under context parallelism this rank's zig-zag chunks (`context_parallel.split`) and the whole
    rows' document spans (`attention.ContextSpans`). The step's counts are taken before, on whole micro-batches."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1 or hf_model.is_hf(_unwrap(model)):
        return batch, model_inputs(batch, cfg, model)
    from pipeline.train.models.attention import context_spans

    if batch.images and any(batch.images):
        model_inputs(batch, cfg, model)  # its refusal of images on this backend
    rank = parallel_state.get_context_parallel_rank()
    local, doc_ids = context_parallel.split(batch, cp, rank)
    spans = context_spans(doc_ids, batch.packed, rank, cp, parallel_state.get_context_parallel_group())
    return local, {"position_ids": local.position_ids, "attention_mask": None, "packed_seq_params": spans}


def score_live(teacher, batch, attn: dict, cfg: TrainConfig, student_vocab: int):
    """The micro-batch with its teacher rows computed now by the frozen live teacher, at its loss positions: the
    top-k and tail the score stage would have stored, unquantised (pipeline/train/teacher/live.py). `attn`: the
    student's forward keywords (`model_inputs`), the teacher being built on the same backend."""
    import dataclasses

    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    if batch.xtok_live is not None:  # another tokenizer: the teacher runs on its own tokens of the samples
        return live_xtok.score(teacher, batch, cfg.teacher_live_topk, lambda tb: model_inputs(tb, cfg, teacher),
                               output_weight(teacher), teacher.hf_vocab_size, tp_group)
    with torch.no_grad():
        hidden = teacher(batch.input_ids, **attn)
        ids, lps, tail, valid = teacher_topk(
            hidden, output_weight(teacher), batch.loss_mask, cfg.teacher_live_topk,
            tp_group=tp_group, vocab_size=teacher.hf_vocab_size, student_vocab=student_vocab)
    return dataclasses.replace(batch, teacher_ids=ids, teacher_logprobs=lps, teacher_tail=tail, teacher_valid=valid)


def forward_step(counts, cfg: TrainConfig, vocab_size: int, data_iterator, model, teacher=None):
    """Megatron's contract: (output tensor, partial(loss_func, ...)); the schedule calls the loss and backward.
    `teacher`: a frozen live teacher that scores the micro-batch first (else the loader brought cached rows)."""

    batch, attn = rank_inputs(next(data_iterator).to(_device()), cfg, model)
    if teacher is not None:
        batch = score_live(teacher, batch, attn, cfg, vocab_size)
    # [B, S, V/tp] logits, or [B, S, H] hidden states with fused_loss
    out = model(batch.input_ids, **attn)
    return out, partial(loss_func, batch, counts, cfg, vocab_size, _unwrap(model))


def train_step(cfg: TrainConfig, ddp, optimizer, scheduler, micro: list, vocab_size: int, teacher=None):
    """One optimizer step over this rank's micro-batches `micro` (the loop's body, without data and logging; the
    benchmarks time exactly this). Returns (global counts [KD, SFT, real tokens, *_DATA_COUNTS], per-micro-batch
    reports, lr, grad norm)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Global active counts of this step, known before any backward: the loss's denominators.
    # Then what the metrics report: real tokens, positions (real + padding), samples, truncated, folded.
    counts = torch.tensor(
        [float(sum(int(b.loss_mask.sum()) for b in micro)),
         float(sum(int(b.sft_mask.sum()) for b in micro)),
         float(sum(b.tokens for b in micro)),
         *(float(sum(getattr(b, f) for b in micro)) for f in _DATA_COUNTS)], dtype=torch.float64,
        device=_device())
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    if getattr(_unwrap(ddp), "gkd_backend", None) == "hf":
        return (counts, *_hf_step(cfg, ddp, optimizer, scheduler, micro, counts, vocab_size, teacher))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=partial(forward_step, (counts[0].item(), counts[1].item()), cfg, vocab_size, teacher=teacher),
        data_iterator=iter(micro), model=ddp, num_microbatches=len(micro), seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size, forward_only=False,
    )
    lr = optimizer.param_groups[0]["lr"]  # the LR this step uses (the scheduler moves it after the step)
    _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return counts, reports, lr, grad_norm


def _hf_step(cfg: TrainConfig, ddp, optimizer, scheduler, micro: list, counts, vocab_size: int, teacher=None):
    """train_step's body on the hf backend, what Megatron's no-pipelining schedule does written out: forward_step
    and the loss per micro-batch, backward (gradients reduced over data-parallel ranks on the last one only), then
    Megatron's clip + update. Returns (reports, lr, grad norm)."""
    student = _unwrap(ddp)
    optimizer.zero_grad(set_to_none=False)
    reports, data = [], iter(micro)
    step_counts = (counts[0].item(), counts[1].item())
    # FSDP averages gradients over ranks; the loss is normalised by the global count already (hf_model docstring)
    scale = dist.get_world_size() if student.fsdp else 1
    for i in range(len(micro)):
        last = i == len(micro) - 1
        if student.fsdp:
            student.set_requires_gradient_sync(last)
        with nullcontext() if last or not hasattr(ddp, "no_sync") else ddp.no_sync():
            out, loss_of = forward_step(step_counts, cfg, vocab_size, data, ddp, teacher=teacher)
            loss, _, report = loss_of(out)
            (loss * scale if scale != 1 else loss).backward()
        reports.append(report)
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = hf_model.clip_and_step(student, optimizer, cfg.clip_grad)
    scheduler.step(increment=1)
    return reports, lr, grad_norm


# ---------------------------------------------------------------- the loop


def check_cache_holds_loss(cfg: TrainConfig) -> None:
    """Refuse a cache that holds less than the configured loss reads: a k = 0 cache (only the actual token's
    teacher logprob) cannot feed the GKD divergence (loss=gkd, or the dataset-sourced rows of loss=opd)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    # indexed: each cache's index is read (and checked) here first, so a stale or foreign index is refused before the
    # model (xtok_map, image_rows and the loader read it again)
    sources = resolve_sources(cfg.cache, indexed=True)
    check_cross_tokenizer(cfg, sources)
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

    teacher_dir = Path(cfg.teacher_live)
    if not (teacher_dir / "config.json").exists():
        raise ConfigError(f"teacher_live: {teacher_dir} is not a Hugging Face model folder (no config.json)")
    if tokenizer_fingerprint(teacher_dir) == tokenizer_fingerprint(tokenizer):
        xtok_rows.refuse_same_tokenizer(teacher_dir, cfg.loss)
    xt = xtok_rows.open_live_xtok(hf_dir, teacher_dir, AutoConfig.from_pretrained(teacher_dir).vocab_size,
                                  AutoConfig.from_pretrained(hf_dir).vocab_size, cfg.loss == "gold")
    xtok_rows.check_rollouts(cfg.rollouts, xt)
    return xt


# MicroBatch counters summed over a step (all ranks) for the metrics: positions = real + padding tokens.
_DATA_COUNTS = ("positions", "samples", "truncated", "folded_positions")


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the last step's metrics. Every rank calls it."""
    from pipeline.train import checkpoint
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    hf_dir = student_dir(cfg)  # the student's family and this run's seq_length are checked before any work
    backend, why = resolve_backend(hf_dir, cfg.backend, cfg.seq_length)
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
    images_at = image_rows(cfg)  # one listing per cache without images; before the model is built
    check_images(hf_dir, images_at)
    packing, packing_why = plan_packing(cfg, backend, images_at, hf_dir)
    resume = checkpoint.latest(cfg.save_dir)
    if resume is not None and backend == "megatron":  # before any process group: a layout it cannot load into
        checkpoint.check_optimizer_layout(resume, checkpoint.read_meta(resume), cfg.use_distributed_optimizer,
                                          cfg.tensor_model_parallel_size)
    init_distributed(tp=cfg.tensor_model_parallel_size, pp=1, seed=cfg.seed, cp=cfg.context_parallel_size)
    try:
        return _train(cfg, backend, why, packing, packing_why)
    finally:
        destroy_distributed()


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


def _train(cfg: TrainConfig, backend: str, why: str, packing: bool | str = True,
           packing_why: str = "packing=true") -> dict:
    """setup -> steps -> checkpoints, inside an initialised process group."""
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from pipeline.train import checkpoint

    rank = dist.get_rank()
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if problem := batch_split_problem(cfg.global_batch_size, cfg.micro_batch_size, dp):
        raise ConfigError(problem)
    accum = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    hf_dir = student_dir(cfg)

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    if cfg.teacher_live is None:
        check_cache_holds_loss(cfg)  # before the model is built: a cache that cannot feed this loss is refused
    xt = None
    if cfg.teacher_live is not None and cfg.loss in XTOK_LOSSES:  # before the model: tokenizers, round trips
        xt = live_xtok_setup(cfg, hf_dir, tokenizer)
    if rank == 0:
        print(f"[train] backend={backend}: {why}", file=sys.stderr)
    model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, hf_dir, backend, packing)
    if packing == "auto":  # the hf backend's build decided
        packing, packing_why = model.packing, model.packing_why
    if rank == 0:
        print(f"[train] packing={'on' if packing else 'off'}: {packing_why}", file=sys.stderr)
    teacher = (setup_live_teacher(cfg, tokenizer_fingerprint(tokenizer), backend, packing) if cfg.teacher_live
               else None)
    loader = ScoredLoader(
        cfg.rollouts if teacher is not None else cfg.cache, micro_batch_size=cfg.micro_batch_size,
        seq_length=cfg.seq_length, seed=cfg.seed, pad_id=pad_id, dp_rank=dp_rank, dp_size=dp,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=model.hf_vocab_size,
        window_rows=cfg.window_rows, packing=packing, rows_per_step=cfg.global_batch_size,
        live_k=cfg.teacher_live_topk if teacher is not None else None, actual=cfg.loss == "opd",
        routes=cfg.teachers or None, route_key=cfg.teacher_tag_key, on_unrouted=cfg.on_unrouted,
        xtok_map=xtok_map(cfg, tokenizer) if cfg.loss in XTOK_LOSSES and xt is None else None, live_xtok=xt,
    )

    save_dir = Path(cfg.save_dir)
    step, position = _resume(cfg, save_dir, loader, model, optimizer, scheduler)
    if rank == 0:  # also with no checkpoint yet: a run killed before its first save left lines of steps it redoes
        keep_metrics_until(Path(cfg.log_dir or cfg.save_dir) / "metrics.jsonl", step)
    if cfg.data_position is not None:
        position = cfg.data_position
    log_dir = Path(cfg.log_dir or cfg.save_dir)
    writer = metrics_file = bar = None
    if rank == 0:
        writer, metrics_file, bar = metrics.open_sinks(log_dir, step, cfg.train_steps, cfg.progress)
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"[train] {hf_dir} ({n_train:,} trainable parameters on this rank"
              f"{', LoRA ' + str(model.lora_spec.to_json()) if cfg.lora_rank else ''}) on {loader.num_samples} samples ({loader.duplicates} duplicate keys skipped), "
              f"dp={dp} tp={cfg.tensor_model_parallel_size} cp={cfg.context_parallel_size} accum={accum}, from step {step}", file=sys.stderr)

    batches = loader.iter_from(position, prefetch=cfg.prefetch)
    # The loss sums: each context-parallel rank's over its own chunks (context_parallel.py), so over DP x CP.
    sums_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    last: dict = {}
    steps_this_run = 0
    state_bytes = 0
    try:
        while step < cfg.train_steps:
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(accum)]
            counts, reports, lr, grad_norm = train_step(cfg, ddp, optimizer, scheduler, micro, model.hf_vocab_size,
                                                        teacher)
            step += 1
            steps_this_run += 1
            if steps_this_run == 1 and backend == "megatron":  # torch creates the state on the first step
                most = torch.tensor([optimizer_state_bytes(optimizer, model)], dtype=torch.float64, device=_device())
                dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most any rank holds
                state_bytes = int(most.item())
            position = micro[-1].end

            sums = metrics.sum_reports(reports, sums_group)
            last = metrics.step_row(cfg, step, sums, counts, lr=lr, grad_norm=grad_norm,
                                    seconds=time.perf_counter() - t0, position=position,
                                    state_bytes=state_bytes if backend == "megatron" else None,
                                    unrouted=loader.unrouted)
            if rank == 0:
                metrics.log_row(last, metrics_file, writer, bar, log_dir / "metrics.jsonl")
            pause.point("train-step")
            done = step >= cfg.train_steps or (cfg.exit_after is not None and steps_this_run >= cfg.exit_after)
            if step % cfg.save_interval == 0 or done:
                checkpoint.save(save_dir, step, model, optimizer, {
                    "data_position": position, "data_fingerprint": loader.fingerprint,
                    "data_shards": loader.shards.paths(),
                    "scheduler": scheduler.state_dict(), "config": to_dict(cfg), "student": str(hf_dir.resolve()),
                    "backend": backend, "packing": packing, "packing_why": packing_why,
                })
            if done:
                break
    finally:
        batches.close()  # stops the prefetch thread
        for closable in (bar, writer, metrics_file):
            if closable is not None:
                closable.close()
    return last


def _resume(cfg: TrainConfig, save_dir: Path, loader, model, optimizer, scheduler) -> tuple[int, int]:
    """(step, data position) to continue from: the latest checkpoint of `save_dir` loaded into the model, the
    optimizer and the scheduler (its data set checked against the loader's), else (0, 0)."""
    from pipeline.train import checkpoint

    resume = checkpoint.latest(save_dir)
    if resume is None:
        return 0, 0
    meta = checkpoint.load(resume, model, optimizer)
    if cfg.data_position is None and meta["data_fingerprint"] != loader.fingerprint:
        raise data_changed(resume, meta, loader)
    scheduler.load_state_dict(meta["scheduler"])
    return meta["step"], meta["data_position"]


def data_changed(resume: Path, meta: dict, loader) -> Exception:
    """The refusal of a resume whose caches now hold other shards than the checkpoint's run saw (a score job was
    still filling them when the run started, or someone rescored): the data order would change under the run."""
    from pipeline.train.checkpoint import CheckpointMismatchError

    now = loader.shards.paths()
    saved = meta.get("data_shards")
    what = ""
    if saved is not None:
        added, gone = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
        what = (f" ({len(saved)} shards then, {len(now)} now: {len(added)} added"
                + (f", e.g. {added[0]}" if added else "") + f", {len(gone)} gone" + (f", e.g. {gone[0]}" if gone else "")
                + ")")
    return CheckpointMismatchError(
        f"{resume}: this run trained on data fingerprint {meta['data_fingerprint']}, the caches now give "
        f"{loader.fingerprint}{what}. A resumed run keeps its data set: rerun with a new save_dir to train on the "
        "shards there are now, or pass data_position=N to continue these weights on the new data set from sample N "
        "(a new data set, not the same run)")


def keep_metrics_until(path: Path, step: int) -> None:
    """On (re)start at `step` (0: no checkpoint yet): drop metrics.jsonl lines of later steps (written before a kill,
    redone now), as the TensorBoard writer's purge_step does for its events, so the file holds each step once."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] = ""  # a line cut by a kill mid-write: its step is redone
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(kept).encode())
