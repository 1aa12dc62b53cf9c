"""A top-p (variable-k) cache through the loader and both loss paths: the padding after each position's kept
entries is `teacher_valid = False`, and the loss is the KL over the kept entries plus the tail, computed by hand.

Run: ``python -m pytest tests/train/data/test_topp.py`` (the tiny random Llama of conftest, scored by an HF forward).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_cache import random_samples, score_into_cache
from tiny_cache import train_tiny

from pipeline.store import read_cache
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.losses.fused import fused_gkd_loss
from pipeline.train.losses.reference import gkd_loss

CAP, MIN_K, TOPP = 8, 2, 0.9


@pytest.fixture(scope="module")
def topp_cache(tiny, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("topp")
    score_into_cache(tiny["model"], root / "cache", random_samples(12, tiny["vocab"], seed=7), k=CAP, topp=TOPP,
                     min_k=MIN_K)
    return {"cache": root / "cache", "rows": {s.key: s for s in read_cache(root / "cache")}}


def _loader(tiny, topp_cache) -> ScoredLoader:
    return ScoredLoader([topp_cache["cache"]], micro_batch_size=4, seq_length=64, seed=0, vocab_size=tiny["vocab"])


def test_loader_marks_padding_invalid(tiny, topp_cache):
    loader = _loader(tiny, topp_cache)
    checked, counts = 0, []
    for m in range(3):
        mb = loader.micro_batch(m)
        for i, key in enumerate(mb.keys):
            s = topp_cache["rows"][key]
            p, n = s.first_scored, len(s.input_ids)
            for t in range(p - 1, min(n, 64) - 1):
                q = t + 1 - p
                c = int(s.topk_counts[q])
                assert mb.teacher_valid[i, t].tolist() == [j < c for j in range(CAP)]
                assert mb.teacher_ids[i, t, :c].tolist() == s.topk_ids[q, :c].tolist()
                assert mb.teacher_logprobs[i, t, :c].tolist() == s.topk_logprobs[q, :c].tolist()
                assert mb.teacher_tail[i, t].item() == s.tail_logprobs[q]
                counts.append(c)
                checked += 1
        assert not mb.teacher_valid[~mb.loss_mask].any()
    assert checked > 50 and min(counts) >= MIN_K and max(counts) <= CAP
    assert len(set(counts)) > 2  # the rows really vary in width


def _hand_kl(logits: torch.Tensor, mb) -> float:
    """Σ over active positions of KL(teacher || student) on the bins {kept ids} + {rest}, float64 loops."""
    total = 0.0
    lsm = torch.log_softmax(logits.double(), -1)
    for b, t in mb.loss_mask.nonzero().tolist():
        valid = mb.teacher_valid[b, t]
        ids = mb.teacher_ids[b, t][valid].tolist()
        p = [math.exp(x) for x in mb.teacher_logprobs[b, t][valid].double().tolist()]
        p.append(math.exp(float(mb.teacher_tail[b, t])))
        z = sum(p)
        p = [max(x / z, 1e-12) for x in p]
        s = [math.exp(float(lsm[b, t, i])) for i in ids]
        s.append(1.0 - sum(s))
        total += sum(pi * (math.log(pi) - math.log(si)) for pi, si in zip(p, s, strict=True))
    return total


@pytest.mark.parametrize("mode", ["tail", "renorm"])
def test_both_loss_paths_on_variable_k(tiny, topp_cache, mode):
    mb = _loader(tiny, topp_cache).micro_batch(0)
    torch.manual_seed(0)
    B, S = mb.input_ids.shape
    H, V = 16, tiny["vocab"]
    h = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(V, H, dtype=torch.float64) * 0.5).requires_grad_()
    args = dict(beta=0.0, mode=mode, teacher_tail=mb.teacher_tail.double(), teacher_valid=mb.teacher_valid)
    ids, ell = mb.teacher_ids, mb.teacher_logprobs.double()
    ref, count = gkd_loss(h @ w.T, ids, ell, mb.loss_mask, **args)
    if mode == "tail":  # float64 on both sides: only summation order differs
        assert ref.item() == pytest.approx(_hand_kl((h @ w.T).detach(), mb), rel=1e-9)
    g_ref = torch.autograd.grad(ref, (h, w))
    out = fused_gkd_loss(h, w, ids, ell, mb.loss_mask, **args)
    g = torch.autograd.grad(out.loss, (h, w))
    assert out.kd_count.item() == count.item() == int(mb.loss_mask.sum())
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-10)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)  # float64, same arithmetic up to order
    # the padding really is excluded: treating it as bins (id 0, p = 0) gives another loss in tail mode
    if mode == "tail":
        wrong, _ = gkd_loss(h @ w.T, ids, ell, mb.loss_mask, **{**args, "teacher_valid": None})
        assert abs(wrong.item() - ref.item()) > 1e-3


def test_heldout_kl_on_a_top_p_cache(tiny, topp_cache):
    from transformers import AutoModelForCausalLM

    from pipeline.evaluate import heldout_kl

    model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
    got = heldout_kl(model, topp_cache["cache"])
    total, tokens = _hand_heldout_kl(tiny["model"], topp_cache["rows"].values())
    assert got["heldout_tokens"] == tokens
    assert got["heldout_kl"] == pytest.approx(total / tokens, rel=1e-6)  # the student is the teacher: tiny KL


def _hand_heldout_kl(model_dir, rows) -> tuple[float, int]:
    """Σ over the rows' scored positions of KL(teacher || model) on the bins {kept ids} + {rest}, from the cache rows
    and a plain transformers forward in float64 (no loader, no loss module), and the number of positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = tokens = 0
    with torch.no_grad():
        for s in rows:
            z = model(torch.as_tensor(s.input_ids[None], dtype=torch.long)).logits[0].double()
            lsm = torch.log_softmax(z[s.first_scored - 1: len(s.input_ids) - 1], -1)
            for q in range(len(s.topk_counts)):
                c = int(s.topk_counts[q])
                p = np.append(np.exp(s.topk_logprobs[q, :c].astype(np.float64)), np.exp(float(s.tail_logprobs[q])))
                p = np.maximum(p / p.sum(), 1e-12)
                st = np.exp(lsm[q, s.topk_ids[q, :c]].numpy())
                st = np.append(st, 1.0 - st.sum())
                total += float((p * (np.log(p) - np.log(st))).sum())
                tokens += 1
    return total, tokens


def test_gkd_train_from_a_top_p_cache(tiny, topp_cache, tmp_path):
    """`gkd train` on the top-p cache: one step at lr 0 whose global batch is the whole cache (12 samples, one per
    row, none truncated) has, at β = 0, the KL per token over the kept entries + tail that the cache rows and a plain
    transformers forward of the student give; two steps at a real lr stay finite."""
    import json

    from pipeline.cli import main as cli

    save = tmp_path / "lr0"
    args = dict(student=str(tiny["student"]), cache=f"[{topp_cache['cache']}]", micro_batch_size=4,
                global_batch_size=12, seq_length=64, train_steps=1, lr=0.0, min_lr=0.0, warmup_steps=0, beta=0.0,
                sft_alpha=0.0, packing="false", save_interval=1, save_dir=str(save), progress=False)
    assert cli(["train", *[f"{k}={v}" for k, v in args.items()]]) == 0
    (m,) = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    total, tokens = _hand_heldout_kl(tiny["student"], topp_cache["rows"].values())
    assert m["active_tokens"] == tokens
    assert m["jsd"] == pytest.approx(total / tokens, rel=1e-4), (m["jsd"], total / tokens)
    assert total / tokens > 0.1  # a random student, far from the teacher: the comparison can fail
    metrics = train_tiny(tiny["student"], topp_cache["cache"], tmp_path / "run", steps=2)
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
