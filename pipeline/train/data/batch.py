"""The micro-batch: samples laid out in rows, with rolled labels, loss mask and aligned teacher rows.

See pipeline/train/data/loader.py for the alignment rules and pipeline/train/data/packing.py for how samples share rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.config import ConfigError

IGNORE_INDEX = -100
_PAD_MULTIPLE = 8


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [B, S]
    position_ids: torch.Tensor  # int64 [B, S]: 0..S-1 per row (what Megatron's RoPE uses, packed or not)
    labels: torch.Tensor  # int64 [B, S]: x_{t+1}, IGNORE_INDEX where there is none
    loss_mask: torch.Tensor  # bool [B, S]: t in [P-1, L-2] of each sample
    sft_mask: torch.Tensor  # bool [B, S]: loss_mask on dataset-sourced samples (SFT applies to these only)
    doc_ids: torch.Tensor  # int32 [B, S]: sample index within its row, -1 for padding
    teacher_ids: torch.Tensor  # int32 [B, S, k]: teacher top-k of token t+1 (zeros where inactive or invalid)
    teacher_logprobs: torch.Tensor  # float32 [B, S, k] (-inf where invalid)
    teacher_valid: torch.Tensor  # bool [B, S, k]: a real teacher entry the student can represent
    teacher_tail: torch.Tensor  # float32 [B, S]: log teacher mass outside the valid top-k entries
    # float32 [B, S]: the teacher's logprob of labels[t] (the actual next token), 0 where inactive or not loaded
    # (ScoredLoader(actual=True) reads it: loss=opd)
    teacher_actual: torch.Tensor
    keys: list[str]  # content keys of the samples, in order
    packed: bool  # several samples per row, kept apart by doc_ids (trainer: attention.attention_inputs)
    end: int  # global sample position right after this micro-batch's round (the resume state at a step end)
    tokens: int  # real (non-pad) tokens
    positions: int  # B * S: real tokens + padding
    samples: int
    truncated: int  # samples longer than seq_length (cut)
    folded_positions: int  # active positions with teacher entries past the student's vocab (mass folded into the tail)
    # the policy_version of each sample that records one (student rollouts): the staleness the step logs (metrics.py)
    policy_versions: tuple[int, ...] = ()
    # The optional parts, one per mode (`PARTS`): None unless the micro-batch is in that mode.
    route: Route | None = None
    images: Images | None = None
    spans: Spans | None = None
    # A live teacher with another tokenizer (train/teacher/live_xtok.py): the samples' teacher tokens and their layout
    # here, from which the trainer computes the teacher rows.
    xtok_live: XtokLive | None = None
    # A hidden-state cache (store/hidden.py): the teacher's final hidden states at the loss positions and its output
    # layer (train/losses/exact.py computes the exact teacher from them).
    exact: Exact | None = None
    # Rows that carry the sampler's logprobs (scored 1.5, loss=opd): the importance weights of stale samples.
    behavior: Behavior | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        """The tensors moved to `device`, those inside its parts too (a no-op on CPU)."""
        moved = {k: _moved(v, device) for k, v in vars(self).items()}
        return MicroBatch(**moved)

    def parts(self) -> tuple[str, ...]:
        """The names of the parts present, in `PARTS` order."""
        return tuple(name for name in PARTS if getattr(self, name) is not None)

    def refuse_parts(self, allowed: set[str], by: str, fix: str | dict[str, str] = "") -> None:
        """ConfigError naming the first present part not in `allowed`, the consumer `by` that cannot use it and
        `fix` (what to change; per part name where a dict) — never a part dropped or misread silently."""
        for name in self.parts():
            if name not in allowed:
                what = fix.get(name, "") if isinstance(fix, dict) else fix
                raise ConfigError(f"the micro-batch of {next(iter(self.keys), '?')} carries {name} "
                                  f"({_PART_DOC[name]}), which {by} cannot use" + (f"; {what}" if what else ""))


@dataclass
class Route:
    """Routing (`teachers`, data/routing.py): which routed teacher each position's row came from."""

    teacher: torch.Tensor  # int64 [B, S]: index into the loader's `route_names`, -1 where inactive


@dataclass
class Images:
    """Image rows (scored schema 1.2, padded rows only; present where some row has an image): each row's images as
    (cache root, content hash), in placeholder order. The trainer turns them into the student processor's pixel
    inputs (hf_model.vision_inputs)."""

    rows: list[list[tuple[str, str]]]


@dataclass
class Spans:
    """Cross-tokenizer rows (loss=uld|gold, train/losses/xtok.py): loss_mask marks span heads only; `head` [B, S] is,
    at a span's other positions, the flat index (row * S + column) of its head, -1 elsewhere. teacher_ids at the heads
    are student ids of matched entries (-1: unmatched)."""

    head: torch.Tensor  # int64 [B, S]
    matched: torch.Tensor | None = None  # bool [student vocab]: the vocabulary map's student side; None: ULD (no map)
    teacher_vocab: int = 0


@dataclass
class Exact:
    """A hidden-state cache's teacher (train/losses/exact.py): `hidden` [B, S, H_t] (bf16 or float32, the cache's
    dtype; zeros where inactive) holds at position t the teacher state that predicts labels[t]; `weight` [V, H_t] is
    the teacher's output layer, one tensor for the whole run (the loader's)."""

    hidden: torch.Tensor
    weight: torch.Tensor | None = None


@dataclass
class Behavior:
    """The sampler's logprob of each label (scored 1.5's completion_logprobs, read for loss=opd): `logprobs` [B, S]
    float32, at position t the raw logprob of labels[t] under the weights that sampled it (policy_version), NaN where
    none (prompt, padding, a row without them). loss=opd weighs each position by min(s(y)/that, cap)
    (losses/reference.py `opd_advantage`)."""

    logprobs: torch.Tensor


PARTS = ("route", "images", "spans", "xtok_live", "exact", "behavior")
_PART_DOC = {"route": "routed teachers' positions", "images": "image rows",
             "spans": "cross-tokenizer span heads", "xtok_live": "a live teacher with another tokenizer",
             "exact": "a hidden-state cache's teacher states",
             "behavior": "the sampler's logprobs of its tokens (completion_logprobs)"}
_ON_DEVICE: dict = {}  # the teacher's output layer moved once per device, not once per micro-batch


def _moved(v: Any, device: torch.device | str) -> Any:
    """`v` with its tensors on `device`: a tensor, or a part (Route, Images, Spans; XtokLive holds numpy only)."""
    if isinstance(v, torch.Tensor):
        return v.to(device, non_blocking=True)
    if isinstance(v, (Route, Spans, Behavior)):
        return dataclasses.replace(v, **{f.name: _moved(getattr(v, f.name), device) for f in dataclasses.fields(v)})
    if isinstance(v, Exact):
        w = v.weight
        if w is not None and w.device != torch.device(device):
            key = (id(w), str(device))
            if key not in _ON_DEVICE:
                _ON_DEVICE.clear()
                _ON_DEVICE[key] = (w, w.to(device))  # holds w too, so its id is not reused meanwhile
            w = _ON_DEVICE[key][1]
        return Exact(v.hidden.to(device, non_blocking=True), w)
    return v


@dataclass
class Block:
    """A decoded row group: what micro-batches are cut from. Rows' tokens and teacher rows are concatenated."""

    token_offsets: np.ndarray  # int64 [rows + 1]
    tokens: np.ndarray  # int64
    first_scored: np.ndarray  # int64 [rows]
    is_dataset: np.ndarray  # bool [rows]
    keys: list[str]
    row_offsets: np.ndarray  # int64 [rows + 1]: teacher rows of row i are [row_offsets[i], row_offsets[i + 1])
    topk_ids: np.ndarray  # int32 [positions, k]
    topk_logprobs: np.ndarray  # float32 [positions, k]
    tail: np.ndarray  # float32 [positions]
    valid: np.ndarray | None  # bool [positions, k]; None: all valid
    folded: np.ndarray | None  # bool [positions]; None: none folded
    actual: np.ndarray | None = None  # float32 [positions]: teacher logprob of the actual token; None: not read
    route: np.ndarray | None = None  # int64 [rows]: routed teacher index of each row; None: no routing
    images: list | None = None  # per row: its images' content hashes (or None); None: no row has any
    root: str = ""  # the cache root the block's shard belongs to (where images/ is)
    # cross-tokenizer rows (student layout, `student_layout`): per position 0 at a span head, else how many
    # positions back its head is; and at heads the span's student length
    member_back: np.ndarray | None = None
    span_len: np.ndarray | None = None
    xtok_live: list[LiveRow] | None = None  # per row: its teacher tokens and spans (a live cross-tokenizer teacher)
    # a hidden-state cache: [positions, H_t] teacher states (bf16 as its int16 bit pattern, or float32)
    hidden: np.ndarray | None = None
    versions: np.ndarray | None = None  # int64 [rows]: each row's policy_version, -1 where none; None: not read
    behavior: np.ndarray | None = None  # float32 [positions]: the sampler's logprob of the token, NaN where none


@dataclass
class LiveRow:
    """A rollout for a live teacher with another tokenizer: its student and teacher tokens and aligned spans
    (store/align.py `retokenize`), what a cross-tokenizer cache row holds besides the teacher rows."""

    key: str
    is_dataset: bool
    student_ids: np.ndarray  # int64 [Ls]
    student_first: int
    teacher_ids: np.ndarray  # int64 [Lt]
    teacher_first: int
    span_student: np.ndarray  # int32 [G + 1]
    span_teacher: np.ndarray  # int32 [G + 1]


@dataclass
class XtokLive:
    """A micro-batch's live cross-tokenizer samples and the `assemble` arguments that laid them out, so the teacher's
    rows, once computed, are placed by the same call (train/teacher/live_xtok.py `with_teacher`)."""

    rows: list[LiveRow]
    row_of: np.ndarray
    offsets: np.ndarray
    full_lengths: np.ndarray
    B: int
    seq_length: int
    k: int
    pad_id: int
    vmap: np.ndarray | None = None  # teacher id -> student id (loss=gold; the loader sets it)


def matched_ids(vmap: np.ndarray, vocab_size: int | None) -> torch.Tensor:
    """The vocabulary map's student side: bool [student vocab], True for student ids some teacher id maps to."""
    matched = np.zeros(int(vocab_size or (vmap.max() + 1)), bool)
    matched[vmap[(vmap >= 0) & (vmap < len(matched))]] = True
    return torch.from_numpy(matched)


def student_layout(keys: list[str], is_dataset: np.ndarray, row_offsets: np.ndarray, tids: np.ndarray,
                   tlp: np.ndarray, tail: np.ndarray, valid: np.ndarray | None, actual: np.ndarray,
                   student_ids: list[np.ndarray], student_first: np.ndarray, span_student: list[np.ndarray],
                   span_teacher: list[np.ndarray], vmap: np.ndarray | None, root: str = "") -> Block:
    """Decoded cross-tokenizer rows (teacher rows per teacher token) -> a block in the student's tokens: at each
    span's head (its first student token) the teacher row of the span's first teacher token, merged over the span
    (log-probabilities + Σ of the later teacher tokens' actual logprobs, each floored at log 1e-8: TRL's observed
    merge, train/losses/xtok.py); ids mapped through `vmap` (teacher id -> student id, -1 unmatched; None: all -1)."""
    k = tids.shape[1]
    floor = np.log(1e-8)
    lens = np.asarray([len(x) - int(f) for x, f in zip(student_ids, student_first, strict=True)], np.int64)
    total = int(lens.sum())
    o_ids = np.zeros((total, k), np.int32)
    o_lp = np.zeros((total, k), np.float32)
    o_valid = np.zeros((total, k), bool)
    o_tail = np.full(total, -np.inf, np.float32)
    back = np.zeros(total, np.int64)
    span_len = np.zeros(total, np.int64)
    out_off = np.concatenate([[0], np.cumsum(lens)])
    for j in range(len(keys)):
        ss, st = np.asarray(span_student[j], np.int64), np.asarray(span_teacher[j], np.int64)
        lo, hi = int(row_offsets[j]), int(row_offsets[j + 1])
        a = np.maximum(actual[lo:hi].astype(np.float64), floor)
        cs = np.concatenate([[0.0], np.cumsum(a)])
        c = cs[st[1:]] - cs[st[:-1] + 1]  # the span's later teacher tokens
        first = lo + st[:-1]
        base = out_off[j]
        heads = base + ss[:-1]
        ids = tids[first].astype(np.int64)
        o_ids[heads] = -1 if vmap is None else vmap[ids]
        o_lp[heads] = tlp[first] + c[:, None]
        o_tail[heads] = tail[first] + c
        o_valid[heads] = True if valid is None else valid[first]
        g = np.repeat(np.arange(len(ss) - 1), np.diff(ss))
        back[base: base + lens[j]] = np.arange(lens[j]) - ss[:-1][g]
        span_len[heads] = np.diff(ss)
    o_lp[~o_valid] = -np.inf
    seqs = [np.asarray(x, np.int64) for x in student_ids]
    return Block(
        token_offsets=np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64),
        tokens=np.concatenate(seqs) if seqs else np.zeros(0, np.int64),
        first_scored=np.asarray(student_first, np.int64), is_dataset=is_dataset, keys=keys, row_offsets=out_off,
        topk_ids=o_ids, topk_logprobs=o_lp, tail=o_tail, valid=o_valid, folded=np.zeros(total, bool), root=root,
        member_back=back, span_len=span_len)


def fold_past_vocab(ids: np.ndarray, lps: np.ndarray, tail: np.ndarray, vocab_size: int) -> tuple:
    """Top-k entries with ids >= vocab_size -> invalid (id 0, logprob -inf), their mass log-added to the tail in
    float64. Returns (ids, lps, tail, valid [P, k], folded [P]); the inputs are not modified."""
    bad = ids >= vocab_size
    folded = bad.any(axis=1)
    if not folded.any():
        return ids, lps, tail, None, None
    ids, lps, tail = ids.copy(), lps.copy(), tail.copy()
    rows = np.flatnonzero(folded)
    ids[rows], lps[rows], tail[rows] = fold_entries(ids[rows], lps[rows], tail[rows], bad[rows])
    return ids, lps, tail, ~bad, folded


def fold_entries(ids: Any, lps: Any, tail: Any, bad: Any, xp: Any = np) -> tuple[Any, Any, Any]:
    """The fold of `fold_past_vocab` on rows [P, k]: entries `bad` -> id 0, logprob -inf, their mass log-added to
    the tail in float64 (returned in float64). `xp`: the array library, numpy or torch (the live teacher folds its
    rows on their device by the rule the loader applies to cached ones)."""
    extra = xp.where(bad, xp.asarray(lps, dtype=xp.float64), -math.inf)
    with np.errstate(divide="ignore"):  # numpy's log(0) = -inf where a part holds no mass
        tail = xp.logaddexp(xp.asarray(tail, dtype=xp.float64), xp.log(xp.exp(extra).sum(-1)))
    return xp.where(bad, 0, ids), xp.where(bad, -math.inf, lps), tail


def assemble(fetched: list[tuple[Block, int]], row_of: np.ndarray, offsets: np.ndarray, full_lengths: np.ndarray, *,
             rows: int, seq_length: int, k: int, pad_id: int, packed: bool, round_end: int) -> MicroBatch:
    """Samples (block, row in it) laid out at (row_of, offsets) into one micro-batch of `rows` rows; `full_lengths`
    are their untruncated lengths (the cut is at seq_length)."""
    B, S, full = rows, seq_length, full_lengths
    lengths = np.minimum(full, S)
    width = min(S, -(-int((offsets + lengths).max()) // _PAD_MULTIPLE) * _PAD_MULTIPLE)
    ids = np.full((B, width), pad_id, np.int64)
    doc = np.full((B, width), -1, np.int32)
    mask = np.zeros((B, width), bool)
    dataset = np.zeros((B, width), bool)
    # The [B, width, k] arrays are written once: their scored positions in the loop, the rest (prompts, padding:
    # ~mask) zeroed after it, instead of zero-filling all and overwriting most (the loader's largest writes).
    t_ids = np.empty((B, width, k), np.int32)
    t_lp = np.empty((B, width, k), np.float32)
    t_valid = np.empty((B, width, k), bool)
    t_tail = np.zeros((B, width), np.float32)
    t_actual = np.zeros((B, width), np.float32)
    sampled = any(blk.behavior is not None for blk, _ in fetched)
    t_behavior = np.full((B, width), np.nan, np.float32) if sampled else None
    in_row = np.zeros(B, np.int32)
    routed = any(blk.route is not None for blk, _ in fetched)
    route = np.full((B, width), -1, np.int64) if routed else None
    cross = any(blk.member_back is not None for blk, _ in fetched)
    span_head = np.full((B, width), -1, np.int64) if cross else None
    states = next((blk.hidden for blk, _ in fetched if blk.hidden is not None), None)
    t_hidden = None if states is None else np.zeros((B, width, states.shape[1]), states.dtype)
    folded = 0
    for (blk, j), r, o, n in zip(fetched, row_of.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
        a = blk.token_offsets[j]
        ids[r, o : o + n] = blk.tokens[a : a + n]
        doc[r, o : o + n] = in_row[r]
        in_row[r] += 1
        p = int(blk.first_scored[j])
        lo = int(blk.row_offsets[j])
        # teacher row q is token p + q; it pairs with logits at t = p + q - 1, kept while p + q < n
        # (truncation) and t >= 0 (a row for token 0 has no student position to predict it).
        q0, q1 = max(0, 1 - p), max(0, n - p)
        if q1 > q0:
            t0, t1 = o + p + q0 - 1, o + p + q1 - 1
            mask[r, t0:t1] = True
            dataset[r, t0:t1] = blk.is_dataset[j]
            t_ids[r, t0:t1] = blk.topk_ids[lo + q0 : lo + q1]
            t_lp[r, t0:t1] = blk.topk_logprobs[lo + q0 : lo + q1]
            t_tail[r, t0:t1] = blk.tail[lo + q0 : lo + q1]
            if blk.actual is not None:
                t_actual[r, t0:t1] = blk.actual[lo + q0 : lo + q1]
            if t_behavior is not None and blk.behavior is not None:
                t_behavior[r, t0:t1] = blk.behavior[lo + q0 : lo + q1]
            if t_hidden is not None:
                t_hidden[r, t0:t1] = blk.hidden[lo + q0 : lo + q1]
            if route is not None:
                route[r, t0:t1] = blk.route[j]
            if blk.valid is None:
                t_valid[r, t0:t1] = True
            else:
                t_valid[r, t0:t1] = blk.valid[lo + q0 : lo + q1]
                folded += int(blk.folded[lo + q0 : lo + q1].sum())
            if blk.member_back is not None:  # heads are the KD positions; a span cut by seq_length is dropped
                pos = np.arange(t0, t1)
                mb = blk.member_back[lo + q0 : lo + q1]
                whole = (mb == 0) & (pos + blk.span_len[lo + q0 : lo + q1] <= t1)
                mask[r, t0:t1] = whole
                members = np.flatnonzero((mb > 0) & whole[np.maximum(pos - mb - t0, 0)])
                span_head[r, pos[members]] = r * width + pos[members] - mb[members]
    live = None
    if any(blk.xtok_live is not None for blk, _ in fetched):
        live = XtokLive([blk.xtok_live[j] for blk, j in fetched], row_of, offsets, full, B, S, k, pad_id)
    gaps = ~mask  # exactly the positions the loop did not write
    t_ids[gaps], t_lp[gaps], t_valid[gaps] = 0, 0.0, False
    # x_{t+1} where t and t+1 belong to the same sample: no label crosses a sample boundary or enters padding
    labels = np.full((B, width), IGNORE_INDEX, np.int64)
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] >= 0)
    labels[:, :-1][same] = ids[:, 1:][same]
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.arange(width).expand(B, width),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(mask),
        sft_mask=torch.from_numpy(dataset),
        doc_ids=torch.from_numpy(doc),
        teacher_ids=torch.from_numpy(t_ids),
        teacher_logprobs=torch.from_numpy(t_lp),
        teacher_valid=torch.from_numpy(t_valid),
        teacher_tail=torch.from_numpy(t_tail),
        teacher_actual=torch.from_numpy(t_actual),
        keys=[blk.keys[j] for blk, j in fetched],
        packed=packed,
        end=round_end,
        tokens=int(lengths.sum()),
        positions=B * width,
        samples=len(fetched),
        truncated=int((full > S).sum()),
        folded_positions=folded,
        policy_versions=tuple(int(blk.versions[j]) for blk, j in fetched
                              if blk.versions is not None and blk.versions[j] >= 0),
        route=None if route is None else Route(torch.from_numpy(route)),
        spans=None if span_head is None else Spans(torch.from_numpy(span_head)),
        xtok_live=live,
        exact=None if t_hidden is None else Exact(_states(t_hidden)),
        behavior=None if t_behavior is None else Behavior(torch.from_numpy(t_behavior)),
    )


def _states(arr: np.ndarray) -> torch.Tensor:
    """Teacher states as a tensor of the cache's dtype (bf16 from its int16 bit pattern, no copy)."""
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if arr.dtype == np.int16 else t
