"""The train stage's library: a student distilled from a teacher cache of sparse top-k logprobs (GKD), on one of two
backends: Megatron-Core, or transformers (models/hf_model.py) for the families Megatron-Core does not map
(models/families.py).

The entry (`gkd train`, `torchrun -m pipeline.train.run`) is pipeline/train/run.py: argparse + `main` over `train`.

The loop is written out here (torchtune recipe / Megatron pretrain_gpt style): checks and setup (setup.py) -> steps
(step.py) -> checkpoints (checkpoint.py), with metrics (metrics.py). One sample's path: cached row ->
`data.loader.ScoredLoader` (rolled labels, aligned teacher rows) -> `step.forward_step` (student logits) ->
`step.loss_func` (GKD divergence + SFT CE) -> Megatron's forward-backward schedule (`step.train_step`).

Resume: `gkd train` with the same save_dir continues from `save_dir/latest` (model, optimizer, LR scheduler, RNG,
data position) and reproduces an uninterrupted run bit-for-bit on CPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import pause
from pipeline.config import ConfigError, to_dict
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.shards import atomic_write_bytes
from pipeline.train import metrics
from pipeline.train.config import TrainConfig
from pipeline.train.data.loader import LiveRows, Routing, ScoredLoader, batch_split_problem
from pipeline.train.data.sources import resolve_sources
from pipeline.train.losses.xtok import XTOK_LOSSES
from pipeline.train.models.families import resolve_backend
from pipeline.train.setup import (
    check_backend,
    check_cache_holds_loss,
    check_hidden_cache,
    check_images,
    image_rows,
    live_xtok_setup,
    optimizer_state_bytes,
    plan_packing,
    setup_live_teacher,
    setup_model_and_optimizer,
    student_dir,
    xtok_map,
)
from pipeline.train.step import device, train_step


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the last step's metrics. Every rank calls it."""
    from pipeline.train import checkpoint
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    hf_dir = student_dir(cfg)  # the student's family and this run's seq_length are checked before any work
    backend, why = resolve_backend(hf_dir, cfg.backend, cfg.seq_length)
    check_backend(cfg, backend, why, hf_dir)
    images_at = image_rows(cfg)  # one listing per cache without images; before the model is built
    check_images(hf_dir, images_at)
    packing, packing_why = plan_packing(cfg, backend, images_at, hf_dir)
    if cfg.teacher_live is None:  # a hidden-state cache's refusals (parallel sizes among them) before any group
        check_hidden_cache(cfg, resolve_sources(cfg.cache, indexed=True))
    resume = checkpoint.latest(cfg.save_dir)
    if resume is not None and backend == "megatron":  # before any process group: a layout it cannot load into
        checkpoint.check_optimizer_layout(resume, checkpoint.read_meta(resume), cfg.use_distributed_optimizer,
                                          cfg.tensor_model_parallel_size)
    init_distributed(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size, seed=cfg.seed,
                     cp=cfg.context_parallel_size, vpp=cfg.virtual_pipeline_model_parallel_size)
    try:
        return _train(cfg, backend, why, packing, packing_why)
    finally:
        destroy_distributed()


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
        actual=cfg.loss == "opd",
        live=LiveRows(cfg.teacher_live_topk, xt) if teacher is not None else None,
        routing=Routing(cfg.teachers, cfg.teacher_tag_key, cfg.on_unrouted) if cfg.teachers else None,
        xtok_map=xtok_map(cfg, tokenizer) if cfg.loss in XTOK_LOSSES and xt is None else None,
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
              f"dp={dp} tp={cfg.tensor_model_parallel_size} cp={cfg.context_parallel_size} pp={cfg.pipeline_model_parallel_size} vpp={cfg.virtual_pipeline_model_parallel_size} accum={accum}, from step {step}", file=sys.stderr)

    batches = loader.iter_from(position, prefetch=cfg.prefetch)
    # The loss sums: each context-parallel rank's over its own chunks (context_parallel.py), so over DP x CP.
    sums_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    pipeline_group = parallel_state.get_pipeline_model_parallel_group()
    last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
    report_names = metrics.report_names(cfg)
    last: dict = {}
    steps_this_run = 0
    state_bytes = 0
    try:
        while step < cfg.train_steps:
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(accum)]
            stale = metrics.staleness(micro, step, parallel_state.get_data_parallel_group(), device())
            counts, reports, lr, grad_norm = train_step(cfg, ddp, optimizer, scheduler, micro, model.hf_vocab_size,
                                                        teacher)
            step += 1
            steps_this_run += 1
            if steps_this_run == 1 and backend == "megatron":  # torch creates the state on the first step
                most = torch.tensor([optimizer_state_bytes(optimizer, model)], dtype=torch.float64, device=device())
                dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most any rank holds
                state_bytes = int(most.item())
            position = micro[-1].end

            # the loss sums exist on the last pipeline stage only: summed there, broadcast to the other stages
            sums = metrics.pipeline_sums(reports, report_names, sums_group, pipeline_group, last_stage_rank, device())
            last = metrics.step_row(cfg, step, sums, counts, lr=lr, grad_norm=grad_norm,
                                    seconds=time.perf_counter() - t0, position=position,
                                    state_bytes=state_bytes if backend == "megatron" else None,
                                    unrouted=loader.unrouted, stale=stale)
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
