"""The exact-teacher fused loss (pipeline/train/losses/exact.py) against the same divergences computed from full
fp64 logits written out here (values and gradients), student == teacher, and its refusals."""

import math

import pytest
import torch

from pipeline.train.losses.exact import exact_gkd_loss
from pipeline.train.losses.reference import OpdCorrection

T, H, HT, V = 37, 16, 24, 50


def _inputs(seed=0, pad=3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T // 2 + 1, H, generator=g, dtype=torch.float64)
    w = torch.randn(V + pad, H, generator=g, dtype=torch.float64) * 0.7  # a padded (Megatron) student vocabulary
    th = torch.randn(2, T // 2 + 1, HT, generator=g, dtype=torch.float64)
    tw = torch.randn(V, HT, generator=g, dtype=torch.float64) * 0.9
    mask = torch.rand(h.shape[:2], generator=g) < 0.7
    labels = torch.randint(0, V, h.shape[:2], generator=g)
    sft = mask & (torch.rand(h.shape[:2], generator=g) < 0.5)
    return h, w, th, tw, mask, labels, sft


def _reference(h, w, th, tw, mask, labels, sft, beta, tau, kd_weight, sft_weight):
    """Full logits [tokens, V] in fp64, each divergence written out."""
    z = (h @ w.t())[..., :V]
    t = th @ tw.t()
    log_s, log_p = torch.log_softmax(z / tau, -1), torch.log_softmax(t / tau, -1)
    s, p = log_s.exp(), log_p.exp()
    if beta == 0.0:
        d = (p * (log_p - log_s)).sum(-1)
    elif beta == 1.0:
        d = (s * (log_s - log_p)).sum(-1)
    else:
        m = beta * p + (1 - beta) * s
        d = beta * (p * (log_p - m.log())).sum(-1) + (1 - beta) * (s * (log_s - m.log())).sum(-1)
    ce = -torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    kd_sum, sft_sum = d[mask].sum(), ce[sft].sum()
    return kd_weight * kd_sum + sft_weight * sft_sum, kd_sum, sft_sum


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tau", [1.0, 0.7, 2.0])
def test_exact_divergences_equal_full_logits_in_fp64(beta, tau):
    h, w, th, tw, mask, labels, sft = _inputs()
    kw = dict(kd_weight=0.3, sft_weight=0.2)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = exact_gkd_loss(h1, w1, th, tw, mask, beta=beta, temperature=tau, labels=labels, sft_mask=sft,
                         vocab_size=V, chunk_size=5, **kw)
    out.loss.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref, kd_sum, sft_sum = _reference(h2, w2, th, tw, mask, labels, sft, beta, tau, **kw)
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.kd_sum, kd_sum.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.sft_sum, sft_sum.detach(), rtol=1e-12, atol=1e-12)
    assert int(out.kd_count) == int(mask.sum()) and int(out.sft_count) == int(sft.sum())
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)
    assert torch.all(w1.grad[V:] == 0)  # padding columns are no token


def test_bf16_teacher_states_and_float32_student_match_fp64():
    """The trainer's dtypes: cached bf16 teacher states, float32 student; the reference gets the same bf16 values."""
    h, w, th, tw, mask, labels, sft = _inputs(1)
    th16 = th.to(torch.bfloat16)
    out = exact_gkd_loss(h.float(), w.float(), th16, tw.float(), mask, beta=1.0, temperature=1.3, vocab_size=V)
    ref, _, _ = _reference(h, w, th16.double(), tw.float().double(), mask, labels, sft, 1.0, 1.3, 1.0, 0.0)
    assert abs(out.loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_student_equal_to_teacher_gives_zero_loss(beta):
    h, w, th, tw, mask, labels, sft = _inputs(2, pad=0)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = exact_gkd_loss(h1, w1, h, w, mask, beta=beta, temperature=0.8, vocab_size=V, chunk_size=7)
    out.loss.backward()
    assert abs(out.loss.item()) < 1e-12 * int(mask.sum())
    assert h1.grad.abs().max() < 1e-12 and w1.grad.abs().max() < 1e-12


@pytest.mark.parametrize("beta", [0.5, 1.0])  # the autograd chunk and the closed form
def test_opd_uses_the_exact_teachers_logprob_of_the_label(beta):
    h, w, th, tw, mask, labels, sft = _inputs(3)
    opd = mask & ~sft
    kd = mask & sft
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = exact_gkd_loss(h1, w1, th, tw, kd, beta=beta, temperature=1.5, labels=labels, opd_mask=opd, opd_weight=0.7,
                         kd_weight=0.0, vocab_size=V, chunk_size=6)
    out.loss.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ls = torch.log_softmax((h2 @ w2.t())[..., :V], -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    lp = torch.log_softmax(th @ tw.t(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (0.7 * ((ls.detach() - lp) * ls)[opd].sum()).backward()  # the sampled-token estimator, at τ = 1
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)
    log_s = torch.log_softmax((h @ w.t())[..., :V], -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    log_p = torch.log_softmax(th @ tw.t(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    adv = (log_s - log_p.clamp_min(math.log(1e-12)))[opd]
    torch.testing.assert_close(out.opd_kl_sum, adv.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.opd_sum, (adv * log_s[opd]).sum(), rtol=1e-12, atol=1e-12)


def test_opd_importance_weights_scale_each_positions_term():
    """Stale samples (OpdCorrection): each OPD term weighted by min(s(y)/b(y), cap), 1 where b is unrecorded —
    the same estimator written out on full fp64 logits."""
    h, w, th, tw, mask, labels, sft = _inputs(5)
    opd = mask & ~sft
    g = torch.Generator().manual_seed(6)
    behavior = -torch.rand(labels.shape, dtype=torch.float64, generator=g) * 8
    behavior[torch.rand(labels.shape, generator=g) < 0.2] = math.nan
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = exact_gkd_loss(h1, w1, th, tw, mask & sft, beta=1.0, labels=labels, opd_mask=opd, opd_weight=0.7,
                         kd_weight=0.0, vocab_size=V, chunk_size=6, opd_correction=OpdCorrection(behavior, 1.5))
    out.loss.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ls = torch.log_softmax((h2 @ w2.t())[..., :V], -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    lp = torch.log_softmax(th @ tw.t(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    weight = torch.where(behavior.isnan(), 1.0, (ls.detach() - behavior).exp().clamp_max(1.5))
    assert bool(((weight < 1.5) & (weight != 1.0))[opd].any()) and bool((weight == 1.5)[opd].any())  # both sides
    (0.7 * (weight * (ls.detach() - lp) * ls)[opd].sum()).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_refusals():
    h, w, th, tw, mask, labels, sft = _inputs(4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        exact_gkd_loss(h, w, th, tw, mask, beta=0.5, temperature=0.0, vocab_size=V)
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(50 output rows\) differs from the student's \(53\)"):
        exact_gkd_loss(h, w, th, tw, mask, beta=0.5)


@pytest.mark.distributed
def test_tp2_matches_tp1():
    """Tensor parallelism (2 gloo processes under torchrun): tests/train/_exact_tp_worker.py."""
    from train_fixtures import run_tp2_worker

    run_tp2_worker("_exact_tp_worker.py")
