"""One trainer step (`train_step`: Megatron's schedule — 1F1B at PP > 1 —, the real forward_step/loss_func, DDP,
finalize_model_grads) per variant at a given pipeline size, dumping the loss sums as the loop reports them
(`metrics.pipeline_sums`: summed on the last stage, broadcast), the counts, the grad norm and the gradients in HF
layout (all stages merged by global layer index), for tests/train/parallel/test_pipeline_parallel.py.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_pp_worker.py STUDENT TIED TEACHER CACHE
OUT 2``
(PP=2; then the TP and CP sizes: 4 processes for PP=2 x TP=2, PP=2 x CP=2, or PP=2 x DP=2 with both 1), or plain ``python ... 1`` for the PP=1
reference. TIED: a student with tied embeddings (same tokenizer); TEACHER: the model the cache was scored from.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

VARIANTS = {  # packed rows of 64 tokens (about two samples each) + the fused loss (the defaults); padded rows (as wide
    # as each micro-batch's longest sample: the stages send each activation's shape first) + the unfused loss +
    # selective recompute; a student with tied embeddings (first stage: the embedding, last stage: its copy as the
    # output layer, their gradients summed by finalize_model_grads); bf16 mixed precision (bf16 activations between
    # stages)
    "packed fused": {"seq_length": 64},
    "padded unfused recompute": {"packing": False, "fused_loss": False, "recompute": "selective", "seq_length": 64},
    "tied": {"tied": True},
    "bf16": {"bf16": True},
    "opd": {"loss": "opd"},  # student-sourced rows: the sampled-token loss; dataset-sourced ones: GKD
    "aligned": {"teacher": True, "temperature": 1.0},  # the scoring model as the student: KD ≈ 0 at every active position (alignment)
    "lora": {"lora_rank": 4},  # adapters on each stage's layers, seeded by global layer (the PP=1 adapter at any PP)
}
# Under PP x TP (and PP x DP, PP x CP: 4 processes each), where TP meets the pipeline: the vocabulary-parallel fused loss on the last stage and the tied
# embedding's copies (first and last stage, each split over the TP ranks). bf16 is compared at TP=1 only: a TP split
# reorders bf16 sums, a gap of bf16's size (1e-2 of the scale) that is not the pipeline's.
TP_VARIANTS = ("packed fused", "tied")


def _grads(model) -> tuple:
    """This step's gradients of every stage and TP rank, HF layout (on every rank). The tied output layer's copy (last
    stage) is returned apart, with the embedding's: after finalize_model_grads it must hold the same summed gradient."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from pipeline.train.models.layers import layer_key
    from pipeline.train.models.megatron import megatron_to_hf_state_dict

    offset = get_transformer_layer_offset(model.config)
    grads = {layer_key(name, offset): p.main_grad.detach().clone()
             for name, p in model.named_parameters() if p.requires_grad}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (parallel_state.get_tensor_model_parallel_rank(), grads))
    by_tp: dict = {}
    for tp_rank, stage in ranks:  # the stages of one TP rank merge by global key
        by_tp.setdefault(tp_rank, {}).update(stage)
    shards = [by_tp[r] for r in sorted(by_tp)]
    if getattr(model, "lora_spec", None) is not None:  # the adapters' gradients, by global key (TP=1 here)
        return shards[0], None, None
    tied_copy = embedding = None
    if model.hf_arch.tied_embeddings and "output_layer.weight" in shards[0]:
        tied_copy = torch.cat([s.pop("output_layer.weight") for s in shards])
        embedding = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    return megatron_to_hf_state_dict(shards, model.hf_arch), tied_copy, embedding


def main(student: str, tied: str, teacher: str, cache: str, out: str, pp: int, tp: int, cp: int) -> None:
    from megatron.core import parallel_state

    from pipeline.train import metrics
    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed
    from pipeline.train.setup import setup_model_and_optimizer
    from pipeline.train.step import device, train_step

    init_distributed(tp=tp, pp=pp, seed=1234, cp=cp)
    results: dict = {}
    for name, kw in VARIANTS.items():
        if dist.get_world_size() > pp and name not in TP_VARIANTS:
            continue
        kw = dict(kw)
        hf_dir = tied if kw.pop("tied", False) else teacher if kw.pop("teacher", False) else student
        cfg = TrainConfig(student=hf_dir, cache=[cache], micro_batch_size=2, global_batch_size=8,
                          pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, context_parallel_size=cp,
                          sft_alpha=0.5, beta=0.5,
                          **{"seq_length": 32, "temperature": 2.0, **kw})
        model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, Path(hf_dir))
        # 4 micro-batches a step > 2 stages (1F1B's warm-up, steady state, cool-down); under DP, m = rank (mod dp)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        it = ScoredLoader(cfg.cache, micro_batch_size=2, seq_length=cfg.seq_length, seed=cfg.seed, dp_rank=dp_rank,
                          dp_size=dp, rows_per_step=cfg.global_batch_size,
                          packing=cfg.packing is not False).iter_from(0, prefetch=0)
        micro = [next(it) for _ in range(4 // dp)]
        counts, reports, _, grad_norm = train_step(cfg, ddp, optimizer, scheduler, micro, model.hf_vocab_size)
        sums = metrics.pipeline_sums(reports, metrics.report_names(cfg),
                                     parallel_state.get_data_parallel_group(with_context_parallel=True),
                                     parallel_state.get_pipeline_model_parallel_group(),
                                     parallel_state.get_pipeline_model_parallel_last_rank(), device())
        grads, tied_copy, embedding = _grads(model)
        results[name] = {"sums": sums, "counts": counts[:2].tolist(), "grad_norm": float(grad_norm), "grads": grads,
                         "tied_copy": tied_copy, "embedding": embedding, "reports": len(reports),
                         "layers": len(model.decoder.layers), "widths": [b.input_ids.shape[1] for b in micro],
                         "samples": sum(b.samples for b in micro), "dp": dp}
    if dist.get_rank() == 0:
        torch.save(results, Path(out) / f"pp{pp}_tp{tp}_cp{cp}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:6], *(int(a) for a in sys.argv[6:9]))
