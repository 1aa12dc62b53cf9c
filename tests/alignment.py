"""The alignment check of a student that equals its teacher: the GKD loss against the cached teacher rows is
≈ 0 at every beta, and the same rows shifted by one position make it large. Shared by the image and Qwen3.5 tests
(tests/score/test_images.py, tests/train/models/test_hf_backend.py), each with the bounds its rows allow."""

from __future__ import annotations

import torch

from pipeline.train.losses.reference import gkd_loss


def assert_aligned(logits: torch.Tensor, mb, *, below: float, min_positions: int, factor: float,
                   floor: float) -> None:
    """Per beta in (0, 0.5, 1): the mean loss over the micro-batch `mb`'s KD positions is below `below` (at least
    `min_positions` of them), and the rows rolled by one position give a mean above `factor` × max(that, `floor`)."""
    for beta in (0.0, 0.5, 1.0):
        s, n = gkd_loss(logits, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=beta, mode="tail")
        assert n > min_positions and (s / n).item() < below, (beta, n, (s / n).item())
        shifted = (torch.roll(mb.teacher_ids, 1, dims=1), torch.roll(mb.teacher_logprobs, 1, dims=1))
        s2, n2 = gkd_loss(logits, *shifted, torch.roll(mb.loss_mask, 1, dims=1), beta=beta, mode="tail")
        assert (s2 / n2).item() > factor * max((s / n).item(), floor), (beta, (s2 / n2).item())
