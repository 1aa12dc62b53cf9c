"""TP=2 worker for tests/train/losses/test_exact_loss.py: the exact-teacher loss on a vocabulary-split student output
layer must equal TP=1 (the same loss and sums on every rank, the same hidden-state gradient, each rank's rows of the
weight gradient), for each β (the closed forms and the autograd chunk), τ, SFT and OPD rows, a padded vocabulary,
and a padding so wide that rank 1 holds no real column.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_exact_tp_worker.py`` (plain
torch.distributed with gloo; no Megatron). Prints "TP2 OK" on each rank, exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "losses"))  # the test module whose cases this checks
from test_exact_loss import V, _inputs  # noqa: E402

from pipeline.train.losses.exact import exact_gkd_loss  # noqa: E402


def loss(h, w, th, tw, c: dict, beta: float, tau: float, group):
    return exact_gkd_loss(h, w, th, tw, c["kd"], beta=beta, temperature=tau, labels=c["labels"], sft_mask=c["sft"],
                          opd_mask=c["opd"], kd_weight=0.6, sft_weight=0.3, opd_weight=0.6, vocab_size=V,
                          chunk_size=5, tp_group=group)


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    h, w, th, tw, mask, labels, sft = _inputs(5, pad=0)
    opd = mask & ~sft & (labels % 3 == 0)
    c = dict(kd=mask & ~opd, labels=labels, sft=sft, opd=opd)
    checked = 0
    for v_pad in (54, 128):  # 128: rank 1's 64 columns are all padding (V = 50)
        w_full = torch.cat([w, torch.zeros(v_pad - V, w.shape[1], dtype=w.dtype)])
        v_local = v_pad // world
        for beta in (0.0, 0.4, 1.0):
            for tau in (1.0, 1.7):
                h1, w1 = h.clone().requires_grad_(), w_full.clone().requires_grad_()
                ref = loss(h1, w1, th, tw, c, beta, tau, None)
                gh_ref, gw_ref = torch.autograd.grad(ref.loss, (h1, w1))
                h2 = h.clone().requires_grad_()
                w2 = w_full[rank * v_local: (rank + 1) * v_local].clone().requires_grad_()
                out = loss(h2, w2, th, tw, c, beta, tau, group)
                gh, gw = torch.autograd.grad(out.loss, (h2, w2))
                name = f"pad to {v_pad}, beta={beta}, tau={tau}"
                for field in ("loss", "kd_sum", "sft_sum", "opd_sum", "opd_kl_sum"):
                    torch.testing.assert_close(getattr(out, field), getattr(ref, field), rtol=1e-11, atol=1e-11,
                                               msg=f"{name} {field}")
                torch.testing.assert_close(gh, gh_ref, rtol=1e-10, atol=1e-12, msg=f"{name} hidden grad")
                torch.testing.assert_close(gw, gw_ref[rank * v_local: (rank + 1) * v_local], rtol=1e-10, atol=1e-12,
                                           msg=f"{name} weight grad")
                assert float(ref.sft_sum) > 0 and float(ref.opd_kl_sum) != 0 and float(ref.kd_sum) > 0, name
                checked += 1
    print(f"TP2 OK rank {rank} ({checked} cases)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
