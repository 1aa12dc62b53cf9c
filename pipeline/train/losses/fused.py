"""Fused output layer + GKD loss: final hidden states and the (vocab-parallel) output weight in, the loss out,
without any ``[tokens, vocab]`` tensor.

The unfused path (``loss.gkd_loss`` on Megatron's logits) keeps the logits, their gradient and the loss's
temporaries alive at once: 4.7 GB of peak growth at 4,096 tokens with a 151,936 vocab, ~19 GB at 16k (BENCHMARKS.md).
Here the logits exist one chunk of tokens at a time, ``[chunk, V_local]``:

    for each chunk of active rows:   z = h_c · W_localᵀ           (the output layer, this TP rank's vocab slice)
        teacher-id logits z_K, the tail logsumexp over the vocab minus K, and (SFT rows) the full logsumexp and z_y,
        each all-reduced over the TP group exactly as ``loss._TopkAndTailLSE`` does;
        the divergence over the k(+1) bins and its gradient w.r.t. those few numbers (a tiny autograd graph);
        ∂loss/∂z for the chunk from them (softmax of the complement, scattered id gradients, CE's softmax − onehot);
        ∂h_c = ∂z · W_local,   ∂W_local += ∂zᵀ · h_c

so the gradients are computed in the forward pass (as Liger-Kernel's fused linear losses do): the same three
matmuls as the unfused path, and ``backward`` only scales the stored ``∂h``, ``∂W`` by the incoming gradient. The
loss is therefore the weighted total ``kd_weight · Σ D + sft_weight · Σ CE`` (the trainer knows both weights, the
inverse global active counts, before the step), returned with the plain sums and counts for reporting.

``renorm`` needs only the student's logits at the teacher's ids, so a chunk without SFT rows gathers the k rows of
``W`` it needs instead of computing the vocab matmul (``[chunk, k, H]`` instead of ``[chunk, V]``).

Numerics: the matmul runs in the weight's dtype (bf16 under mixed precision), everything after it — logsumexps,
divergences, ∂z — in float32 (float64 inputs stay float64) inside each chunk; ∂W is accumulated in float32 across
chunks. TP: ∂h is the sum of every rank's vocab slice (one all-reduce at the end: what Megatron's
``copy_to_tensor_model_parallel_region`` does in the unfused output layer's backward).

Test: ``python -m pytest tests/train/losses/test_fused_loss.py`` (against ``loss.gkd_loss`` on ``h @ Wᵀ``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.train.losses.reference import (
    TEACHER_EPS,
    OpdCorrection,
    correction_at,
    divergence,
    loss_arg_problems,
    opd_advantage,
    student_bins,
    teacher_bins,
)
from pipeline.train.losses.vocab_parallel import all_reduce, global_lse, tp_rank_world, valid_columns

# The [chunk, V_local] float32 buffer is about this big; at V = 151,936 that is 441 rows. One exists at a time (two
# with SFT rows in tail mode). Every chunk streams all of W through its three matmuls, so small chunks are slow: with
# 110 rows (64 MiB, and three buffers alive) the fused step was 1.14x the unfused one at 4,096 tokens, with 441 rows
# 0.87x and 0.97x in two runs, at 0.79 GB peak against the unfused 4.66 (BENCHMARKS.md, loss section). The live
# teacher's top-k pass (live_teacher.py) uses the same size, also one buffer at a time.
CHUNK_BYTES = 256 << 20


def chunk_rows(v_local: int, budget: int = CHUNK_BYTES) -> int:
    return int(min(1024, max(16, budget // (4 * max(1, v_local)))))


def _exp_sum(x: Tensor) -> tuple[Tensor, Tensor]:
    """In place x <- exp(x - m) per row; returns (m, Σ exp(x - m)). Rows that are all -inf get m = 0, sum 0."""
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    x.sub_(m).exp_()
    return m.squeeze(-1), x.sum(-1)


@dataclass
class FusedOut:
    loss: Tensor  # kd_weight * kd_sum + sft_weight * sft_sum: the differentiable output
    kd_sum: Tensor  # Σ D over KD-active positions (detached)
    kd_count: Tensor
    sft_sum: Tensor  # Σ CE over SFT-active positions (detached)
    sft_count: Tensor
    opd_sum: Tensor  # Σ sg(log s − log p)·log s over OPD-active positions (detached; loss.opd_loss)
    opd_kl_sum: Tensor  # Σ (log s − log p) there: the per-token reverse-KL estimate
    opd_count: Tensor


class _FusedLinearGKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, rows, ids, valid, a, kd_on, labels, sft_on, kd_weight, sft_weight, opts, opd):
        beta, tau, mode, group, chunk, n_vocab = opts
        # rows of the sampled-token estimator, their teacher logprobs, its weight, stale samples' (behavior, cap)
        opd_on, log_p, opd_weight, behavior, cap = opd
        ce_on = sft_on | opd_on  # rows that need log s(y): the full logsumexp and z_y
        rank, _ = tp_rank_world(group)
        v_local = weight.shape[0]
        n_valid = valid_columns(n_vocab, rank, v_local)
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        want_h, want_w = hidden.requires_grad, weight.requires_grad
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if want_w else None
        kd_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
        sft_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
        opd_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
        opd_kl = torch.zeros((), dtype=cdtype, device=hidden.device)
        local = ids - rank * v_local
        owned = (local >= 0) & (local < n_valid) & valid
        idx = local.clamp(0, max(v_local - 1, 0))
        y_local = labels - rank * v_local
        y_owned = (y_local >= 0) & (y_local < n_valid) & ce_on
        y_idx = y_local.clamp(0, max(v_local - 1, 0)).unsqueeze(-1)
        fill = torch.where(owned, -math.inf, math.inf).to(cdtype)  # amin-scatter: only owned ids leave the tail
        for s in range(0, rows.numel(), chunk):
            # Free the last chunk's buffers before this chunk's matmul allocates the next (else two are alive).
            z = ex = ef = gz = wk = contrib = None
            e = min(s + chunk, rows.numel())
            hc = hidden[rows[s:e]]
            any_sft = bool(ce_on[s:e].any())
            dense = mode == "tail" or any_sft
            if dense:
                z = (hc.to(weight.dtype) @ weight.t()).to(cdtype)
                if n_valid < v_local:
                    z[:, n_valid:] = -math.inf
                zk = z.gather(1, idx[s:e]) * owned[s:e]
            else:  # renorm without SFT rows: only the k rows of W at the teacher's ids
                wk = weight[idx[s:e]]  # [c, k, H]
                zk = torch.einsum("ch,ckh->ck", hc.to(weight.dtype), wk).to(cdtype) * owned[s:e]
            zk = all_reduce(zk, group)
            # z is consumed in place; ef (SFT rows in tail mode) is the only second buffer (why: CHUNK_BYTES).
            lse_full = ef = zy = None
            if any_sft:
                zy = all_reduce(z.gather(1, y_idx[s:e]).squeeze(-1) * y_owned[s:e], group)
                ef = z.clone() if mode == "tail" else z
                m_f, s_f = _exp_sum(ef)
                lse_full = global_lse(m_f + s_f.log(), group)  # (max, sum of exp(x - max)) per rank
            lse_tail = ex = None
            if mode == "tail":
                ex = z.div_(tau) if tau != 1.0 else z
                ex.scatter_reduce_(1, idx[s:e], fill[s:e], "amin")
                m_t, s_t = _exp_sum(ex)  # ex <- exp(x - m_t): reused for the gradient
                lse_tail = global_lse(m_t + s_t.log(), group)
            # The divergence (and CE) of this chunk as a function of the few gathered numbers; their gradients.
            with torch.enable_grad():
                zk_l = zk.detach().requires_grad_()
                tail_l = lse_tail.detach().requires_grad_() if lse_tail is not None else None
                b = student_bins(zk_l, tail_l, valid[s:e], tau, mode)
                d = torch.where(kd_on[s:e], divergence(a[s:e].to(b.dtype), b, beta, valid[s:e], mode), 0.0)
                total = kd_weight * d.sum()
                leaves = [zk_l] + ([tail_l] if tail_l is not None else [])
                if any_sft:
                    full_l, zy_l = lse_full.detach().requires_grad_(), zy.detach().requires_grad_()
                    ce = torch.where(sft_on[s:e], full_l - zy_l, 0.0)
                    total = total + sft_weight * ce.sum()
                    leaves += [full_l, zy_l]
                    sft_sum += ce.detach().sum()
                    log_s = zy_l - full_l
                    on = opd_on[s:e]
                    wadv, adv = opd_advantage(log_s, log_p[s:e], None if behavior is None else behavior[s:e], cap)
                    adv = torch.where(on, adv, 0.0)
                    term = torch.where(on, wadv, 0.0) * torch.where(on, log_s, 0.0)
                    total = total + opd_weight * term.sum()
                    opd_sum += term.detach().sum()
                    opd_kl += adv.sum()
                grads = torch.autograd.grad(total, leaves, allow_unused=True)
            kd_sum += d.detach().sum()
            if not (want_h or want_w):
                continue
            g_zk = grads[0] if grads[0] is not None else torch.zeros_like(zk)
            g_zk = g_zk * owned[s:e]  # each rank owns its ids' entries; the loss is replicated across TP
            if dense:  # tail mode or SFT rows, so gz is set below
                gz = None
                if mode == "tail":  # ∂ lse_tail / ∂z_v = softmax over the complement / τ
                    g_tail = grads[1] if grads[1] is not None else torch.zeros_like(lse_tail)
                    scale = torch.where(torch.isfinite(lse_tail), (m_t - lse_tail).exp(), 0.0) * g_tail / tau
                    gz = ex.mul_(scale.unsqueeze(-1))
                if any_sft:  # CE: g · (softmax − onehot(y))
                    g_full, g_zy = grads[-2], grads[-1]
                    p_full = ef.mul_(((m_f - lse_full).exp() * g_full).unsqueeze(-1))
                    gz = p_full if gz is None else gz.add_(p_full)
                    gz.scatter_add_(1, y_idx[s:e], (g_zy * y_owned[s:e]).unsqueeze(-1))
                gz.scatter_add_(1, idx[s:e], g_zk)
                if n_valid < v_local:
                    gz[:, n_valid:] = 0.0
                if want_h:
                    grad_h[rows[s:e]] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
                if want_w:
                    if gz.dtype == weight.dtype and hc.dtype == weight.dtype:
                        grad_w.addmm_(gz.t(), hc)
                    else:
                        grad_w.add_(gz.t().to(weight.dtype) @ hc.to(weight.dtype))
            else:
                if want_h:
                    grad_h[rows[s:e]] = torch.einsum("ck,ckh->ch", g_zk.to(weight.dtype), wk).to(hidden.dtype)
                if want_w:
                    contrib = g_zk.to(cdtype).unsqueeze(-1) * hc.to(cdtype).unsqueeze(1)  # [c, k, H]
                    grad_w.index_add_(0, idx[s:e].reshape(-1), contrib.reshape(-1, contrib.shape[-1]))
        if want_h:
            all_reduce(grad_h, group)
        keep_grads(ctx, grad_h, grad_w, weight.dtype)
        loss = kd_weight * kd_sum + sft_weight * sft_sum + opd_weight * opd_sum
        return loss, kd_sum, sft_sum, opd_sum, opd_kl

    @staticmethod
    def backward(ctx, g_loss, _g_kd, _g_sft, _g_opd, _g_kl):
        return scaled_grads(ctx, g_loss) + (None,) * 11


def keep_grads(ctx, grad_h: Tensor | None, grad_w: Tensor | None, weight_dtype: torch.dtype) -> None:
    """Forward side of the fused losses (this one, xtok.py, exact.py): their gradients, made in the forward pass for a
    loss of gradient 1, kept for `scaled_grads`."""
    ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
    ctx.have = (grad_h is not None, grad_w is not None)
    ctx.weight_dtype = weight_dtype


def scaled_grads(ctx, g_loss: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Backward side of the fused losses: (∂hidden, ∂weight) scaled by the loss's incoming gradient (Megatron's
    schedule divides the loss by the micro-batch count), ∂weight cast to the weight's dtype last. The scale is cast
    to each gradient's own dtype (∂weight accumulates in float32: a bf16 scale would round it first); a scale of
    exactly 1 (a plain `loss.backward()`) multiplies nothing."""
    saved = list(ctx.saved_tensors)
    want_h, want_w = ctx.have
    grad_h = saved.pop(0) if want_h else None
    grad_w = saved.pop(0) if want_w else None
    one = bool(g_loss == 1)
    if grad_h is not None and not one:
        grad_h = grad_h * g_loss.to(grad_h.dtype)
    if grad_w is not None:
        grad_w = (grad_w if one else grad_w * g_loss.to(grad_w.dtype)).to(ctx.weight_dtype)
    return grad_h, grad_w


def fused_gkd_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    mode: Literal["tail", "renorm"] = "tail",
    teacher_tail: Tensor | None = None,
    teacher_valid: Tensor | None = None,
    labels: Tensor | None = None,
    sft_mask: Tensor | None = None,
    kd_weight: float = 1.0,
    sft_weight: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    opd_mask: Tensor | None = None,
    teacher_actual: Tensor | None = None,
    opd_weight: float = 0.0,
    opd_correction: OpdCorrection | None = None,
) -> FusedOut:
    """GKD divergence (and SFT cross-entropy) of ``logits = hidden · weightᵀ`` without materialising the logits.

    ``hidden``: ``[..., H]`` (leading dims flattened like ``mask``); ``weight``: ``[V_local, H]``, this TP rank's
    vocab slice of the output layer (tied or not); the teacher arguments, ``mask``, ``tp_group`` and ``vocab_size``
    as in :func:`pipeline.train.losses.reference.gkd_loss`. SFT: CE on ``labels`` at ``sft_mask`` positions. Returns the
    weighted loss (differentiable w.r.t. ``hidden`` and ``weight``) and the plain sums and counts. OPD
    (``loss=opd``): at ``opd_mask`` positions (not KD positions) the sampled-token estimator of
    :func:`pipeline.train.losses.reference.opd_loss` on ``labels`` with ``teacher_actual``, weighted by ``opd_weight``; it
    reads log s(y) from the same full logsumexp as SFT's CE; ``opd_correction``: stale samples' importance weights
    (:func:`pipeline.train.losses.reference.opd_advantage`). k = 0 (no teacher entries): OPD/SFT rows only.
    """
    if problems := loss_arg_problems(beta, temperature, mode):
        raise ValueError("; ".join(problems))
    h = hidden.reshape(-1, hidden.shape[-1])
    k = teacher_ids.shape[-1]
    kd_flat = mask.reshape(-1)
    sft_flat = sft_mask.reshape(-1) if sft_mask is not None else torch.zeros_like(kd_flat)
    opd_flat = opd_mask.reshape(-1) if opd_mask is not None else torch.zeros_like(kd_flat)
    if (sft_mask is not None or opd_mask is not None) and labels is None:
        raise ValueError("sft_mask and opd_mask need labels")
    if opd_mask is not None and teacher_actual is None:
        raise ValueError("opd_mask needs teacher_actual (the teacher's logprob of each label)")
    if bool((kd_flat & opd_flat).any()):
        raise ValueError("a position is both a KD (mask) and an OPD (opd_mask) position")
    if k == 0:
        if bool(kd_flat.any()):
            raise ValueError("KD positions need teacher top-k entries; these teacher rows have k = 0")
        mode = "renorm"  # no bins at all: no divergence, and no tail pass to make
    rows = (kd_flat | sft_flat | opd_flat).nonzero().squeeze(-1)
    ids = teacher_ids.reshape(kd_flat.numel(), k)[rows].long()
    valid = (teacher_valid.reshape(kd_flat.numel(), k)[rows] if teacher_valid is not None
             else torch.ones(ids.shape, dtype=torch.bool, device=ids.device))
    kd_on, sft_on = kd_flat[rows], sft_flat[rows]
    # Rows active for SFT only carry no teacher row: finite stand-ins (never counted: d is masked by kd_on).
    ell = torch.where(kd_on.unsqueeze(-1), teacher_logprobs.reshape(kd_flat.numel(), k)[rows], 0.0)
    valid = valid | ~kd_on.unsqueeze(-1)
    tail = torch.where(kd_on, teacher_tail.reshape(-1)[rows], 0.0) if teacher_tail is not None else None
    a = teacher_bins(ell, tail, valid, temperature, mode)
    y = labels.reshape(-1)[rows].long() if labels is not None else torch.zeros_like(rows)
    opd_on = opd_flat[rows]
    log_p = (teacher_actual.reshape(-1)[rows].clamp_min(math.log(TEACHER_EPS)) if teacher_actual is not None
             else torch.zeros(rows.shape, device=h.device))
    y = torch.where(sft_on | opd_on, y, 0)  # ignored labels (-100) are never read
    chunk = chunk_size or chunk_rows(weight.shape[0])
    loss, kd_sum, sft_sum, opd_sum, opd_kl = _FusedLinearGKD.apply(
        h, weight, rows, ids, valid, a, kd_on, y, sft_on, float(kd_weight), float(sft_weight),
        (beta, temperature, mode, tp_group, chunk, vocab_size), (opd_on, log_p, float(opd_weight), *correction_at(opd_correction, rows)),
    )
    dev = h.device
    return FusedOut(loss, kd_sum.detach(), torch.tensor(int(kd_on.sum()), device=dev), sft_sum.detach(),
                    torch.tensor(int(sft_on.sum()), device=dev), opd_sum.detach(), opd_kl.detach(),
                    torch.tensor(int(opd_on.sum()), device=dev))


# ---------------------------------------------------------------- the model side


def output_hidden_states(model) -> None:
    """Make a Megatron GPTModel return its final (normed) hidden states ``[b, s, h]`` instead of logits: the
    output layer's forward becomes the identity, its weight stays where it is (checkpoints, tying, TP split
    unchanged) and is read by the loss through :func:`output_weight`. Idempotent."""
    layer = model.output_layer
    if getattr(layer, "_gkd_passthrough", False):
        return

    def passthrough(hidden_states, weight=None, runtime_gather_output=None):
        return hidden_states, None

    layer.forward = passthrough
    layer._gkd_passthrough = True


def output_weight(model) -> Tensor:
    """This rank's vocab slice of the output-layer weight (the embedding when tied), as GPTModel uses it; the LM
    head's weight of an hf-backend student (`hf_model.HFStudent.output_weight`)."""
    if hasattr(model, "output_weight"):
        return model.output_weight()
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
