"""GKD loss against an independent full-softmax reference, its gradients, TP=2 vs TP=1, and invariants.

Run: ``python -m pytest tests/train/losses/test_loss.py`` (the TP test launches torchrun with 2 gloo processes).
"""

from __future__ import annotations

import math

import pytest
import torch
from train_fixtures import peak_tensor_bytes, run_tp2_worker

from pipeline.train.losses.reference import gkd_loss, vocab_parallel_ce

T, V, K = 7, 23, 5
MASK = torch.tensor([True, True, False, True, True, False, True])


def _case(seed: int, t: int = T, v: int = V, k: int = K, mask: torch.Tensor = MASK):
    """Student logits, and a teacher top-k taken from a real full distribution (so its tail is the true rest)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, v, generator=g, dtype=torch.float64) * 2
    teacher_full = torch.log_softmax(torch.randn(t, v, generator=g, dtype=torch.float64) * 3, dim=-1)
    ell, ids = teacher_full.topk(k, dim=-1)
    # Inactive positions carry garbage the loss must never read.
    ids = torch.where(mask.unsqueeze(-1), ids, -100)
    ell = torch.where(mask.unsqueeze(-1), ell, math.nan)
    return z, ids, ell


def _reference(z, ids, ell, mask, beta, tau, mode):
    """Straight from the formulas, one position at a time, full softmax over the vocab."""
    total = z.new_zeros(())
    for t in range(z.shape[0]):
        if not mask[t]:
            continue
        s_full = torch.softmax(z[t] / tau, dim=-1)
        s_k = s_full[ids[t]]
        if mode == "renorm":
            p = torch.exp(ell[t] / tau)
            p = p / p.sum()
            s = s_k / s_k.sum()
        else:
            p_k = torch.exp(ell[t])
            p_bins = torch.cat([p_k, (1 - p_k.sum()).reshape(1)]) ** (1 / tau)
            p = p_bins / p_bins.sum()
            outside = torch.ones(z.shape[1], dtype=torch.bool)
            outside[ids[t]] = False
            s = torch.cat([s_k, s_full[outside].sum().reshape(1)])
        if beta == 0:
            d = (p * (p / s).log()).sum()
        elif beta == 1:
            d = (s * (s / p).log()).sum()
        else:
            m = beta * p + (1 - beta) * s
            d = beta * (p * (p / m).log()).sum() + (1 - beta) * (s * (s / m).log()).sum()
        total = total + d
    return total


@pytest.mark.parametrize("mode", ["tail", "renorm"])
@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_grad_match_reference(beta, tau, mode):
    z, ids, ell = _case(seed=int(beta * 10 + tau * 100))
    z_ours = z.clone().requires_grad_()
    z_ref = z.clone().requires_grad_()
    loss, count = gkd_loss(z_ours, ids, ell, MASK, beta=beta, temperature=tau, mode=mode, chunk_size=2)
    ref = _reference(z_ref, ids, ell, MASK, beta, tau, mode)
    assert count.item() == int(MASK.sum())
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(z_ours.grad, z_ref.grad, rtol=1e-9, atol=1e-12)
    assert torch.all(z_ours.grad[~MASK] == 0)


@pytest.mark.parametrize("mode", ["tail", "renorm"])
@pytest.mark.parametrize("mask", [MASK[:4], torch.ones(4, dtype=torch.bool)], ids=["masked", "all-active"])
def test_gradcheck(mode, mask):
    z, ids, ell = _case(seed=3, t=4, v=9, k=3, mask=mask)
    z.requires_grad_()

    def f(x):
        return gkd_loss(x, ids, ell, mask, beta=0.3, temperature=1.5, mode=mode, chunk_size=3)[0]

    assert torch.autograd.gradcheck(f, (z,))


def test_ce_matches_torch():
    z, _, _ = _case(seed=5)
    labels = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(0))
    labels[~MASK] = -100
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    ce, count = vocab_parallel_ce(z1, labels, MASK, chunk_size=3)
    ref = torch.nn.functional.cross_entropy(z2, labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(ce, ref, rtol=1e-12, atol=1e-12)
    assert count.item() == int(MASK.sum())
    ce.backward()
    ref.backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-12)
    small = z[:4, :6].clone().requires_grad_()
    small_labels = torch.tensor([5, 0, -100, 3])
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_ce(x, small_labels, MASK[:4], chunk_size=2)[0], (small,))


def test_float32_and_bfloat16_logits_close_to_float64():
    z, ids, ell = _case(seed=11)
    ref = gkd_loss(z, ids, ell, MASK, beta=0.5, temperature=2.0, mode="tail")[0]
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        x = z.to(dtype).requires_grad_()
        loss = gkd_loss(x, ids, ell.float(), MASK, beta=0.5, temperature=2.0, mode="tail")[0]
        loss.backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == dtype
        assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())


@pytest.mark.parametrize("seed", range(5))
def test_tail_loss_is_nonnegative(seed):
    z, ids, ell = _case(seed=100 + seed)
    z = z * (1 + 3 * seed)  # from flat to very peaked students
    for beta in (0.0, 0.25, 0.5, 1.0):
        for tau in (0.5, 1.0, 2.0):
            loss, _ = gkd_loss(z, ids, ell, MASK, beta=beta, temperature=tau, mode="tail")
            assert loss.item() >= -1e-12


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_zero_when_student_equals_teacher_over_bins(beta):
    _, ids, ell = _case(seed=21)
    # Student: the teacher's top-k probabilities at the ids, the teacher's tail spread over the rest of the vocab.
    p_tail = 1 - ell.nan_to_num(-math.inf).exp().sum(-1, keepdim=True)
    z = (p_tail / (V - K)).log().expand(T, V).clone()
    z[MASK] = z[MASK].scatter(1, ids[MASK], ell[MASK])
    loss, _ = gkd_loss(z, ids, ell, MASK, beta=beta, temperature=1.0, mode="tail")
    assert abs(loss.item()) < 1e-12
    # renorm only sees the ids: any shift of them and any logits elsewhere still give zero, at any temperature.
    z2 = torch.randn(T, V, dtype=torch.float64)
    z2[MASK] = z2[MASK].scatter(1, ids[MASK], ell[MASK] + 3.0)
    loss, _ = gkd_loss(z2, ids, ell, MASK, beta=beta, temperature=2.0, mode="renorm")
    assert abs(loss.item()) < 1e-12


def test_inf_logprobs_and_empty_tails_stay_finite():
    z, ids, ell = _case(seed=31)
    ell = ell.clone()
    ell[0, -2:] = -math.inf  # vLLM can return -inf inside the top-k
    ell[1] = math.log(0.21)  # quantised logprobs summing past 1: teacher tail <= 0
    ell[3] = torch.log(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64))  # one-hot teacher
    full_ids = torch.arange(V).expand(T, V)  # k = V: the student's complement is empty too
    full_ell = torch.log_softmax(torch.randn(T, V, dtype=torch.float64), -1)
    for mode in ("tail", "renorm"):
        for beta in (0.0, 0.5, 1.0):
            for case_ids, case_ell in ((ids, ell), (full_ids, full_ell)):
                x = z.clone().requires_grad_()
                loss, _ = gkd_loss(x, case_ids, case_ell, MASK, beta=beta, temperature=2.0, mode=mode)
                loss.backward()
                assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), (mode, beta)


@pytest.mark.parametrize("mode", ["tail", "renorm"])
def test_vocab_padding_columns_are_ignored(mode):
    z, ids, ell = _case(seed=51)
    labels = ids[:, 0].clamp_min(0)
    padded = torch.cat([z, torch.randn(T, 3, dtype=torch.float64) * 50], dim=-1).requires_grad_()
    plain = z.clone().requires_grad_()
    for fn in (
        lambda x, **kw: gkd_loss(x, ids, ell, MASK, beta=0.5, temperature=2.0, mode=mode, chunk_size=3, **kw)[0],
        lambda x, **kw: vocab_parallel_ce(x, labels, MASK, chunk_size=3, **kw)[0],
    ):
        padded.grad = plain.grad = None
        loss, ref = fn(padded, vocab_size=V), fn(plain)
        (loss + ref).backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(padded.grad[:, :V], plain.grad, rtol=1e-10, atol=1e-12)
        assert torch.all(padded.grad[:, V:] == 0)


def test_no_active_positions():
    z, ids, ell = _case(seed=41)
    x = z.clone().requires_grad_()
    loss, count = gkd_loss(x, ids, ell, torch.zeros(T, dtype=torch.bool), beta=0.5)
    loss.backward()
    assert loss.item() == 0 and count.item() == 0 and torch.all(x.grad == 0)


def test_bad_arguments():
    z, ids, ell = _case(seed=0)
    with pytest.raises(ValueError, match="beta"):
        gkd_loss(z, ids, ell, MASK, beta=1.5)
    with pytest.raises(ValueError, match="mode"):
        gkd_loss(z, ids, ell, MASK, beta=0.5, mode="full")


@pytest.mark.parametrize("mode", ["tail", "renorm"])
def test_peak_memory_is_logits_grad_plus_one_chunk(mode):
    t, v, k, chunk = 1024, 32768, 16, 128
    z = torch.randn(t, v).requires_grad_()
    ids = torch.randint(0, v // k, (t, k)) + torch.arange(k) * (v // k)  # distinct per row
    ell = torch.log_softmax(torch.randn(t, k), -1) - 0.1
    mask = torch.ones(t, dtype=torch.bool)
    mask[::3] = False  # the masked path copies rows, so check it rather than the in-place one
    gkd_loss(z[:8], ids[:8], ell[:8], mask[:8], beta=0.5, mode=mode)[0].backward()  # warm up allocator/threads
    z.grad = None
    growth = peak_tensor_bytes(
        lambda: gkd_loss(z, ids, ell, mask, beta=0.5, temperature=2.0, mode=mode, chunk_size=chunk)[0].backward())
    tv = t * v * 4
    # Tensor bytes (train_fixtures.peak_tensor_bytes): the gradient plus two [chunk, V] buffers (tail mode 160 MiB,
    # renorm 128); any extra [T, V] float32 temporary adds 128 MiB (a full log_softmax reference grows by 3x the logits).
    assert growth < tv + 4 * chunk * v * 4 + 8 * 2**20, growth / tv


@pytest.mark.distributed
def test_tp2_matches_tp1(tmp_path):
    run_tp2_worker("_loss_tp_worker.py")
