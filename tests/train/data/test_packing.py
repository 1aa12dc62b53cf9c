"""Sequence packing: the plan, the packed layout against a hand computation, and the Megatron student on packed rows
against the same samples one per row (logits, per-token losses, gradients), no cross-sample attention, DP slices.

Run: ``python -m pytest tests/train/data/test_packing.py`` (tiny random Llama, a cache scored from it: ~20 s).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_cache import build_tiny, score_into_cache

from pipeline.store import read_cache
from pipeline.train.data.batch import IGNORE_INDEX
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.data.packing import attention_mask, pack, row_offsets

S = 32  # seq_length of these tests
# Lengths chosen so packed rows hit every edge: rows filled exactly to S (8 + 24, 16 + 16, 8 + 8 + 16, a 32),
# samples longer than S (40, 37: truncated), and short ones that fill gaps.
LENGTHS = [8, 24, 16, 16, 40, 8, 8, 16, 32, 12, 20, 37, 5, 27, 9, 14, 18, 30]


def test_pack_is_first_fit_then_first_fit_decreasing():
    # first-fit in order: 20 -> row 0, 20 -> row 1, 10 -> row 0, 2 -> row 0 (full), 12 -> row 1 (full); 30 fits
    # nowhere and no repack can place it (94 tokens > 2 x 32): the run ends before it
    assert pack(np.array([20, 20, 10, 2, 12, 30]), rows=2, seq_length=32).tolist() == [0, 1, 0, 0, 1]
    # 24 | 8 fill row 0 exactly, 8 | 24 row 1: samples ending exactly at the row boundary
    assert pack(np.array([24, 8, 8, 24, 1]), rows=2, seq_length=32).tolist() == [0, 0, 1, 1]
    # in order 10, 10 -> row 0, 22 -> row 1, then 22 fits nowhere (12 and 10 free); first-fit decreasing of the
    # run so far plus it places 22 + 10 | 22 + 10: the run goes on, and ends at 5 (69 tokens > 64)
    assert pack(np.array([10, 10, 22, 22, 5]), rows=2, seq_length=32).tolist() == [0, 1, 0, 1]
    assert pack(np.array([32, 32]), rows=1, seq_length=32).tolist() == [0]  # a single full row
    assert pack(np.array([3, 4]), rows=4, seq_length=32).tolist() == [0, 0]  # the end of the lengths ends the run
    with pytest.raises(ValueError, match="outside"):
        pack(np.array([33]), rows=1, seq_length=32)


def test_row_offsets_lay_samples_out_in_order():
    row_of = np.array([0, 1, 0, 1, 0])
    assert row_offsets(row_of, np.array([5, 7, 3, 2, 4])).tolist() == [0, 0, 5, 7, 8]


def test_attention_mask_is_block_diagonal_causal():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    masked = attention_mask(doc)
    assert masked.shape == (2, 1, 7, 7) and masked.dtype == torch.bool
    for b in range(2):
        for i in range(7):
            for j in range(7):
                assert bool(masked[b, 0, i, j]) == (not (j <= i and doc[b, i] == doc[b, j])), (b, i, j)
    assert not masked.all(-1).any()  # no softmax row is empty, padding rows included


@pytest.fixture(scope="module")
def packed_cache(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("packing")
    model = build_tiny(root / "model")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = np.random.default_rng(3)
    samples = []
    for i, n in enumerate(LENGTHS):
        p = int(rng.integers(1, max(2, n // 2)))
        samples.append((rng.integers(3, vocab, size=n).astype(np.int32), p, "dataset" if i % 3 else "student"))
    score_into_cache(model, root / "cache", samples, shard_rows=6)
    rows = {s.key: s for s in read_cache(root / "cache")}
    # another random model as the student, so per-token divergences are O(1), not codec noise
    return {"model": model, "student": build_tiny(root / "student", seed=1), "cache": root / "cache", "rows": rows}


def _loader(cache, **kw) -> ScoredLoader:
    return ScoredLoader([cache], **{"micro_batch_size": 2, "seq_length": S, "seed": 5, "packing": True, **kw})


def _epoch(loader: ScoredLoader) -> list:
    """The micro-batches of the first epoch (the last one may run into the second)."""
    out, it = [], loader.iter_from(0, prefetch=0)
    while not out or out[-1].end < loader.num_samples:
        out.append(next(it))
    return out


def _spans(mb) -> list[tuple[int, int, int]]:
    """(row, first column, length) of each sample of a packed micro-batch, in key order."""
    out = []
    for r in range(mb.doc_ids.shape[0]):
        doc = mb.doc_ids[r]
        for d in range(int(doc.max()) + 1):
            cols = (doc == d).nonzero().flatten()
            out.append((r, int(cols[0]), len(cols)))
    return out


def test_packed_layout_matches_hand_computation(packed_cache):
    loader = _loader(packed_cache["cache"])
    mbs = _epoch(loader)
    seen, exact_fill, truncated = [], 0, 0
    for mb in mbs:
        assert mb.input_ids.shape[1] <= S and mb.packed
        assert len(_spans(mb)) == mb.samples == len(mb.keys)
        plan_end, row_of, offsets = loader.plan(mb.end - mb.samples)  # dp = 1: the micro-batch is its round
        assert plan_end == mb.end
        for key, r, o in zip(mb.keys, row_of.tolist(), offsets.tolist(), strict=True):
            s = packed_cache["rows"][key]
            ids, p = s.input_ids.astype(np.int64), s.first_scored
            n = min(len(ids), S)
            truncated += len(ids) > S
            exact_fill += o + n == S
            assert mb.input_ids[r, o : o + n].tolist() == ids[:n].tolist()
            assert len(set(mb.doc_ids[r, o : o + n].tolist())) == 1
            assert mb.labels[r, o : o + n - 1].tolist() == ids[1:n].tolist()
            assert mb.labels[r, o + n - 1] == IGNORE_INDEX  # the sample's last token: no label across the boundary
            expect = np.zeros(n, bool)
            expect[p - 1 : n - 1] = True
            assert mb.loss_mask[r, o : o + n].tolist() == expect.tolist()
            assert mb.sft_mask[r, o : o + n].tolist() == (expect & (s.source == "dataset")).tolist()
            for t in range(p - 1, n - 1):  # teacher row of token j = t + 1 sits at o + t
                assert mb.teacher_ids[r, o + t].tolist() == s.topk_ids[t + 1 - p].tolist()
                assert mb.teacher_logprobs[r, o + t].tolist() == s.topk_logprobs[t + 1 - p].tolist()
                assert mb.teacher_tail[r, o + t].item() == s.tail_logprobs[t + 1 - p]
            seen.append(key)
        assert mb.truncated == sum(len(packed_cache["rows"][k].input_ids) > S for k in mb.keys)
        pad = mb.doc_ids < 0
        assert not mb.loss_mask[pad].any() and (mb.labels[pad] == IGNORE_INDEX).all()
        assert mb.tokens == int((~pad).sum()) and mb.positions == mb.doc_ids.numel()
    assert sorted(seen[: loader.num_samples]) == sorted(packed_cache["rows"])  # the epoch, each sample once
    assert exact_fill >= 2 and truncated >= 2  # the edge cases were exercised
    # fewer micro-batches than one sample per row would need
    assert len(mbs) < loader.num_samples / 2


def test_resume_and_data_parallel_plans(packed_cache):
    it = _loader(packed_cache["cache"]).iter_from(0, prefetch=0)
    whole = [next(it) for _ in range(12)]
    # resume at any micro-batch end (a step boundary when dp = accum = 1) continues identically
    resumed = _loader(packed_cache["cache"]).iter_from(whole[4].end, prefetch=2)
    for a in whole[5:]:
        b = next(resumed)
        assert a.keys == b.keys and a.end == b.end
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "labels", "doc_ids",
                                                                          "teacher_logprobs", "teacher_ids"))
    resumed.close()
    # global micro-batch numbering agrees with iteration
    assert _loader(packed_cache["cache"]).micro_batch(7).keys == whole[7].keys
    # a step of 4 rows (2 micro-batches): one plan per step, so dp = 2 (rank r takes micro-batch r of each step)
    # sees exactly what dp = 1 with 2 accumulation steps sees; ends are the step's end on both ranks
    acc = _loader(packed_cache["cache"], rows_per_step=4).iter_from(0, prefetch=0)
    steps = [next(acc) for _ in range(12)]
    ranks = [_loader(packed_cache["cache"], dp_rank=r, dp_size=2, rows_per_step=4).iter_from(0, prefetch=0)
             for r in range(2)]
    for i in range(6):
        r0, r1 = next(ranks[0]), next(ranks[1])
        assert r0.keys == steps[2 * i].keys and r1.keys == steps[2 * i + 1].keys
        assert r0.end == r1.end == steps[2 * i + 1].end == steps[2 * i].end
        assert not set(r0.keys) & set(r1.keys)


# ---------------------------------------------------------------- the student on packed rows


def _unpack(mb) -> tuple[dict, list[tuple[int, int, int]]]:
    """The same samples one per row (width S, right padding): the reference layout, cut from the packed one."""
    spans = _spans(mb)
    n = len(spans)
    out = {"input_ids": torch.zeros(n, S, dtype=torch.long), "teacher_ids": torch.zeros(n, S, mb.teacher_ids.shape[-1], dtype=torch.int32),
           "teacher_logprobs": torch.zeros(n, S, mb.teacher_ids.shape[-1]), "loss_mask": torch.zeros(n, S, dtype=torch.bool)}
    for i, (r, o, length) in enumerate(spans):
        for name, t in out.items():
            t[i, :length] = getattr(mb, name)[r, o : o + length]
    return out, spans


@pytest.fixture(scope="module")
def student(packed_cache):
    from pipeline.train.models.megatron import build_model, load_hf_weights
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    model = build_model(packed_cache["student"])
    load_hf_weights(model, packed_cache["student"])
    yield model
    destroy_distributed()


def _forward(model, ids, mask=None, **attn):
    """Logits of `ids`; `attn`: GPTModel.forward keywords (attention.attention_inputs) instead of `mask`."""
    return model(ids, torch.arange(ids.shape[1]).expand_as(ids), **(attn or {"attention_mask": mask}))


def _per_token_kd(logits, t_ids, t_lp, mask) -> torch.Tensor:
    from pipeline.train.losses.reference import gkd_loss

    out = []
    for pos in mask.reshape(-1).nonzero().flatten().tolist():
        one = torch.zeros(mask.numel(), dtype=torch.bool)
        one[pos] = True
        s, _ = gkd_loss(logits, t_ids, t_lp, one.view_as(mask), beta=0.5, mode="tail")
        out.append(s)
    return torch.stack(out)


# Tolerances: about 15x what was measured on these micro-batches (max |diff| / max |value| of each tensor; per-token
# divergences relative to their own size). float32: logits 2.5e-7, per-token GKD 2.1e-7, gradients 9.2e-7 apart.
# float64: 2.7e-9, 8e-11, 7e-9 -- not float64 round-off but Megatron's RoPE, whose angles (position x inverse
# frequency) are float32 whatever the model dtype, so packed samples, at other positions, round differently.
# A leak across samples or a RoPE offset moves them by O(1) (see test_no_attention_across_samples).
TOLERANCES = {torch.float64: (4e-8, 2e-9, 1e-7), torch.float32: (4e-6, 4e-6, 2e-5)}  # logits, per-token GKD, grads


@pytest.mark.parametrize("apart", ["spans", "mask"])  # what the trainer passes the sdpa student; the mask path
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_student_equals_one_sample_per_row(packed_cache, student, dtype, apart):
    """Logits, per-token GKD losses and parameter gradients of packed rows equal those of the same samples padded
    one per row: samples at column offsets > 0 see RoPE at shifted positions, which must not matter. `apart`: the
    rows' samples kept apart by their document spans (the trainer's sdpa input) or by the block-diagonal mask."""
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.models.attention import attention_inputs

    tol_logits, tol_kd, tol_grad = TOLERANCES[dtype]
    student.to(dtype)  # float32 -> float64 -> float32 is exact: the other tests see the same weights
    try:
        mbs = _epoch(_loader(packed_cache["cache"]))
        offsets = []
        for mb in mbs:
            ref, spans = _unpack(mb)
            offsets += [o for _, o, _ in spans]
            results = []
            packed_attn = (attention_inputs(mb.doc_ids, True, "sdpa") if apart == "spans"
                           else {"attention_mask": attention_mask(mb.doc_ids)})
            for ids, t_ids, t_lp, lmask, attn in (
                (mb.input_ids, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, packed_attn),
                (ref["input_ids"], ref["teacher_ids"], ref["teacher_logprobs"], ref["loss_mask"], {}),
            ):
                student.zero_grad()
                logits = _forward(student, ids, **attn)
                s, n = gkd_loss(logits, t_ids, t_lp.to(dtype), lmask, beta=0.5, mode="tail")
                (s / n).backward()
                grads = {k: p.grad.clone() for k, p in student.named_parameters() if p.grad is not None}
                with torch.no_grad():
                    per_token = _per_token_kd(logits.detach(), t_ids, t_lp.to(dtype), lmask)
                results.append((logits.detach(), per_token, grads))
            (packed, kd_p, g_p), (single, kd_s, g_s) = results
            scale = single.abs().max().item()
            for i, (r, o, length) in enumerate(spans):
                torch.testing.assert_close(packed[r, o : o + length], single[i, :length], rtol=0, atol=tol_logits * scale)
            assert kd_s.min() > 1e-2  # a distinct student: divergences O(1), so the relative check means something
            torch.testing.assert_close(kd_p, kd_s, rtol=tol_kd, atol=0)
            for k, g in g_s.items():
                torch.testing.assert_close(g_p[k], g, rtol=0, atol=tol_grad * g.abs().max().item(),
                                           msg=lambda m, k=k: f"{k}: {m}")
        assert max(offsets) >= S // 2  # samples far from their row's start were compared
    finally:
        student.to(torch.float32)
        student.zero_grad()


def test_no_attention_across_samples(packed_cache, student):
    """Perturb the first sample of a row: every later sample of that row keeps its logits exactly (masked scores
    get probability exactly 0), kept apart by document spans or by the mask. Without either they move: the check
    can fail."""
    from pipeline.train.models.attention import attention_inputs

    mb = next(m for m in _epoch(_loader(packed_cache["cache"])) if int(m.doc_ids[0].max()) >= 1)
    first = mb.doc_ids[0] == 0
    later = mb.doc_ids[0] >= 1
    ids = mb.input_ids.clone()
    ids[0, first] = (ids[0, first] + 7) % 300 + 3
    with torch.no_grad():
        unmasked = _forward(student, mb.input_ids, None), _forward(student, ids, None)
        for attn in (attention_inputs(mb.doc_ids, True, "sdpa"), {"attention_mask": attention_mask(mb.doc_ids)}):
            base = _forward(student, mb.input_ids, **attn)
            moved = _forward(student, ids, **attn)
            assert not torch.equal(base[0, first], moved[0, first])
            assert torch.equal(base[0, later], moved[0, later])
            assert torch.equal(base[1:], moved[1:])
    assert not torch.allclose(unmasked[0][0, later], unmasked[1][0, later])
