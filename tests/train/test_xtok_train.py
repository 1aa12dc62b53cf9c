"""`gkd train loss=gold|uld` from a cross-tokenizer cache (rows in the SmolLM2 teacher's tokens, a student with a
byte-level BPE trained in the test): the loader's student layout against the teacher's own forward, and the first
step's loss against the plain definition (train/losses/xtok.py `xtok_loss_reference`) on a transformers forward of
the student."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_cache import build_tiny, score_cross_into_cache, xtok_rollouts
from tolerance import assert_layout_close

from pipeline.store import align
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.losses.xtok import gold_weights, xtok_loss_reference

SEQ = 128
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def xt(tmp_path_factory):
    from tiny_models import build_smollm2_tiny
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("xtrain")
    teacher = build_smollm2_tiny(root / "teacher")
    student = build_tiny(root / "student")
    s_tok, t_tok = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    rows = xtok_rollouts(s_tok)
    score_cross_into_cache(teacher, student, root / "cache", rows)
    vmap = align.vocab_map(s_tok, t_tok, len(t_tok))
    return dict(root=root, teacher=teacher, student=student, s_tok=s_tok, t_tok=t_tok, rows=rows, vmap=vmap,
                cache=root / "cache")


def _loader(xt, **kw):
    args = dict(micro_batch_size=4, seq_length=SEQ, seed=0, vocab_size=len(xt["s_tok"]),
                tokenizer_fingerprint=tokenizer_fingerprint(xt["s_tok"]), xtok_map=xt["vmap"])
    return ScoredLoader([xt["cache"]], **{**args, **kw})


def test_loader_puts_the_merged_teacher_row_at_each_span_head(xt):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(xt["teacher"], dtype=torch.float64).eval()
    mb = _loader(xt).micro_batch(0)
    by_ids = {tuple(r["prompt_ids"] + r["completion_ids"]): r for r in xt["rows"]}
    assert mb.spans.head is not None and mb.spans.teacher_vocab == len(xt["t_tok"])
    width = mb.input_ids.shape[1]
    for i in range(mb.samples):
        n = int((mb.doc_ids[i] >= 0).sum())
        r = by_ids[tuple(mb.input_ids[i, :n].tolist())]
        got = align.retokenize(xt["s_tok"], xt["t_tok"], r["prompt_ids"], r["completion_ids"])
        ss, st, ps, pt = got.span_student, got.span_teacher, len(r["prompt_ids"]), got.teacher_first
        with torch.no_grad():
            lt = torch.log_softmax(teacher(torch.as_tensor(got.teacher_ids[None])).logits[0], -1)
        heads = ps - 1 + ss[:-1]
        assert np.flatnonzero(mb.loss_mask[i].numpy()).tolist() == heads.tolist()
        assert mb.sft_mask[i, ps - 1: n - 1].all() and int(mb.sft_mask[i].sum()) == n - ps
        for g in range(len(ss) - 1):
            members = np.arange(heads[g] + 1, ps - 1 + ss[g + 1])
            assert (mb.spans.head[i, members] == i * width + heads[g]).all()
            row = lt[pt + st[g] - 1]  # the teacher's distribution of the span's first teacher token
            later = sum(max(float(lt[pt + j - 1, got.teacher_ids[pt + j]]), math.log(1e-8))
                        for j in range(st[g] + 1, st[g + 1]))
            top = torch.topk(row, 8)
            # the cache's teacher ran on a batch, this forward on one row: other kernels, so the cross-layout rule
            # (a 2.5e-5 absolute gap was measured on this machine; a row off by one position differs by O(1))
            assert_layout_close(mb.teacher_logprobs[i, heads[g]], top.values + later, f"sample {i} span {g}")
            assert mb.teacher_ids[i, heads[g]].tolist() == xt["vmap"][top.indices.numpy()].tolist()
            tail = math.log1p(-float(top.values.exp().sum())) + later
            assert float(mb.teacher_tail[i, heads[g]]) == pytest.approx(tail, abs=1e-3)  # 1 - Σp: ill-conditioned
        assert (mb.spans.head[i][~mb.sft_mask[i]] == -1).all()


def _train(xt, save: Path, **kw) -> list[dict]:
    from pipeline.cli import main as cli

    args = dict(student=str(xt["student"]), cache=f"[{xt['cache']}]", micro_batch_size=2, global_batch_size=2,
                seq_length=SEQ, train_steps=2, warmup_steps=1, save_interval=2, save_dir=str(save), progress=False,
                packing=False, **kw)
    assert cli(["train", *[f"{k}={v}" for k, v in args.items()]]) == 0
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["gold", "uld"])
def test_first_step_loss_equals_the_definition_on_the_students_own_forward(xt, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    # gold: both parts at full weight (TRL's adaptive matched weight is ~3 % here, too little to see β) and the
    # default β (`beta: null`), which for gold is 0: forward KL on the matched ids (TrainConfig.kd_beta)
    full = dict(gold_matched_weight=1.0, gold_unmatched_weight=1.0) if kind == "gold" else {}
    metrics = _train(xt, tmp_path / kind, loss=kind, sft_alpha=0.5, **full)
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    # step 1 (lr 0 in warmup: the initial student) by hand, padded layout: row i is the step's sample i at offset 0
    loader = ScoredLoader([xt["cache"]], micro_batch_size=2, seq_length=SEQ, seed=1234, vocab_size=len(xt["s_tok"]),
                          tokenizer_fingerprint=tokenizer_fingerprint(xt["s_tok"]),
                          xtok_map=xt["vmap"] if kind == "gold" else None, rows_per_step=2)
    mb = next(loader.iter_from(0, prefetch=0))
    model = AutoModelForCausalLM.from_pretrained(xt["student"], dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(mb.input_ids).logits  # padding sits after each sample: causal, so it changes nothing before
    matched = mb.spans.matched
    weights = (1.0, 1.0) if kind == "gold" else gold_weights(0, mb.spans.teacher_vocab)
    args = (logits, mb.labels, mb.loss_mask, mb.spans.head, mb.teacher_ids, mb.teacher_logprobs.double(),
            mb.teacher_valid, mb.teacher_tail.double())
    total, count = xtok_loss_reference(*args, kind=kind, matched=matched, weights=weights, beta=0.0)
    if kind == "gold":  # the test tells the default β from the JSD's
        other, _ = xtok_loss_reference(*args, kind=kind, matched=matched, weights=weights, beta=0.5)
        assert abs(float((other - total) / count)) > 1e-2
    # fp32 Megatron forward vs fp64 transformers: ~1e-5 per logit; a misaligned span or row is off by far more
    assert metrics[0]["jsd"] == pytest.approx(float(total / count), abs=1e-3)
    lsm = torch.log_softmax(logits, -1)
    on = mb.sft_mask
    ce = -lsm.gather(-1, mb.labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)[on]
    assert metrics[0]["sft"] == pytest.approx(float(ce.mean()), abs=1e-3)


def test_packed_layout_equals_the_padded_one_sample_by_sample(xt):
    """Packed rows (several samples per row, the trainer's default) carry each sample's heads, span pointers and
    merged teacher rows exactly as one sample per row does, shifted to its columns."""
    packed = _loader(xt, packing=True, rows_per_step=4).micro_batch(0)
    padded = _loader(xt, micro_batch_size=len(xt["rows"])).micro_batch(0)
    assert packed.spans.matched is not None and packed.samples > packed.input_ids.shape[0]  # really packed
    where = {tuple(padded.input_ids[i, :int((padded.doc_ids[i] >= 0).sum())].tolist()): i
             for i in range(padded.samples)}
    wp, wq = packed.input_ids.shape[1], padded.input_ids.shape[1]
    for r in range(packed.input_ids.shape[0]):
        for d in range(int(packed.doc_ids[r].max()) + 1):
            cols = np.flatnonzero(packed.doc_ids[r].numpy() == d)
            o, n = int(cols[0]), len(cols)
            i = where[tuple(packed.input_ids[r, o:o + n].tolist())]
            assert packed.loss_mask[r, o:o + n].tolist() == padded.loss_mask[i, :n].tolist()
            assert packed.sft_mask[r, o:o + n].tolist() == padded.sft_mask[i, :n].tolist()
            torch.testing.assert_close(packed.teacher_logprobs[r, o:o + n], padded.teacher_logprobs[i, :n])
            assert torch.equal(packed.teacher_ids[r, o:o + n], padded.teacher_ids[i, :n])
            sp, sq = packed.spans.head[r, o:o + n], padded.spans.head[i, :n]
            assert torch.equal(sp >= 0, sq >= 0)
            assert torch.equal(sp[sp >= 0] - (r * wp + o), sq[sq >= 0] - i * wq)



@pytest.mark.parametrize("packing", [False, True])
def test_the_spans_part_on_the_padded_and_the_packed_path(xt, packing):
    """The loader builds the spans part on both layouts (cross-tokenizer rows pack): every span member points at its
    head, a loss position; the part carries the vocabulary map's student side (None for ULD) and the teacher's
    vocabulary; `.to` moves its tensors. The consumers that cannot use it refuse it by name: a same-tokenizer loss
    and context parallelism (the heads are flat indices into whole rows)."""
    from pipeline.config import ConfigError
    from pipeline.train.config import TrainConfig
    from pipeline.train.data.batch import matched_ids
    from pipeline.train.parallel.context_parallel import split
    from pipeline.train.step import loss_func

    kw = dict(packing=True, rows_per_step=4) if packing else {}
    mb = _loader(xt, **kw).micro_batch(0)
    assert mb.parts() == ("spans",) and mb.packed == packing
    if packing:
        assert mb.samples > mb.input_ids.shape[0]
    s = mb.spans
    assert s.head.dtype == torch.int64 and s.head.shape == mb.input_ids.shape and s.teacher_vocab == len(xt["t_tok"])
    assert torch.equal(s.matched, matched_ids(xt["vmap"], len(xt["s_tok"])))
    members = s.head >= 0
    assert bool(members.any()) and bool(mb.loss_mask.reshape(-1)[s.head[members]].all())
    moved = mb.to("meta")
    assert moved.spans.head.is_meta and moved.spans.matched.is_meta and moved.spans.teacher_vocab == s.teacher_vocab
    assert _loader(xt, xtok_map=None, **kw).micro_batch(0).spans.matched is None  # ULD: no map
    with pytest.raises(ConfigError, match=r"carries spans \(cross-tokenizer span heads\), which loss=gkd cannot use; "
                                          r"cross-tokenizer rows train with loss=gold"):
        loss_func(mb, (1.0, 1.0), TrainConfig(cache=[], loss="gkd"), len(xt["s_tok"]), None, torch.zeros(0))
    with pytest.raises(ConfigError, match=r"carries spans .*which context parallelism \(context_parallel_size=2\) "
                                          r"cannot use; span heads are flat indices"):
        split(mb, 2, 0)

@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gold", pytest.param("uld", marks=pytest.mark.slow)])  # CI: gold
def test_tp2_trains_like_tp1(xt, tmp_path, kind):
    """`gkd train loss=gold|uld` at TP=2 (torchrun, gloo: the student's vocabulary split over two ranks) vs TP=1 on
    the same micro-batches: the same loss, KD and SFT terms at every step, and the same weight change after SGD
    steps (tests/tolerance.py's cross-layout rule), read from both exports."""
    from tolerance import assert_layout_close
    from transformers import AutoModelForCausalLM

    from pipeline.cli import main as cli

    args = dict(student=str(xt["student"]), cache=f"[{xt['cache']}]", micro_batch_size=2, global_batch_size=4,
                seq_length=SEQ, train_steps=3, warmup_steps=1, save_interval=3, progress=False, prefetch=1,
                optimizer="sgd", lr=0.5, loss=kind, sft_alpha=0.5, gold_matched_weight=1.0, gold_unmatched_weight=1.0)
    argv = [f"{k}={v}" for k, v in args.items()]
    assert cli(["train", *argv, f"save_dir={tmp_path / 'tp1'}"]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "pipeline.train.run", *argv, f"save_dir={tmp_path / 'tp2'}",
                    "tensor_model_parallel_size=2"], check=True, env=env, cwd=REPO, timeout=1800)
    runs = {}
    for name in ("tp1", "tp2"):
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 3 and all(m["jsd"] > 0 and m["sft"] > 0 for m in metrics), metrics
        assert cli(["export", "--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"{name}-hf")]) == 0
        model = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf", dtype=torch.float32)
        runs[name] = (metrics, model.state_dict())
    init = AutoModelForCausalLM.from_pretrained(xt["student"], dtype=torch.float32).state_dict()
    for (one, two) in zip(runs["tp1"][0], runs["tp2"][0], strict=True):
        for key in ("loss", "jsd", "sft"):
            assert_layout_close(torch.tensor(two[key]), torch.tensor(one[key]), f"step {one['step']} {key}")
    delta = {name: {k: v - init[k] for k, v in sd.items()} for name, (_, sd) in runs.items()}
    assert float(delta["tp1"]["lm_head.weight"].abs().max()) > 1e-4  # trained, not the initial weights
    assert_layout_close(delta["tp2"], delta["tp1"], "weight change")
