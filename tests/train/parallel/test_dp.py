"""Normalisation across micro-batches, gradient accumulation and data-parallel ranks: the same global batch split
three ways (DP=1 with 4 micro-batches, DP=1 with 2, DP=2 under torchrun with 2 per rank) trains the same model.

The cache mixes very short and very long samples (2 vs ~50 active positions), so a per-micro-batch mean instead
of the global active count (the bug of TRL #4719 / ms-swift #10165) weights them differently and fails here.
Compared under the cross-layout rule of tests/tolerance.py (SGD; per-step losses and the trained update).

Run: ``python -m pytest tests/train/parallel/test_dp.py`` (launches torchrun with 2 gloo processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_cache import build_tiny, score_into_cache
from tolerance import assert_layout_close, layout_gap

from pipeline.cli import main as cli

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> dict:
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("dp")
    teacher, student = build_tiny(root / "teacher"), build_tiny(root / "student", seed=1)
    vocab = AutoConfig.from_pretrained(teacher).vocab_size
    rng = np.random.default_rng(3)
    samples = []
    for i in range(32):  # 2 to 50 scored positions: however the loader pairs them, micro-batches differ
        length = 3 + (i * 13) % 54
        p = 1 if length < 10 else 6
        samples.append((rng.integers(3, vocab, size=length).astype(np.int32), p, "dataset" if i % 4 else "student"))
    score_into_cache(teacher, root / "cache", samples, shard_rows=32)  # one shard, one row group
    return {"student": student, "cache": root / "cache"}


def _args(d: dict, save: Path, micro: int, fused: bool = True, backend: str = "auto") -> list[str]:
    return [f"backend={backend}", f"student={d['student']}", f"cache=[{d['cache']}]", f"micro_batch_size={micro}", "global_batch_size=8",
            "seq_length=64", "train_steps=3", "warmup_steps=0", "optimizer=sgd", "lr=0.5", "min_lr=0.5",
            "sft_alpha=0.5", f"save_dir={save}", "save_interval=3", "progress=false", f"fused_loss={str(fused).lower()}"]


def _run(d: dict, save: Path, micro: int, dp: int = 1, backend: str = "auto", extra: tuple = ()
         ) -> tuple[list[dict], dict]:
    if dp == 1:
        assert cli(["train", *_args(d, save, micro, backend=backend), *extra]) == 0
    else:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(dp),
                        "-m", "pipeline.train.run", *_args(d, save, micro, backend=backend), *extra], check=True,
                       env=env, cwd=REPO, timeout=1800)
    assert cli(["export", "--checkpoint", str(save), "--out", str(save / "hf")]) == 0
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_file(save / "hf" / "model.safetensors")


@pytest.mark.distributed
def test_dp_and_accumulation_invariance(uneven, tmp_path):
    start = load_file(uneven["student"] / "model.safetensors")
    runs = {"dp1 x4": _run(uneven, tmp_path / "a", micro=2), "dp1 x2": _run(uneven, tmp_path / "b", micro=4),
            "dp2 x2": _run(uneven, tmp_path / "c", micro=2, dp=2)}
    ref_metrics, ref_w = runs["dp1 x4"]
    counts = [m["active_tokens"] for m in ref_metrics]
    assert len(counts) == 3 and all(c > 0 for c in counts)
    for name, (metrics, w) in runs.items():
        assert [m["active_tokens"] for m in metrics] == counts, name  # the same samples in each step
        for m, r in zip(metrics, ref_metrics, strict=True):
            assert_layout_close(torch.tensor([m["jsd"], m["sft"]]), torch.tensor([r["jsd"], r["sft"]]), f"{name} loss")
        assert_layout_close({k: w[k] - start[k] for k in start}, {k: ref_w[k] - start[k] for k in start}, name)


@pytest.mark.distributed
def test_hf_backend_dp_and_accumulation_invariance(uneven, tmp_path):
    """The same layouts on the transformers backend (torch DDP, gradients summed over ranks; FSDP2, weights,
    gradients and optimizer state sharded over the 2 ranks): DP=2 == FSDP=2 == DP=1 == the Megatron backend's DP=1
    run. Then the FSDP run stopped after step 2 (a checkpoint gathered from the shards) and rerun resumes exactly."""
    start = load_file(uneven["student"] / "model.safetensors")
    runs = {"hf dp1 x4": _run(uneven, tmp_path / "a", micro=2, backend="hf"),
            "hf dp2 x2": _run(uneven, tmp_path / "c", micro=2, dp=2, backend="hf"),
            "hf fsdp2 x2": _run(uneven, tmp_path / "f", micro=2, dp=2, backend="hf", extra=("fsdp=true",)),
            "megatron dp1 x4": _run(uneven, tmp_path / "m", micro=2, backend="megatron")}
    ref_metrics, ref_w = runs["hf dp1 x4"]
    for name, (metrics, w) in runs.items():
        assert [m["active_tokens"] for m in metrics] == [m["active_tokens"] for m in ref_metrics], name
        for m, r in zip(metrics, ref_metrics, strict=True):
            assert_layout_close(torch.tensor([m["jsd"], m["sft"]]), torch.tensor([r["jsd"], r["sft"]]), f"{name} loss")
        assert_layout_close({k: w[k] - start[k] for k in start}, {k: ref_w[k] - start[k] for k in start}, name)
    assert json.loads((tmp_path / "c" / "step_0000003" / "trainer.json").read_text())["backend"] == "hf"
    resumed = tmp_path / "r"
    for stop in (("exit_after=2",), ()):
        _run(uneven, resumed, micro=2, dp=2, backend="hf", extra=("fsdp=true", *stop))
    metrics, w = runs["hf fsdp2 x2"]
    again = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "jsd", "sft", "grad_norm", "active_tokens")
    assert [[m[k] for k in keys] for m in again] == [[m[k] for k in keys] for m in metrics]
    a = load_file(tmp_path / "f" / "step_0000003" / "student.safetensors")
    b = load_file(resumed / "step_0000003" / "student.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_per_microbatch_mean_would_fail_this_data(uneven):
    """The premise of the test above: on this data, in every step of the "dp1 x4" run, weighting its micro-batches
    equally (per-micro-batch means, averaged) instead of by their share of the step's tokens is off by far more
    than the rule's tolerance, so a trainer normalising per micro-batch could not pass it."""
    from pipeline.train.data.loader import ScoredLoader

    loader = ScoredLoader([uneven["cache"]], micro_batch_size=2, seq_length=64, seed=1234)
    for step in range(3):
        n = torch.tensor([float(loader.micro_batch(4 * step + m).loss_mask.sum()) for m in range(4)])
        w_global = n / n.sum()  # each micro-batch's share of the step's tokens
        w_mean = torch.full_like(n, 1 / len(n))
        assert layout_gap(w_mean, w_global) > 1e-1, (step, n)
