"""The vocabulary-parallel rules the losses and the live teacher share, in one place.

Under tensor parallelism each rank holds `V_local` output-layer rows (its slice of the vocabulary, ids
`[rank * V_local, (rank + 1) * V_local)`), and Megatron pads the vocabulary to a multiple of the TP size, so the last
slices end in padding columns that are no token. A group of None means no tensor parallelism (not the default
world group: the trainer always passes its TP group). Used by train/losses/reference.py (the unfused reference),
train/losses/fused.py, train/losses/xtok.py and train/teacher/live.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def tp_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this rank in the TP group, the group's size); (0, 1) without tensor parallelism."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(t: Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """`t` reduced in place over the TP group (a no-op without one, or with one rank); returns `t`."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def valid_columns(vocab_size: int | None, rank: int, v_local: int) -> int:
    """How many of this rank's `v_local` columns are real tokens of a `vocab_size` vocabulary (None: all of them):
    the columns at or past it are Megatron's padding and take no part in a softmax."""
    return v_local if vocab_size is None else min(max(vocab_size - rank * v_local, 0), v_local)


def global_lse(lse_local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """logsumexp over the whole vocabulary from each rank's logsumexp over its slice: the max over ranks as the
    shift, then the sum of the shifted exps; rows with nothing to sum on any rank stay -inf (not NaN)."""
    if group is None or dist.get_world_size(group) == 1:
        return lse_local
    g = lse_local.clone()
    dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
    g = torch.where(torch.isfinite(g), g, 0.0)  # a shift only: any finite value is exact
    return g + all_reduce((lse_local - g).exp(), group).log()


# Differentiable collectives for a loss that every TP rank computes identically from the reduced or gathered values
# (the fused losses' convention: the loss is replicated over the TP group). Each rank's backward then already holds
# the whole gradient of the reduced/gathered value, so its input's share needs no communication: the incoming
# gradient (a sum) or its own slice (a gather). A value every rank holds and feeds into its own slice (the global
# logsumexp, a span's factor) has, on each rank, only that slice's part of its gradient: the caller sums those over
# the group (`all_reduce`), as train/losses/xtok.py does.
class _ReplicatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        return all_reduce(t.clone(), group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


class _ReplicatedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        rank, world = tp_rank_world(group)
        ctx.rank, ctx.width = rank, t.shape[-1]
        if world == 1:
            return t.clone()
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None


def replicated_sum(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Σ over the TP ranks of `t`, differentiable under the replicated-loss convention above (a copy without TP)."""
    return _ReplicatedSum.apply(t, group)


def replicated_gather(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's `t` (same shape) concatenated along the last dimension in rank order, differentiable under the
    replicated-loss convention above (a copy without TP)."""
    return _ReplicatedGather.apply(t, group)
