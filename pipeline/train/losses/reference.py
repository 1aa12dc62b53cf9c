"""GKD loss on a vocab-parallel shard of student logits, against a sparse top-k teacher.

Per active position t (docs/architecture.md, "Loss"): teacher top-k ids ``K_t`` with logprobs ``ℓ`` stored at temperature 1,
student logits ``z`` over the full vocab, temperature ``τ``, JSD weight ``β``.

* ``renorm``: teacher ``softmax(ℓ/τ)`` and student ``softmax(z_K/τ)``, both restricted to ``K_t``
  (what ms-swift, twinkle and NeMo-RL do). Exact at any τ; blind to student mass outside ``K_t``.
* ``tail``: k+1 bins, the k ids plus one bin holding the rest of the mass on each side. The teacher's tail bin is
  the log tail mass the score stage stored (computed there from unquantised logprobs; recomputing ``1 − Σp`` from the
  quantised top-k goes ≤ 0 at confident positions), so training and held-out evaluation (``pipeline/evaluate.py``)
  see one teacher distribution. The student side is exact
  at any τ: its tail bin is ``logsumexp`` of ``z/τ`` over the vocab *minus* ``K_t`` (computed directly, not as
  ``1 − Σ``, so a confident student's tiny tail does not cancel away). The teacher side at τ ≠ 1 uses one-bin-tail
  tempering (DistillKit's choice): bins ``p_i^(1/τ)`` and ``p_tail^(1/τ)`` renormalised, because the full-vocab
  tempered teacher is not recoverable from the top-k alone. At τ = 1 it is exact.
* ``β = 0``: KL(p‖s); ``β = 1``: KL(s‖p); else ``β·KL(p‖m) + (1−β)·KL(s‖m)`` with ``m = β·p + (1−β)·s``.

Numerics: teacher bin probabilities (float64) are floored at ``TEACHER_EPS`` and the bins renormalised (the stored
top-k and tail are quantised, so they sum to 1 only within the codec's bound), so a ``-inf`` logprob or an empty
tail gives a finite loss; under reverse KL this caps the penalty for student mass there at
``-log(TEACHER_EPS)`` ≈ 27.6 nats per unit of mass instead of +inf. Active positions must have distinct ids in
``[0, V)``; inactive positions are never read. Entries marked not ``valid`` (teacher ids past the student's vocab,
whose mass the loader folds into the tail; shorter rows of a variable-k cache) are not bins on either side.

Tensor parallel (Megatron convention: the loss is replicated on every rank of ``tp_group``, gradients are local):
the raw logits at ``K_t`` are gathered by a masked gather + SUM all-reduce, and the log-normaliser by all-reducing
the max then the sum of exps. Reducing per-shard log-softmaxes instead gives the right loss but ~1 % wrong
gradients.

Memory: the only full-vocab pass (the tail ``logsumexp``) runs over chunks of ``chunk_size`` tokens in forward and
is recomputed in backward, so beyond the logits and their gradient only ``[chunk_size, V_local]`` temporaries exist.
The trainer's default (``fused_loss: true``) does better: ``fused_loss.py`` never builds the logits at all; this
module is its reference (``fused_loss: false``).

``opd_loss`` (``loss=opd``): the sampled-token on-policy distillation estimator on the student's own tokens; see
its docstring.

Test: ``python -m pytest tests/train/losses/test_loss.py``; benchmark: ``python benchmarks/loss_bench.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.train.losses.vocab_parallel import all_reduce, global_lse, tp_rank_world, valid_columns

TEACHER_EPS = 1e-12
# Relative floor for the student tail bin: below float32's smallest normal the complement has underflowed anyway.
_LOG_TINY = math.log(torch.finfo(torch.float32).tiny)
DEFAULT_CHUNK = 256


class _TopkAndTailLSE(torch.autograd.Function):
    """(logits[T, V_local], active rows[A], global ids[A, k]) -> (raw logits at the ids [A, k], lse_tail [A]).

    ``lse_tail = logsumexp over the global vocab minus the ids of logits/τ`` (only when ``with_tail``). One custom
    function for both outputs so backward writes a single ``[T, V_local]`` gradient, chunk by chunk, instead of
    autograd summing a dense gather-gradient and a dense softmax-gradient.
    This is the unfused path (`fused_loss: false`) on Megatron's logits; the fused output layer + loss, which never
    builds the ``[T, V]`` logits, is pipeline/train/losses/fused.py, tested against this one.
    """

    @staticmethod
    def forward(ctx, logits, rows, ids, tau, group, chunk_size, with_tail, vocab_size, valid=None):
        rank, _ = tp_rank_world(group)
        v_local = logits.shape[-1]
        # Columns at or past the real vocab (Megatron pads it to a multiple of TP) are skipped, not copied and masked.
        n_valid = valid_columns(vocab_size, rank, v_local)
        cdtype = torch.promote_types(logits.dtype, torch.float32)
        local = ids - rank * v_local
        inrange = (local >= 0) & (local < v_local)
        if valid is not None:  # an entry that is not a bin neither gathers nor leaves the complement
            inrange = inrange & valid
        idx = local.clamp(0, v_local - 1)
        # Ids owned by another rank read a clamped local entry that is zeroed before the SUM all-reduce.
        zk = logits[rows.unsqueeze(-1), idx].to(cdtype) * inrange
        all_reduce(zk, group)
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
            lse_tail = global_lse(lse_local, group)  # all shards' complements empty: -inf, not NaN
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
            return grad, None, None, None, None, None, None, None, None
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
        return grad, None, None, None, None, None, None, None, None


def teacher_bins(ell: Tensor, tail: Tensor | None, valid: Tensor | None, temperature: float, mode: str) -> Tensor:
    """Teacher log-probabilities over the bins (k for renorm, k+1 for tail: the stored log tail mass last), float64.

    ``tail``: the score stage's stored log mass outside the top-k; None recomputes ``1 − Σ exp(ℓ)``, which goes
    <= 0 where quantised top-k logprobs sum past 1 (the stored tail is computed from unquantised values: use it).
    ``valid``: entries to keep (False: not a bin at all — a teacher id the student cannot represent, whose mass the
    loader has already folded into the tail)."""
    log_eps = math.log(TEACHER_EPS)
    ell = ell.double().clamp_min(log_eps)
    if valid is not None:
        ell = torch.where(valid, ell, -math.inf)
    if mode == "renorm":
        return torch.log_softmax(ell / temperature, dim=-1)
    if tail is None:
        # 1 − Σp via -expm1(log Σp): accurate when the top-k holds almost all the mass.
        tail = torch.log((-torch.expm1(torch.logsumexp(ell, dim=-1))).clamp_min(TEACHER_EPS))
    bins = torch.cat([ell, tail.double().clamp_min(log_eps).unsqueeze(-1)], dim=-1)
    return torch.log_softmax(bins / temperature, dim=-1)  # one-bin-tail tempering (exact at τ = 1)


def student_bins(zk: Tensor, lse_tail: Tensor | None, valid: Tensor | None, temperature: float, mode: str) -> Tensor:
    """Student log-probabilities over the bins from its raw logits at the teacher ids ``zk`` [A, k] and (tail) the
    logsumexp of ``z/τ`` over the vocab minus the valid ids."""
    zt = zk / temperature
    if valid is not None:
        zt = torch.where(valid, zt, -math.inf)
    if mode == "tail":
        # Floor the tail "logit" relative to the row (empty/underflowed complement): finite loss, zero gradient there.
        top = zt.detach().amax(-1)
        floor = (torch.where(torch.isfinite(top), top, 0.0) + _LOG_TINY).to(zt.dtype)
        zt = torch.cat([zt, torch.maximum(lse_tail, floor).unsqueeze(-1)], dim=-1)
    return torch.log_softmax(zt, dim=-1)  # the tail bin's logit is the complement's logsumexp: log s over k+1 bins


def divergence(a: Tensor, b: Tensor, beta: float, valid: Tensor | None = None, mode: str = "tail") -> Tensor:
    """Per-position generalised JSD between teacher log-probs ``a`` and student log-probs ``b`` ([A, bins]).
    Bins that are not ``valid`` (and the rows of renorm mode with no valid bin at all) contribute exactly 0."""
    if valid is not None:
        keep = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], -1) if mode == "tail" else valid
        if mode == "renorm":  # a row with no representable teacher id has nothing to renormalise
            keep = keep & keep.any(-1, keepdim=True)
        a = torch.where(keep, a, 0.0)  # finite stand-ins, so masked terms have finite gradients (then zeroed)
        b = torch.where(keep, b, 0.0)
    if beta == 0.0:
        terms = a.exp() * (a - b)
    elif beta == 1.0:
        terms = b.exp() * (b - a)
    else:
        log_m = torch.logsumexp(torch.stack([a + math.log(beta), b + math.log1p(-beta)]), dim=0)
        terms = beta * a.exp() * (a - log_m) + (1.0 - beta) * b.exp() * (b - log_m)
    if valid is not None:
        terms = torch.where(keep, terms, 0.0)
    return terms.sum(-1)


MODES = ("tail", "renorm")  # topk_mode: the k+1 bins with the stored tail, or the top-k renormalised


def loss_arg_problems(beta: float, temperature: float, mode: str, mode_key: str = "mode") -> list[str]:
    """What is wrong with the loss's β, τ and mode (the one check: the losses raise it, the trainer's config
    validation lists it under its own key names)."""
    p = []
    if not 0.0 <= beta <= 1.0:
        p.append(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        p.append(f"temperature must be > 0, got {temperature}")
    if mode not in MODES:
        p.append(f"{mode_key} must be 'tail' or 'renorm', got {mode!r}")
    return p


def gkd_loss(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    mode: Literal["tail", "renorm"] = "tail",
    teacher_tail: Tensor | None = None,
    teacher_valid: Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum of the per-position GKD divergence over active positions, and the active count.

    ``logits``: ``[..., V_local]``, this TP rank's vocab slice (vocab_start = rank · V_local); ``teacher_ids``:
    ``[..., k]`` global vocab ids; ``teacher_logprobs``: ``[..., k]`` at temperature 1; ``mask``: ``[...]`` bool;
    ``teacher_tail``: ``[...]`` the stored log teacher mass outside the top-k (None: recomputed as ``1 − Σp``);
    ``teacher_valid``: ``[..., k]`` bool, False for entries that are not bins (see :func:`teacher_bins`).
    Leading dims are flattened. The sum is differentiable w.r.t. ``logits``; divide by the *global* active count
    (across micro-batches, grad-accum and DP ranks) where it is known. ``tp_group=None`` means no tensor parallelism.
    ``vocab_size``: the real (global) vocab size; logits columns at or past it (Megatron's padding to a multiple of
    TP) are left out of the student's distribution and get zero gradient, without a masked copy of the logits.
    This is the reference the fused output-layer loss (``fused_loss.fused_gkd_loss``) is tested against.
    """
    if problems := loss_arg_problems(beta, temperature, mode):
        raise ValueError("; ".join(problems))
    logits = logits.reshape(-1, logits.shape[-1])
    k = teacher_ids.shape[-1]
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    count = torch.tensor(rows.numel(), dtype=torch.long, device=logits.device)
    ids = teacher_ids.reshape(-1, k)[rows].long()
    valid = teacher_valid.reshape(-1, k)[rows] if teacher_valid is not None else None
    tail = teacher_tail.reshape(-1)[rows] if teacher_tail is not None else None
    a = teacher_bins(teacher_logprobs.reshape(-1, k)[rows], tail, valid, temperature, mode)
    zk, lse_tail = _TopkAndTailLSE.apply(
        logits, rows, ids, temperature, tp_group, chunk_size, mode == "tail", vocab_size, valid
    )
    b = student_bins(zk, lse_tail, valid, temperature, mode)
    div = divergence(a.to(b.dtype), b, beta, valid, mode)
    return div.sum(), count


def _label_logits(logits: Tensor, labels: Tensor, mask: Tensor, tp_group: dist.ProcessGroup | None, chunk_size: int,
                  vocab_size: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(active rows, their count, the label's logit [n, 1], the logsumexp of the other logits [n]) at `mask`'s
    positions: the tail kernel with k = 1 and τ = 1, what the CE and the OPD estimator both start from."""
    logits = logits.reshape(-1, logits.shape[-1])
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    count = torch.tensor(rows.numel(), dtype=torch.long, device=logits.device)
    ids = labels.reshape(-1)[rows].long().unsqueeze(-1)
    zy, lse_rest = _TopkAndTailLSE.apply(logits, rows, ids, 1.0, tp_group, chunk_size, True, vocab_size)
    return rows, count, zy, lse_rest


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
    rows, count, zy, lse_rest = _label_logits(logits, labels, mask, tp_group, chunk_size, vocab_size)
    lse = torch.logsumexp(torch.cat([zy, lse_rest.unsqueeze(-1)], dim=-1), dim=-1)
    return (lse - zy[:, 0]).sum(), count


@dataclass(frozen=True)
class OpdCorrection:
    """loss=opd on stale samples (`gkd onpolicy max_staleness >= 1`): truncated importance sampling. `behavior` is
    the sampler's logprob of each label, laid out like the loss mask (NaN where none: MicroBatch.behavior), `cap`
    the truncation C of the weights (`train.opd_is_cap`)."""

    behavior: Tensor
    cap: float


def opd_advantage(log_s: Tensor, log_p: Tensor, behavior: Tensor | None = None,
                  cap: float | None = None) -> tuple[Tensor, Tensor]:
    """The sampled-token estimator's per-position coefficient ``w · (log s − log p)`` and the plain ``log s − log p``
    (the per-token reverse-KL estimate), both detached, with log p floored at ``log TEACHER_EPS`` as the teacher
    bins are. Every OPD loss (this module's, fused.py's, exact.py's) takes them from here.

    ``w``: the estimator is unbiased only for tokens sampled from s itself. A token sampled by older weights b (its
    raw logprob ``behavior``, recorded by the sampler) is weighted by ``min(s(y)/b(y), cap)`` — per-token truncated
    importance sampling: the ratio corrects the sampling distribution, the cap bounds the variance a token the
    student now prefers far more would add (the truncation's bias is toward b). ``w = 1`` where ``behavior`` is NaN
    (no record) or no correction is asked (None)."""
    log_s = log_s.detach()
    adv = log_s - log_p.to(log_s.dtype).clamp_min(math.log(TEACHER_EPS))
    if behavior is None or cap is None:
        return adv, adv
    b = behavior.to(log_s.dtype)
    w = torch.where(torch.isnan(b), 1.0, (log_s - b).exp().clamp_max(cap))
    return w * adv, adv


def opd_loss(
    logits: Tensor,
    labels: Tensor,
    teacher_actual: Tensor,
    mask: Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    vocab_size: int | None = None,
    correction: OpdCorrection | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sampled-token on-policy distillation (``loss=opd``): ``Σ_t sg(log s(x_t) − log p(x_t)) · log s(x_t)`` over
    active positions, i.e. ``−Σ sg(log p − log s) · log s``, with ``x_t = labels`` the student's own sampled
    tokens and ``log p(x_t) = teacher_actual`` (the cache's actual-token logprob, floored at ``log TEACHER_EPS``
    as the teacher bins are). Its gradient is a single-sample estimate of ∇ KL(s‖p) at each position (the
    score-function identity, ``E_s[∇ log s] = 0``); the loss value itself is not the KL. Returns (that sum, the
    active count, ``Σ (log s − log p)``: the per-token reverse-KL estimate, detached). ``vocab_size``, TP: as in
    :func:`gkd_loss`; ``log s`` uses the same kernel as :func:`vocab_parallel_ce`. ``correction``: stale samples'
    importance weights (:func:`opd_advantage`), which scale each position's term.
    """
    rows, count, zy, lse_rest = _label_logits(logits, labels, mask, tp_group, chunk_size, vocab_size)
    log_s = zy[:, 0] - torch.logaddexp(zy[:, 0], lse_rest)
    wadv, adv = opd_advantage(log_s, teacher_actual.reshape(-1)[rows], *correction_at(correction, rows))
    return (wadv * log_s).sum(), count, adv.sum()


def correction_at(correction: OpdCorrection | None, rows: Tensor) -> tuple[Tensor | None, float | None]:
    """(behavior at the loss's gathered flat rows, cap) for :func:`opd_advantage`; (None, None) without a correction."""
    return (None, None) if correction is None else (correction.behavior.reshape(-1)[rows], correction.cap)
