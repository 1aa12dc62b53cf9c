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
        ∂loss/∂z of the chunk in closed form, in place, for β = 0 and β = 1 (`_chunk`), by autograd on the
            chunk's log s for other β; CE and OPD in closed form; ∂h_c = ∂z · W, ∂W += ∂zᵀ · h_c

so, like fused.py, the gradients are made in the forward pass and ``backward`` scales them. The teacher side has no
gradient. Numerics: both matmuls and everything after them in float32 (float64 inputs stay float64; bf16 cached
states are exact in float32); ∂W accumulates in float32. Memory: the closed form holds 3 ``[chunk, V]`` buffers at
β = 1 (z, t and one softmax), 4 at β = 0 (both softmaxes), in chunks of half fused.py's ``CHUNK_BYTES``; the
autograd graph ~8 (a quarter). Time: two exps per element (one per softmax, normalisers from the same pass) and no
``[chunk, V]`` allocation after the first chunk; the four matmuls (student, teacher, ∂h, ∂W) are the rest.

Tensor parallelism: each rank holds its vocabulary slice of the student's output layer (Megatron's, padded to a
multiple of TP) and takes the same rows of the teacher's; the log-normalisers, the divergence's per-row sum, the
label reads and ∂hidden are reduced over the TP group, so the loss is replicated on every rank, as fused.py's is.
Context parallelism needs nothing here: each rank's positions are whole rows of the loss (the trainer splits the
cached states with the tokens, parallel/context_parallel.py); nor pipeline parallelism (the last stage runs the loss
on the micro-batch every stage reads).

Test: ``python -m pytest tests/train/losses/test_exact_loss.py`` (against the same divergences on full fp64 logits).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.train.losses.fused import CHUNK_BYTES, FusedOut, chunk_rows, keep_grads, scaled_grads
from pipeline.train.losses.reference import OpdCorrection, correction_at, divergence, loss_arg_problems, opd_advantage
from pipeline.train.losses.vocab_parallel import all_reduce, global_lse, tp_rank_world, valid_columns


def _lse(x: Tensor, group) -> Tensor:
    """[c, 1] log-normaliser of each row over the whole vocabulary from this rank's columns `x` [c, v]."""
    return global_lse(torch.logsumexp(x, -1, keepdim=True), group)


def _at_label(x: Tensor, y_idx: Tensor, y_owned: Tensor, group) -> Tensor:
    """[c] x[row, y] from the rank whose columns hold y (0 elsewhere), summed over the TP group."""
    v = x.gather(1, y_idx).squeeze(-1) * y_owned if x.shape[1] else x.new_zeros(y_owned.shape)  # no column here
    return all_reduce(v, group)


def _softmax_into(x: Tensor, out: Tensor, group) -> Tensor:
    """out ← softmax of `x` [c, v] over the whole vocabulary (every TP rank's columns, one shift for all of them);
    returns the rows' log-normalisers [c, 1]. One exp per element into a buffer the caller keeps: torch.logsumexp
    would allocate and fill a ``[c, v]`` temporary, and the softmax would need a second exp pass."""
    m = x.amax(-1, keepdim=True) if x.shape[1] else x.new_full((x.shape[0], 1), -math.inf)  # no column here
    all_reduce(m, group, op=torch.distributed.ReduceOp.MAX)
    torch.sub(x, m, out=out).exp_()
    total = all_reduce(out.sum(-1, keepdim=True), group)
    out.mul_(total.reciprocal())
    return total.log_().add_(m)


def _chunk(z: Tensor, t: Tensor, kd_on, ce_on, y_idx, y_owned, beta: float, tau: float, n: int, kd_w: float, group,
           scratch: list[Tensor]):
    """One chunk's per-row divergence D (over the whole vocabulary), log s₁(y), log p₁(y) and ∂(Σ D)/∂z, from this
    rank's logit columns `z` [c, v_local] (its first `n` real, the rest Megatron's padding) and `t` [c, n], both
    consumed, with the `scratch` buffers ([≥c, n] each: one for β = 1, two for β = 0) the loop keeps across chunks.
    The log-normalisers are over every TP rank. ∂D/∂z per column: β = 0 (forward KL) (s − p)/τ, β = 1 (reverse KL)
    s ⊙ (log s − log p − D)/τ, in place, two exps per element (the two softmaxes, their normalisers from the same
    pass: `_softmax_into`); other β by autograd on the chunk's log s only, then through the softmax by hand,
    (g − s Σ g)/τ, Σ over the TP group (about eight buffers). The label reads (CE, OPD) are at τ = 1. Returns
    (kd_w · ∂D/∂z on kd_on rows [c, n], D, log s₁(y), log p₁(y), log s at τ [c, n] (only when a row reads its label:
    else None), its normaliser lse_s, lse₁)."""
    zv = z[:, :n]
    c = zv.shape[0]
    lse1 = lse_t1 = log_s1_y = log_p1_y = None
    if bool(ce_on.any()):  # read before the buffers are scaled
        lse1, lse_t1 = _lse(zv, group), _lse(t, group)
        log_s1_y = _at_label(zv, y_idx, y_owned, group) - lse1.squeeze(-1)
        log_p1_y = _at_label(t, y_idx, y_owned, group) - lse_t1.squeeze(-1)
    if tau != 1.0:
        t.div_(tau)
        zv.div_(tau)
    if beta == 1.0:
        s = scratch[0][:c]
        lse_t = _softmax_into(t, s, group)  # only its normaliser: the buffer is s's next
        lse_s = _softmax_into(zv, s, group)
        g = torch.sub(zv, t, out=t).sub_(lse_s - lse_t).mul_(s)  # s ⊙ (log s − log p)
        d = all_reduce(g.sum(-1), group)
        g.addcmul_(s, d.unsqueeze(-1), value=-1.0)  # s ⊙ (log s − log p − D)
    elif beta == 0.0:
        p, s = scratch[0][:c], scratch[1][:c]
        lse_t = _softmax_into(t, p, group)
        lse_s = _softmax_into(zv, s, group)
        d = all_reduce(t.sub_(zv).sub_(lse_t - lse_s).mul_(p).sum(-1), group)  # Σ p (log p − log s)
        g = s.sub_(p)
    else:
        t.sub_(lse_t1 if tau == 1.0 and lse_t1 is not None else _lse(t, group))  # log p at τ
        lse_s = lse1 if tau == 1.0 and lse1 is not None else _lse(zv, group)
        zv.sub_(lse_s)  # log s at τ
        with torch.enable_grad():
            ls = zv.detach().requires_grad_()
            d = divergence(t, ls, beta)  # this rank's bins: the generalised JSD is a sum over bins
            (g,) = torch.autograd.grad(torch.where(kd_on, d, 0.0).sum(), [ls])
        d = all_reduce(d.detach(), group)
        s = zv.exp()
        g = g.sub_(s.mul_(all_reduce(g.sum(-1, keepdim=True), group)))  # through log s = z/τ − lse(z/τ)
    if beta in (0.0, 1.0) and log_s1_y is not None:
        zv.sub_(lse_s)  # log s at τ, for the label terms' softmax
    if not (kd_w / tau == 1.0 and bool(kd_on.all())):  # a no-op scale is a whole pass over the chunk
        g.mul_(kd_on.to(g.dtype).unsqueeze(-1) * (kd_w / tau))
    return g, torch.where(kd_on, d, 0.0), log_s1_y, log_p1_y, zv if log_s1_y is not None else None, lse_s, lse1


class _ExactGKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, rows, kd_on, labels, sft_on, opd_on, weights, opts):
        beta, tau, chunk, n_vocab, group, (behavior, cap) = opts
        kd_w, sft_w, opd_w = weights
        rank, _ = tp_rank_world(group)
        v_local = weight.shape[0]
        n = valid_columns(n_vocab, rank, v_local)  # this rank's real columns, from rank * v_local
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        want_h, want_w = hidden.requires_grad, weight.requires_grad
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if want_w else None
        sums = torch.zeros(4, dtype=cdtype, device=hidden.device)  # kd, sft, opd, opd's reverse-KL estimate
        ce_on = sft_on | opd_on
        tw = t_weight[rank * v_local: rank * v_local + n].to(cdtype)  # the teacher's rows for this rank's columns
        y_local = labels - rank * v_local
        y_owned = (y_local >= 0) & (y_local < n) & ce_on
        y_idx = y_local.clamp(0, max(n - 1, 0)).unsqueeze(-1)
        chunk = chunk if beta not in (0.0, 1.0) else 2 * chunk  # the closed form keeps half the buffers
        # the closed form's softmax buffers, made once: a fresh [chunk, V] per chunk costs its page faults each time
        scratch = [torch.empty(min(chunk, rows.numel()), n, dtype=cdtype, device=hidden.device)
                   for _ in range({0.0: 2, 1.0: 1}.get(beta, 0))]
        for s in range(0, rows.numel(), chunk):
            e = min(s + chunk, rows.numel())
            hc = hidden[rows[s:e]]
            z = (hc.to(weight.dtype) @ weight.t()).to(cdtype)
            t = t_hidden[rows[s:e]].to(cdtype) @ tw.t()
            g, d, log_s1_y, log_p1_y, log_s, lse_s, lse1 = _chunk(
                z, t, kd_on[s:e], ce_on[s:e], y_idx[s:e], y_owned[s:e], beta, tau, n, kd_w, group, scratch)
            del t
            if n < v_local:  # a padded student vocabulary: no gradient on the padding
                g = torch.nn.functional.pad(g, (0, v_local - n))
            sums[0] += d.sum()
            if log_s1_y is not None:  # CE and OPD: coef · (softmax₁ − onehot(y)), softmax₁ from log s at τ
                sft_c, opd_c = sft_on[s:e], opd_on[s:e]
                wadv, adv = opd_advantage(log_s1_y, log_p1_y, None if behavior is None else behavior[s:e], cap)
                wadv, adv = torch.where(opd_c, wadv, 0.0), torch.where(opd_c, adv, 0.0)
                term = wadv * torch.where(opd_c, log_s1_y, 0.0)
                sums[1:] += torch.stack([torch.where(sft_c, -log_s1_y, 0.0).sum(), term.sum(), adv.sum()])
                coef = sft_w * sft_c.to(g.dtype) - opd_w * opd_c.to(g.dtype) * wadv
                q = log_s.mul_(tau).add_(tau * lse_s - lse1).exp_() if tau != 1.0 else log_s.exp_()
                g[:, :n].addcmul_(coef.unsqueeze(-1), q)
                g.scatter_add_(1, y_idx[s:e], -(coef * y_owned[s:e]).unsqueeze(-1))
            del z, log_s
            if want_h:
                grad_h[rows[s:e]] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                if g.dtype == grad_w.dtype == hc.dtype:
                    grad_w.addmm_(g.t(), hc)  # no [V, H] temporary
                else:
                    grad_w.add_(g.t().to(cdtype) @ hc.to(cdtype))
        if want_h:
            all_reduce(grad_h, group)  # each rank's columns' share of ∂hidden
        keep_grads(ctx, grad_h, grad_w, weight.dtype)
        loss = kd_w * sums[0] + sft_w * sums[1] + opd_w * sums[2]
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
    opd_correction: OpdCorrection | None = None,
) -> FusedOut:
    """The exact full-vocabulary GKD divergence between ``softmax(hidden · weightᵀ / τ)`` and the teacher's
    ``softmax(teacher_hidden · teacher_weightᵀ / τ)`` at ``mask`` positions (SFT CE at ``sft_mask``, OPD at
    ``opd_mask`` with the exact teacher's log p(label), weighted by ``opd_correction``'s importance weights where
    given), never materialising ``[tokens, vocab]``.

    ``hidden`` ``[..., H]``, ``teacher_hidden`` ``[..., H_t]`` (any float dtype: bf16 from the cache), both laid out
    like ``mask``; ``weight`` ``[V(+padding), H]``; ``teacher_weight`` ``[V, H_t]``; ``vocab_size``: the student's
    real vocabulary V (columns past it are padding). Returns what fused.py's loss returns."""
    if problems := loss_arg_problems(beta, temperature, "tail"):
        raise ValueError("; ".join(problems))
    n = vocab_size or weight.shape[0] * tp_rank_world(tp_group)[1]
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
        (float(kd_weight), float(sft_weight), float(opd_weight)), (beta, float(temperature), chunk, n, tp_group,
                                                         correction_at(opd_correction, rows)))
    dev = h.device
    return FusedOut(loss, kd_sum.detach(), torch.tensor(int(kd_on.sum()), device=dev), sft_sum.detach(),
                    torch.tensor(int(sft_on.sum()), device=dev), opd_sum.detach(), opd_kl.detach(),
                    torch.tensor(int(opd_on.sum()), device=dev))
