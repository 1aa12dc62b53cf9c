"""ULD and GOLD over aligned spans (pipeline/train/losses/xtok.py) against TRL 1.16's own implementation
(`trl.experimental.gold.gold_trainer.ULDLoss`, installed here with `pip install --no-deps` into a temporary folder, a
reference only), on two real tokenizers that differ (the embedded SmolLM2 tokenizer and a BPE trained in the test)
and full distributions; then the top-k cache's version against the full one within the bound the module states; and
the fused pass (no [tokens, vocab] logits) against the plain autograd definition, loss and both gradients."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_fixtures import run_tp2_worker

from pipeline.store import align
from pipeline.train.losses.xtok import EPS, fused_xtok_loss, gold_weights, span_divergence, xtok_loss_reference

REPO = Path(__file__).resolve().parents[3]
PROMPT = "<|im_start|>user\nWhat is 3 × 4?<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "The answer is twelve: 3 × 4 = 12. Knowledge distillation trains a small model, naïvely.<|im_end|>"


@pytest.fixture(scope="module")
def trl_uld(tmp_path_factory):
    target = tmp_path_factory.mktemp("trl")
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "trl==1.16.*", "--target",
                        str(target)], check=True, capture_output=True, timeout=1800)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        out = getattr(e, "stderr", b"") or b""
        pytest.skip(f"PyPI unreachable, TRL 1.16 cannot be installed as the reference: {out.decode()[-300:]}")
    sys.path.insert(0, str(target))
    try:
        from trl.experimental.gold.gold_trainer import ULDLoss
    finally:
        sys.path.remove(str(target))
    return ULDLoss


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Both tokenizers, the answer's tokens in each, its spans, the vocabulary map and random distributions."""
    from tiny_models import build_tokenizer, smollm2_tokenizer

    root = tmp_path_factory.mktemp("tok")
    teacher, student = smollm2_tokenizer(root / "t"), build_tokenizer(root / "s")
    p_ids = student(PROMPT, add_special_tokens=False).input_ids
    c_ids = student(ANSWER, add_special_tokens=False).input_ids
    got = align.retokenize(student, teacher, p_ids, c_ids)
    assert not isinstance(got, str), got
    tc = got.teacher_ids[got.teacher_first:]
    vt, vs = len(teacher), len(student)
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        student=student, teacher=teacher, sc=np.asarray(c_ids), tc=tc, spans=(got.span_student, got.span_teacher),
        s_ends=got.student_ends[len(p_ids):] - len(PROMPT), t_ends=got.teacher_ends[got.teacher_first:] - len(PROMPT),
        vmap=align.vocab_map(student, teacher, vt), vs=vs, vt=vt,
        # row i: the distribution of completion token i (sharp enough that top-k cuts matter)
        zs=torch.randn(len(c_ids), vs, generator=g, dtype=torch.float64) * 3,
        zt=torch.randn(len(tc), vt, generator=g, dtype=torch.float64) * 3)


def byte_ends(tokenizer, ids) -> np.ndarray:
    """UTF-8 byte end of each token of a byte-level BPE (what TRL's collator gives ULDLoss): its token string mapped
    back through GPT-2's byte alphabet; added tokens (<|im_end|>) are their own text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    sizes = [len(t.encode()) if t in added else len(bytes(back[c] for c in t))
             for t in tokenizer.convert_ids_to_tokens(list(map(int, ids)))]
    return np.cumsum(sizes)


def _trl(ULDLoss, p, *, hybrid: bool, beta: float = 0.5):
    cfg = SimpleNamespace(uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
                          uld_teacher_temperature=1.0, uld_skip_student_eos=False, uld_skip_teacher_eos=False,
                          use_extended_uld=True, uld_token_merge_strategy="observed", uld_use_hybrid_loss=hybrid,
                          uld_hybrid_matched_weight=None, uld_hybrid_unmatched_weight=None, beta=beta)
    loss = ULDLoss(cfg, student_tokenizer=p.student, teacher_tokenizer=p.teacher)
    ns, nt = len(p.sc), len(p.tc)
    # TRL aligns on byte offsets, we on character ends where no token splits a character: the same spans unless
    # both tokenizers split one character at the same byte (not so here: checked below)
    s_b, t_b = byte_ends(p.student, p.sc), byte_ends(p.teacher, p.tc)
    s_off = torch.tensor(np.stack([np.r_[0, s_b[:-1]], s_b], -1)).unsqueeze(0)
    t_off = torch.tensor(np.stack([np.r_[0, t_b[:-1]], t_b], -1)).unsqueeze(0)
    groups = ULDLoss._align_by_byte_offsets(s_off[0].tolist(), t_off[0].tolist())
    assert [g[0] for g in groups[0]] == p.spans[0][:-1].tolist()
    assert [g[0] for g in groups[1]] == p.spans[1][:-1].tolist()
    # "observed": the logits row at an answer position is merged with that position's token, so row i is the
    # distribution of token i, as in our layout
    return loss(p.zs.unsqueeze(0), p.zt.unsqueeze(0), torch.tensor(p.sc).unsqueeze(0), torch.tensor(p.tc).unsqueeze(0),
                torch.tensor(p.sc).unsqueeze(0), torch.tensor(p.tc).unsqueeze(0), s_off, t_off).item(), (ns, nt)


def _ours(p, *, kind: str, k: int | None = None, beta: float = 0.5, fused: bool = False):
    """Our loss on the same rows, laid out as the loader does (heads carry the merged teacher row, members point at
    their head); teacher rows cut to the top-k (tail = the exact mass outside) when k is given."""
    ss, st = p.spans
    n = len(p.sc)
    heads = ss[:-1]
    span_head = torch.full((n,), -1, dtype=torch.long)
    for a, b in zip(ss[:-1], ss[1:], strict=True):
        span_head[a + 1:b] = int(a)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.as_tensor(heads)] = True
    lt = torch.log_softmax(p.zt, -1)
    kk = p.vt if k is None else k
    ids = torch.zeros(n, kk, dtype=torch.long)
    lps = torch.zeros(n, kk, dtype=torch.float64)
    tail = torch.full((n,), -math.inf, dtype=torch.float64)
    for g, (a, b) in enumerate(zip(st[:-1], st[1:], strict=True)):
        later = lt[torch.arange(a + 1, b), torch.as_tensor(p.tc[a + 1:b])].clamp_min(math.log(EPS)).sum()
        top = torch.sort(lt[a], descending=True)
        ids[heads[g]], lps[heads[g]] = top.indices[:kk], top.values[:kk] + later
        if k is not None:
            tail[heads[g]] = torch.log1p(-top.values[:kk].exp().sum()) + later
    sid = torch.as_tensor(p.vmap)[ids] if kind == "gold" else torch.full_like(ids, -1)
    matched = torch.zeros(p.vs, dtype=torch.bool)
    matched[torch.as_tensor(p.vmap[p.vmap >= 0])] = True
    weights = gold_weights(int((p.vmap >= 0).sum()), p.vt)
    labels = torch.as_tensor(p.sc)
    valid = torch.ones(n, kk, dtype=torch.bool)
    kw = dict(kind=kind, matched=matched, weights=weights, beta=beta)
    if fused:
        h = p.zs.clone().requires_grad_()  # logits = h · Iᵀ: the fused pass sees the same numbers
        w = torch.eye(p.vs, dtype=torch.float64).requires_grad_()
        out = fused_xtok_loss(h, w, labels, mask, span_head, sid, lps, valid, tail, chunk_size=5,
                              kd_weight=1 / len(heads), **kw)
        out.loss.backward()
        return out.kd_sum.item() / len(heads), h.grad, w.grad
    z = p.zs.clone().requires_grad_()
    total, count = xtok_loss_reference(z, labels, mask, span_head, sid, lps, valid, tail, **kw)
    (total / count).backward()
    return (total / count).item(), z.grad, ids, lps, tail


def test_uld_and_gold_equal_trl_on_full_distributions(trl_uld, pair):
    assert 1 < len(pair.spans[0]) - 1 < len(pair.sc)  # some spans merge several student tokens
    assert (np.diff(pair.spans[1]) > 1).any()  # and some several teacher tokens
    for kind, hybrid in (("uld", False), ("gold", True)):
        theirs, _ = _trl(trl_uld, pair, hybrid=hybrid)
        ours = _ours(pair, kind=kind)[0]
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12), kind
    for beta in (0.0, 0.9, 1.0):  # the generalized JSD's other ends (GOLD's matched part)
        assert _ours(pair, kind="gold", beta=beta)[0] == pytest.approx(_trl(trl_uld, pair, hybrid=True, beta=beta)[0],
                                                                     rel=1e-9, abs=1e-12)


def test_topk_cache_loss_is_within_the_stated_bound_of_the_full_one(trl_uld, pair):
    k = 8
    full_uld, _ = _trl(trl_uld, pair, hybrid=False)
    full_gold, _ = _trl(trl_uld, pair, hybrid=True)
    uld, _, ids, lps, tail = _ours(pair, kind="uld", k=k)
    gold = _ours(pair, kind="gold", k=k)[0]
    assert abs(uld - full_uld) > 1e-6  # the cut is visible, so the bound is what is tested
    # the student's merged vectors at the heads, for A and the matched mass outside the top-k
    ss, st = pair.spans
    heads = ss[:-1]
    logc = torch.zeros(len(pair.sc), dtype=torch.float64)
    lp = torch.log_softmax(pair.zs, -1)[torch.arange(len(pair.sc)), torch.as_tensor(pair.sc)].clamp_min(math.log(EPS))
    for a, b in zip(ss[:-1], ss[1:], strict=True):
        logc[a] = lp[a + 1:b].sum()
    s = torch.softmax(pair.zs[heads], -1) * logc[heads].exp().unsqueeze(-1)
    tau = tail[heads].exp()
    a_mass = torch.sort(s, -1, descending=True).values[:, k:].sum(-1)
    bound_uld = (2 * torch.minimum(a_mass, tau)).sum().item() / len(heads)
    assert uld - 1e-12 <= full_uld <= uld + bound_uld + 1e-12
    beta, c = 0.5, math.log(2.0)
    w_m, w_u = gold_weights(int((pair.vmap >= 0).sum()), pair.vt)
    matched = torch.zeros(pair.vs, dtype=torch.bool)
    matched[torch.as_tensor(pair.vmap[pair.vmap >= 0])] = True
    in_top = torch.zeros_like(s, dtype=torch.bool)
    sid = torch.as_tensor(pair.vmap)[ids[heads]]
    in_top.scatter_(1, sid.clamp_min(0), sid >= 0)
    out = matched.unsqueeze(0) & ~in_top
    n_out = out.sum(-1)
    bound_m = c * ((1 - beta) * (torch.where(out, s, 0.0).sum(-1) + n_out * EPS) + beta * (tau + n_out * EPS))
    bound_gold = (w_m * bound_m + w_u * 2 * tau).sum().item() / len(heads)
    assert abs(gold - full_gold) <= bound_gold
    assert abs(gold - full_gold) > 1e-6


@pytest.mark.parametrize("kind", ["uld", "gold"])
def test_fused_pass_equals_the_plain_definition(pair, kind):
    ref, g_ref, *_ = _ours(pair, kind=kind, k=8)
    fused, g_h, g_w = _ours(pair, kind=kind, k=8, fused=True)
    assert fused == pytest.approx(ref, rel=1e-10)
    # logits = h·Iᵀ, so ∂h is ∂logits; ∂W = ∂logitsᵀ·h
    torch.testing.assert_close(g_h, g_ref, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(g_w, g_ref.t() @ pair.zs, rtol=1e-8, atol=1e-10)


def test_span_divergence_is_zero_for_identical_vectors():
    # a student whose merged vector is the teacher's (same vocabulary, all matched): ULD and GOLD vanish
    z = torch.randn(3, 16, dtype=torch.float64)
    lp = torch.log_softmax(z, -1)
    top = torch.sort(lp, -1, descending=True)
    valid = torch.ones(3, 16, dtype=torch.bool)
    tail = torch.full((3,), -math.inf, dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    for kind in ("uld", "gold"):
        d = span_divergence(z, zero, top.values, top.indices, valid, tail, kind=kind,
                            matched=torch.ones(16, dtype=torch.bool), weights=(0.5, 0.5))
        assert d.abs().max().item() < 1e-12, kind
    shifted = span_divergence(z.roll(1, -1), zero, top.values, top.indices, valid, tail, kind="gold",
                              matched=torch.ones(16, dtype=torch.bool), weights=(0.5, 0.5))
    assert shifted.min().item() > 1e-3


@pytest.mark.parametrize("vocab", [8, 50])
def test_sorted_l1_by_top_k_equals_the_full_sort(vocab):
    """The sorted L1 compares the student's top-k only (the rest as the row sum less them); against the definition
    written with a full descending sort of both sides, zero-padded to a common width, on rows with ties (zeroed
    entries, as GOLD's unmatched part has) and a student vocabulary smaller and larger than k = 16."""
    from pipeline.train.losses.xtok import _sorted_l1

    g = torch.Generator().manual_seed(vocab)
    n, k = 6, 16
    s = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1) * torch.rand(n, 1, generator=g)
    s = torch.where(torch.rand(n, vocab, generator=g) < 0.3, 0.0, s).double()
    t = torch.softmax(torch.randn(n, k, generator=g) * 2, -1).double() * 0.9
    on = torch.rand(n, k, generator=g) < 0.7
    tail = torch.rand(n, generator=g).double() * 0.1
    want = []
    for i in range(n):
        width = max(vocab, k)
        ss = torch.nn.functional.pad(torch.sort(s[i], descending=True).values, (0, width - vocab))
        tt = torch.sort(t[i][on[i]], descending=True).values
        q = len(tt)
        want.append((ss[:q] - tt).abs().sum() + (ss[q:].sum() - tail[i]).abs())
    torch.testing.assert_close(_sorted_l1(s, t, on, tail), torch.stack(want), rtol=0, atol=1e-12)


@pytest.mark.distributed
def test_tp2_matches_tp1():
    """ULD and GOLD (β 0 and 0.5, with and without SFT) on a vocab-split output weight (TP=2, torchrun, gloo) equal
    TP=1 and the plain definition: loss, ∂h, each rank's rows of ∂W (tests/train/_xtok_tp_worker.py)."""
    run_tp2_worker("_xtok_tp_worker.py")
