"""A live teacher with another tokenizer (`gkd train loss=gold|uld teacher_live=DIR rollouts=[...]`): the rows a
cross-tokenizer cache would hold, computed per micro-batch.

The loader has laid each rollout out as a cross-tokenizer cache row with zero teacher rows (train/data/xtok_rows.py)
and the micro-batch carries each sample's teacher tokens and its place (`XtokLive`). Per micro-batch the trainer then

  1. lays the samples' teacher tokens out one per row (batch.assemble, padded) and runs the frozen teacher on them;
  2. reduces its output at the completion's teacher positions to what the score stage stores: the top-k ids and
     logprobs and the tail (teacher/live.py `teacher_topk`) and the actual next token's logprob (`actual_logprobs`);
  3. merges them over the spans and places them in the student's layout with the same two functions the cache's
     rows go through (batch.student_layout, batch.assemble), so live and cached rows differ by the codec only.

Nothing is quantised: compare with a cache written with the `exact-f32` codec (tests/train/teacher/test_live_xtok.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.train.data.batch import Block, MicroBatch, XtokLive, assemble
from pipeline.train.data.xtok_rows import layout
from pipeline.train.losses.vocab_parallel import tp_rank_world
from pipeline.train.teacher.live import teacher_topk


def teacher_batch(live: XtokLive) -> MicroBatch:
    """The micro-batch's samples in the teacher's tokens, one per row (padded, right): what the teacher runs on. Its
    loss mask marks the positions whose next token is a completion token (the rows the score stage stores) and its
    labels are those tokens; it has no teacher rows (k = 0)."""
    rows = live.rows
    lengths = np.asarray([len(r.teacher_ids) for r in rows], np.int64)
    first = np.asarray([r.teacher_first for r in rows], np.int64)
    stored = int((lengths - first).sum())
    blk = Block(token_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                tokens=np.concatenate([r.teacher_ids for r in rows]).astype(np.int64), first_scored=first,
                is_dataset=np.zeros(len(rows), bool), keys=[r.key for r in rows],
                row_offsets=np.concatenate([[0], np.cumsum(lengths - first)]).astype(np.int64),
                topk_ids=np.zeros((stored, 0), np.int32), topk_logprobs=np.zeros((stored, 0), np.float32),
                tail=np.zeros(stored, np.float32), valid=None, folded=None)
    n = len(rows)
    return assemble([(blk, j) for j in range(n)], np.arange(n), np.zeros(n, np.int64), lengths, rows=n,
                    seq_length=int(lengths.max()), k=0, pad_id=live.pad_id, packed=False, round_end=0)


@torch.no_grad()
def actual_logprobs(hidden: Tensor, weight: Tensor, mask: Tensor, labels: Tensor, top_ids: Tensor, top_lps: Tensor,
                    tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The teacher's logprob of each active position's next token, [...] float32 (0 where inactive), from its top-1
    entry: log p(x) = z_x − z_top1 + log p(top1) (the softmax's normaliser cancels, so no second pass over the
    vocabulary). Under TP each logit is on the rank that holds its vocab slice: summed over the ranks."""
    rank, world = tp_rank_world(tp_group)
    v_local = weight.shape[0]
    h = hidden.reshape(-1, hidden.shape[-1])
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    h = h[rows].to(weight.dtype)

    def logit(ids: Tensor) -> Tensor:
        local = ids - rank * v_local
        here = (local >= 0) & (local < v_local)
        z = (h * weight[local.clamp(0, v_local - 1)]).sum(-1).float()
        z = torch.where(here, z, torch.zeros_like(z))
        if world > 1:
            dist.all_reduce(z, group=tp_group)
        return z

    lab = labels.reshape(-1)[rows].long()
    top = top_ids.reshape(-1, top_ids.shape[-1])[rows, 0].long()
    out = torch.zeros(mask.numel(), dtype=torch.float32, device=hidden.device)
    out[rows] = logit(lab) - logit(top) + top_lps.reshape(-1, top_lps.shape[-1])[rows, 0].float()
    return out.reshape(mask.shape)


def with_teacher(batch: MicroBatch, tb: MicroBatch, ids: Tensor, lps: Tensor, tail: Tensor, actual: Tensor
                 ) -> MicroBatch:
    """`batch` with the teacher rows of its samples (`tb` their teacher layout, `ids`/`lps`/`tail`/`actual` its
    live rows) merged over the spans and laid out as a cached row would be (batch.student_layout, batch.assemble)."""
    import dataclasses

    live = batch.xtok_live
    m = tb.loss_mask.cpu().numpy()
    ids, lps, tail, actual = (x.cpu().numpy()[m] for x in (ids, lps, tail, actual))  # row-major: sample by sample
    block = layout(live.rows, ids.astype(np.int32), lps.astype(np.float32), tail.astype(np.float32),
                    actual.astype(np.float32), live.vmap)
    n = len(live.rows)
    out = assemble([(block, j) for j in range(n)], live.row_of, live.offsets, live.full_lengths, rows=live.B,
                   seq_length=live.seq_length, k=live.k, pad_id=live.pad_id, packed=batch.packed,
                   round_end=batch.end)
    if not torch.equal(out.loss_mask, batch.loss_mask.cpu()):  # the same layout twice: a broken invariant, not input
        raise RuntimeError("live cross-tokenizer rows: the teacher's layout moved the span heads")
    dev = batch.loss_mask.device
    return dataclasses.replace(batch, teacher_ids=out.teacher_ids.to(dev), teacher_logprobs=out.teacher_logprobs.to(dev),
                               teacher_tail=out.teacher_tail.to(dev), teacher_valid=out.teacher_valid.to(dev))


def score(teacher, batch: MicroBatch, k: int, inputs, weight: Tensor, vocab_size: int,
          tp_group: dist.ProcessGroup | None = None) -> MicroBatch:
    """The micro-batch with its live cross-tokenizer teacher rows. `inputs(tb)`: the teacher's forward keywords for
    a micro-batch (step.model_inputs), `weight`: its output layer (vocab slice under TP)."""
    dev = batch.loss_mask.device
    tb = teacher_batch(batch.xtok_live).to(dev)
    with torch.no_grad():
        hidden = teacher(tb.input_ids, **inputs(tb))
        ids, lps, tail, _ = teacher_topk(hidden, weight, tb.loss_mask, k, tp_group=tp_group, vocab_size=vocab_size)
        actual = actual_logprobs(hidden, weight, tb.loss_mask, tb.labels, ids, lps, tp_group)
    return with_teacher(batch, tb, ids, lps, tail, actual)
