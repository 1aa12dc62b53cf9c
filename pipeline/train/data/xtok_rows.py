"""The data half of a live teacher with another tokenizer (`gkd train loss=gold|uld teacher_live=DIR rollouts=[...]`):
each rollout laid out as a cross-tokenizer cache row would be, with zero teacher rows, before any teacher runs.

For each rollout in the student's tokens the loader applies the score stage's rules (pipeline/store/align.py
`retokenize`: the student's decode of prompt and completion, the teacher's tokens of that text, the aligned spans)
and lays the sample out exactly as a cross-tokenizer cache's row is laid out (batch.student_layout), with zero
teacher rows: so the loss mask (span heads) and the span pointers of the micro-batch are final before the teacher
runs. The micro-batch carries each sample's teacher tokens and its place (`XtokLive`); the trainer's live teacher
(train/teacher/live_xtok.py) fills the rows in.

Rollouts that do not round-trip through the text are refused before any work (`check_rollouts`); the score stage's
`on_mismatch=skip` has no live counterpart (the loader's order is fixed by the rollout shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import Tensor

from pipeline.config import ConfigError
from pipeline.errors import InputError
from pipeline.store import align
from pipeline.store.rollouts import iter_rollouts
from pipeline.train.data.batch import Block, LiveRow, matched_ids, student_layout
from pipeline.train.data.sources import resolve_rollouts


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
    block = layout(rows, np.zeros((teacher_rows[-1], k), np.int32), np.zeros((teacher_rows[-1], k), np.float32),
                    np.zeros(teacher_rows[-1], np.float32), np.zeros(teacher_rows[-1], np.float32), None)
    block.xtok_live = rows
    return block


def layout(rows: list[LiveRow], tids: np.ndarray, tlp: np.ndarray, tail: np.ndarray, actual: np.ndarray,
            vmap: np.ndarray | None) -> Block:
    """The cache's student layout (batch.student_layout) of `rows` from their teacher rows, concatenated."""
    offsets = np.concatenate([[0], np.cumsum([len(r.teacher_ids) - r.teacher_first for r in rows])]).astype(np.int64)
    return student_layout([r.key for r in rows], np.asarray([r.is_dataset for r in rows], bool), offsets, tids, tlp,
                          tail, None, actual, [r.student_ids for r in rows],
                          np.asarray([r.student_first for r in rows], np.int64), [r.span_student for r in rows],
                          [r.span_teacher for r in rows], vmap)


def refuse_same_tokenizer(teacher_dir: Path, loss: str) -> None:
    raise ConfigError(f"teacher_live {teacher_dir}: its tokenizer is the student's; loss={loss} is for a teacher "
                      "with another tokenizer; this is plain GKD: train with loss=gkd")
