"""loss=opd: the sampled-token on-policy distillation estimator (pipeline/train/losses/reference.py `opd_loss`, and the fused
path), k = 0 caches, and the refusals when a cache holds less than the loss reads.

Run: ``python -m pytest tests/train/losses/test_opd.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tiny_cache import random_samples, score_into_cache

from pipeline.store import read_cache
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.losses.fused import fused_gkd_loss
from pipeline.train.losses.reference import OpdCorrection, gkd_loss, opd_advantage, opd_loss


def test_opd_gradient_is_an_unbiased_estimate_of_the_reverse_kl_gradient():
    """Tiny vocab: the OPD gradient averaged over N tokens sampled from the student equals the exact gradient of
    KL(s||p) w.r.t. the logits, within 5 standard errors per component; the standard error is the exact standard
    deviation of the one-sample gradient (enumerated over the vocab) over sqrt(N)."""
    torch.manual_seed(0)
    V, N = 6, 200_000
    z = (torch.randn(V, dtype=torch.float64) * 1.5).requires_grad_()
    log_p = torch.log_softmax(torch.randn(V, dtype=torch.float64) * 1.5, -1)
    log_s = torch.log_softmax(z, -1)
    exact = torch.autograd.grad((log_s.exp() * (log_s - log_p)).sum(), z)[0]
    # one-sample gradient for token x: (log s(x) - log p(x)) (onehot(x) - s); its exact mean and variance
    s = log_s.detach().exp()
    g = (log_s.detach() - log_p)[:, None] * (torch.eye(V, dtype=torch.float64) - s[None, :])  # [x, component]
    mean = (s[:, None] * g).sum(0)
    torch.testing.assert_close(mean, exact, rtol=1e-12, atol=1e-12)  # the identity the estimator rests on
    sd = ((s[:, None] * g**2).sum(0) - mean**2).sqrt()
    x = torch.multinomial(s, N, replacement=True, generator=torch.Generator().manual_seed(1))
    logits = z.expand(N, V)
    total, count, kl_sum = opd_loss(logits, x, log_p[x], torch.ones(N, dtype=torch.bool))
    est = torch.autograd.grad(total / count, z)[0]
    assert count.item() == N
    assert torch.all((est - exact).abs() <= 5 * sd / math.sqrt(N)), (est, exact, sd / math.sqrt(N))
    kl = float((s * (log_s.detach() - log_p)).sum())  # the reported estimate is unbiased for KL(s||p) itself
    kl_sd = float((s * (log_s.detach() - log_p) ** 2).sum() - kl**2) ** 0.5
    assert abs(kl_sum.item() / N - kl) <= 5 * kl_sd / math.sqrt(N)


def test_importance_weights_make_opd_unbiased_on_samples_of_older_weights():
    """Tokens sampled from older weights b, not from s (an overlapped cycle's stale samples): weighted by s/b
    (uncapped), the OPD gradient averaged over N samples equals the exact ∇ KL(s||p) within 5 standard errors (the
    exact standard deviation of the weighted one-sample gradient under b, enumerated); unweighted it misses it by
    far more — the bias the weights remove."""
    torch.manual_seed(0)
    V, N = 6, 200_000
    z = (torch.randn(V, dtype=torch.float64) * 1.5).requires_grad_()
    log_p = torch.log_softmax(torch.randn(V, dtype=torch.float64) * 1.5, -1)
    log_b = torch.log_softmax(z.detach() + torch.randn(V, dtype=torch.float64), -1)  # the sampler's older weights
    log_s = torch.log_softmax(z, -1)
    exact = torch.autograd.grad((log_s.exp() * (log_s - log_p)).sum(), z)[0]
    s, b = log_s.detach().exp(), log_b.exp()
    g = ((s / b) * (log_s.detach() - log_p))[:, None] * (torch.eye(V, dtype=torch.float64) - s[None, :])
    mean = (b[:, None] * g).sum(0)
    torch.testing.assert_close(mean, exact, rtol=1e-12, atol=1e-12)  # the identity the weights rest on
    se = ((b[:, None] * g**2).sum(0) - mean**2).sqrt() / math.sqrt(N)
    x = torch.multinomial(b, N, replacement=True, generator=torch.Generator().manual_seed(1))
    everywhere = torch.ones(N, dtype=torch.bool)
    total, count, _ = opd_loss(z.expand(N, V), x, log_p[x], everywhere, correction=OpdCorrection(log_b[x], 1e9))
    est = torch.autograd.grad(total / count, z)[0]
    assert torch.all((est - exact).abs() <= 5 * se), (est, exact, se)
    total, count, _ = opd_loss(z.expand(N, V), x, log_p[x], everywhere)  # the same samples, unweighted
    biased = torch.autograd.grad(total / count, z)[0]
    assert (biased - exact).abs().max() > 20 * se.max(), (biased, exact, se)


def test_importance_weights_are_capped_and_one_where_no_logprob_was_recorded():
    log_s = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    log_p = torch.tensor([-2.0, -2.0, -2.0, -40.0], dtype=torch.float64)  # the last below the teacher floor
    behavior = torch.tensor([math.nan, -1.5, -3.0, -1.0], dtype=torch.float64)
    wadv, adv = opd_advantage(log_s, log_p, behavior, cap=2.0)
    floor = math.log(1e-12)
    assert adv.tolist() == pytest.approx([1.0, 1.0, 1.0, -1.0 - floor])
    # no record: 1; ratio e^0.5 under the cap; e^2 capped at 2; ratio 1
    assert wadv.tolist() == pytest.approx([1.0, math.exp(0.5), 2.0, -1.0 - floor])
    assert opd_advantage(log_s, log_p, behavior, None)[0].tolist() == adv.tolist()  # no cap asked: no weights


def _case(seed: int, V: int = 50, H: int = 12, B: int = 3, S: int = 10, k: int = 4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, H, dtype=torch.float64, generator=g).requires_grad_()
    w = (torch.randn(V, H, dtype=torch.float64, generator=g) * 0.7).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(B * S)]).reshape(B, S, k).int()
    ell = torch.log_softmax(torch.randn(B, S, k, dtype=torch.float64, generator=g), -1) + math.log(0.9)
    tail = torch.full((B, S), math.log(0.1), dtype=torch.float64)
    actual = -torch.rand(B, S, dtype=torch.float64, generator=g) * 6
    active = torch.rand(B, S, generator=g) < 0.8
    dataset = torch.zeros(B, S, dtype=torch.bool)
    dataset[0] = True  # row 0 is dataset-sourced: GKD there, OPD on the others
    return h, w, labels, ids, ell, tail, actual, active & dataset, active & ~dataset


@pytest.mark.parametrize("weighted", [False, True])
def test_fused_and_unfused_opd_agree(weighted):
    h, w, labels, ids, ell, tail, actual, kd, opd = _case(0)
    n = int((kd | opd).sum())
    correction = None
    if weighted:  # the sampler's logprobs: some positions unrecorded, ratios both sides of the cap
        g = torch.Generator().manual_seed(5)
        behavior = -torch.rand(labels.shape, dtype=torch.float64, generator=g) * 8
        behavior[torch.rand(labels.shape, generator=g) < 0.2] = math.nan
        correction = OpdCorrection(behavior, 1.5)
    ref_kd, _ = gkd_loss(h @ w.T, ids, ell, kd, beta=0.5, teacher_tail=tail)
    ref_opd, opd_n, ref_kl = opd_loss(h @ w.T, labels, actual, opd, correction=correction)
    ref = (ref_kd + ref_opd) / n
    g_ref = torch.autograd.grad(ref, (h, w))
    out = fused_gkd_loss(h, w, ids, ell, kd, beta=0.5, teacher_tail=tail, labels=labels, kd_weight=1 / n,
                         opd_mask=opd, teacher_actual=actual, opd_weight=1 / n, chunk_size=7, opd_correction=correction)
    g = torch.autograd.grad(out.loss, (h, w))
    assert out.opd_count.item() == opd_n.item() == int(opd.sum()) and out.kd_count.item() == int(kd.sum())
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-10)  # float64, same arithmetic up to order
    assert out.opd_kl_sum.item() == pytest.approx(ref_kl.item(), rel=1e-10)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_opd_is_zero_when_the_student_is_the_teacher():
    h, w, labels, _, _, _, _, _, opd = _case(1)
    teacher = torch.log_softmax(h.detach() @ w.detach().T, -1).gather(-1, labels[..., None])[..., 0]
    total, _, kl = opd_loss(h @ w.T, labels, teacher, opd)
    g = torch.autograd.grad(total, (h, w))
    assert abs(total.item()) < 1e-12 and abs(kl.item()) < 1e-12 and all(x.abs().max() < 1e-12 for x in g)
    empty = torch.zeros(*labels.shape, 0, dtype=torch.int32)
    out = fused_gkd_loss(h, w, empty, empty.double(), torch.zeros_like(opd), beta=0.0, labels=labels,
                         opd_mask=opd, teacher_actual=teacher, opd_weight=1.0)  # k = 0 rows
    g = torch.autograd.grad(out.loss, (h, w))
    assert abs(out.loss.item()) < 1e-12 and all(x.abs().max() < 1e-12 for x in g)


@pytest.fixture(scope="module")
def k0(tiny, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("k0")
    student_rows = [(ids, p, "student") for ids, p, _ in random_samples(12, tiny["vocab"], seed=9)]
    score_into_cache(tiny["model"], root / "k0", student_rows, k=0)
    score_into_cache(tiny["model"], root / "mixed", random_samples(6, tiny["vocab"], seed=10), k=0)
    return {"cache": root / "k0", "mixed": root / "mixed", "rows": {s.key: s for s in read_cache(root / "k0")}}


def test_loader_brings_the_actual_tokens_teacher_logprob(tiny, k0):
    mb = ScoredLoader([k0["cache"]], micro_batch_size=4, seq_length=64, seed=0, vocab_size=tiny["vocab"],
                      actual=True).micro_batch(0)
    assert mb.teacher_ids.shape[-1] == 0
    for i, key in enumerate(mb.keys):
        s = k0["rows"][key]
        p, n = s.first_scored, min(len(s.input_ids), 64)
        assert mb.teacher_actual[i, p - 1 : n - 1].tolist() == s.actual_logprobs[: n - p].tolist()
        assert mb.labels[i, p - 1 : n - 1].tolist() == s.input_ids[p:n].tolist()
    assert not mb.teacher_actual[~mb.loss_mask].any()


def _train(tiny, cache, save, **kw):
    from pipeline.cli import main as cli

    args = dict(student=str(tiny["student"]), cache=f"[{cache}]", micro_batch_size=2, global_batch_size=2,
                seq_length=64, train_steps=2, warmup_steps=1, save_interval=2, save_dir=str(save), progress=False, **kw)
    return cli(["train", *[f"{k}={v}" for k, v in args.items()]])


def test_gkd_train_loss_opd_on_a_k0_cache(tiny, k0, tmp_path):
    assert _train(tiny, k0["cache"], tmp_path / "run", loss="opd") == 0
    metrics = [json.loads(line) for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["loss"] == pytest.approx(m["opd"] + m["jsd"]) for m in metrics)
    # Step 1 (lr 0 in warmup: the initial student) by hand: a plain HF forward of the student on the step's
    # samples, mean of log s(x) - log p(x) over their scored positions, against the cached teacher logprobs.
    from transformers import AutoModelForCausalLM

    loader = ScoredLoader([k0["cache"]], micro_batch_size=2, seq_length=64, seed=1234, vocab_size=tiny["vocab"],
                          packing=True, rows_per_step=2)
    mb = next(loader.iter_from(0, prefetch=0))
    model = AutoModelForCausalLM.from_pretrained(tiny["student"], dtype=torch.float64).eval()
    total = count = 0
    for key in mb.keys:
        r = k0["rows"][key]
        ids = r.input_ids[:64]
        with torch.no_grad():
            lsm = torch.log_softmax(model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0], -1)
        for t in range(r.first_scored - 1, len(ids) - 1):
            total += float(lsm[t, ids[t + 1]]) - float(r.actual_logprobs[t + 1 - r.first_scored])
            count += 1
    # fp32 Megatron forward vs fp64 HF: ~1e-5 per logprob; 1e-3 leaves room without hiding a misalignment (~1 nat)
    assert metrics[0]["opd_kl"] == pytest.approx(total / count, abs=1e-3)


@pytest.mark.parametrize("case", ["gkd_on_k0", "dataset_rows_on_k0"])
def test_a_cache_holding_less_than_the_loss_reads_is_refused_before_training(tiny, k0, tmp_path, capsys, case):
    if case == "gkd_on_k0":
        assert _train(tiny, k0["cache"], tmp_path / "r", topk_mode="tail") == 2
        assert "loss=gkd (topk_mode=tail) needs its top-k entries" in capsys.readouterr().err
    else:
        assert _train(tiny, k0["mixed"], tmp_path / "r", loss="opd") == 2
        assert "dataset-sourced row(s); loss=opd trains them with the GKD loss" in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before any step


@pytest.fixture(scope="module")
def sampled(tiny, tmp_path_factory) -> dict:
    """k = 0 caches whose student rows carry the sampler's logprobs (scored 1.5's completion_logprobs): "mixed"
    random ones, some rows without; "far" every token at logprob -1e4, so that every weight s(y)/b(y) hits the cap."""
    root = tmp_path_factory.mktemp("sampled")
    rows = [(ids, p, "student") for ids, p, _ in random_samples(12, tiny["vocab"], seed=9)]
    g = np.random.default_rng(3)
    mixed = [None if i % 4 == 0 else (-g.random(len(ids) - p) * 5).astype(np.float32).tolist()
             for i, (ids, p, _) in enumerate(rows)]
    score_into_cache(tiny["model"], root / "mixed", rows, k=0, behavior=mixed)
    score_into_cache(tiny["model"], root / "far", rows, k=0, behavior=[[-1e4] * (len(ids) - p) for ids, p, _ in rows])
    keys = [s.key for s in read_cache(root / "mixed")]
    return {"mixed": root / "mixed", "far": root / "far", "behavior": dict(zip(keys, mixed, strict=True)),
            "rows": {s.key: s for s in read_cache(root / "mixed")}}


def test_loader_lays_the_samplers_logprobs_on_their_labels(tiny, sampled):
    shard = next((sampled["mixed"] / "shards").glob("*.parquet"))
    assert pq.read_schema(shard).metadata[b"gkd.schema"] == b"scored/1.5"
    mb = ScoredLoader([sampled["mixed"]], micro_batch_size=8, seq_length=64, seed=0, vocab_size=tiny["vocab"],
                      actual=True).micro_batch(0)
    got = mb.behavior.logprobs
    for i, key in enumerate(mb.keys):
        s, lp = sampled["rows"][key], sampled["behavior"][key]
        p, n = s.first_scored, min(len(s.input_ids), 64)
        if lp is None:  # a row without them: no weight (NaN) at its positions
            assert got[i, p - 1 : n - 1].isnan().all()
        else:  # the logprob of label t = token t + 1 = completion token t + 1 - P
            assert got[i, p - 1 : n - 1].tolist() == lp[: n - p]
    assert got[~mb.loss_mask].isnan().all()
    assert ScoredLoader([sampled["mixed"]], micro_batch_size=8, seq_length=64, seed=0,
                        vocab_size=tiny["vocab"]).micro_batch(0).behavior is None  # only loss=opd reads them


def test_gkd_train_weighs_opd_by_the_rows_recorded_logprobs(tiny, sampled, tmp_path):
    """Through the trainer: every token recorded at logprob -1e4 puts every weight at the cap, so the step-1
    estimator (lr 0: the same initial student) is exactly opd_is_cap times the unweighted one, its KL the same."""
    assert _train(tiny, sampled["far"], tmp_path / "capped", loss="opd", opd_is_cap=3) == 0
    assert _train(tiny, sampled["far"], tmp_path / "plain", loss="opd", opd_is_cap="null") == 0
    capped, plain = ([json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()][0]
                     for run in ("capped", "plain"))
    assert plain["opd"] != 0 and capped["opd"] == pytest.approx(3 * plain["opd"], rel=1e-6)
    assert capped["opd_kl"] == pytest.approx(plain["opd_kl"], rel=1e-9)
