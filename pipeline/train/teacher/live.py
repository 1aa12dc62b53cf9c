"""A live teacher inside the trainer (`gkd train teacher_live=DIR`): the baseline the cache is judged against.

What ms-swift, TRL and NeMo-RL do: the teacher is a frozen model in the same processes, run on every micro-batch's
own tokens. Here it is a Megatron-Core GPTModel with the student's TP split (no gradients, no optimizer state, no
DDP), and its output is reduced on the fly to exactly what the score stage stores — per scored position the top-k
ids and logprobs (temperature 1, rank order) and the log mass outside them — so the same loss consumes it:

    for each chunk of active rows:  z = h_c · W_localᵀ  (the teacher's vocab slice, [chunk, V_local], float32)
        local top-k of z, the local (max, Σexp) of z;  across TP: all-gather the k candidates of every rank and
        keep the best k, all-reduce the logsumexp;  logprobs = z_topk − lse;  tail = log(1 − Σ exp(logprobs))

so, as in the fused loss, no [tokens, vocab] tensor exists. Nothing is quantised (compare with the `exact` codec).
Teacher ids at or past the student's real vocab (a teacher with more embedding rows, same tokenizer) are folded
into the tail and marked invalid, the rule the loader applies to cached rows.

    python -m pytest tests/train/teacher/test_live_teacher.py
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.store.codec import tail_logprob
from pipeline.train.data.batch import fold_entries
from pipeline.train.losses.fused import CHUNK_BYTES, chunk_rows
from pipeline.train.losses.vocab_parallel import global_lse, tp_rank_world, valid_columns


@torch.no_grad()
def teacher_topk(hidden: Tensor, weight: Tensor, mask: Tensor, k: int, *, tp_group: dist.ProcessGroup | None = None,
                 vocab_size: int | None = None, student_vocab: int | None = None,
                 chunk_size: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Teacher rows for the active positions of a micro-batch.

    ``hidden``: ``[..., H]`` the teacher's final hidden states; ``weight``: ``[V_local, H]`` its output layer's vocab
    slice on this TP rank; ``mask``: ``[...]`` which positions to score (the micro-batch's loss mask);
    ``vocab_size``: the teacher's real vocab (Megatron's padding columns are skipped); ``student_vocab``: ids at or
    past it are folded into the tail. Returns ``(ids [..., k] int32, logprobs [..., k] float32, tail [...] float32,
    valid [..., k] bool)`` laid out like the loader's teacher arrays (zeros where inactive).
    """
    rank, world = tp_rank_world(tp_group)
    lead = mask.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    v_local = weight.shape[0]
    n_valid = valid_columns(vocab_size, rank, v_local)
    if n_valid < k and world == 1:
        raise ValueError(f"teacher vocab {n_valid} is smaller than k={k}")
    n = h.shape[0]
    ids = torch.zeros(n, k, dtype=torch.int64, device=h.device)
    lps = torch.zeros(n, k, dtype=torch.float32, device=h.device)
    tail = torch.zeros(n, dtype=torch.float32, device=h.device)
    chunk = chunk_size or chunk_rows(v_local, CHUNK_BYTES)
    cdtype = torch.promote_types(weight.dtype, torch.float32)  # bf16 weights: float32 after the matmul
    kk = min(k, n_valid)  # a rank whose slice is mostly padding offers fewer candidates
    for s in range(0, rows.numel(), chunk):
        z = None  # one [chunk, V_local] buffer at a time (fused_loss.CHUNK_BYTES): free the last before the matmul
        r = rows[s: s + chunk]
        z = (h[r].to(weight.dtype) @ weight.t()).to(cdtype)
        z = z[:, :n_valid]
        vals, idx = z.topk(kk, dim=-1)  # sorted, largest first
        m = z.amax(-1)
        se = z.sub_(m.unsqueeze(-1)).exp_().sum(-1)  # in place: z is not read again
        gid = idx + rank * v_local
        if world > 1:
            if kk < k:  # pad to a common width so all ranks gather the same shape
                vals = torch.cat([vals, vals.new_full((vals.shape[0], k - kk), -math.inf)], -1)
                gid = torch.cat([gid, gid.new_zeros(gid.shape[0], k - kk)], -1)
            all_vals = [torch.empty_like(vals) for _ in range(world)]
            all_ids = [torch.empty_like(gid) for _ in range(world)]
            dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
            dist.all_gather(all_ids, gid.contiguous(), group=tp_group)
            cand_v, cand_i = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
            vals, pick = cand_v.topk(k, dim=-1)
            gid = cand_i.gather(-1, pick)
        lse = global_lse(m + se.log(), tp_group)
        lp = vals - lse.unsqueeze(-1)
        ids[r], lps[r] = gid, lp.float()
        tail[r] = tail_logprob(lp, torch).float()  # from the unquantised values, as the score stage stores it
    valid = torch.ones(n, k, dtype=torch.bool, device=h.device)
    if student_vocab is not None:
        out = (ids >= student_vocab) & mask.reshape(-1, 1)
        if bool(out.any()):
            ids, lps, tail = fold_entries(ids, lps, tail, out, torch)
            tail, valid = tail.float(), ~out
    return (ids.to(torch.int32).reshape(*lead, k), lps.reshape(*lead, k), tail.reshape(lead), valid.reshape(*lead, k))
