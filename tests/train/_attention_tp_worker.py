"""TP=2 worker for tests/train/models/test_attention.py: the SDPA student at TP=2, causal and with a packed mask.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_attention_tp_worker.py IN OUT HF..``
IN is a torch.save'd {"ids", "mask", "weights_seed"}. For every HF dir and mask case, rank 0 writes
OUT/<name>-<case>.pt with the TP-gathered logits and the gradients of loss = (logits * w).sum() that the test
compares with TP=1: the final norm (replicated), and per layer the fused QKV (row-parallel by query group, so the TP
shards concatenate along dim 0 to the TP=1 tensor) and the output projection (split along dim 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from pipeline.train.models.megatron import build_model, load_hf_weights
from pipeline.train.parallel.groups import destroy_distributed, init_distributed


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def main(in_path: str, out_dir: str, hf_dirs: list[str]) -> None:
    init_distributed(tp=2, pp=1, seed=0)
    inputs = torch.load(in_path)
    ids = inputs["ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    for hf_dir in hf_dirs:
        for case, mask in (("causal", None), ("packed", inputs["mask"])):
            model = build_model(hf_dir, attention="sdpa")
            load_hf_weights(model, hf_dir)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(ids, positions, mask))
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(inputs["weights_seed"]))
            (logits * weights).sum().backward()
            grads = {"decoder.final_layernorm.weight": model.decoder.final_layernorm.weight.grad}
            for i, layer in enumerate(model.decoder.layers):
                attn = layer.self_attention
                grads[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = _gather(attn.linear_qkv.weight.grad, 0)
                grads[f"decoder.layers.{i}.self_attention.linear_proj.weight"] = _gather(attn.linear_proj.weight.grad, 1)
            if dist.get_rank() == 0:
                torch.save({"logits": logits.detach(), "grads": grads}, Path(out_dir) / f"{Path(hf_dir).name}-{case}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
