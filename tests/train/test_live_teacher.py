"""The live teacher's on-the-fly reduction (pipeline/train/live_teacher.py) against a full-softmax top-k, TP=2 vs
TP=1, the fold of ids past the student's vocab; the trainer trained by a live teacher against the same trainer on
a cache of the same rows (exact codec: the same steps; default codec: within its quantisation bound).

Run: ``python -m pytest tests/train/test_live_teacher.py``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.train.live_teacher import teacher_topk

REPO = Path(__file__).resolve().parents[2]


def _case(seed: int, t: int = 11, h: int = 8, v: int = 50, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g, dtype=dtype), torch.randn(v, h, generator=g, dtype=dtype) * 1.5,
            torch.rand(t, generator=g) > 0.3)


def test_matches_full_softmax_topk():
    h, w, mask = _case(0)
    ids, lps, tail, valid = teacher_topk(h, w, mask, 5, chunk_size=4)
    ref = torch.log_softmax(h @ w.t(), -1).topk(5, -1)
    assert valid.all()
    assert torch.equal(ids[mask].long(), ref.indices[mask])
    torch.testing.assert_close(lps[mask].double(), ref.values[mask], rtol=0, atol=1e-6)  # float32 outputs
    mass = ref.values[mask].exp().sum(-1)
    torch.testing.assert_close(tail[mask].double(), torch.log1p(-mass), rtol=0, atol=1e-5)
    assert not ids[~mask].any() and not lps[~mask].any()  # inactive positions stay zero


def test_ids_past_the_student_vocab_are_folded_into_the_tail():
    """A teacher with more embedding rows: its top-k entries at ids >= the student's vocab become invalid bins and
    their mass joins the tail (the loader's rule for cached rows)."""
    h, w, mask = _case(1)
    w[45:] += 4.0 * w[45:].abs()  # make the extra rows likely to be in the top-k
    ids, lps, tail, valid = teacher_topk(h, w, mask, 6, student_vocab=45)
    full = torch.log_softmax(h @ w.t(), -1)
    top = full.topk(6, -1)
    assert (~valid[mask]).any()
    assert torch.all(ids[~valid] == 0) and torch.all(torch.isneginf(lps[~valid]))
    kept = top.values.masked_fill(top.indices >= 45, -math.inf)
    ref_tail = torch.log1p(-kept.exp().sum(-1))  # everything outside the representable kept entries
    torch.testing.assert_close(tail[mask].double(), ref_tail[mask], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_tp2_matches_tp1():
    worker = Path(__file__).with_name("_live_tp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP2 OK") == 2, proc.stdout[-3000:]
