"""Cross-tokenizer losses from the cache: ULD and GOLD over aligned spans (`loss=uld|gold`).

A cross-tokenizer cache (pipeline/store/align.py) stores teacher rows per teacher token and the aligned spans of each
completion. The loader (train/data/loader.py) lays a sample out in the STUDENT's tokens and puts, at the first student
position of each span (its *head*, predicting the span's first student token), the teacher's row of the span's first
teacher token, merged over the span; the span's other student positions (*members*) point at their head
(the micro-batch's `spans.head`). Merging is TRL's "observed" strategy (`ULDLoss._merge_probabilities_with_alignment_groups`):

    merged(v) = p(first token = v | context) · Π_{later tokens j of the span} max(p(x_j | x_<j), 1e-8)

for the teacher from the cache (top-k at the span's first teacher token; the later tokens' actual logprobs), for the
student from its own logits (head row's softmax; members' label probabilities). Per span, with s = the student's merged
vector (full student vocabulary) and t = the teacher's (top-k entries + tail mass τ, both scaled by the same factor):

- **ULD** (Boizard et al. 2024; TRL `ULDLoss`, `uld_use_hybrid_loss=False`): Wasserstein-1 between the sorted
  vectors, which for this cost is the L1 distance of the descending sorts: Σ_r |s_(r) − t_(r)|. The cache knows the
  teacher's first k sorted entries only, so the rest is one bin: ours = Σ_{r≤k} |s_(r) − t_(r)| + |Σ_{r>k} s_(r) − τ|.
  Bound (triangle inequality, A = Σ_{r>k} s_(r)): ours ≤ full ≤ ours + 2·min(A, τ); equal when τ = 0 (full rows).
- **GOLD** (TRL's hybrid ULD, `uld_use_hybrid_loss=True`): the vocabulary map (teacher id → the student id of the same
  token string) splits both vocabularies. Matched ids: TRL's generalized JSD on the (unnormalised) probabilities,
  clamped at 1e-8, summed over the matched student ids; a matched id outside the teacher's top-k gets teacher
  probability 0 (clamped). Unmatched: the sorted L1 as in ULD, over unmatched entries only, the teacher's whole tail τ
  as the one bin. Weighted w_m = matched ids / teacher vocab, w_u = 1 − w_m (TRL's adaptive weights), or
  `gold_matched_weight`/`gold_unmatched_weight`. Bound for 0 < β < 1, C = log(1/min(β, 1−β)): |full_u − ours_u| ≤ 2τ
  and |full_m − ours_m| ≤ C·Σ_{v matched, not in the top-k} ((1−β)·max(s_v, 1e-8) + β·max(t_v, 1e-8)) ≤
  C·((1−β)·(S_out + n·1e-8) + β·(τ + n·1e-8)) (each elementwise JSD term lies in [0, C·m_v], m_v the mixture mass).

Normalisation: the sum over spans divided by the global count of spans (the KD count); TRL divides each sample's sum
by its span count and averages over samples, the same for one sample. SFT (GKD's mix, `sft_alpha`): CE over every
student completion position of dataset rows, as in plain GKD.

Fused (the only path: no `[tokens, vocab]` logits): three passes over chunks of rows, each computing `[chunk, V]`
logits and consuming them: (1) members' label logprobs → each span's student factor; (2) heads: the span loss and
its gradient w.r.t. the head's logits (autograd inside the chunk, through the top-k) and w.r.t. the factor;
(3) members and SFT rows: the factor's gradient times (onehot − softmax), and CE's softmax − onehot. ∂h and ∂W are
formed per chunk as in fused_loss.py; backward only scales them.

Tensor parallelism (each rank holds a slice of the student vocabulary, train/losses/vocab_parallel.py): the loss needs no
full vector on any rank. The student's logsumexp and label logit are all-reduced as in fused_loss.py; the matched
JSD is a sum over ids (each rank's partial sum, all-reduced); the sorted L1 needs the student's top-k values and the
row's sum: each rank's local top-k, all-gathered, and the top-k of those k·TP candidates are the global top-k
exactly (an entry of the global top-k is in its own rank's top-k), and the sum is all-reduced. Every rank then
computes the same loss (replicated, vocab_parallel.py's `replicated_sum`/`replicated_gather`), and the gradient
reaches each rank's own slice only: inside a chunk autograd runs with the global logsumexp L and the span factor
log c as leaves, their per-rank gradient parts are summed over the group, and ∂/∂z_v gains ∂D/∂L · softmax_v.
∂h is all-reduced once at the end (fused_loss.py's rule).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.train.losses.fused import CHUNK_BYTES, FusedOut, keep_grads, scaled_grads
from pipeline.train.losses.vocab_parallel import (
    all_reduce,
    global_lse,
    replicated_gather,
    replicated_sum,
    tp_rank_world,
    valid_columns,
)

# The cross-tokenizer losses (`loss=uld|gold`): the one list the config, the trainer and the on-policy driver use.
XTOK_LOSSES = ("uld", "gold")

EPS = 1e-8  # TRL's clamp of probabilities (token factors and the JSD's logs)
LOG_EPS = math.log(EPS)


def gold_weights(matched: int, teacher_vocab: int, matched_weight: float | None = None,
                 unmatched_weight: float | None = None) -> tuple[float, float]:
    """(w_m, w_u): the configured pair, else TRL's adaptive one (matched ids / teacher vocabulary)."""
    if matched_weight is not None:
        return float(matched_weight), float(unmatched_weight)
    w = matched / max(1, teacher_vocab)
    return w, 1.0 - w


def _sorted_l1(s: Tensor, t: Tensor, t_on: Tensor, tail: Tensor, group: dist.ProcessGroup | None = None,
               vocab: int | None = None) -> Tensor:
    """Σ_{r<q} |s_(r) − t_(r)| + |Σ_{r≥q} s_(r) − τ| per row; s [n, V] (entries out of play are 0), t [n, k] with
    t_on marking its q entries in play (the rest 0), tail τ [n]. Only the student's first k sorted entries are
    compared one by one, so a top-k (not a sort of all V) finds them, and the rest is the row's sum less theirs: the
    loss's hot spot at a real vocabulary (V = 150k, k = 32). Under TP `s` is this rank's slice of a `vocab`-wide
    vector: the global top-k is the top-k of the ranks' gathered local ones, the sum all-reduced (module docstring)."""
    width = min(s.shape[-1] if vocab is None else vocab, t.shape[-1])
    ss = torch.topk(s, min(width, s.shape[-1]), dim=-1, sorted=True).values
    total = s.sum(-1)
    if tp_rank_world(group)[1] > 1:  # a rank with fewer columns than `width` offers zeros (no entry is below 0)
        ss = torch.nn.functional.pad(ss, (0, width - ss.shape[-1]))
        ss = torch.topk(replicated_gather(ss, group), width, dim=-1, sorted=True).values
        total = replicated_sum(total, group)
    tt = torch.sort(torch.where(t_on, t, 0.0), dim=-1, descending=True).values
    if tt.shape[-1] > width:  # V < k: the student's missing ranks hold 0
        ss = torch.nn.functional.pad(ss, (0, tt.shape[-1] - width))
    q = t_on.sum(-1)
    head = torch.arange(ss.shape[-1], device=s.device).unsqueeze(0) < q.unsqueeze(-1)  # [n, k]
    known = torch.where(head, (ss - tt).abs(), 0.0).sum(-1)
    rest = total - torch.where(head, ss, 0.0).sum(-1)
    return known + (rest - tail).abs()


def _jsd_terms(s: Tensor, t: Tensor, beta: float) -> Tensor:
    """TRL's generalized JSD (GOLDTrainer.generalized_jsd_loss, logits_are_probs=True), elementwise. TRL takes logs of
    the clamped probabilities and log-adds them; the mixture is formed from the clamped probabilities directly (the
    same value, two fewer [n, V] exps and no logaddexp)."""
    sc, tc = s.clamp_min(EPS), t.clamp_min(EPS)
    ls, lt = sc.log(), tc.log()
    if beta == 0:
        return tc * (lt - ls)
    if beta == 1:
        return sc * (ls - lt)
    lm = (sc * (1 - beta) + tc * beta).log()
    return beta * tc * (lt - lm) + (1 - beta) * sc * (ls - lm)


def span_divergence(z: Tensor, logc: Tensor, t_lp: Tensor, t_sid: Tensor, t_valid: Tensor, t_tail: Tensor, *,
                    kind: str, matched: Tensor | None = None, weights: tuple[float, float] = (0.0, 1.0),
                    beta: float = 0.5, n_vocab: int | None = None, lse: Tensor | None = None,
                    group: dist.ProcessGroup | None = None, offset: int = 0) -> Tensor:
    """Per span (row): ULD or GOLD between the student's merged vector softmax(z)·exp(logc) over its vocabulary and
    the teacher's merged top-k (logprobs t_lp, student ids t_sid (-1: unmatched), t_valid) and tail (log, merged).
    `matched`: bool [V] of the student ids in the vocabulary map (GOLD). `n_vocab`: the vocabulary's size; columns
    past it are padding. Under TP (`group`), z is this rank's slice (ids from `offset`, `matched` its slice of the
    map, padding columns -inf), `lse` the global logsumexp of each row and n_vocab the whole vocabulary's size; the
    result is the same on every rank."""
    if tp_rank_world(group)[1] == 1 and n_vocab is not None and n_vocab < z.shape[-1]:
        z = z[:, :n_vocab]
        matched = None if matched is None else matched[:n_vocab]
    dtype = torch.promote_types(z.dtype, torch.float32)
    z = z.to(dtype)
    lse = torch.logsumexp(z, -1) if lse is None else lse.to(dtype)
    s = (z - (lse - logc.to(dtype)).unsqueeze(-1)).exp()  # softmax(z) · c
    t = torch.where(t_valid, t_lp.to(dtype).exp(), 0.0)
    tail = t_tail.to(dtype).exp()
    world = tp_rank_world(group)[1]
    vocab = None if world == 1 else (n_vocab if n_vocab is not None else s.shape[-1] * world)  # whole vocabulary
    if kind == "uld":
        return _sorted_l1(s, t, t_valid, tail, group, vocab)
    w_m, w_u = weights
    local = t_sid - offset
    own = t_valid & (t_sid >= 0) & (local >= 0) & (local < s.shape[-1])  # matched entries of this rank's ids
    dense = torch.zeros_like(s).scatter_add_(1, torch.where(own, local, 0).long(), torch.where(own, t, 0.0))
    jsd = replicated_sum(torch.where(matched.unsqueeze(0), _jsd_terms(s, dense, beta), 0.0).sum(-1), group)
    unmatched = _sorted_l1(torch.where(matched.unsqueeze(0), 0.0, s), t, t_valid & (t_sid < 0), tail, group, vocab)
    return w_m * jsd + w_u * unmatched


def xtok_rows(span_head: Tensor, mask: Tensor, sft_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Flat row indices: heads (KD positions), members (with a head), SFT-only rows (neither)."""
    heads = mask.reshape(-1).nonzero().squeeze(-1)
    sh = span_head.reshape(-1)
    members = (sh >= 0).nonzero().squeeze(-1)
    extra = torch.zeros_like(sh, dtype=torch.bool)
    if sft_mask is not None:
        extra = sft_mask.reshape(-1) & (sh < 0) & ~mask.reshape(-1)
    return heads, members, extra.nonzero().squeeze(-1)


def xtok_loss_reference(logits: Tensor, labels: Tensor, mask: Tensor, span_head: Tensor, teacher_ids: Tensor,
                        teacher_logprobs: Tensor, teacher_valid: Tensor, teacher_tail: Tensor, *, kind: str,
                        matched: Tensor | None = None, weights: tuple[float, float] = (0.0, 1.0), beta: float = 0.5,
                        vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
    """(Σ over spans of the divergence, span count) on full logits [..., V]: the plain autograd definition the
    fused pass is tested against (and that `fused_loss: false` would run)."""
    v = logits.shape[-1]
    z = logits.reshape(-1, v).to(torch.promote_types(logits.dtype, torch.float32))
    y = labels.reshape(-1)
    heads, members, _ = xtok_rows(span_head, mask, None)
    logc = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
    if members.numel():
        zm = z[members]
        if vocab_size is not None and vocab_size < v:
            zm = zm[:, :vocab_size]
        lp = (zm.gather(1, y[members].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(zm, -1)).clamp_min(LOG_EPS)
        logc = logc.index_add(0, span_head.reshape(-1)[members], lp)
    k = teacher_ids.shape[-1]
    d = span_divergence(z[heads], logc[heads], teacher_logprobs.reshape(-1, k)[heads],
                        teacher_ids.reshape(-1, k)[heads].long(), teacher_valid.reshape(-1, k)[heads],
                        teacher_tail.reshape(-1)[heads], kind=kind, matched=matched, weights=weights, beta=beta,
                        n_vocab=vocab_size)
    return d.sum(), torch.tensor(heads.numel(), device=z.device)


class _FusedXtok(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, heads, members, extra, head_of, y, sft_on, teacher, opts):
        t_lp, t_sid, t_valid, t_tail = teacher
        kind, matched, weights, beta, n_vocab, chunk, kd_weight, sft_weight, group = opts
        rank, world = tp_rank_world(group)
        v_local = weight.shape[0]
        offset = rank * v_local
        n_valid = valid_columns(n_vocab, rank, v_local)
        vocab = n_vocab if n_vocab is not None else v_local * world  # the whole vocabulary's real size
        if matched is not None:  # this rank's slice of the map, False on padding columns
            matched = torch.nn.functional.pad(matched[offset:offset + n_valid], (0, v_local - n_valid))
        y_local = y - offset
        y_own = (y_local >= 0) & (y_local < n_valid)
        y_idx = y_local.clamp(0, max(v_local - 1, 0)).unsqueeze(-1)
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        want_h, want_w = hidden.requires_grad, weight.requires_grad
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if want_w else None
        n_rows = hidden.shape[0]
        logc = torch.zeros(n_rows, dtype=cdtype, device=hidden.device)
        g_logc = torch.zeros(n_rows, dtype=cdtype, device=hidden.device)
        kd_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
        sft_sum = torch.zeros((), dtype=cdtype, device=hidden.device)

        def logits(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            """This rank's [rows, V_local] logits (padding columns -inf), the global logsumexp and label logit."""
            z = (hidden[rows].to(weight.dtype) @ weight.t()).to(cdtype)
            if n_valid < v_local:
                z[:, n_valid:] = -math.inf
            lse = global_lse(torch.logsumexp(z, -1), group)
            zy = all_reduce(torch.where(y_own[rows], z.gather(1, y_idx[rows]).squeeze(-1), 0.0), group)
            return z, lse, zy

        def apply(rows: Tensor, gz: Tensor) -> None:
            if n_valid < v_local:
                gz[:, n_valid:] = 0.0
            if want_h:  # this rank's part; all-reduced at the end
                grad_h[rows] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w.add_(gz.t().to(weight.dtype) @ hidden[rows].to(weight.dtype))

        def softmax_times(z: Tensor, lse: Tensor, coef: Tensor) -> Tensor:
            """coef · softmax(z) over this rank's columns (in place on z), finite where a row has no mass."""
            return z.sub_(lse.unsqueeze(-1)).exp_().mul_(torch.where(torch.isfinite(lse), coef, 0.0).unsqueeze(-1))

        # (1) members: label logprobs -> each span's student factor log c (clamped as TRL's 1e-8)
        for s in range(0, members.numel(), chunk):
            rows = members[s:s + chunk]
            z, lse, zy = logits(rows)
            logc.index_add_(0, head_of[rows], (zy - lse).clamp_min(LOG_EPS))
            del z
        # (2) heads: the span divergence and its gradients w.r.t. the head's logits and the factor (+ CE). The global
        # logsumexp L and log c are leaves: each rank's autograd sees only its slice's part of their gradients.
        for s in range(0, heads.numel(), chunk):
            rows = heads[s:s + chunk]
            z, lse, zy = logits(rows)
            with torch.enable_grad():
                zl = z.detach().requires_grad_()
                ll = lse.detach().requires_grad_()
                lc = logc[rows].detach().requires_grad_()
                d = span_divergence(zl, lc, t_lp[rows], t_sid[rows], t_valid[rows], t_tail[rows], kind=kind,
                                    matched=matched, weights=weights, beta=beta, n_vocab=vocab, lse=ll,
                                    group=group, offset=offset)
                gz, gll, gl = torch.autograd.grad(kd_weight * d.sum(), [zl, ll, lc], allow_unused=True)
            gz = torch.zeros_like(z) if gz is None else gz
            gll = all_reduce(torch.zeros_like(lse) if gll is None else gll, group)
            gl = all_reduce(torch.zeros_like(lse) if gl is None else gl, group)
            on = sft_on[rows]
            ce = torch.where(on, lse - zy, 0.0)
            kd_sum += d.detach().sum()
            sft_sum += ce.sum()
            g_logc[rows] = gl  # d total / d log c of each span (kd_weight included)
            if want_h or want_w:
                # ∂L/∂z_v = softmax_v: the divergence's ∂D/∂L and CE's sft_weight (CE = L − z_y)
                gz = gz.add_(softmax_times(z, lse, gll + sft_weight * on.to(cdtype)))
                gz.scatter_add_(1, y_idx[rows], ((y_own[rows] & on).to(gz.dtype) * -sft_weight).unsqueeze(-1))
                apply(rows, gz)
            del z, gz
        # (3) members and SFT-only rows: ∂(kd_weight·D)/∂log c · ∂log c/∂z = g·(onehot − softmax) where unclamped
        rest = torch.cat([members, extra]).sort().values
        for s in range(0, rest.numel(), chunk):
            rows = rest[s:s + chunk]
            z, lse, zy = logits(rows)
            on = sft_on[rows]
            sft_sum += torch.where(on, lse - zy, 0.0).sum()
            if not (want_h or want_w):
                continue
            hd = head_of[rows]
            live = (hd >= 0) & (zy - lse > LOG_EPS)
            g = torch.where(live, g_logc[hd.clamp_min(0)], 0.0)  # d total / d log p(y)
            coef = sft_weight * on.to(cdtype) - g  # total = ... + g·log p(y) − ... ; CE = −log p(y)
            gz = softmax_times(z, lse, coef)
            gz.scatter_add_(1, y_idx[rows], torch.where(y_own[rows], -coef, 0.0).unsqueeze(-1))
            apply(rows, gz)
            del z, gz
        if want_h:
            all_reduce(grad_h, group)  # every rank's vocabulary slice adds its part of ∂h
        keep_grads(ctx, grad_h, grad_w, weight.dtype)
        return kd_weight * kd_sum + sft_weight * sft_sum, kd_sum, sft_sum

    @staticmethod
    def backward(ctx, g_loss, _g_kd, _g_sft):
        return scaled_grads(ctx, g_loss) + (None,) * 8


def fused_xtok_loss(hidden: Tensor, weight: Tensor, labels: Tensor, mask: Tensor, span_head: Tensor,
                    teacher_ids: Tensor, teacher_logprobs: Tensor, teacher_valid: Tensor, teacher_tail: Tensor, *,
                    kind: str, matched: Tensor | None = None, weights: tuple[float, float] = (0.0, 1.0),
                    beta: float = 0.5, sft_mask: Tensor | None = None, kd_weight: float = 1.0,
                    sft_weight: float = 0.0, vocab_size: int | None = None, chunk_size: int | None = None,
                    tp_group: dist.ProcessGroup | None = None) -> FusedOut:
    """ULD/GOLD over aligned spans (and SFT CE) of ``logits = hidden · weightᵀ`` without materialising them.
    ``mask``: span heads (KD positions); ``span_head``: per position the flat index of its span's head (members),
    -1 elsewhere; teacher arrays [..., k] at the heads (ids: the student id of a matched entry, -1 unmatched).
    Under TP, ``weight`` is this rank's vocabulary slice and ``matched`` the whole map (module docstring)."""
    if kind not in XTOK_LOSSES:
        raise ValueError(f"kind must be 'uld' or 'gold', got {kind!r}")
    if kind == "gold" and matched is None:
        raise ValueError("kind='gold' needs the matched student ids (the vocabulary map)")
    h = hidden.reshape(-1, hidden.shape[-1])
    k = teacher_ids.shape[-1]
    heads, members, extra = xtok_rows(span_head, mask, sft_mask)
    y = torch.where(labels.reshape(-1) >= 0, labels.reshape(-1), 0).long()
    sft_on = sft_mask.reshape(-1) if sft_mask is not None else torch.zeros_like(mask.reshape(-1))
    teacher = (teacher_logprobs.reshape(-1, k), teacher_ids.reshape(-1, k).long(), teacher_valid.reshape(-1, k),
               teacher_tail.reshape(-1))
    # several [chunk, V] float32 buffers live at once inside a chunk (sort, JSD): an eighth of fused_loss's rows
    chunk = chunk_size or int(min(256, max(8, CHUNK_BYTES // (32 * max(1, weight.shape[0])))))
    loss, kd_sum, sft_sum = _FusedXtok.apply(
        h, weight, heads, members, extra, span_head.reshape(-1), y, sft_on, teacher,
        (kind, matched, weights, float(beta), vocab_size, chunk, float(kd_weight), float(sft_weight), tp_group))
    zero = torch.zeros((), dtype=kd_sum.dtype, device=h.device)
    return FusedOut(loss, kd_sum.detach(), torch.tensor(heads.numel(), device=h.device), sft_sum.detach(),
                    torch.tensor(int(sft_on.sum()), device=h.device), zero, zero, torch.tensor(0, device=h.device))
