"""Cross-tokenizer alignment: one text, two tokenizations, and the spans where they agree.

A cross-tokenizer cache (scored schema 1.3, `gkd score cross_tokenizer=true`) holds rollouts tokenized by the
student's tokenizer and scored by a teacher with another one. The rules both sides need live here, the ground floor:

- **Text** (`rollout_text`): a rollout's prompt and completion are decoded *separately* by the student's tokenizer,
  special tokens kept as their strings (`<|im_start|>`), no clean-up of spaces. The teacher sees exactly that text:
  the student's chat template as rendered into the prompt ids, not its own template (we have ids, not messages, and
  prompt positions are never scored, so the template only changes the context the teacher conditions on).
- **Round trip** (`retokenize`): the student's tokenizer must give the rollout's ids back from that text (a sampled
  completion need not be the canonical tokenization of its text, e.g. "h"+"ello"), and the teacher's tokenizer must
  decode its own ids to the same text; otherwise the sample has no exact alignment and is reported (skipped or
  refused: `ScoreConfig.on_mismatch`).
- **Character spans**: token i covers `[ends[i-1], ends[i])` of the text (character offsets from the fast
  tokenizer's offset mapping, made non-decreasing). A byte-level token holding part of a multi-byte character shares
  its character with the next token: no boundary falls after it.
- **Aligned spans** (`align`): over the completion, the common boundaries of the two tokenizations cut it into spans;
  span g holds student completion tokens `[s[g], s[g+1])` and teacher ones `[t[g], t[g+1])`. This is the grouping of
  TRL's GOLD (`_align_by_byte_offsets`: a group closes where both sides reach the same boundary). Every span is
  checked: both tokenizers decode their tokens of it to exactly its text.
- **Vocabulary map** (`vocab_map`): a teacher id maps to the student id of the same token string (exact match of the
  vocabularies' strings, TRL's rule); the rest is unmatched (-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.errors import UserError

TEACHER_TOKENIZER = "teacher_tokenizer"  # CACHE/teacher_tokenizer/: a cross-tokenizer cache's copy of it
# A sentence with spaces, digits, punctuation, a newline and multi-byte characters: what the decode check probes.
DECODE_PROBE = "The answer is 12.  Zwölf, ×4 = 48?\nYes — 日本 ok"


class TokenizerDecodeError(UserError, ValueError):
    """A tokenizer whose decode is not a pure, concatenative function of the ids: no exact alignment exists."""


def decode(tokenizer, ids: Sequence[int]) -> str:
    """The one decode rule: special tokens kept as their strings, spaces not cleaned up."""
    return tokenizer.decode(list(map(int, ids)), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, character ends) of `text`, no special tokens added (the text carries its own)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int64)
    off = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
    return ids, _ends(off)


def _ends(off: np.ndarray) -> np.ndarray:
    """Character end of each token; where the next token starts before this one ends (a multi-byte character split
    over byte-level tokens), the end moves to the next token's, so no boundary falls inside a character."""
    ends = np.maximum.accumulate(off[:, 1]) if len(off) else np.zeros(0, np.int64)
    ends = ends.copy()
    for i in range(len(off) - 2, -1, -1):
        if off[i + 1, 0] < ends[i]:
            ends[i] = ends[i + 1]
    return ends.astype(np.int32)


def check_decode(tokenizer, where: str) -> None:
    """Refuse a tokenizer whose decode is not deterministic and concatenative (what exact spans need): the probe's
    ids decode to the probe, twice alike, and its halves at a clean boundary decode to the two halves."""
    ids, ends = encode(tokenizer, DECODE_PROBE)
    first, again = decode(tokenizer, ids), decode(tokenizer, ids)
    problem = None
    if first != again:
        problem = f"decoding the same ids twice gave {first!r} and {again!r}"
    elif first != DECODE_PROBE:
        problem = f"{DECODE_PROBE!r} encodes to ids that decode to {first!r}"
    else:
        for i in range(len(ids) - 1):
            if ends[i] != ends[i + 1]:
                a, b = decode(tokenizer, ids[: i + 1]), decode(tokenizer, ids[i + 1:])
                if a + b != first:
                    problem = (f"decode depends on the neighbouring tokens: the halves decode to {a!r} + {b!r}, the "
                               f"whole to {first!r}")
                    break
    if problem:
        raise TokenizerDecodeError(
            f"{where}: its decode is not deterministic and concatenative ({problem}), so a text span cannot be tied "
            "to its tokens exactly; cross-tokenizer distillation needs a tokenizer whose pieces decode to pieces of "
            "the text (byte-level BPE does; SentencePiece models that strip a leading space or clean up spaces on "
            "decode do not: use a fast tokenizer with clean_up_tokenization_spaces=false and a byte-level decoder)")


@dataclass
class Retokenized:
    """One rollout in both tokenizations (ids of the whole sequence, character ends in prompt text + completion
    text) and the aligned spans of its completion (`align`)."""

    teacher_ids: np.ndarray  # int64 [Lt]
    teacher_first: int  # len(teacher prompt ids)
    teacher_ends: np.ndarray  # int32 [Lt]
    student_ends: np.ndarray  # int32 [Ls]
    span_student: np.ndarray  # int32 [G + 1]: span g = student completion tokens [s[g], s[g+1])
    span_teacher: np.ndarray  # int32 [G + 1]


def rollout_text(student_tokenizer, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> tuple[str, str]:
    return decode(student_tokenizer, prompt_ids), decode(student_tokenizer, completion_ids)


def retokenize(student_tokenizer, teacher_tokenizer, prompt_ids: Sequence[int],
               completion_ids: Sequence[int]) -> Retokenized | str:
    """The rollout in the teacher's tokens with its spans, or why it does not round-trip (a message)."""
    p_text, c_text = rollout_text(student_tokenizer, prompt_ids, completion_ids)
    sp, sp_ends = encode(student_tokenizer, p_text)
    sc, sc_ends = encode(student_tokenizer, c_text)
    if not (np.array_equal(sp, prompt_ids) and np.array_equal(sc, completion_ids)):
        part = "prompt" if not np.array_equal(sp, prompt_ids) else "completion"
        return (f"the student's tokenizer does not give its {part} ids back from their text (not the canonical "
                f"tokenization of {c_text[:40]!r}...)")
    tp, tp_ends = encode(teacher_tokenizer, p_text)
    tc, tc_ends = encode(teacher_tokenizer, c_text)
    if decode(teacher_tokenizer, tp) != p_text or decode(teacher_tokenizer, tc) != c_text:
        return "the teacher's tokenizer does not decode its ids of the text back to the text"
    if len(tp) == 0 or len(tc) == 0:
        return "the teacher's tokenization of the prompt or the completion is empty"
    span_s, span_t = align(sc_ends, tc_ends)
    pieces = [c_text[int(a):int(b)] for a, b in zip(np.r_[0, sc_ends[span_s[1:-1] - 1]],
                                                    sc_ends[span_s[1:] - 1], strict=True)]
    s_dec = student_tokenizer.batch_decode([sc[a:b].tolist() for a, b in zip(span_s[:-1], span_s[1:], strict=True)],
                                           skip_special_tokens=False, clean_up_tokenization_spaces=False)
    t_dec = teacher_tokenizer.batch_decode([tc[a:b].tolist() for a, b in zip(span_t[:-1], span_t[1:], strict=True)],
                                           skip_special_tokens=False, clean_up_tokenization_spaces=False)
    for g, (piece, s, t) in enumerate(zip(pieces, s_dec, t_dec, strict=True)):
        if s != piece or t != piece:
            return (f"span {g} ({piece!r}) decodes to {s!r} (student) and {t!r} (teacher): a tokenizer's pieces do "
                    "not decode to pieces of the text")
    offset = len(p_text)
    return Retokenized(
        teacher_ids=np.concatenate([tp, tc]), teacher_first=len(tp),
        teacher_ends=np.concatenate([tp_ends, tc_ends + offset]).astype(np.int32),
        student_ends=np.concatenate([sp_ends, sc_ends + offset]).astype(np.int32),
        span_student=span_s, span_teacher=span_t)


def align(student_ends: np.ndarray, teacher_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Aligned spans of one text from both tokenizations' character ends: the common boundaries (> 0) cut it;
    returns the token index at which each span starts on each side, plus the token count at the end."""
    common = np.intersect1d(student_ends[student_ends > 0], teacher_ends[teacher_ends > 0])
    if len(common) == 0 or common[-1] < max(int(student_ends[-1]), int(teacher_ends[-1])):
        common = np.r_[common, max(int(student_ends[-1]), int(teacher_ends[-1]))]
    # token i belongs to the first span whose end boundary is >= its own end
    gs = np.minimum(np.searchsorted(common, student_ends, "left"), len(common) - 1)
    gt = np.minimum(np.searchsorted(common, teacher_ends, "left"), len(common) - 1)
    span_s = np.searchsorted(gs, np.arange(len(common) + 1), "left").astype(np.int32)
    span_t = np.searchsorted(gt, np.arange(len(common) + 1), "left").astype(np.int32)
    return span_s, span_t


def vocab_map(student_tokenizer, teacher_tokenizer, teacher_vocab_size: int) -> np.ndarray:
    """int64 [teacher_vocab_size]: the student id of each teacher id's exact token string, -1 where the student's
    vocabulary has no such string (and for ids past the teacher tokenizer's vocabulary)."""
    student = student_tokenizer.get_vocab()
    out = np.full(int(teacher_vocab_size), -1, np.int64)
    for token, tid in teacher_tokenizer.get_vocab().items():
        sid = student.get(token)
        if sid is not None and tid < len(out):
            out[tid] = sid
    return out


def span_stats(span_student: Sequence[np.ndarray], span_teacher: Sequence[np.ndarray]) -> dict:
    """Alignment of many rows: share of student tokens in 1:1 spans, mean span length on each side."""
    ns = np.concatenate([np.diff(s) for s in span_student]) if span_student else np.zeros(0, np.int64)
    nt = np.concatenate([np.diff(t) for t in span_teacher]) if span_teacher else np.zeros(0, np.int64)
    spans, tokens = len(ns), int(ns.sum())
    one = (ns == 1) & (nt == 1)
    return {"spans": spans, "student_tokens": tokens, "teacher_tokens": int(nt.sum()),
            "one_to_one_share": round(float(one.sum()) / tokens, 4) if tokens else None,
            "mean_span_student_tokens": round(tokens / spans, 3) if spans else None,
            "mean_span_teacher_tokens": round(float(nt.sum()) / spans, 3) if spans else None}
