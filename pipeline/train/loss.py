"""GKD loss on a vocab-parallel shard of student logits, against a sparse top-k teacher.

Per active position t (DESIGN.md, "Loss"): teacher top-k ids ``K_t`` with logprobs ``ℓ`` stored at temperature 1,
student logits ``z`` over the full vocab, temperature ``τ``, JSD weight ``β``.

* ``renorm``: teacher ``softmax(ℓ/τ)`` and student ``softmax(z_K/τ)``, both restricted to ``K_t``
  (what ms-swift, twinkle and NeMo-RL do). Exact at any τ; blind to student mass outside ``K_t``.
* ``tail``: k+1 bins, the k ids plus one bin holding the rest of the mass on each side. The student side is exact
  at any τ: its tail bin is ``logsumexp`` of ``z/τ`` over the vocab *minus* ``K_t`` (computed directly, not as
  ``1 − Σ``, so a confident student's tiny tail does not cancel away). The teacher side at τ ≠ 1 uses one-bin-tail
  tempering (DistillKit's choice): bins ``p_i^(1/τ)`` and ``p_tail^(1/τ)`` renormalised, because the full-vocab
  tempered teacher is not recoverable from the top-k alone. At τ = 1 it is exact.
* ``β = 0``: KL(p‖s); ``β = 1``: KL(s‖p); else ``β·KL(p‖m) + (1−β)·KL(s‖m)`` with ``m = β·p + (1−β)·s``.

Numerics: teacher bin probabilities (including the tail ``1 − Σp``, computed in float64) are floored at
``TEACHER_EPS`` and the bins renormalised, so a ``-inf`` logprob or a tail that rounds to ≤ 0 (quantised logprobs can
sum past 1) gives a finite loss; under reverse KL this caps the penalty for student mass there at
``-log(TEACHER_EPS)`` ≈ 27.6 nats per unit of mass instead of +inf. Active positions must have distinct ids in
``[0, V)``; inactive positions are never read.

Tensor parallel (Megatron convention: the loss is replicated on every rank of ``tp_group``, gradients are local):
the raw logits at ``K_t`` are gathered by a masked gather + SUM all-reduce, and the log-normaliser by all-reducing
the max then the sum of exps. Reducing per-shard log-softmaxes instead gives the right loss but ~1 % wrong
gradients.

Memory: the only full-vocab pass (the tail ``logsumexp``) runs over chunks of ``chunk_size`` tokens in forward and
is recomputed in backward, so beyond the logits and their gradient only ``[chunk_size, V_local]`` temporaries exist.

Test: ``python -m pytest tests/train/test_loss.py``; benchmark: ``python benchmarks/loss_bench.py``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

TEACHER_EPS = 1e-12
# Relative floor for the student tail bin: below float32's smallest normal the complement has underflowed anyway.
_LOG_TINY = math.log(torch.finfo(torch.float32).tiny)
DEFAULT_CHUNK = 256


def _tp(group: dist.ProcessGroup | None) -> tuple[int, int]:
    # None means "no tensor parallelism", not the default (world) group: the trainer always passes its TP group.
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _TopkAndTailLSE(torch.autograd.Function):
    """(logits[T, V_local], active rows[A], global ids[A, k]) -> (raw logits at the ids [A, k], lse_tail [A]).

    ``lse_tail = logsumexp over the global vocab minus the ids of logits/τ`` (only when ``with_tail``). One custom
    function for both outputs so backward writes a single ``[T, V_local]`` gradient, chunk by chunk, instead of
    autograd summing a dense gather-gradient and a dense softmax-gradient.
    Later this can take (hidden states, output weight) instead of logits and build each logits chunk inside the same
    loop (a fused linear + loss), so the ``[T, V]`` logits never exist; the outputs and the loss stay as they are.
    """

    @staticmethod
    def forward(ctx, logits, rows, ids, tau, group, chunk_size, with_tail, vocab_size):
        rank, _ = _tp(group)
        v_local = logits.shape[-1]
        # Columns at or past the real vocab (Megatron pads it to a multiple of TP) are skipped, not copied and masked.
        n_valid = v_local if vocab_size is None else min(max(vocab_size - rank * v_local, 0), v_local)
        cdtype = torch.promote_types(logits.dtype, torch.float32)
        local = ids - rank * v_local
        inrange = (local >= 0) & (local < v_local)
        idx = local.clamp(0, v_local - 1)
        # Ids owned by another rank read a clamped local entry that is zeroed before the SUM all-reduce.
        zk = logits[rows.unsqueeze(-1), idx].to(cdtype) * inrange
        _all_reduce(zk, dist.ReduceOp.SUM, group)
        lse_tail = torch.empty(0, dtype=cdtype, device=logits.device)
        if with_tail:
            # amin-scatter -inf onto owned ids, +inf (a no-op) onto clamped foreign ones: commutative, so a foreign
            # id clamped onto an owned id's column cannot undo the masking.
            fill = torch.where(inrange, -math.inf, math.inf).to(cdtype)
            all_rows = rows.numel() == logits.shape[0]  # rows come sorted from nonzero(): then rows == arange(T)
            lse_local = torch.empty(rows.numel(), dtype=cdtype, device=logits.device)
            for s in range(0, rows.numel(), chunk_size):
                e = min(s + chunk_size, rows.numel())
                z, owned = (logits[s:e], False) if all_rows else (logits[rows[s:e]], True)
                m = z[:, :n_valid].amax(-1, keepdim=True).to(cdtype) if n_valid else z.new_zeros(e - s, 1, dtype=cdtype)
                m = torch.where(torch.isfinite(m), m, 0.0)  # a shift only: any finite value is exact
                x = z.sub_(m) if owned and z.dtype == cdtype else torch.sub(z, m)  # the one chunk buffer, in cdtype
                x[:, n_valid:] = -math.inf
                if tau != 1.0:
                    x.div_(tau)
                x.scatter_reduce_(1, idx[s:e], fill[s:e], "amin")
                lse_local[s:e] = m.squeeze(-1) / tau + x.exp_().sum(-1).log()
            lse_tail = lse_local
            if group is not None and dist.get_world_size(group) > 1:
                m = _all_reduce(lse_local.clone(), dist.ReduceOp.MAX, group)
                m = torch.where(torch.isfinite(m), m, 0.0)  # all shards' complements empty: keep -inf, not NaN
                ssum = _all_reduce((lse_local - m).exp(), dist.ReduceOp.SUM, group)
                lse_tail = m + ssum.log()
        ctx.save_for_backward(logits, rows, idx, inrange, lse_tail)
        ctx.tau, ctx.chunk_size, ctx.with_tail, ctx.n_valid = tau, chunk_size, with_tail, n_valid
        return zk, lse_tail

    @staticmethod
    def backward(ctx, g_zk, g_tail):
        logits, rows, idx, inrange, lse_tail = ctx.saved_tensors
        tau, chunk = ctx.tau, ctx.chunk_size
        cdtype = lse_tail.dtype if ctx.with_tail else torch.promote_types(logits.dtype, torch.float32)
        if g_zk is None:
            g_zk = torch.zeros(idx.shape, dtype=cdtype, device=logits.device)
        # Each rank holds the same replicated loss, so g_zk is already the full gradient: keep the owned entries.
        g_zk = g_zk.to(cdtype) * inrange
        if not ctx.with_tail or g_tail is None:
            grad = torch.zeros_like(logits)
            grad.index_put_((rows.unsqueeze(-1).expand_as(idx), idx), g_zk.to(logits.dtype), accumulate=True)
            return grad, None, None, None, None, None, None, None
        all_rows = rows.numel() == logits.shape[0]
        grad = torch.empty_like(logits) if all_rows else torch.zeros_like(logits)
        fill = torch.where(inrange, -math.inf, math.inf).to(cdtype)
        # Shift in logit units: z/τ - lse = (z - τ·lse)/τ. Empty complement (-inf): use 0, its entries are -inf anyway.
        shift = torch.where(torch.isfinite(lse_tail), lse_tail, 0.0).unsqueeze(-1) * tau
        g_scale = g_tail.to(cdtype).unsqueeze(-1) / tau
        for s in range(0, rows.numel(), chunk):
            e = min(s + chunk, rows.numel())
            if all_rows and logits.dtype == cdtype:
                x = torch.sub(logits[s:e], shift[s:e], out=grad[s:e])  # recompute straight into the gradient
            elif all_rows:
                x = torch.sub(logits[s:e], shift[s:e])
            else:
                z = logits[rows[s:e]]
                x = z.sub_(shift[s:e]) if z.dtype == cdtype else torch.sub(z, shift[s:e])
            x[:, ctx.n_valid :] = -math.inf
            if tau != 1.0:
                x.div_(tau)
            x.scatter_reduce_(1, idx[s:e], fill[s:e], "amin")
            # d lse_tail / d z_v = softmax over the complement / τ; the owned ids get their gathered gradient.
            x.exp_().mul_(g_scale[s:e])
            x.scatter_add_(1, idx[s:e], g_zk[s:e])
            if all_rows and x.dtype != logits.dtype:
                grad[s:e] = x
            elif not all_rows:
                grad[rows[s:e]] = x.to(logits.dtype)
        return grad, None, None, None, None, None, None, None


def _teacher_logprobs(ell: Tensor, temperature: float, mode: str) -> Tensor:
    """Teacher log-probabilities over the bins (k for renorm, k+1 for tail), float64."""
    log_eps = math.log(TEACHER_EPS)
    ell = ell.double().clamp_min(log_eps)
    if mode == "renorm":
        return torch.log_softmax(ell / temperature, dim=-1)
    # 1 − Σp via -expm1(log Σp): accurate when the top-k holds almost all the mass.
    log_tail = torch.log((-torch.expm1(torch.logsumexp(ell, dim=-1))).clamp_min(TEACHER_EPS))
    bins = torch.cat([ell, log_tail.unsqueeze(-1)], dim=-1)
    return torch.log_softmax(bins / temperature, dim=-1)  # one-bin-tail tempering (exact at τ = 1)


def _divergence(a: Tensor, b: Tensor, beta: float) -> Tensor:
    """Per-position generalised JSD between teacher log-probs ``a`` and student log-probs ``b`` (both [A, bins])."""
    if beta == 0.0:
        return (a.exp() * (a - b)).sum(-1)
    if beta == 1.0:
        return (b.exp() * (b - a)).sum(-1)
    log_m = torch.logsumexp(torch.stack([a + math.log(beta), b + math.log1p(-beta)]), dim=0)
    return beta * (a.exp() * (a - log_m)).sum(-1) + (1.0 - beta) * (b.exp() * (b - log_m)).sum(-1)


def gkd_loss(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    mode: Literal["tail", "renorm"] = "tail",
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum of the per-position GKD divergence over active positions, and the active count.

    ``logits``: ``[..., V_local]``, this TP rank's vocab slice (vocab_start = rank · V_local); ``teacher_ids``:
    ``[..., k]`` global vocab ids; ``teacher_logprobs``: ``[..., k]`` at temperature 1; ``mask``: ``[...]`` bool.
    Leading dims are flattened. The sum is differentiable w.r.t. ``logits``; divide by the *global* active count
    (across micro-batches, grad-accum and DP ranks) where it is known. ``tp_group=None`` means no tensor parallelism.
    ``vocab_size``: the real (global) vocab size; logits columns at or past it (Megatron's padding to a multiple of
    TP) are left out of the student's distribution and get zero gradient, without a masked copy of the logits.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if mode not in ("tail", "renorm"):
        raise ValueError(f"mode must be 'tail' or 'renorm', got {mode!r}")
    logits = logits.reshape(-1, logits.shape[-1])
    k = teacher_ids.shape[-1]
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    count = torch.tensor(rows.numel(), dtype=torch.long, device=logits.device)
    ids = teacher_ids.reshape(-1, k)[rows].long()
    a = _teacher_logprobs(teacher_logprobs.reshape(-1, k)[rows], temperature, mode)
    zk, lse_tail = _TopkAndTailLSE.apply(
        logits, rows, ids, temperature, tp_group, chunk_size, mode == "tail", vocab_size
    )
    zt = zk / temperature
    if mode == "tail":
        # Floor the tail "logit" relative to the row (empty/underflowed complement): finite loss, zero gradient there.
        floor = (zt.detach().amax(-1) + _LOG_TINY).to(zt.dtype)
        zt = torch.cat([zt, torch.maximum(lse_tail, floor).unsqueeze(-1)], dim=-1)
    b = torch.log_softmax(zt, dim=-1)  # the tail bin's logit is the complement's logsumexp: b = log s over k+1 bins
    div = _divergence(a.to(b.dtype), b, beta)
    return div.sum(), count


def vocab_parallel_ce(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum of cross-entropy over active positions and the active count, on a vocab-parallel logits shard.

    Same kernel as the tail loss with k = 1 and τ = 1: ``lse = logaddexp(z_y, lse over the rest)``. Labels at
    inactive positions are never read (so -100 padding is fine); the input is not modified (unlike Megatron's).
    ``vocab_size`` as in :func:`gkd_loss`.
    """
    logits = logits.reshape(-1, logits.shape[-1])
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    count = torch.tensor(rows.numel(), dtype=torch.long, device=logits.device)
    ids = labels.reshape(-1)[rows].long().unsqueeze(-1)
    zy, lse_rest = _TopkAndTailLSE.apply(logits, rows, ids, 1.0, tp_group, chunk_size, True, vocab_size)
    lse = torch.logsumexp(torch.cat([zy, lse_rest.unsqueeze(-1)], dim=-1), dim=-1)
    return (lse - zy[:, 0]).sum(), count
