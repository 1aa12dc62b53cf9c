"""TP=2 worker for tests/train/losses/test_loss.py: vocab-parallel loss and gradients must equal TP=1.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_loss_tp_worker.py``
(plain torch.distributed with gloo; no Megatron). Prints "TP2 OK" on each rank, exits non-zero on a mismatch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipeline.train.losses.reference import gkd_loss, vocab_parallel_ce


def _check(name: str, fn, z: torch.Tensor, group: dist.ProcessGroup) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_local = z.shape[-1] // world
    full = z.clone().requires_grad_()
    ref = fn(full, None)
    ref.backward()
    shard = z[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    loss = fn(shard, group)
    loss.backward()
    grads = [torch.empty_like(shard.grad) for _ in range(world)]
    dist.all_gather(grads, shard.grad.contiguous(), group=group)
    grad = torch.cat(grads, dim=-1)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-12, msg=lambda m: f"{name} loss: {m}")
    scale = full.grad.abs().max()
    torch.testing.assert_close(grad / scale, full.grad / scale, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    g = torch.Generator().manual_seed(0)  # same data on every rank, as in TP
    t, v, k = 9, 16, 5
    z = torch.randn(t, v, generator=g, dtype=torch.float64) * 2
    ell, ids = torch.log_softmax(torch.randn(t, v, generator=g, dtype=torch.float64) * 3, -1).topk(k, dim=-1)
    ids[0] = torch.tensor([0, 7, 8, 15, 3])  # both shard boundaries
    ids[1] = torch.tensor([0, 1, 2, 3, 4])  # all ids on rank 0
    ids[2] = torch.tensor([8, 9, 10, 11, 12])  # all ids on rank 1
    ell[3, -1] = -math.inf
    mask = torch.ones(t, dtype=torch.bool)
    mask[[4, 7]] = False
    for mode in ("tail", "renorm"):
        for beta in (0.0, 0.5, 1.0):
            for tau in (1.0, 2.0):
                for m in (mask, torch.ones_like(mask)):

                    def fn(x, grp, mode=mode, beta=beta, tau=tau, m=m):
                        return gkd_loss(
                            x, ids, ell, m, beta=beta, temperature=tau, mode=mode, tp_group=grp, chunk_size=4
                        )[0]

                    _check(f"{mode} beta={beta} tau={tau}", fn, z, group)
    # A shard whose whole slice is in the top-k: its local complement is empty (-inf), the global one is not.
    v_small = 8
    ids_small = torch.tensor([[0, 1, 2, 3, 6]]).expand(t, -1)
    ell_small = torch.log_softmax(torch.randn(t, v_small, generator=g, dtype=torch.float64), -1)[:, :5]
    z_small = torch.randn(t, v_small, generator=g, dtype=torch.float64)

    def fn_small(x, grp):
        return gkd_loss(x, ids_small, ell_small, mask, beta=0.5, temperature=2.0, mode="tail", tp_group=grp)[0]

    _check("empty local complement", fn_small, z_small, group)
    # Megatron's vocab padding: the last 3 columns (on rank 1) are not tokens and hold garbage.
    z_pad = z.clone()
    z_pad[:, v - 3 :] = 40.0
    ell_pad, ids_pad = torch.log_softmax(torch.randn(t, v - 3, generator=g, dtype=torch.float64), -1).topk(k, dim=-1)

    def fn_pad(x, grp):
        return gkd_loss(x, ids_pad, ell_pad, mask, beta=0.5, temperature=2.0, tp_group=grp, vocab_size=v - 3)[0]

    _check("vocab padding", fn_pad, z_pad, group)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[~mask] = -100
    _check("ce", lambda x, grp: vocab_parallel_ce(x, labels, mask, grp, chunk_size=4)[0], z, group)
    print(f"rank {dist.get_rank()}: TP2 OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
