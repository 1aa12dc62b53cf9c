"""Cross-tokenizer scoring (pipeline/store/align.py, scored schema 1.3) with two real tokenizers that differ: the
embedded teacher's SmolLM2 tokenizer (49,152 tokens) and a byte-level BPE trained here on a paragraph
(tests/tiny_models.build_tokenizer, 384 tokens). The teacher is a tiny random Llama over the SmolLM2 vocabulary,
scored by real vLLM once for the module."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.score.config import ScoreConfig
from pipeline.score.errors import ScoreInputError
from pipeline.score.scorer import score
from pipeline.store import TeacherCache, read_cache
from pipeline.store.align import decode
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import rollout_row, write_rollouts

K = 8
MAX_LEN = 160
PROMPTS = ["What is three times four?", "Say something about the fox.", "Seven plus five?", "Explain distillation.",
           "Count to twenty.", "Tell me about caches."]
ANSWERS = ["The answer is twelve.", "The quick brown fox jumps over the lazy dog.", "Seven plus five is twelve.",
           "Knowledge distillation trains a small model to match a large one: 3 × 4 = 12, naïve.",
           "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
           "A teacher scores the rollouts once; many students learn from the cache."]


def rollouts(tokenizer, *, odd: bool = False) -> list[dict]:
    """One rollout per prompt in `tokenizer`'s ids (chat template applied once, as gkd import does); `odd` adds a
    completion that is not the canonical tokenization of its text (it cannot round-trip)."""
    rows = []
    for i, (q, a) in enumerate(zip(PROMPTS, ANSWERS, strict=True)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        completion = tokenizer(a + "<|im_end|>", add_special_tokens=False).input_ids
        rows.append(rollout_row(prompt_id=f"p{i}", prompt_ids=list(prompt), completion_ids=completion,
                                source="dataset"))
    if odd:
        chars = [t for c in "The answer" for t in tokenizer(c, add_special_tokens=False).input_ids]
        rows.append(rollout_row(prompt_id="odd", prompt_ids=rows[0]["prompt_ids"], completion_ids=chars,
                                source="dataset"))
    return rows


@pytest.fixture(scope="module")
def xtok(tmp_path_factory):
    """Both tokenizers, the teacher, a cross-tokenizer cache of the student's rollouts and a same-tokenizer cache of
    the same texts in the teacher's own ids, scored by one engine."""
    from tiny_models import build_smollm2_tiny, build_tokenizer

    from pipeline.engine import EngineArgs, open_engine

    root = tmp_path_factory.mktemp("xtok")
    teacher = build_smollm2_tiny(root / "teacher")
    student_tok = build_tokenizer(root / "student")
    from transformers import AutoTokenizer

    teacher_tok = AutoTokenizer.from_pretrained(teacher)
    student_rows = rollouts(student_tok, odd=True)
    write_rollouts(root / "r-student" / "r-00000-of-00001.parquet", student_rows,
                   tokenizer_fingerprint=tokenizer_fingerprint(student_tok))
    # the same texts as the teacher sees them: the student's rendered prompt and its completion, in teacher ids
    same_rows = []
    for r in student_rows[:-1]:
        p, c = decode(student_tok, r["prompt_ids"]), decode(student_tok, r["completion_ids"])
        same_rows.append(rollout_row(prompt_id=r["prompt_id"], source="dataset",
                                     prompt_ids=teacher_tok(p, add_special_tokens=False).input_ids,
                                     completion_ids=teacher_tok(c, add_special_tokens=False).input_ids))
    write_rollouts(root / "r-teacher" / "r-00000-of-00001.parquet", same_rows,
                   tokenizer_fingerprint=tokenizer_fingerprint(teacher_tok))
    args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=MAX_LEN + 1, kv_cache_gib=0.05,
                      enforce_eager=True, max_num_batched_tokens=1024)
    common = dict(teacher=str(teacher), topk=K, max_model_len=MAX_LEN, part_rows=4, batch_tokens=512)
    with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as llm:
        cross_cfg = ScoreConfig(rollouts=str(root / "r-student"), cache=str(root / "c-cross"), cross_tokenizer=True,
                                student_tokenizer=str(root / "student"), **common)
        summary = score(cross_cfg, llm=llm)
        same = score(ScoreConfig(rollouts=str(root / "r-teacher"), cache=str(root / "c-same"), **common), llm=llm)
        refused = None
        try:
            score(ScoreConfig(**{**vars(cross_cfg), "cache": str(root / "c-strict"), "on_mismatch": "error"}), llm=llm)
        except ScoreInputError as e:
            refused = e
    return dict(root=root, teacher=teacher, student_tok=student_tok, teacher_tok=teacher_tok, rows=student_rows,
                summary=summary, same=same, refused=refused)


def test_a_rollout_that_does_not_round_trip_is_reported_and_skipped_or_refused(xtok):
    s = xtok["summary"]
    assert s["scored"] == len(PROMPTS) and s["skipped"]["no_round_trip"] == 1
    odd = xtok["rows"][-1]["sample_id"]
    assert len(s["mismatched"]) == 1 and odd in s["mismatched"][0]
    assert xtok["refused"] is not None and odd in str(xtok["refused"]) and "on_mismatch=skip" in str(xtok["refused"])
    assert not (xtok["root"] / "c-strict" / "shards").exists() or not list((xtok["root"] / "c-strict" / "shards").glob("*.parquet"))


def test_stored_spans_reconstruct_the_text_exactly(xtok):
    st, tt = xtok["student_tok"], xtok["teacher_tok"]
    by_id = {r["sample_id"]: r for r in xtok["rows"]}
    cache = xtok["root"] / "c-cross"
    tables = [pq.read_table(p) for p in TeacherCache.open(cache).shard_paths()]
    assert tables and all(t.schema.metadata[b"gkd.schema"] == b"scored/1.3" for t in tables)
    seen = 0
    for table in tables:
        for row in table.to_pylist():
            r = by_id[row["sample_id"]]
            assert row["student_ids"] == r["prompt_ids"] + r["completion_ids"]
            assert row["student_first"] == len(r["prompt_ids"])
            text = decode(st, r["prompt_ids"]) + decode(st, r["completion_ids"])
            t_ids, t_ends, s_ends = row["input_ids"], row["teacher_char_ends"], row["student_char_ends"]
            assert decode(tt, t_ids) == text
            # every teacher token's span: the pieces, decoded by the teacher, are the text (here a byte-level
            # token may hold part of a character, so compare whole tokenizations piece by piece where ends move)
            assert t_ends[-1] == len(text) == s_ends[-1] and np.all(np.diff(t_ends) >= 0)
            starts = [0, *t_ends[:-1]]
            assert "".join(text[a:b] for a, b in zip(starts, t_ends, strict=True)) == text
            # aligned spans of the completion: each decodes, on both sides, to exactly its piece of the text
            ps, pt = row["student_first"], row["first_scored"]
            c_s, c_t = row["student_ids"][ps:], t_ids[pt:]
            ss, sp = row["span_student"], row["span_teacher"]
            assert ss[0] == sp[0] == 0 and ss[-1] == len(c_s) and sp[-1] == len(c_t) and len(ss) == len(sp)
            offset = len(decode(st, r["prompt_ids"]))
            pieces = []
            for g in range(len(ss) - 1):
                a = offset if g == 0 else s_ends[ps + ss[g] - 1]
                b = s_ends[ps + ss[g + 1] - 1]
                assert b == t_ends[pt + sp[g + 1] - 1]  # the span ends where both tokenizations have a boundary
                piece = text[a:b]
                assert decode(st, c_s[ss[g]:ss[g + 1]]) == piece == decode(tt, c_t[sp[g]:sp[g + 1]])
                pieces.append(piece)
            assert "".join(pieces) == decode(st, r["completion_ids"])
            seen += 1
    assert seen == len(PROMPTS)


def test_a_one_to_one_spans_teacher_row_equals_the_same_tokenizer_row(xtok):
    cross = {tuple(s.input_ids.tolist()): s for s in read_cache(xtok["root"] / "c-cross")}
    same = {tuple(s.input_ids.tolist()): s for s in read_cache(xtok["root"] / "c-same")}
    assert set(cross) == set(same)  # the teacher saw the same ids either way
    spans = {tuple(r["input_ids"]): (r["span_student"], r["span_teacher"]) for p in
             TeacherCache.open(xtok["root"] / "c-cross").shard_paths() for r in pq.read_table(p).to_pylist()}
    compared = 0
    for ids, c in cross.items():
        s = same[ids]
        assert c.first_scored == s.first_scored
        ss, st = map(np.asarray, spans[ids])
        one = np.flatnonzero((np.diff(ss) == 1) & (np.diff(st) == 1))
        q = st[one]  # teacher rows (scored positions) of the 1:1 spans
        assert len(q)
        np.testing.assert_array_equal(c.topk_ids[q, :3], s.topk_ids[q, :3])
        np.testing.assert_allclose(c.topk_logprobs[q], s.topk_logprobs[q], atol=2 / 64)  # the codec's grid, twice
        np.testing.assert_allclose(c.actual_logprobs[q], s.actual_logprobs[q], atol=2 / 64)
        compared += len(q)
    assert compared > 10


def test_cache_stats_report_the_alignment_and_same_tokenizer_caches_are_unchanged(xtok, capsys):
    from pipeline.cli import main as gkd

    assert gkd(["cache", "stats", str(xtok["root"] / "c-cross"), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)["alignment"]
    rows = [r for p in TeacherCache.open(xtok["root"] / "c-cross").shard_paths() for r in pq.read_table(p).to_pylist()]
    ns = np.concatenate([np.diff(r["span_student"]) for r in rows])
    nt = np.concatenate([np.diff(r["span_teacher"]) for r in rows])
    assert a["spans"] == len(ns) and a["student_tokens"] == ns.sum()
    assert a["one_to_one_share"] == round(float(((ns == 1) & (nt == 1)).sum() / ns.sum()), 4)
    assert a["mean_span_student_tokens"] == round(ns.sum() / len(ns), 3)
    assert 0 < a["one_to_one_share"] < 1
    desc = json.loads((xtok["root"] / "c-cross" / "cache.json").read_text())
    assert desc["descriptor_version"] == "1.6" and desc["schema_version"] == "1.3"
    assert desc["student_tokenizer_fingerprint"] == tokenizer_fingerprint(xtok["student_tok"])
    assert (xtok["root"] / "c-cross" / "teacher_tokenizer" / "tokenizer.json").exists()
    # the same-tokenizer cache is what it was before schema 1.3: no sparse column, tags 1.2/1.5
    plain = json.loads((xtok["root"] / "c-same" / "cache.json").read_text())
    assert plain["descriptor_version"] == "1.5" and plain["schema_version"] == "1.2"
    assert "student_tokenizer_fingerprint" not in plain
    for p in TeacherCache.open(xtok["root"] / "c-same").shard_paths():
        schema = pq.read_schema(p)
        assert schema.metadata[b"gkd.schema"] == b"scored/1.2" and "student_ids" not in schema.names
    assert "alignment" not in TeacherCache.open(xtok["root"] / "c-same").stats()


def test_the_content_key_covers_both_tokenizers(xtok):
    cross_keys = TeacherCache.open(xtok["root"] / "c-cross").keys()
    same_keys = TeacherCache.open(xtok["root"] / "c-same").keys()
    assert not cross_keys & same_keys
    from pipeline.store.rollouts import rollout_key

    d = TeacherCache.open(xtok["root"] / "c-cross").descriptor
    keys = {rollout_key(r, d.teacher_fingerprint, K, "raw_logprobs",
                        cross=(d.tokenizer_fingerprint, d.student_tokenizer_fingerprint)) for r in xtok["rows"][:-1]}
    assert keys == cross_keys


def test_score_refuses_cross_tokenizer_rollouts_without_the_opt_in(xtok, tmp_path):
    cfg = ScoreConfig(rollouts=str(xtok["root"] / "r-student"), cache=str(tmp_path / "c"), teacher=str(xtok["teacher"]),
                      topk=K, max_model_len=MAX_LEN)
    with pytest.raises(ScoreInputError, match="cross_tokenizer=true student_tokenizer=DIR"):
        score(cfg)
    assert not Path(tmp_path / "c").exists()
