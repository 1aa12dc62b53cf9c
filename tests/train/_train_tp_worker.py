"""One trainer step (Megatron schedule, real forward_step/loss_func) at a given TP; dumps the loss sums and the
gradients in HF layout, for tests/train/test_run.py::test_tp2_matches_tp1.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_train_tp_worker.py STUDENT CACHE OUT 2``
(or plain ``python ... 1`` for the TP=1 reference). A 5th argument ``lora`` trains a rank-8 adapter instead, set to a
random non-zero adapter first (B = 0 at init would give A no gradient), and dumps adapter gradients in peft layout.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist


def main(student: str, cache: str, out: str, tp: int, lora: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.metrics import sum_reports
    from pipeline.train.models.megatron import megatron_to_hf_state_dict
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed
    from pipeline.train.setup import setup_model_and_optimizer
    from pipeline.train.step import forward_step

    cfg = TrainConfig(student=student, cache=[cache], micro_batch_size=2, global_batch_size=4, seq_length=32,
                      tensor_model_parallel_size=tp, sft_alpha=0.5, beta=0.5, temperature=2.0,
                      lora_rank=8 if lora else 0)
    init_distributed(tp=tp, pp=1, seed=cfg.seed)
    model, ddp, optimizer, _ = setup_model_and_optimizer(cfg, Path(student))
    if lora:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tiny_models import random_peft

        from pipeline.train.models.lora import from_peft, load_lora_state, to_peft

        spec = cfg.lora_spec()
        load_lora_state(model, from_peft(random_peft(model.hf_arch, spec), model.hf_arch, spec,
                                         parallel_state.get_tensor_model_parallel_rank(), tp))
    # packed (the trainer's default): TP=2 vs TP=1 also covers the block-diagonal attention mask
    it = ScoredLoader(cfg.cache, micro_batch_size=2, seq_length=32, seed=cfg.seed, packing=True).iter_from(0, prefetch=0)
    micro = [next(it) for _ in range(2)]
    counts = (float(sum(int(b.loss_mask.sum()) for b in micro)),
              float(sum(int(b.sft_mask.sum()) for b in micro)))
    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=partial(forward_step, counts, cfg, model.hf_vocab_size), data_iterator=iter(micro),
        model=ddp, num_microbatches=2, seq_length=32, micro_batch_size=2,
    )
    _, grad_norm, _ = optimizer.step()
    grads = {name: p.main_grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    shards = [None] * tp
    dist.all_gather_object(shards, grads, group=parallel_state.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        sums = sum_reports(reports, reduce=False)  # rank 0's: the loss sums are the same on every TP rank
        torch.save({"sums": sums, "counts": counts, "grad_norm": float(grad_norm),
                    "grads": to_peft(shards, model.hf_arch, spec) if lora else megatron_to_hf_state_dict(shards, model.hf_arch)},
                   Path(out) / f"tp{tp}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:] == ["lora"])
