"""TP=2 worker for tests/train/models/test_model.py: build, load, forward/backward and export each given HF folder.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_tp_worker.py IDS OUT HF_DIR...``
IDS is a torch.save'd [batch, seq] LongTensor. For every HF_DIR, rank 0 writes OUT/<name>.pt with the gathered
logits and the final-norm gradient of loss = (logits * w).sum(), and every rank joins export_hf to OUT/<name>-hf.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from pipeline.train.models.megatron import build_model, export_hf, load_hf_weights
from pipeline.train.parallel.groups import destroy_distributed, init_distributed


def main(ids_path: str, out_dir: str, hf_dirs: list[str]) -> None:
    init_distributed(tp=2, pp=1, seed=0)
    ids = torch.load(ids_path)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    for hf_dir in hf_dirs:
        name = Path(hf_dir).name
        model = build_model(hf_dir)
        load_hf_weights(model, hf_dir)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(ids, positions, None))
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
        (logits * weights).sum().backward()
        if dist.get_rank() == 0:
            grad = model.decoder.final_layernorm.weight.grad
            torch.save({"logits": logits.detach(), "norm_grad": grad}, Path(out_dir) / f"{name}.pt")
        export_hf(model, hf_dir, Path(out_dir) / f"{name}-hf")
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
