"""The vocabulary-parallel rules the losses and the live teacher share, in one place.

Under tensor parallelism each rank holds `V_local` output-layer rows (its slice of the vocabulary, ids
`[rank * V_local, (rank + 1) * V_local)`), and Megatron pads the vocabulary to a multiple of the TP size, so the last
slices end in padding columns that are no token. A group of None means no tensor parallelism (not the default
world group: the trainer always passes its TP group). Used by train/loss.py (the unfused reference),
train/fused_loss.py and train/live_teacher.py.
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
