"""Context parallelism (`context_parallel_size: N`, `attention: sdpa`): one sequence split over N ranks.

The scheme is the all-gather-K/V one of the Llama 3 paper (§3.3.2), not Megatron's ring attention (that one is
Transformer Engine's, which does not exist on CPU):

- Zig-zag chunks: a micro-batch's rows (width W, padded here to a multiple of 2N) are cut into 2N chunks of
  c = W / 2N columns; CP rank r keeps chunks r and 2N-1-r (`columns`). Under causal attention chunk j costs ~j, so
  each rank gets one cheap and one dear chunk: the work per rank is balanced.
- Everything per token is split that way before the model sees it (`split`): input ids, labels, loss masks, teacher
  rows. The labels were rolled on the whole row by the loader (`batch.assemble`: x_{t+1} where t and t+1 are in
  one sample), so a sample crossing a chunk boundary keeps its alignment; nothing here shifts anything.
- The attention (attention.py, `ContextSpans`): each rank keeps its queries and all-gathers the keys and values
  of the whole row (`gather_sequence`, an autograd Function: all_gather forward, reduce_scatter of the gathered
  K/V gradients backward, which sums what every rank's queries contributed to this rank's keys). The documents of
  a packed row (and the causal mask) are decided on GLOBAL columns: the spans come from the whole row's doc_ids.
- RoPE: Megatron's RotaryEmbedding already selects chunks r and 2N-1-r of the row's position embedding under CP
  (`get_pos_emb_on_this_cp_rank`, given the global length through `max_seqlen_q`), so each token is rotated by
  its global position, the same zig-zag as here.
- Loss and gradients: each rank's loss is the sum over ITS positions divided by the step's global count, counted
  on the whole micro-batches before the split (every CP rank of a data-parallel replica holds the same ones), so
  the DP rule of train/step.py holds unchanged; the reported sums are reduced over the data-parallel x context-parallel
  group, and Megatron's DDP sums the weight gradients over that same group (its `dp_cp` group) — with per-token
  loss (no averaging) that sum is the gradient of the whole sequence's loss.

Memory per rank: the activations of W/N tokens plus each layer's gathered K/V (W tokens x the KV heads, small with
GQA); the step's compute per rank is ~1/N of the dense work plus the gathers.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from pipeline.train.data.batch import IGNORE_INDEX, Behavior, Exact, MicroBatch, Route

Tensor = torch.Tensor


def columns(width: int, size: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Global columns (int64) CP rank `rank` of `size` holds of a row of `width` (a multiple of 2 * size):
    chunk `rank` then chunk 2 * size - 1 - rank."""
    c = width // (2 * size)
    first, second = rank * c, (2 * size - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


# Fill of the columns `split` pads a micro-batch with: what the loader writes at padding (batch.assemble).
_PAD = {"input_ids": 0, "labels": IGNORE_INDEX, "loss_mask": False, "sft_mask": False, "doc_ids": -1,
        "teacher_ids": 0, "teacher_logprobs": 0.0, "teacher_valid": False, "teacher_tail": 0.0,
        "teacher_actual": 0.0, "route": -1, "exact": 0.0, "behavior": float("nan")}
# The parts `split` cannot cut into chunks, and why: it refuses them by name instead of passing them on whole.
_UNSPLIT = {
    "images": "a row's images feed the vision tower of a vision-language student, which is on the hf backend (no "
              "context parallelism); train it with context_parallel_size=1",
    "spans": "span heads are flat indices into the whole rows, and a span may cross a chunk boundary; train "
             "cross-tokenizer rows with context_parallel_size=1",
    "xtok_live": "the live teacher lays its rows out on whole samples; use context_parallel_size=1",
}


def split(batch: MicroBatch, size: int, rank: int) -> tuple[MicroBatch, Tensor]:
    """(this rank's part of `batch`, the whole padded row's doc_ids [B, W]). The rows are first padded to a multiple
    of 2 * size columns (padding: no loss, a document of its own in a packed row, after every real token in a padded
    one), then every [B, W, ...] tensor keeps `columns(W, size, rank)`; position_ids keep their global values. The
    scalar counters (tokens, positions, ...) stay those of the whole micro-batch. Parts: route is split like the
    rows (padding -1: no teacher), exact's cached states and behavior's logprobs too (padding 0 and NaN, under no
    loss); the others (`_UNSPLIT`) are
    refused by name."""
    batch.refuse_parts({"route", "exact", "behavior"}, f"context parallelism (context_parallel_size={size})", fix=_UNSPLIT)
    b, w = batch.input_ids.shape
    width = -(-w // (2 * size)) * (2 * size)
    keep = columns(width, size, rank, device=batch.input_ids.device)

    def cut(name: str, t: Tensor) -> Tensor:
        if width != w:
            if name == "position_ids":
                t = torch.arange(width, device=t.device).expand(b, width)
            else:
                pad = t.new_full((b, width - w, *t.shape[2:]), _PAD[name])
                t = torch.cat([t, pad], dim=1)
        return t

    fields = {name: cut(name, t) for name, t in vars(batch).items() if isinstance(t, Tensor)}
    doc_ids = fields["doc_ids"]
    local = {name: t.index_select(1, keep) for name, t in fields.items()}
    if batch.route is not None:
        local["route"] = Route(cut("route", batch.route.teacher).index_select(1, keep))
    if batch.exact is not None:  # the cached teacher states travel with their positions; the output layer is whole
        local["exact"] = Exact(cut("exact", batch.exact.hidden).index_select(1, keep), batch.exact.weight)
    if batch.behavior is not None:
        local["behavior"] = Behavior(cut("behavior", batch.behavior.logprobs).index_select(1, keep))
    return dataclasses.replace(batch, **local), doc_ids


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group, rank-major; backward: reduce-scatter (sum) of the gradient, each rank
    getting its own slice. Written here because torch.distributed.nn's all_gather aborts at process exit on gloo."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def gather_sequence(x: Tensor, group, size: int) -> Tensor:
    """This rank's zig-zag part `x` [2c, ...] (dim 0 = sequence, `columns` order) -> the whole row [2N c, ...] in
    global order, differentiable (the gradient of each rank's part is the sum over all ranks' uses of it)."""
    gathered = _GatherSequence.apply(x, group)  # rank i's [chunk i, chunk 2N-1-i], for i = 0..N-1
    chunks = gathered.chunk(2 * size)  # chunks[2i] = global chunk i, chunks[2i + 1] = global chunk 2N-1-i
    order = [2 * j if j < size else 2 * (2 * size - 1 - j) + 1 for j in range(2 * size)]
    return torch.cat([chunks[i] for i in order])
