"""TP=2 worker for tests/train/losses/test_fused_loss.py: the fused output layer + loss on a vocab-split weight must equal
TP=1 (same loss on every rank, the same hidden-state gradient, each rank's weight-gradient rows of the full one).

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_fused_tp_worker.py`` (plain
torch.distributed with gloo; no Megatron). Prints "TP2 OK" on each rank, exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tolerance import assert_layout_close

sys.path.insert(0, str(Path(__file__).resolve().parent / "losses"))  # the test module whose cases this checks
from test_fused_loss import H, fused, make_case  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for dtype in (torch.float64, torch.float32):
        c = make_case(seed=0, dtype=dtype)  # same data on every rank, as in TP
        v = c["w"].shape[0]
        v_pad = -(-v // world) * world  # Megatron pads the vocab to a multiple of TP
        w_full = torch.cat([c["w"], torch.zeros(v_pad - v, H, dtype=dtype)])
        v_local = v_pad // world
        for mode in ("tail", "renorm"):
            for sft_w in (0.0, 0.4):
                h1, w1 = c["h"].clone().requires_grad_(), w_full.clone().requires_grad_()
                ref = fused(c, h1, w1, beta=0.5, tau=2.0, mode=mode, kd_w=0.8, sft_w=sft_w, vocab_size=v,
                            sft=sft_w > 0)
                gh_ref, gw_ref = torch.autograd.grad(ref.loss, (h1, w1))
                h2 = c["h"].clone().requires_grad_()
                w2 = w_full[rank * v_local: (rank + 1) * v_local].clone().requires_grad_()
                out = fused_tp(c, h2, w2, mode, sft_w, v, group)
                gh, gw = torch.autograd.grad(out.loss, (h2, w2))
                name = f"{dtype} {mode} sft={sft_w}"
                assert_layout_close(out.loss, ref.loss, f"{name} loss", dtype)
                assert_layout_close(gh, gh_ref, f"{name} hidden grad", dtype)
                assert_layout_close(gw, gw_ref[rank * v_local: (rank + 1) * v_local], f"{name} weight grad", dtype)
    print(f"TP2 OK rank {rank}", flush=True)
    dist.destroy_process_group()


def fused_tp(c, h, w, mode, sft_w, vocab_size, group):
    from pipeline.train.losses.fused import fused_gkd_loss

    return fused_gkd_loss(h, w, c["ids"], c["ell"], c["mask"], beta=0.5, temperature=2.0, mode=mode,
                          teacher_tail=c["tail"], teacher_valid=c["valid"], labels=c["labels"],
                          sft_mask=c["sft"] if sft_w > 0 else None, kd_weight=0.8, sft_weight=sft_w,
                          tp_group=group, chunk_size=4, vocab_size=vocab_size)


if __name__ == "__main__":
    main()
