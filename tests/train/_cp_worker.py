"""One trainer step (`train_step`: the Megatron schedule, real forward_step/loss_func) per variant at a given CP (and
TP), dumping the loss sums, counts, grad norm and gradients in HF layout; and the alignment check under CP (student =
the scoring model: loss ~ 0; teacher rows shifted by one: large), for tests/train/parallel/test_context_parallel.py.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_cp_worker.py STUDENT TEACHER CACHE
OUT 2`` (CP=2; a 6th argument is the TP size), or plain ``python ... 1`` for the CP=1 reference.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

VARIANTS = {  # packed rows + the fused loss (the defaults); padded rows + the unfused loss + selective recompute;
    # a LoRA adapter (set to random non-zero values first: B = 0 at init would give A no gradient) + full recompute;
# loss=opd
    "packed fused": {},
    "padded unfused recompute": {"packing": False, "fused_loss": False, "recompute": "selective"},
    "lora full recompute": {"lora_rank": 8, "recompute": "full"},
    "opd": {"loss": "opd"},  # student-sourced rows: the sampled-token loss; dataset-sourced ones: GKD
}


def _grads(model, tp: int, spec) -> dict:
    """This step's gradients, gathered over TP: HF layout, or peft layout for a LoRA adapter."""
    from megatron.core import parallel_state

    from pipeline.train.models.lora import to_peft
    from pipeline.train.models.megatron import megatron_to_hf_state_dict

    grads = {name: p.main_grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    shards = [None] * tp
    dist.all_gather_object(shards, grads, group=parallel_state.get_tensor_model_parallel_group())
    return to_peft(shards, model.hf_arch, spec) if spec else megatron_to_hf_state_dict(shards, model.hf_arch)


def _random_adapter(model, cfg, tp: int) -> None:
    from megatron.core import parallel_state

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import random_peft

    from pipeline.train.models.lora import from_peft, load_lora_state

    spec = cfg.lora_spec()
    load_lora_state(model, from_peft(random_peft(model.hf_arch, spec), model.hf_arch, spec,
                                     parallel_state.get_tensor_model_parallel_rank(), tp))


def _crossing(doc_ids: torch.Tensor, cp: int) -> int:
    """Samples of a [B, W] doc_ids whose tokens lie in more than one of the 2 * cp chunks (W a multiple of 2 * cp)."""
    b, w = doc_ids.shape
    chunk = torch.arange(w) // (w // (2 * cp))
    return sum(len({int(c) for c in chunk[doc_ids[r] == d]}) > 1 for r in range(b) for d in doc_ids[r].unique()
               if d >= 0)


def alignment(teacher: str, cache: str, cp: int, tp: int) -> dict:
    """Loss per active position of the scoring model on its own cache, under CP, and with the teacher rows paired one
    position off (rolled on the WHOLE rows, then split), summed over the CP ranks."""
    from megatron.core import parallel_state

    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.models.megatron import build_model, load_hf_weights
    from pipeline.train.parallel.context_parallel import split
    from pipeline.train.step import rank_inputs

    cfg = TrainConfig(student=teacher, cache=[cache], seq_length=64, context_parallel_size=cp,
                      tensor_model_parallel_size=tp)
    model = build_model(teacher)
    load_hf_weights(model, teacher)
    mb = ScoredLoader([cache], micro_batch_size=8, seq_length=64, seed=0).micro_batch(0)
    local, attn = rank_inputs(mb, cfg, model)
    shifted = dataclasses.replace(mb, teacher_ids=torch.roll(mb.teacher_ids, 1, dims=1),
                                  teacher_logprobs=torch.roll(mb.teacher_logprobs, 1, dims=1),
                                  loss_mask=torch.roll(mb.loss_mask, 1, dims=1))
    local_shifted = split(shifted, cp, parallel_state.get_context_parallel_rank())[0] if cp > 1 else shifted
    with torch.no_grad():
        logits = model(local.input_ids, **attn)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    out = torch.zeros(2, 2, dtype=torch.float64)
    for i, b in enumerate((local, local_shifted)):
        s, n = gkd_loss(logits, b.teacher_ids, b.teacher_logprobs, b.loss_mask, beta=0.5, mode="tail",
                        tp_group=tp_group, vocab_size=model.hf_vocab_size)
        out[i] = torch.stack([s.double(), n.double()])
    dist.all_reduce(out, group=parallel_state.get_context_parallel_group())
    return {"loss": float(out[0, 0] / out[0, 1]), "shifted": float(out[1, 0] / out[1, 1]),
            "active": int(out[0, 1]), "crossing": _crossing(mb.doc_ids, 2) if mb.doc_ids.shape[1] % 4 == 0 else 0}


def main(student: str, teacher: str, cache: str, out: str, cp: int, tp: int) -> None:
    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.metrics import sum_reports
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed
    from pipeline.train.setup import setup_model_and_optimizer
    from pipeline.train.step import train_step

    init_distributed(tp=tp, pp=1, seed=1234, cp=cp)
    results: dict = {}
    for name, kw in VARIANTS.items():
        cfg = TrainConfig(student=student, cache=[cache], micro_batch_size=2, global_batch_size=4, seq_length=32,
                          tensor_model_parallel_size=tp, context_parallel_size=cp, sft_alpha=0.5, beta=0.5,
                          temperature=2.0, **kw)
        model, ddp, optimizer, scheduler = setup_model_and_optimizer(cfg, Path(student))
        if cfg.lora_rank:
            _random_adapter(model, cfg, tp)
        it = ScoredLoader(cfg.cache, micro_batch_size=2, seq_length=32, seed=cfg.seed,
                          packing=True).iter_from(0, prefetch=0)
        micro = [next(it) for _ in range(2)]
        counts, reports, _, grad_norm = train_step(cfg, ddp, optimizer, scheduler, micro, model.hf_vocab_size)
        from megatron.core import parallel_state

        sums = sum_reports(reports, parallel_state.get_context_parallel_group())
        results[name] = {"sums": sums, "counts": counts[:2].tolist(), "grad_norm": float(grad_norm),
                         "grads": _grads(model, tp, cfg.lora_spec()),
                         "crossing": sum(_crossing(b.doc_ids, 2) for b in micro if b.doc_ids.shape[1] % 4 == 0)}
    results["alignment"] = alignment(teacher, cache, cp, tp)
    if dist.get_rank() == 0:
        torch.save(results, Path(out) / f"cp{cp}_tp{tp}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:5], int(sys.argv[5]), int(sys.argv[6]) if len(sys.argv) > 6 else 1)
