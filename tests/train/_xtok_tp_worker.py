"""TP=2 worker for tests/train/losses/test_xtok_loss.py::test_tp2_matches_tp1: the cross-tokenizer losses (ULD, GOLD at
β 0 and 0.5, with and without the SFT mix) on a vocab-split output weight equal TP=1 and the plain definition
(`xtok_loss_reference` + CE on the full logits, autograd): the same loss on every rank, the same hidden-state
gradient, each rank's weight-gradient rows of the full one.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train/_xtok_tp_worker.py`` (plain
torch.distributed with gloo; no Megatron). Prints "TP2 OK" on each rank, exits non-zero on a mismatch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tolerance import assert_layout_close

from pipeline.train.losses.xtok import fused_xtok_loss, gold_weights, xtok_loss_reference

B, T, H, V, K = 2, 14, 16, 37, 6  # V odd: TP=2 pads the last slice (Megatron's rule)


def make_case(seed: int, dtype: torch.dtype) -> dict:
    """Two rows in the loader's layout: a 3-token prompt, then spans of 1-3 student tokens (head: the loss
    position carrying the teacher's merged top-k; members point at it); row 0 a dataset row (SFT), row 1 not.
    Teacher entries: K distinct ids, the matched ones given as student ids, the rest -1; some entries invalid."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype) * 1.5
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = -1
    mask = torch.zeros(B, T, dtype=torch.bool)
    span_head = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        t = 2
        while t < T:
            n = min(int(torch.randint(1, 4, (1,), generator=g)), T - t)
            mask[b, t] = True
            span_head[b, t + 1:t + n] = b * T + t
            t += n
    sft = torch.zeros(B, T, dtype=torch.bool)
    sft[0, 2:] = True
    matched = torch.rand(V, generator=g) < 0.6
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * T)]).reshape(B, T, K)
    sid = torch.where(matched[ids], ids, -1)
    p = torch.softmax(torch.randn(B, T, K, generator=g, dtype=dtype) * 2, -1) * 0.9
    later = -torch.rand(B, T, 1, generator=g, dtype=dtype)  # the span's later teacher tokens' log-factor
    lp = p.log() + later
    valid = torch.rand(B, T, K, generator=g) < 0.85
    tail = (1 - (p * valid).sum(-1)).log() + later.squeeze(-1)
    return dict(h=h, w=w, labels=labels, mask=mask, span_head=span_head, sft=sft, matched=matched, sid=sid, lp=lp,
                valid=valid, tail=tail)


def reference(c: dict, kind: str, beta: float, kd_w: float, sft_w: float):
    """The plain definition on full logits h·Wᵀ (autograd): loss, ∂h, ∂W."""
    h, w = c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()
    logits = h @ w.t()
    total, _ = xtok_loss_reference(logits, c["labels"], c["mask"], c["span_head"], c["sid"], c["lp"], c["valid"],
                                   c["tail"], kind=kind, matched=c["matched"], weights=weights(c), beta=beta)
    on = c["sft"] & (c["labels"] >= 0)
    ce = -torch.log_softmax(logits, -1).gather(-1, c["labels"].clamp_min(0).unsqueeze(-1)).squeeze(-1)[on].sum()
    loss = kd_w * total + sft_w * ce
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), gh, gw


def weights(c: dict) -> tuple[float, float]:
    return gold_weights(int(c["matched"].sum()), 2 * V)


def fused(c: dict, h, w, kind: str, beta: float, kd_w: float, sft_w: float, group):
    return fused_xtok_loss(h, w, c["labels"], c["mask"], c["span_head"], c["sid"], c["lp"], c["valid"], c["tail"],
                           kind=kind, matched=c["matched"], weights=weights(c), beta=beta,
                           sft_mask=c["sft"] if sft_w > 0 else None, kd_weight=kd_w, sft_weight=sft_w,
                           vocab_size=V, chunk_size=3, tp_group=group)


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_pad = -(-V // world) * world
    v_local = v_pad // world
    for dtype in (torch.float64, torch.float32):
        c = make_case(seed=0, dtype=dtype)  # same data on every rank, as in TP
        w_full = torch.cat([c["w"], torch.zeros(v_pad - V, H, dtype=dtype)])
        for kind, beta in (("uld", 0.5), ("gold", 0.5), ("gold", 0.0)):
            for sft_w in (0.0, 0.4):
                name = f"{dtype} {kind} β={beta} sft={sft_w}"
                ref, gh_ref, gw_ref = reference(c, kind, beta, 0.7, sft_w)
                assert math.isfinite(float(ref)) and float(gh_ref.abs().max()) > 0, name
                gw_ref = torch.cat([gw_ref, torch.zeros(v_pad - V, H, dtype=dtype)])
                runs = {"TP=1": (None, w_full, gw_ref),
                        f"TP={world}": (group, w_full[rank * v_local:(rank + 1) * v_local],
                                        gw_ref[rank * v_local:(rank + 1) * v_local])}
                for layout, (grp, w0, gw_want) in runs.items():
                    h = c["h"].clone().requires_grad_()
                    w = w0.clone().requires_grad_()
                    out = fused(c, h, w, kind, beta, 0.7, sft_w, grp)
                    gh, gw = torch.autograd.grad(out.loss, (h, w))
                    assert_layout_close(out.loss, ref, f"{name} {layout} loss", dtype)
                    assert_layout_close(gh, gh_ref, f"{name} {layout} hidden grad", dtype)
                    assert_layout_close(gw, gw_want, f"{name} {layout} weight grad", dtype)
    print(f"TP2 OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
