"""A live teacher with another tokenizer (`gkd train loss=gold|uld teacher_live=DIR rollouts=[...]`): the rows a
cross-tokenizer cache would hold, computed per micro-batch.

The loader reads rollouts in the student's tokens. For each one it applies the score stage's rules
(pipeline/store/align.py `retokenize`: the student's decode of prompt and completion, the teacher's tokens of that
text, the aligned spans) and lays the sample out exactly as a cross-tokenizer cache's row is laid out
(batch.student_layout), with zero teacher rows: so the loss mask (span heads) and the span pointers of the
micro-batch are final before the teacher runs. The micro-batch carries each sample's teacher tokens and its place
(`XtokLive`). Per micro-batch the trainer then

  1. lays the samples' teacher tokens out one per row (batch.assemble, padded) and runs the frozen teacher on them;
  2. reduces its output at the completion's teacher positions to what the score stage stores: the top-k ids and
     logprobs and the tail (live_teacher.teacher_topk) and the actual next token's logprob (`actual_logprobs`);
  3. merges them over the spans and places them in the student's layout with the same two functions the cache's
     rows go through (batch.student_layout, batch.assemble), so live and cached rows differ by the codec only.

Nothing is quantised: compare with a cache written with the `exact-f32` codec (tests/train/test_live_xtok.py).
Rollouts that do not round-trip through the text are refused before any work (`check_rollouts`); the score stage's
`on_mismatch=skip` has no live counterpart (the loader's order is fixed by the rollout shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.config import ConfigError
from pipeline.errors import InputError
from pipeline.store import align
from pipeline.store.rollouts import iter_rollouts
from pipeline.train.batch import Block, LiveRow, MicroBatch, XtokLive, assemble, matched_ids, student_layout
from pipeline.train.live_teacher import teacher_topk
from pipeline.train.sources import resolve_rollouts
from pipeline.train.vocab_parallel import tp_rank_world


class RoundTripError(InputError):
    """Rollouts whose text does not give their ids back: a live cross-tokenizer teacher cannot align them."""


@dataclass
class LiveXtok:
    """The two tokenizers of a live cross-tokenizer run and the vocabulary map (None: loss=uld)."""

    student: object
    teacher: object
    teacher_vocab: int
    vmap: np.ndarray | None
    matched: Tensor | None  # bool [student vocab]: the map's student side (batch.matched_ids)


def open_live_xtok(student_dir: Path, teacher_dir: Path, teacher_vocab: int, student_vocab: int, gold: bool
                   ) -> LiveXtok:
    """The tokenizers, checked as the score stage checks them (align.check_decode), and the map for loss=gold."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(str(student_dir))
    teacher = AutoTokenizer.from_pretrained(str(teacher_dir))
    align.check_decode(student, f"student tokenizer {student_dir}")
    align.check_decode(teacher, f"teacher_live tokenizer {teacher_dir}")
    vmap = align.vocab_map(student, teacher, teacher_vocab) if gold else None
    return LiveXtok(student, teacher, int(teacher_vocab), vmap,
                    None if vmap is None else matched_ids(vmap, student_vocab))


def check_rollouts(paths: Sequence[str | Path], xt: LiveXtok) -> None:
    """Refuse, before any work, rollouts whose text does not round-trip (the score stage's `retokenize` rule)."""
    bad = []
    shards = [s.shard for s in resolve_rollouts(paths, None)]
    for r in iter_rollouts(shards):
        if not r["completion_ids"]:
            continue  # never trained on (no scored position)
        got = align.retokenize(xt.student, xt.teacher, r["prompt_ids"], r["completion_ids"])
        if isinstance(got, str):
            bad.append(f"sample {r['sample_id']}: {got}")
    if bad:
        raise RoundTripError(
            f"{', '.join(map(str, paths))}: {len(bad)} rollout(s) do not round-trip through the text (decode, then "
            "encode gives other ids), so a live teacher with another tokenizer cannot align them: "
            + "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
            + "; score these rollouts into a cache with `gkd score cross_tokenizer=true on_mismatch=skip` (skips and "
            "reports them) and train from it, or drop them from the rollouts")


def rollout_block(xt: LiveXtok, keys: list[str], is_dataset: np.ndarray, prompts: list[list[int]],
                  completions: list[list[int]], k: int) -> Block:
    """Rollout rows in the student's layout of a cross-tokenizer cache row (zero teacher rows), each carrying its
    teacher tokens and spans for the live teacher (`Block.xtok_live`)."""
    rows, teacher_rows = [], [0]
    for key, ds, p, c in zip(keys, is_dataset.tolist(), prompts, completions, strict=True):
        if not c:  # no scored position: in the block, never in a micro-batch (the loader's order skips it)
            rows.append(LiveRow(key=key, is_dataset=bool(ds), student_ids=np.asarray(p, np.int64),
                                student_first=len(p), teacher_ids=np.zeros(0, np.int64), teacher_first=0,
                                span_student=np.zeros(1, np.int32), span_teacher=np.zeros(1, np.int32)))
            continue
        got = align.retokenize(xt.student, xt.teacher, p, c)
        if isinstance(got, str):  # check_rollouts refused these before training; a shard changed since
            raise RoundTripError(f"sample {key}: {got} (the rollouts changed after the start-up check)")
        rows.append(LiveRow(key=key, is_dataset=bool(ds), student_ids=np.asarray(p + c, np.int64),
                            student_first=len(p), teacher_ids=got.teacher_ids, teacher_first=got.teacher_first,
                            span_student=got.span_student, span_teacher=got.span_teacher))
        teacher_rows.append(teacher_rows[-1] + len(got.teacher_ids) - got.teacher_first)
    block = _layout(rows, np.zeros((teacher_rows[-1], k), np.int32), np.zeros((teacher_rows[-1], k), np.float32),
                    np.zeros(teacher_rows[-1], np.float32), np.zeros(teacher_rows[-1], np.float32), None)
    block.xtok_live = rows
    return block


def _layout(rows: list[LiveRow], tids: np.ndarray, tlp: np.ndarray, tail: np.ndarray, actual: np.ndarray,
            vmap: np.ndarray | None) -> Block:
    """The cache's student layout (batch.student_layout) of `rows` from their teacher rows, concatenated."""
    offsets = np.concatenate([[0], np.cumsum([len(r.teacher_ids) - r.teacher_first for r in rows])]).astype(np.int64)
    return student_layout([r.key for r in rows], np.asarray([r.is_dataset for r in rows], bool), offsets, tids, tlp,
                          tail, None, actual, [r.student_ids for r in rows],
                          np.asarray([r.student_first for r in rows], np.int64), [r.span_student for r in rows],
                          [r.span_teacher for r in rows], vmap)


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
    block = _layout(live.rows, ids.astype(np.int32), lps.astype(np.float32), tail.astype(np.float32),
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
    a micro-batch (trainer.model_inputs), `weight`: its output layer (vocab slice under TP)."""
    dev = batch.loss_mask.device
    tb = teacher_batch(batch.xtok_live).to(dev)
    with torch.no_grad():
        hidden = teacher(tb.input_ids, **inputs(tb))
        ids, lps, tail, _ = teacher_topk(hidden, weight, tb.loss_mask, k, tp_group=tp_group, vocab_size=vocab_size)
        actual = actual_logprobs(hidden, weight, tb.loss_mask, tb.labels, ids, lps, tp_group)
    return with_teacher(batch, tb, ids, lps, tail, actual)


def refuse_same_tokenizer(teacher_dir: Path, loss: str) -> None:
    raise ConfigError(f"teacher_live {teacher_dir}: its tokenizer is the student's; loss={loss} is for a teacher "
                      "with another tokenizer; this is plain GKD: train with loss=gkd")
