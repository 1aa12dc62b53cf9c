"""The live teacher's on-the-fly reduction (pipeline/train/teacher/live.py) against a full-softmax top-k, TP=2 vs
TP=1, the fold of ids past the student's vocab; the trainer trained by a live teacher against the same trainer on
a cache of the same rows (exact codec: the same steps; default codec: within its quantisation bound).

Run: ``python -m pytest tests/train/teacher/test_live_teacher.py``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.train.teacher.live import teacher_topk

REPO = Path(__file__).resolve().parents[3]


def _case(seed: int, t: int = 11, h: int = 8, v: int = 50, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g, dtype=dtype), torch.randn(v, h, generator=g, dtype=dtype) * 1.5,
            torch.rand(t, generator=g) > 0.3)


def test_matches_full_softmax_topk():
    h, w, mask = _case(0)
    ids, lps, tail, valid = teacher_topk(h, w, mask, 5, chunk_size=4)
    ref = torch.log_softmax(h @ w.t(), -1).topk(5, -1)
    assert valid.all()
    assert torch.equal(ids[mask].long(), ref.indices[mask])
    torch.testing.assert_close(lps[mask].double(), ref.values[mask], rtol=0, atol=1e-6)  # float32 outputs
    mass = ref.values[mask].exp().sum(-1)
    torch.testing.assert_close(tail[mask].double(), torch.log1p(-mass), rtol=0, atol=1e-5)
    assert not ids[~mask].any() and not lps[~mask].any()  # inactive positions stay zero


def test_ids_past_the_student_vocab_are_folded_into_the_tail():
    """A teacher with more embedding rows: its top-k entries at ids >= the student's vocab become invalid bins and
    their mass joins the tail (the loader's rule for cached rows)."""
    h, w, mask = _case(1)
    w[45:] += 4.0 * w[45:].abs()  # make the extra rows likely to be in the top-k
    ids, lps, tail, valid = teacher_topk(h, w, mask, 6, student_vocab=45)
    full = torch.log_softmax(h @ w.t(), -1)
    top = full.topk(6, -1)
    assert (~valid[mask]).any()
    assert torch.all(ids[~valid] == 0) and torch.all(torch.isneginf(lps[~valid]))
    kept = top.values.masked_fill(top.indices >= 45, -math.inf)
    ref_tail = torch.log1p(-kept.exp().sum(-1))  # everything outside the representable kept entries
    torch.testing.assert_close(tail[mask].double(), ref_tail[mask], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_tp2_matches_tp1():
    worker = Path(__file__).resolve().parents[1] / "_live_tp_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP2 OK") == 2, proc.stdout[-3000:]


# ---------------------------------------------------------------- the trainer: live teacher vs cache

EPS = 1 / 64  # the default codec's bound on every stored logprob (and the stored tail), pipeline/store/codec.py


@pytest.fixture(scope="module")
def same_rows(tmp_path_factory) -> dict:
    """A teacher, a student, and the same 24 samples twice: as rollouts (for teacher_live) and as caches scored by
    a plain transformers forward of that teacher (exact codec and default codec). One shard and one row group
    each, in the same order, so the loader's seeded order picks the same samples in both."""
    from tiny_cache import build_tiny, random_samples, score_into_cache
    from transformers import AutoConfig

    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import rollout_row, write_rollouts

    root = tmp_path_factory.mktemp("live")
    teacher, student = build_tiny(root / "teacher"), build_tiny(root / "student", seed=1)
    vocab = AutoConfig.from_pretrained(teacher).vocab_size
    samples = random_samples(24, vocab, seed=9)
    for codec in ("exact-f32", "rank-grid-esc"):
        score_into_cache(teacher, root / codec, samples, shard_rows=24, codec=codec)
    rows = [rollout_row(prompt_id=str(i), prompt_ids=ids[:p].tolist(), completion_ids=ids[p:].tolist(),
                        source=src, policy_version=None if src == "dataset" else 0)
            for i, (ids, p, src) in enumerate(samples)]
    write_rollouts(root / "rollouts" / "r-00000-of-00001.parquet", rows,
                   tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    return {"teacher": teacher, "student": student, "root": root}


def _train(d: dict, save: Path, source: str, **kw) -> list[dict]:
    import json

    from pipeline.cli import main as cli

    data = ([f"teacher_live={d['teacher']}", f"rollouts=[{d['root'] / 'rollouts'}]", "cache=[]",
             f"teacher_live_topk={8}"] if source == "live" else [f"cache=[{d['root'] / source}]"])
    args = [f"student={d['student']}", "micro_batch_size=2", "global_batch_size=4", "seq_length=48",
            "train_steps=10", "warmup_steps=1", "optimizer=sgd", "lr=0.3", "min_lr=0.3", "beta=0.0", "sft_alpha=0.5",
            f"save_dir={save}", "save_interval=10", "progress=false", *data, *[f"{k}={v}" for k, v in kw.items()]]
    assert cli(["train", *args]) == 0
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_live_teacher_trains_like_its_exact_cache(same_rows, tmp_path):
    """10 SGD steps, same seed and samples, fp32: per-step losses within 1e-5 relative (the cache's rows come from
    a transformers forward, the live ones from Megatron's: logits agree to ~1e-6) and the trained weights under the
    cross-layout rule (tests/tolerance.py)."""
    from tolerance import assert_trains_alike

    live = _train(same_rows, tmp_path / "live", "live")
    cached = _train(same_rows, tmp_path / "exact", "exact-f32")
    assert_trains_alike(live, cached, same_rows["student"], tmp_path, ("live", "exact"), "exact codec")


def test_default_codec_stays_within_its_bound(same_rows, tmp_path):
    """The same first step (same weights) from the default codec's cache. Bound (forward KL, β = 0), per position:
    every stored value, the tail included, is within ε = 1/64 nat of the true one, and the true bins sum to 1, so
    the renormalised bins satisfy |â − a| <= 2ε and |p̂ − p| <= p(e^{2ε} − 1); then
        D̂ − D = Σ p̂(â − a) + Σ (p̂ − p)(a − b),  |D̂ − D| <= 2ε + (e^{2ε} − 1) · Σ p|a − b|,
    and Σ p|log(p/s)| = D + 2 Σ_{p<s} p log(s/p) <= D + 2 (p log(s/p) <= s − p). Linear in D, so it holds for the
    step's mean with D = the live (unquantised) loss: |ΔD| <= 2ε + (e^{2ε} − 1)(D + 2)."""
    live = _train(same_rows, tmp_path / "live1", "live", train_steps=1, warmup_steps=0)
    quant = _train(same_rows, tmp_path / "q1", "rank-grid-esc", train_steps=1, warmup_steps=0)
    d_live, d_q = live[0]["jsd"], quant[0]["jsd"]
    bound = 2 * EPS + math.expm1(2 * EPS) * (d_live + 2) + 1e-4  # + the engines' float agreement
    print(f"[default codec] live {d_live:.6f} vs cached {d_q:.6f}: |diff| {abs(d_q - d_live):.2e} <= bound {bound:.3f}",
          file=sys.stderr)
    assert 0 < abs(d_q - d_live) <= bound, (d_q, d_live, bound)


def test_privileged_teacher_prompts_are_refused_by_the_live_teacher(tmp_path):
    """A live teacher scores prompt + completion; rollouts whose teacher sees another prompt (OPSD) need the score
    stage, so the loader refuses them by file instead of training on the wrong teacher view."""
    from pipeline.store.rollouts import rollout_row, write_rollouts
    from pipeline.store.shards import ShardError
    from pipeline.train.data.loader import LiveRows, ScoredLoader

    rows = [rollout_row(prompt_id="a", prompt_ids=[5, 6], completion_ids=[7, 8], source="dataset"),
            rollout_row(prompt_id="b", prompt_ids=[5, 6], completion_ids=[7, 9], source="dataset",
                        teacher_prompt_ids=[3, 4, 5])]
    write_rollouts(tmp_path / "plain.parquet", rows[:1])
    write_rollouts(tmp_path / "opsd.parquet", rows)
    assert ScoredLoader([tmp_path / "plain.parquet"], micro_batch_size=1, seq_length=8, seed=0, live=LiveRows(4)).num_samples == 1
    with pytest.raises(ShardError, match=r"opsd\.parquet: rollouts with a privileged teacher_prompt_ids"):
        ScoredLoader([tmp_path / "opsd.parquet"], micro_batch_size=1, seq_length=8, seed=0, live=LiveRows(4))


def test_hf_backend_live_teacher_trains_like_its_exact_cache(same_rows, tmp_path):
    """The same comparison on the transformers backend (the live teacher an HF model too): 3 SGD steps, per-step
    losses within 1e-5 relative of the exact cache's."""
    live = _train(same_rows, tmp_path / "live", "live", backend="hf", train_steps=3, save_interval=3)
    cached = _train(same_rows, tmp_path / "exact", "exact-f32", backend="hf", train_steps=3, save_interval=3)
    assert [m["active_tokens"] for m in live] == [m["active_tokens"] for m in cached]
    for a, b in zip(live, cached, strict=True):
        assert abs(a["jsd"] - b["jsd"]) <= 1e-5 * b["jsd"] and abs(a["sft"] - b["sft"]) <= 1e-5 * b["sft"], (a, b)
