"""The fused output layer + GKD loss against the unfused reference (``loss.gkd_loss`` on ``h @ Wᵀ``), the stored
teacher tail against an fp64 hand computation, the memory bound, TP=2 vs TP=1, and a whole trainer step.

Run: ``python -m pytest tests/train/losses/test_fused_loss.py`` (the TP test launches torchrun with 2 gloo processes).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_fixtures import peak_tensor_bytes, run_tp2_worker

from pipeline.train.losses.fused import fused_gkd_loss
from pipeline.train.losses.reference import gkd_loss, vocab_parallel_ce

T, H, V, K = 13, 8, 29, 5
REPO = Path(__file__).resolve().parents[3]


def make_case(seed: int, t: int = T, h: int = H, v: int = V, k: int = K, dtype=torch.float64) -> dict:
    """Hidden states, an output weight, a teacher top-k of a real full distribution with its exact log tail mass,
    masked rows, SFT rows (a subset, as the trainer's dataset rows are), labels and some invalid teacher entries."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(torch.randn(t, v, generator=g, dtype=torch.float64) * 3, -1)
    ell, ids = teacher.topk(k, dim=-1)
    mask = torch.rand(t, generator=g) > 0.3
    return {
        "h": torch.randn(t, h, generator=g, dtype=dtype),
        "w": torch.randn(v, h, generator=g, dtype=dtype) * 0.7,
        "ids": ids, "ell": ell.to(dtype),
        "tail": torch.log(-torch.expm1(torch.logsumexp(ell, -1))).to(dtype),
        "mask": mask, "sft": mask & (torch.rand(t, generator=g) > 0.5),
        "labels": torch.randint(0, v, (t,), generator=g),
        "valid": torch.rand(t, k, generator=g) > 0.15,
    }


def unfused(c: dict, h, w, *, beta, tau, mode, kd_w=1.0, sft_w=0.0, valid=True, vocab_size=None, chunk=4):
    z = h @ w.t()
    kd, n = gkd_loss(z, c["ids"], c["ell"], c["mask"], beta=beta, temperature=tau, mode=mode, teacher_tail=c["tail"],
                     teacher_valid=c["valid"] if valid else None, chunk_size=chunk, vocab_size=vocab_size)
    ce, m = vocab_parallel_ce(z, c["labels"], c["sft"], chunk_size=chunk, vocab_size=vocab_size)
    return kd_w * kd + sft_w * ce, kd, n, ce, m


def fused(c: dict, h, w, *, beta, tau, mode, kd_w=1.0, sft_w=0.0, valid=True, vocab_size=None, chunk=4, sft=True):
    return fused_gkd_loss(h, w, c["ids"], c["ell"], c["mask"], beta=beta, temperature=tau, mode=mode,
                          teacher_tail=c["tail"], teacher_valid=c["valid"] if valid else None, labels=c["labels"],
                          sft_mask=c["sft"] if sft else None, kd_weight=kd_w, sft_weight=sft_w, chunk_size=chunk,
                          vocab_size=vocab_size)


def _grads(loss, *leaves):
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("mode", ["tail", "renorm"])
@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_equals_unfused_loss_and_gradients(beta, tau, mode):
    c = make_case(seed=int(beta * 10 + tau * 100))
    for sft_w, valid in ((0.0, True), (0.3, True), (0.3, False)):  # KD only (renorm: the gather path), + SFT
        h1, w1 = c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()
        ref, kd, n, ce, m = unfused(c, h1, w1, beta=beta, tau=tau, mode=mode, kd_w=0.7, sft_w=sft_w, valid=valid)
        h2, w2 = c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()
        out = fused(c, h2, w2, beta=beta, tau=tau, mode=mode, kd_w=0.7, sft_w=sft_w, valid=valid, sft=sft_w > 0)
        assert out.kd_count.item() == n.item() == int(c["mask"].sum())
        torch.testing.assert_close(out.kd_sum, kd, rtol=1e-12, atol=1e-12)  # fp64 throughout: rounding only
        torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
        if sft_w:
            torch.testing.assert_close(out.sft_sum, ce, rtol=1e-12, atol=1e-12)
            assert out.sft_count.item() == m.item()
        for mine, theirs in zip(_grads(out.loss, h2, w2), _grads(ref, h1, w1), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["tail", "renorm"])
def test_padded_vocab_rows_are_ignored(mode):
    """Megatron pads the vocab to a multiple of TP with extra output rows: they are not part of the student's
    distribution and get no gradient (their logits would be large here if they were)."""
    c = make_case(seed=7)
    w_pad = torch.cat([c["w"], torch.randn(3, H, dtype=torch.float64) * 30]).requires_grad_()
    h = c["h"].clone().requires_grad_()
    out = fused(c, h, w_pad, beta=0.5, tau=2.0, mode=mode, sft_w=0.5, vocab_size=V)
    h_ref, w_ref = c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()
    ref = unfused(c, h_ref, w_ref, beta=0.5, tau=2.0, mode=mode, sft_w=0.5)[0]
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
    gh, gw = _grads(out.loss, h, w_pad)
    gh_ref, gw_ref = _grads(ref, h_ref, w_ref)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw[:V], gw_ref, rtol=1e-10, atol=1e-12)
    assert torch.all(gw[V:] == 0)


def test_gradcheck():
    c = make_case(seed=3, t=5, h=3, v=9, k=3)
    for mode in ("tail", "renorm"):
        def f(h, w, mode=mode):
            return fused(c, h, w, beta=0.3, tau=1.5, mode=mode, kd_w=0.9, sft_w=0.4, chunk=2).loss

        assert torch.autograd.gradcheck(f, (c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()))


def test_frozen_weight_and_no_active_rows():
    c = make_case(seed=5)
    h = c["h"].clone().requires_grad_()
    out = fused(c, h, c["w"], beta=0.5, tau=1.0, mode="tail")  # a frozen output layer (LoRA): no weight grad
    (gh,) = _grads(out.loss, h)
    assert torch.isfinite(gh).all() and gh.abs().max() > 0
    empty = {**c, "mask": torch.zeros(T, dtype=torch.bool), "sft": torch.zeros(T, dtype=torch.bool)}
    h, w = c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()
    out = fused(empty, h, w, beta=0.5, tau=1.0, mode="tail")
    gh, gw = _grads(out.loss, h, w)
    assert out.loss.item() == 0 and out.kd_count.item() == 0 and not gh.any() and not gw.any()


def test_float32_and_bfloat16_close_to_float64():
    """Mixed precision: a bf16 matmul, then float32 logsumexps and divergences within each chunk."""
    c = make_case(seed=11, h=64, v=200)
    ref = fused(c, c["h"], c["w"], beta=0.5, tau=2.0, mode="tail").loss
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h = c["h"].to(torch.float32).requires_grad_()  # Float16Module hands the loss float32 hidden states
        w = c["w"].to(dtype).requires_grad_()
        cc = {**c, "ell": c["ell"].float(), "tail": c["tail"].float()}
        out = fused(cc, h, w, beta=0.5, tau=2.0, mode="tail")
        gh, gw = _grads(out.loss, h, w)
        assert out.loss.dtype == torch.float32 and gw.dtype == dtype and gh.dtype == torch.float32
        assert abs(out.loss.item() - ref.item()) <= tol * abs(ref.item())


# ---------------------------------------------------------------- the stored tail


def test_stored_tail_is_used_where_quantised_topk_sums_past_one():
    """The score stage stores log(1 − Σ p) from the unquantised top-k; after quantisation Σ exp(ℓ̂) can exceed 1,
    so recomputing the tail gives ≤ 0 (floored to 1e-12). The loss must use the stored value: checked against an
    fp64 hand computation of the k+1-bin KL at τ = 1, β = 0."""
    p = torch.tensor([[0.6, 0.3, 0.095], [0.5, 0.25, 0.2]], dtype=torch.float64)  # tails 0.005 and 0.05
    tail = torch.log1p(-p.sum(-1))
    ell = torch.log(p) + 0.01  # quantisation error pushes Σ exp(ℓ̂) past 1 (1.0045 and 0.9545)
    assert (ell.exp().sum(-1)[0] > 1).item()
    ids = torch.tensor([[0, 1, 2], [3, 1, 0]])
    h = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, dtype=torch.bool)
    out = fused_gkd_loss(h, w, ids, ell, mask, beta=0.0, teacher_tail=tail)
    s = torch.softmax(h @ w.t(), -1)
    hand = 0.0
    for r in range(2):
        t_bins = torch.cat([ell[r].exp(), tail[r].exp().reshape(1)])
        t_bins = t_bins / t_bins.sum()  # the quantised bins renormalised: what the loss defines as the teacher
        s_k = s[r, ids[r]]
        s_bins = torch.cat([s_k, (1 - s_k.sum()).reshape(1)])
        hand += float((t_bins * (t_bins / s_bins).log()).sum())
    assert abs(out.kd_sum.item() - hand) < 1e-12
    recomputed = fused_gkd_loss(h, w, ids, ell, mask, beta=0.0)  # without the stored tail: a different teacher
    assert abs(recomputed.kd_sum.item() - hand) > 1e-3


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("mode", ["tail", "renorm"])
def test_peak_memory_does_not_grow_with_tokens_times_vocab(mode):
    """Peak tensor bytes over forward+backward: the gradients of hidden and weight plus one [chunk, V] buffer, never a
    [T, V] tensor (which would be 512 MiB here: the unfused path holds two or more)."""
    t, hdim, v, k, chunk = 4096, 64, 32768, 16, 512  # 64 MiB buffers: above glibc's mmap threshold, so RSS sees them
    g = torch.Generator().manual_seed(0)
    h = torch.randn(t, hdim, generator=g).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * 0.1).requires_grad_()
    ids = torch.randint(0, v // k, (t, k), generator=g) + torch.arange(k) * (v // k)  # distinct per row
    ell = torch.log_softmax(torch.randn(t, k, generator=g), -1) - 0.1
    tail = torch.full((t,), math.log(1 - math.exp(-0.1)))
    mask = torch.ones(t, dtype=torch.bool)
    mask[::3] = False
    args = dict(beta=0.5, temperature=2.0, mode=mode, teacher_tail=tail, chunk_size=chunk)
    fused_gkd_loss(h[:8], w, ids[:8], ell[:8], mask[:8], **{**args, "teacher_tail": tail[:8]}).loss.backward()
    h.grad = w.grad = None
    growth = peak_tensor_bytes(lambda: fused_gkd_loss(h, w, ids, ell, mask, **args).loss.backward())
    tv, chunk_bytes = t * v * 4, chunk * v * 4
    params = 2 * (v * hdim + t * hdim) * 4  # dW (stored, then handed to autograd) and dh
    # One [chunk, V] buffer at a time (tensor bytes, tests/train/train_fixtures.peak_tensor_bytes: tail mode 76 MiB,
    # the gradients and one chunk; renorm 15 MiB, no dense chunk); the bound fails at three chunks (210 MiB), what the
    # loop held when ex was a copy of z and a chunk's buffers outlived the next chunk's matmul.
    assert growth < params + 2 * chunk_bytes + 8 * 2**20, (growth / 2**20, tv / 2**20)
    assert growth < tv / 2


# ---------------------------------------------------------------- tensor parallel


@pytest.mark.distributed
def test_tp2_matches_tp1():
    run_tp2_worker("_fused_tp_worker.py")


def test_scaled_grads_one_rule_for_every_fused_loss():
    """fused.scaled_grads, the backward of the fused, cross-tokenizer and exact losses: a scale of 1 multiplies
    nothing; another scale (Megatron's 1 / micro-batches) is cast to each gradient's own dtype, so ∂weight, kept in
    float32, is scaled by the float32 number, not by its bf16 rounding; ∂weight then takes the weight's dtype."""
    from types import SimpleNamespace

    from pipeline.train.losses.fused import keep_grads, scaled_grads

    gen = torch.Generator().manual_seed(0)
    grad_h = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
    grad_w = torch.randn(11, 8, generator=gen)  # float32, as the losses accumulate it
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved_tensors", t))
    keep_grads(ctx, grad_h, grad_w, torch.bfloat16)
    h, w = scaled_grads(ctx, torch.tensor(1.0))
    assert h is grad_h and torch.equal(w, grad_w.to(torch.bfloat16))
    third = torch.tensor(1 / 3)
    h, w = scaled_grads(ctx, third)
    assert torch.equal(h, grad_h * third.to(torch.bfloat16))
    assert torch.equal(w, (grad_w * third).to(torch.bfloat16))
    rounded = (grad_w * third.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert not torch.equal(w, rounded)  # the rule is visible: the bf16-rounded scale gives other weight gradients
    keep_grads(ctx, None, grad_w, torch.float32)  # a frozen input (LoRA's base weight is the other way round)
    assert scaled_grads(ctx, third)[0] is None
