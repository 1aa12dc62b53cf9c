"""One optimizer step on either backend: a micro-batch's forward keywords, the live teacher's rows, the loss and its
named report, and Megatron's forward-backward schedule (or the same written out for the transformers backend).

Normalisation: every micro-batch's loss is its SUM over active positions divided by the GLOBAL count of active
positions of the step (all micro-batches, all data-parallel ranks), counted before the step (`train_step`), so the
per-token loss does not depend on how the global batch is split. Hence `calculate_per_token_loss=True` (the schedule
leaves the loss as returned and DDP sums gradients instead of averaging; setup.py) and a finalize hook that does not
rescale again. Context parallelism (parallel/context_parallel.py) keeps this rule: the counts are taken on the whole
micro-batches (all CP ranks of a replica hold the same), each CP rank's loss sums its own chunks' positions, and both
the reported sums and DDP's gradient sum run over the data-parallel x context-parallel group.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from pipeline.config import ConfigError
from pipeline.train import metrics
from pipeline.train.config import TrainConfig
from pipeline.train.losses.exact import exact_gkd_loss
from pipeline.train.losses.fused import fused_gkd_loss, output_weight
from pipeline.train.losses.reference import OpdCorrection, gkd_loss, opd_loss, vocab_parallel_ce
from pipeline.train.losses.xtok import XTOK_LOSSES, fused_xtok_loss, gold_weights
from pipeline.train.models import hf_model
from pipeline.train.parallel import context_parallel
from pipeline.train.teacher import live_xtok
from pipeline.train.teacher.live import teacher_topk


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.currentdevice()) if torch.cuda.is_available() else torch.device("cpu")


# MicroBatch counters summed over a step (all ranks) for the metrics: positions = real + padding tokens.
_DATA_COUNTS = ("positions", "samples", "truncated", "folded_positions")


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
    # the loss reads route and spans; images and xtok_live were the forward's and the live teacher's (already used)
    used = {"route", "images", "xtok_live", "behavior"} | ({"spans"} if cfg.loss in XTOK_LOSSES else {"exact"})
    batch.refuse_parts(used, f"loss={cfg.loss}", fix="cross-tokenizer rows train with loss=gold (or loss=uld)")
    if batch.route is None or not names:
        loss, kd_n, t = _loss_terms(batch, batch.loss_mask, 1.0, counts, cfg, vocab_size, gpt, output_tensor)
        return loss, kd_n.int(), {**t, metrics.WEIGHTED_KD_SUM: t[metrics.KD_SUM]}
    dev = batch.loss_mask.device

    def zero() -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=dev)

    loss, kd_n = 0.0, 0
    report = {name: zero() for name in (*metrics.TERMS, metrics.WEIGHTED_KD_SUM)}
    for name in names:
        report[metrics.teacher_kd_sum(name)], report[metrics.teacher_kd_count(name)] = zero(), zero()
    route = batch.route.teacher
    present = [i for i in range(len(names)) if bool((route == i).any())] or [None]
    for i in present:
        mask = batch.loss_mask if i is None else batch.loss_mask & (route == i)
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
    kd_weight, sft_weight = cfg.kd_alpha * kd_scale / max(counts[0], 1.0), cfg.sft_alpha / max(counts[1], 1.0)
    # kd_alpha=0: no divergence computed at all (an SFT step's cost), not one computed and weighted by 0
    kd_mask, opd_mask = (mask if cfg.kd_alpha else torch.zeros_like(mask)), None
    if cfg.loss == "opd":  # student-sourced positions: OPD; dataset-sourced ones (loss_mask & dataset): GKD
        kd_mask, opd_mask = batch.sft_mask & mask, mask & ~batch.sft_mask
    teacher = dict(teacher_tail=batch.teacher_tail, teacher_valid=batch.teacher_valid)
    # stale samples' importance weights: rows that recorded the sampler's logprobs (loss=opd reads them)
    correction = (OpdCorrection(batch.behavior.logprobs, float(cfg.opd_is_cap))
                  if batch.behavior is not None and cfg.opd_is_cap is not None else None)
    opd_sum = opd_kl = torch.zeros((), device=output_tensor.device, dtype=torch.float64)
    if cfg.loss in XTOK_LOSSES:  # cross-tokenizer spans (xtok_loss.py): SFT on every completion position
        spans = batch.spans
        if spans is None:
            raise ConfigError(f"loss={cfg.loss}: the micro-batch of {next(iter(batch.keys), '?')} has no spans (not "
                              "cross-tokenizer rows); train it with loss=gkd, or train on a cross-tokenizer cache")
        matched = spans.matched
        weights = gold_weights(int(matched.sum()) if matched is not None else 0, spans.teacher_vocab,
                               cfg.gold_matched_weight, cfg.gold_unmatched_weight)
        out = fused_xtok_loss(
            output_tensor, output_weight(gpt), batch.labels, mask, spans.head, batch.teacher_ids,
            batch.teacher_logprobs, batch.teacher_valid, batch.teacher_tail, kind=cfg.loss, matched=matched,
            weights=weights, beta=cfg.kd_beta, sft_mask=batch.sft_mask if cfg.sft_alpha > 0 else None,
            kd_weight=kd_weight, sft_weight=sft_weight, vocab_size=vocab_size, tp_group=tp_group)
        return out.loss, out.kd_count, metrics.terms(out.kd_sum, out.sft_sum, opd_sum, opd_kl)
    if batch.exact is not None:  # a hidden-state cache: the exact teacher, chunk by chunk (losses/exact.py)
        if not cfg.fused_loss:
            raise ConfigError("a hidden-state cache trains through the fused output layer: drop fused_loss=false")
        out = exact_gkd_loss(
            output_tensor, output_weight(gpt), batch.exact.hidden, batch.exact.weight, kd_mask, beta=cfg.kd_beta,
            temperature=cfg.temperature, labels=batch.labels, sft_mask=sft_mask, kd_weight=kd_weight,
            sft_weight=sft_weight, tp_group=tp_group, vocab_size=vocab_size, opd_mask=opd_mask, opd_weight=kd_weight,
            opd_correction=correction)
        loss, kd_sum, sft_sum = out.loss, out.kd_sum, out.sft_sum
        kd_n = out.kd_count + out.opd_count
        if opd_mask is not None:
            opd_sum, opd_kl = out.opd_sum, out.opd_kl_sum
    elif cfg.fused_loss:
        t_ids, t_lps = batch.teacher_ids, batch.teacher_logprobs
        if not cfg.kd_alpha:  # no teacher column enters the kernel: k = 0 makes no bins and no tail pass
            t_ids, t_lps = t_ids[..., :0], t_lps[..., :0]
            teacher = dict(teacher_tail=None, teacher_valid=None)
        out = fused_gkd_loss(
            output_tensor, output_weight(gpt), t_ids, t_lps, kd_mask,
            beta=cfg.kd_beta, temperature=cfg.temperature, mode=cfg.topk_mode, **teacher, labels=batch.labels,
            sft_mask=sft_mask, kd_weight=kd_weight, sft_weight=sft_weight, tp_group=tp_group, vocab_size=vocab_size,
            opd_mask=opd_mask, teacher_actual=batch.teacher_actual, opd_weight=kd_weight, opd_correction=correction,
        )
        loss, kd_sum, sft_sum = out.loss, out.kd_sum, out.sft_sum
        kd_n = out.kd_count + out.opd_count
        if opd_mask is not None:
            opd_sum, opd_kl = out.opd_sum, out.opd_kl_sum
    else:
        logits = output_tensor.float()
        # Megatron pads the vocab to a multiple of TP; `vocab_size` makes the loss ignore those columns without the
        # extra [T, V] copy a masked_fill would keep alive (the schedule holds on to output_tensor).
        if cfg.kd_alpha and (batch.teacher_ids.shape[-1] or bool(kd_mask.any())):
            kd_sum, kd_n = gkd_loss(
                logits, batch.teacher_ids, batch.teacher_logprobs, kd_mask, beta=cfg.kd_beta,
                temperature=cfg.temperature, mode=cfg.topk_mode, **teacher, tp_group=tp_group, vocab_size=vocab_size,
            )
        else:  # k = 0 rows (loss=opd, student-sourced only): no divergence to compute
            kd_sum, kd_n = logits.new_zeros(()), torch.zeros((), dtype=torch.long, device=logits.device)
        loss = kd_weight * kd_sum
        if opd_mask is not None:
            opd_sum, opd_n, opd_kl = opd_loss(logits, batch.labels, batch.teacher_actual, opd_mask, tp_group,
                                              vocab_size=vocab_size, correction=correction)
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

    if batch.images is not None:  # the forward reads images only; the other parts are the loss's and the teacher's
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

    if batch.images is not None:
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


def topk_view(batch, k: int, student_vocab: int):
    """A hidden-state cache's micro-batch as a top-k one (`topk_from_hidden`): the teacher's top-k and tail at the
    loss positions computed from its states and output layer, as the live teacher's are (teacher/live.py), the
    exact part dropped; every top-k loss then reads it."""
    import dataclasses

    with torch.no_grad():
        ids, lps, tail, valid = teacher_topk(batch.exact.hidden, batch.exact.weight, batch.loss_mask, k,
                                             vocab_size=batch.exact.weight.shape[0], student_vocab=student_vocab)
    return dataclasses.replace(batch, teacher_ids=ids, teacher_logprobs=lps, teacher_tail=tail, teacher_valid=valid,
                               exact=None)


def forward_step(counts, cfg: TrainConfig, vocab_size: int, data_iterator, model, teacher=None):
    """Megatron's contract: (output tensor, partial(loss_func, ...)); the schedule calls the loss and backward.
    `teacher`: a frozen live teacher that scores the micro-batch first (else the loader brought cached rows)."""

    batch, attn = rank_inputs(next(data_iterator).to(device()), cfg, model)
    if teacher is not None:
        batch = score_live(teacher, batch, attn, cfg, vocab_size)
    elif batch.exact is not None and cfg.topk_from_hidden:
        batch = topk_view(batch, cfg.topk_from_hidden, vocab_size)
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
        device=device())
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    if getattr(_unwrap(ddp), "gkd_backend", None) == "hf":
        return (counts, *_hf_step(cfg, ddp, optimizer, scheduler, micro, counts, vocab_size, teacher))
    for chunk in ddp if isinstance(ddp, list) else [ddp]:  # interleaved pipelining: one DDP per model chunk
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=partial(forward_step, (counts[0].item(), counts[1].item()), cfg, vocab_size, teacher=teacher),
        # interleaved (a list of model chunks): every chunk reads each micro-batch (positions, spans, the loss's rows)
        data_iterator=[iter(micro) for _ in ddp] if isinstance(ddp, list) else iter(micro), model=ddp, num_microbatches=len(micro), seq_length=cfg.seq_length,
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
