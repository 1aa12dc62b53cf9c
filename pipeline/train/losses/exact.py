"""The exact teacher's fused loss: student hidden states and output layer, teacher hidden states (a hidden-state
cache, pipeline/store/hidden.py) and the teacher's output layer in, the full-vocabulary divergence out, without any
``[tokens, vocab]`` tensor.

As in fused.py the rows are taken a chunk at a time, each chunk with its whole vocabulary (so each row's two
log-normalisers are exact within the chunk, one pass):

    for each chunk of active rows:
        z = h_c · Wᵀ                      the student's logits  [chunk, V]
        t = g_c · W_tᵀ                    the teacher's logits  [chunk, V]   (g: the cached hidden states)
        log s = log_softmax(z / τ), log p = log_softmax(t / τ)               (τ chosen at train time)
        D = reference.divergence(log p, log s, β) over all V bins: β = 0 forward KL(p‖s), β = 1 reverse KL(s‖p),
            else the generalised JSD(β); SFT rows CE = −log softmax(z)_y; OPD rows the sampled-token estimator
            with the exact teacher's log p(y) at τ = 1
        ∂loss/∂z of the chunk in closed form, in place, for β = 0 and β = 1 (`_analytic`), by autograd on the
            chunk's small graph for other β; ∂h_c = ∂z · W, ∂W += ∂zᵀ · h_c

so, like fused.py, the gradients are made in the forward pass and ``backward`` scales them. The teacher side has no
gradient. Numerics: both matmuls and everything after them in float32 (float64 inputs stay float64; bf16 cached
states are exact in float32); ∂W accumulates in float32. Memory: the closed form holds ~3 ``[chunk, V]`` buffers
(chunks of half fused.py's ``CHUNK_BYTES``), the autograd graph ~8 (a quarter).

Not done yet: tensor parallelism (the teacher's output layer would be split by vocabulary like the student's, with the
log-normalisers all-reduced: `vocab_parallel.global_lse`); the trainer refuses TP, CP and PP > 1 with a hidden-state
cache (setup.check_hidden_cache).

Test: ``python -m pytest tests/train/losses/test_exact_loss.py`` (against the same divergences on full fp64 logits).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.train.losses.fused import CHUNK_BYTES, FusedOut, chunk_rows, keep_grads, scaled_grads
from pipeline.train.losses.reference import TEACHER_EPS, divergence, loss_arg_problems
from pipeline.train.losses.vocab_parallel import tp_rank_world


def _analytic(z: Tensor, t: Tensor, kd_on, sft_on, opd_on, y, beta: float, tau: float, n: int, weights):
    """One chunk's sums and ∂loss/∂z for β = 0 (forward KL, ∂D/∂z = (s − p)/τ) or β = 1 (reverse KL,
    ∂D/∂z = s ⊙ (log s − log p − D)/τ), with CE and OPD (∂ log s₁(y)/∂z = onehot(y) − softmax(z)), in place on the
    two logit buffers: about three ``[chunk, V]`` buffers instead of the autograd graph's ~8. `z` [c, V(+pad)] and
    `t` [c, V] are consumed. Returns (∂loss/∂z [c, V(+pad)], d, ce, term, adv)."""
    kd_w, sft_w, opd_w = weights
    zv = z[:, :n]
    yy = y.unsqueeze(-1)
    any_ce = bool((sft_on | opd_on).any())
    lse_t = lse_s = None
    if any_ce:  # what CE and OPD read at τ = 1, before the buffers are scaled
        lse1, lse_t1 = torch.logsumexp(zv, -1), torch.logsumexp(t, -1)
        log_s1_y = zv.gather(1, yy).squeeze(-1) - lse1
        log_p1_y = t.gather(1, yy).squeeze(-1) - lse_t1
        if tau == 1.0:
            lse_t, lse_s = lse_t1.unsqueeze(-1), lse1.unsqueeze(-1)
    if tau != 1.0:
        t.div_(tau)
        zv.div_(tau)
    t.sub_(torch.logsumexp(t, -1, keepdim=True) if lse_t is None else lse_t)  # log p at τ
    lse_s = torch.logsumexp(zv, -1, keepdim=True) if lse_s is None else lse_s
    zv.sub_(lse_s)  # log s at τ
    s = zv.exp()
    if beta == 0.0:
        p = t.exp()
        d = torch.bmm(t.sub_(zv).unsqueeze(1), p.unsqueeze(2)).view(-1)  # Σ p (log p − log s)
        g = s.sub_(p)
        del p
    else:
        t.neg_().add_(zv)  # log s − log p
        d = torch.bmm(t.unsqueeze(1), s.unsqueeze(2)).view(-1)
        g = t.sub_(d.unsqueeze(-1)).mul_(s)
        del s
    d = torch.where(kd_on, d, 0.0)
    g.mul_((kd_on.to(g.dtype) * (kd_w / tau)).unsqueeze(-1))
    zero = torch.zeros_like(d)
    ce = term = adv = zero
    if any_ce:
        adv = torch.where(opd_on, log_s1_y - log_p1_y.clamp_min(math.log(TEACHER_EPS)), 0.0)
        ce = torch.where(sft_on, -log_s1_y, 0.0)
        term = adv * torch.where(opd_on, log_s1_y, 0.0)
        coef = sft_w * sft_on.to(g.dtype) - opd_w * opd_on.to(g.dtype) * adv  # × (softmax₁ − onehot(y))
        q = zv.mul_(tau).add_(tau * lse_s - lse1.unsqueeze(-1)).exp_() if tau != 1.0 else zv.exp_()
        g.addcmul_(coef.unsqueeze(-1), q)
        g.scatter_add_(1, yy, -coef.unsqueeze(-1))
    if g.shape[1] < z.shape[1]:  # a padded student vocabulary: no gradient on the padding
        g = torch.nn.functional.pad(g, (0, z.shape[1] - g.shape[1]))
    return g, d, ce, term, adv


class _ExactGKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, rows, kd_on, labels, sft_on, opd_on, weights, opts):
        beta, tau, chunk, n = opts
        kd_weight, sft_weight, opd_weight = weights
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        want_h, want_w = hidden.requires_grad, weight.requires_grad
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if want_w else None
        sums = torch.zeros(4, dtype=cdtype, device=hidden.device)  # kd, sft, opd, opd's reverse-KL estimate
        ce_on = sft_on | opd_on
        tw = t_weight.to(cdtype)
        chunk = chunk if beta not in (0.0, 1.0) else 2 * chunk  # the closed form keeps half the buffers
        for s in range(0, rows.numel(), chunk):
            e = min(s + chunk, rows.numel())
            hc = hidden[rows[s:e]]
            z = (hc.to(weight.dtype) @ weight.t()).to(cdtype)
            if beta in (0.0, 1.0):  # closed-form gradients, in place (`_analytic`)
                t = t_hidden[rows[s:e]].to(cdtype) @ tw.t()
                gz, d, ce, term, adv = _analytic(z, t, kd_on[s:e], sft_on[s:e], opd_on[s:e], labels[s:e], beta, tau,
                                                 n, weights)
                del z, t
                sums += torch.stack([d.sum(), ce.sum(), term.sum(), adv.sum()])
                if want_h:
                    grad_h[rows[s:e]] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
                if want_w:
                    if gz.dtype == grad_w.dtype == hc.dtype:
                        grad_w.addmm_(gz.t(), hc)  # no [V, H] temporary
                    else:
                        grad_w.add_(gz.t().to(cdtype) @ hc.to(cdtype))
                continue
            with torch.no_grad():
                log_p = torch.log_softmax((t_hidden[rows[s:e]].to(cdtype) @ tw.t()).div_(tau), -1)
                log_p1 = (torch.log_softmax((t_hidden[rows[s:e]].to(cdtype) @ tw.t()), -1)
                          if tau != 1.0 and bool(opd_on[s:e].any()) else log_p)
            with torch.enable_grad():
                zl = z.detach().requires_grad_()
                zv = zl[:, :n]  # a padded student vocabulary (Megatron): its extra columns are no token
                log_s = torch.log_softmax(zv / tau if tau != 1.0 else zv, -1)
                d = torch.where(kd_on[s:e], divergence(log_p, log_s, beta), 0.0)
                total = kd_weight * d.sum()
                if bool(ce_on[s:e].any()):
                    y = labels[s:e].unsqueeze(-1)
                    log_s1 = torch.log_softmax(zv, -1).gather(1, y).squeeze(-1) if tau != 1.0 else log_s.gather(1, y).squeeze(-1)
                    ce = torch.where(sft_on[s:e], -log_s1, 0.0)
                    lp_y = log_p1.gather(1, y).squeeze(-1).clamp_min(math.log(TEACHER_EPS))
                    adv = torch.where(opd_on[s:e], log_s1.detach() - lp_y, 0.0)
                    term = adv * torch.where(opd_on[s:e], log_s1, 0.0)
                    total = total + sft_weight * ce.sum() + opd_weight * term.sum()
                    sums[1:] += torch.stack([ce.detach().sum(), term.detach().sum(), adv.sum()])
                sums[0] += d.detach().sum()
                if not (want_h or want_w):
                    continue
                (gz,) = torch.autograd.grad(total, [zl])
            del log_p, log_p1, log_s, zl, zv, z
            if want_h:
                grad_h[rows[s:e]] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w.add_(gz.t().to(cdtype) @ hc.to(cdtype))
        keep_grads(ctx, grad_h, grad_w, weight.dtype)
        loss = kd_weight * sums[0] + sft_weight * sums[1] + opd_weight * sums[2]
        return loss, sums[0], sums[1], sums[2], sums[3]

    @staticmethod
    def backward(ctx, g_loss, _g_kd, _g_sft, _g_opd, _g_kl):
        return scaled_grads(ctx, g_loss) + (None,) * 9


def exact_problems(student_vocab: int, teacher_weight: Tensor, temperature: float) -> list[str]:
    """Why the exact loss cannot run (the trainer's setup names the file and key around these)."""
    p = []
    if teacher_weight.shape[0] != student_vocab:
        p.append(f"the teacher's vocabulary ({teacher_weight.shape[0]} output rows) differs from the student's "
                 f"({student_vocab}): the exact divergence pairs token ids one to one")
    if temperature <= 0:
        p.append(f"temperature must be > 0, got {temperature}")
    return p


def exact_gkd_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    sft_mask: Tensor | None = None,
    kd_weight: float = 1.0,
    sft_weight: float = 0.0,
    tp_group=None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    opd_mask: Tensor | None = None,
    opd_weight: float = 0.0,
) -> FusedOut:
    """The exact full-vocabulary GKD divergence between ``softmax(hidden · weightᵀ / τ)`` and the teacher's
    ``softmax(teacher_hidden · teacher_weightᵀ / τ)`` at ``mask`` positions (SFT CE at ``sft_mask``, OPD at
    ``opd_mask`` with the exact teacher's log p(label)), never materialising ``[tokens, vocab]``.

    ``hidden`` ``[..., H]``, ``teacher_hidden`` ``[..., H_t]`` (any float dtype: bf16 from the cache), both laid out
    like ``mask``; ``weight`` ``[V(+padding), H]``; ``teacher_weight`` ``[V, H_t]``; ``vocab_size``: the student's
    real vocabulary V (columns past it are padding). Returns what fused.py's loss returns."""
    if problems := loss_arg_problems(beta, temperature, "tail"):
        raise ValueError("; ".join(problems))
    if tp_rank_world(tp_group)[1] > 1:
        raise ValueError("the exact-teacher loss runs at tensor_model_parallel_size=1 only (not done yet)")
    n = vocab_size or weight.shape[0]
    if problems := exact_problems(n, teacher_weight, temperature):
        raise ValueError("; ".join(problems))
    h = hidden.reshape(-1, hidden.shape[-1])
    g = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    kd_flat = mask.reshape(-1)
    sft_flat = sft_mask.reshape(-1) if sft_mask is not None else torch.zeros_like(kd_flat)
    opd_flat = opd_mask.reshape(-1) if opd_mask is not None else torch.zeros_like(kd_flat)
    if (sft_mask is not None or opd_mask is not None) and labels is None:
        raise ValueError("sft_mask and opd_mask need labels")
    if bool((kd_flat & opd_flat).any()):
        raise ValueError("a position is both a KD (mask) and an OPD (opd_mask) position")
    rows = (kd_flat | sft_flat | opd_flat).nonzero().squeeze(-1)
    kd_on, sft_on, opd_on = kd_flat[rows], sft_flat[rows], opd_flat[rows]
    y = labels.reshape(-1)[rows].long() if labels is not None else torch.zeros_like(rows)
    y = torch.where(sft_on | opd_on, y, 0)  # ignored labels (-100) are never read
    chunk = chunk_size or chunk_rows(max(weight.shape[0], teacher_weight.shape[0]), CHUNK_BYTES // 4)
    loss, kd_sum, sft_sum, opd_sum, opd_kl = _ExactGKD.apply(
        h, weight, g, teacher_weight, rows, kd_on, y, sft_on, opd_on,
        (float(kd_weight), float(sft_weight), float(opd_weight)), (beta, float(temperature), chunk, n))
    dev = h.device
    return FusedOut(loss, kd_sum.detach(), torch.tensor(int(kd_on.sum()), device=dev), sft_sum.detach(),
                    torch.tensor(int(sft_on.sum()), device=dev), opd_sum.detach(), opd_kl.detach(),
                    torch.tensor(int(opd_on.sum()), device=dev))
