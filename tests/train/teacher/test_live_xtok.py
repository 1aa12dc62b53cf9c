"""A live teacher with another tokenizer (pipeline/train/teacher/live_xtok.py) against a cross-tokenizer cache of the same
rollouts written with the exact codec: the trainer's per-step losses and its trained weights agree (the cache's rows
come from a transformers forward of the teacher on its own tokens, the live ones from the trainer's teacher on the
same tokens); and the actual-token logprob of the live reduction against a full log-softmax.

Run: ``python -m pytest tests/train/teacher/test_live_xtok.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import write_rollouts
from pipeline.train.teacher.live import teacher_topk
from pipeline.train.teacher.live_xtok import actual_logprobs

SEQ = 128


def test_actual_logprobs_equal_the_full_log_softmax():
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(2, 7, 8, generator=g, dtype=torch.float64), torch.randn(40, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 7, generator=g) > 0.3
    labels = torch.randint(0, 40, (2, 7), generator=g)
    ids, lps, _, _ = teacher_topk(h, w, mask, 4)
    got = actual_logprobs(h, w, mask, labels, ids, lps)
    ref = torch.log_softmax(h @ w.t(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got[mask].double(), ref[mask], rtol=0, atol=1e-5)
    assert not got[~mask].any()


@pytest.fixture(scope="module")
def xl(tmp_path_factory) -> dict:
    """A SmolLM2-vocabulary teacher, a student with a byte-level BPE trained in the test (tiny_cache.build_tiny),
    and the same chat rollouts twice: as a rollout shard (for teacher_live) and as an exact-codec cross-tokenizer
    cache. One shard and one row group each, in the same order, so the loader's seeded order picks the same
    samples from both."""
    from tiny_cache import build_tiny, score_cross_into_cache, xtok_rollouts
    from tiny_models import build_smollm2_tiny
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("livextok")
    teacher, student = build_smollm2_tiny(root / "teacher"), build_tiny(root / "student", seed=1)
    s_tok = AutoTokenizer.from_pretrained(student)
    rows = xtok_rollouts(s_tok)
    score_cross_into_cache(teacher, student, root / "cache", rows, codec="exact-f32")
    write_rollouts(root / "rollouts" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(s_tok))
    return {"teacher": teacher, "student": student, "root": root}


def _train(d: dict, save: Path, source: str, **kw) -> list[dict]:
    from pipeline.cli import main as cli

    data = ([f"teacher_live={d['teacher']}", f"rollouts=[{d['root'] / 'rollouts'}]", "cache=[]",
             "teacher_live_topk=8"] if source == "live" else [f"cache=[{d['root'] / 'cache'}]"])
    args = [f"student={d['student']}", "micro_batch_size=2", "global_batch_size=4", f"seq_length={SEQ}",
            "train_steps=4", "warmup_steps=1", "optimizer=sgd", "lr=0.3", "min_lr=0.3", "sft_alpha=0.5",
            f"save_dir={save}", "save_interval=4", "progress=false", *data, *[f"{k}={v}" for k, v in kw.items()]]
    assert cli(["train", *args]) == 0
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind,packing", [("gold", "true"), ("uld", "false")])
def test_live_cross_tokenizer_teacher_trains_like_its_exact_cache(xl, tmp_path, kind, packing):
    """4 SGD steps, same seed and samples, fp32: per-step KD and SFT losses within 1e-5 relative (Megatron's teacher
    forward vs transformers': logits agree to ~1e-6; a misplaced span or row is off by far more) and the trained
    weights under the cross-layout rule (tests/tolerance.py)."""
    from tolerance import assert_trains_alike

    live = _train(xl, tmp_path / "live", "live", loss=kind, packing=packing)
    cached = _train(xl, tmp_path / "cache", "cache", loss=kind, packing=packing)
    assert live[0]["jsd"] != live[-1]["jsd"]  # the steps trained (SGD at lr 0.3 moves the student)
    assert_trains_alike(live, cached, xl["student"], tmp_path, ("live", "cache"), kind)


def test_hf_backend_live_cross_tokenizer_teacher_trains_like_its_exact_cache(xl, tmp_path):
    """The same comparison on the transformers backend (student and live teacher HF models): 2 SGD steps of GOLD."""
    live = _train(xl, tmp_path / "live", "live", loss="gold", backend="hf", train_steps=2, save_interval=2)
    cached = _train(xl, tmp_path / "cache", "cache", loss="gold", backend="hf", train_steps=2, save_interval=2)
    assert [m["active_tokens"] for m in live] == [m["active_tokens"] for m in cached]
    for a, b in zip(live, cached, strict=True):
        assert abs(a["jsd"] - b["jsd"]) <= 1e-5 * b["jsd"] and abs(a["sft"] - b["sft"]) <= 1e-5 * b["sft"], (a, b)


def test_live_layout_equals_the_caches_sample_by_sample(xl, tmp_path):
    """Before the teacher runs, a live micro-batch already has the cache's heads, span pointers and SFT mask; and
    once `with_teacher` has placed rows computed from the cache's own teacher rows, it equals the cache's micro-batch
    (the same layout functions). A rollout with an empty completion (never trained on) does not stop the loader."""
    from transformers import AutoConfig

    from pipeline.store.rollouts import iter_rollouts, rollout_row
    from pipeline.train.data.loader import LiveRows, ScoredLoader
    from pipeline.train.data.xtok_rows import open_live_xtok

    rows = list(iter_rollouts([xl["root"] / "rollouts" / "r-00000-of-00001.parquet"]))
    empty = rollout_row(prompt_id="e", prompt_ids=rows[0]["prompt_ids"], completion_ids=[], source="dataset")
    s_fp = tokenizer_fingerprint(xl["student"])
    write_rollouts(tmp_path / "r.parquet", [*rows, empty], tokenizer_fingerprint=s_fp)
    vocab = AutoConfig.from_pretrained(xl["student"]).vocab_size
    xt = open_live_xtok(xl["student"], xl["teacher"], AutoConfig.from_pretrained(xl["teacher"]).vocab_size, vocab, True)
    n = len(rows)
    live = ScoredLoader([tmp_path / "r.parquet"], micro_batch_size=n, seq_length=SEQ, seed=0, live=LiveRows(8, xt),
                        tokenizer_fingerprint=s_fp).micro_batch(0)
    cache = ScoredLoader([xl["root"] / "cache"], micro_batch_size=n, seq_length=SEQ, seed=0, vocab_size=vocab,
                         tokenizer_fingerprint=s_fp, xtok_map=xt.vmap).micro_batch(0)
    assert live.samples == cache.samples == n and live.xtok_live is not None and live.xtok_live.vmap is xt.vmap
    assert live.parts() == ("spans", "xtok_live") and cache.parts() == ("spans",)
    assert live.to("meta").xtok_live is live.xtok_live and live.to("meta").spans.head.is_meta  # numpy: stays put
    assert torch.equal(live.spans.matched, cache.spans.matched) and live.spans.teacher_vocab == cache.spans.teacher_vocab
    where = {tuple(cache.input_ids[i, :int((cache.doc_ids[i] >= 0).sum())].tolist()): i for i in range(n)}
    order = [where[tuple(live.input_ids[i, :int((live.doc_ids[i] >= 0).sum())].tolist())] for i in range(n)]
    assert sorted(order) == list(range(n))
    for name in ("loss_mask", "sft_mask", "labels"):
        assert torch.equal(getattr(live, name), getattr(cache, name)[order]), name
    w = live.input_ids.shape[1]
    heads = cache.spans.head[order]
    moved = torch.where(heads >= 0, heads % w + torch.arange(n)[:, None] * w, heads)  # row index of the live layout
    assert torch.equal(live.spans.head, moved)
    assert not live.teacher_logprobs.any()  # placeholders until the teacher runs
    # the teacher's rows as the test's cache writer computes them (a transformers forward, top-8, actual token)
    from transformers import AutoModelForCausalLM

    from pipeline.store.codec import tail_logprob
    from pipeline.train.teacher.live_xtok import teacher_batch, with_teacher

    tb = teacher_batch(live.xtok_live)
    model = AutoModelForCausalLM.from_pretrained(xl["teacher"], dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(tb.input_ids).logits.float(), -1)
    top = lp.topk(8, -1)
    actual = lp.gather(-1, tb.labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    on = tb.loss_mask
    assert int(on.sum()) == sum(len(r.teacher_ids) - r.teacher_first for r in live.xtok_live.rows)
    filled = with_teacher(live, tb, top.indices.int(), top.values, tail_logprob(top.values, torch).float(),
                          torch.where(on, actual, 0.0))
    assert filled.parts() == live.parts()  # the teacher rows placed, the parts kept
    m = cache.loss_mask[order]
    assert torch.equal(filled.teacher_ids[m], cache.teacher_ids[order][m])
    torch.testing.assert_close(filled.teacher_logprobs[m], cache.teacher_logprobs[order][m], rtol=0, atol=1e-5)
    torch.testing.assert_close(filled.teacher_tail[m], cache.teacher_tail[order][m], rtol=0, atol=1e-4)
    assert torch.equal(filled.teacher_valid, cache.teacher_valid[order])
