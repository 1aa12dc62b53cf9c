"""Context parallelism (pipeline/train/parallel/context_parallel.py): CP=2 == CP=1, and a sample crossing a chunk boundary
keeps its alignment.

- The split itself (no process group): every rank's zig-zag columns, put back together, are the padded micro-batch.
- One trainer step at CP=2 (torchrun, gloo: CP=2 x DP=1 on 2 processes, and TP=2 x CP=2 on 4) vs CP=1, on the same
  packed (and padded) micro-batches whose samples cross the chunk boundaries: the same loss sums and the same
  gradients (HF layout; a LoRA adapter's in peft layout) under tests/tolerance.py's rule, with the fused loss (packed
  rows), the unfused one with selective recompute (padded rows), a LoRA adapter with full recompute, and loss=opd
  (its sampled-token sums too). Both sides
  are the real `train_step` (Megatron's schedule, `forward_step`, `loss_func`, DDP).
- Through the CLI: a CP=2 run stopped and resumed from its checkpoint against a CP=1 run (losses, trained weights).
- The scoring model trained on its own cache under CP=2: loss ~ 0 per active position; the teacher rows paired one
  position off (the classic bug): large.

Run: ``python -m pytest tests/train/parallel/test_context_parallel.py`` (the torchrun test is marked distributed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import assert_layout_close

from pipeline.train.data.loader import ScoredLoader
from pipeline.train.metrics import OPD_KL_SUM, OPD_SUM, SFT_SUM
from pipeline.train.parallel.context_parallel import columns, split

REPO = Path(__file__).resolve().parents[3]


def test_split_is_the_zigzag_of_the_padded_rows(tiny):
    """cp=3 on 32-column rows: padded to 36 (6 chunks of 6), rank r holds chunks r and 5 - r; the ranks' parts
    put back at their columns are the padded batch, the padding being loss-free padding of its own document."""
    mb = ScoredLoader([tiny["cache"]], micro_batch_size=2, seq_length=32, seed=0).micro_batch(0)
    b, w = mb.input_ids.shape
    assert w == 32
    assert columns(12, 3, 0).tolist() == [0, 1, 10, 11] and columns(12, 3, 2).tolist() == [4, 5, 6, 7]
    parts = [split(mb, 3, r) for r in range(3)]
    doc_ids = parts[0][1]
    assert doc_ids.shape == (b, 36) and torch.equal(doc_ids[:, :w], mb.doc_ids) and bool((doc_ids[:, w:] == -1).all())
    for name in ("input_ids", "labels", "loss_mask", "teacher_ids", "teacher_logprobs", "teacher_tail", "doc_ids",
                 "position_ids"):
        whole = torch.empty((b, 36, *getattr(mb, name).shape[2:]), dtype=getattr(mb, name).dtype)
        for r, (local, _) in enumerate(parts):
            assert local.input_ids.shape == (b, 12)
            whole[:, columns(36, 3, r)] = getattr(local, name)
        assert torch.equal(whole[:, :w], getattr(mb, name)), name
    assert torch.equal(parts[1][0].position_ids[0], torch.tensor([6, 7, 8, 9, 10, 11, 24, 25, 26, 27, 28, 29]))
    # the padded columns: no loss, no label; the counters stay the whole micro-batch's
    whole_mask = torch.zeros(b, 36, dtype=torch.bool)
    whole_labels = torch.zeros(b, 36, dtype=torch.long)
    for r, (local, _) in enumerate(parts):
        whole_mask[:, columns(36, 3, r)] = local.loss_mask
        whole_labels[:, columns(36, 3, r)] = local.labels
    assert not whole_mask[:, w:].any() and bool((whole_labels[:, w:] == -100).all()) and parts[2][0].tokens == mb.tokens


def _worker(tiny: dict, out: Path, cp: int, tp: int = 1) -> dict:
    worker = str(Path(__file__).resolve().parents[1] / "_cp_worker.py")
    args = [worker, str(tiny["student"]), str(tiny["model"]), str(tiny["cache"]), str(out), str(cp), str(tp)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = [] if cp * tp == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp * tp)]
    subprocess.run([sys.executable, *launcher, *args], check=True, env=env, cwd=REPO, timeout=1800)
    return torch.load(out / f"cp{cp}_tp{tp}.pt")


@pytest.fixture(scope="module")
def cp1(tiny, tmp_path_factory) -> dict:
    """The CP=1 reference: one process."""
    return _worker(tiny, tmp_path_factory.mktemp("cp1"), 1)


def test_context_spans_attention_matches_the_masked_kernel(single_process):
    """`SDPAttention` on `ContextSpans` (one CP rank holding both chunks of each row, so chunk 1 continues the
    documents chunk 0 began: the lower-right strided-mask path) equals one SDPA call with the dense block-diagonal
    causal mask, output and q/k/v gradients, GQA (4 query heads over 2 groups)."""
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from pipeline.train.data.packing import attention_mask
    from pipeline.train.models.attention import SDPAttention, context_spans

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                               attention_dropout=0.0, use_cpu_initialization=True)
    sdpa = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    doc_ids = torch.tensor([[0] * 5 + [1] * 14 + [2] * 3 + [-1] * 2, [0] * 24])  # documents cross column 12
    g = torch.Generator().manual_seed(5)
    q = torch.randn(24, 2, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(24, 2, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    out = sdpa(q, k, v, None, packed_seq_params=context_spans(doc_ids, True, 0, 1, dist.group.WORLD))
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    ref = sdpa._sdpa(qq, kk, vv, ~attention_mask(doc_ids), False).permute(2, 0, 1, 3).reshape(24, 2, 64)
    assert_layout_close(out, ref, "output")
    w = torch.randn(out.shape, generator=g)
    for a, e, name in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                          torch.autograd.grad((ref * w).sum(), (q, k, v)), "qkv", strict=True):
        assert_layout_close(a, e, f"d{name}")


@pytest.mark.distributed
# CI: tp2 x cp2 (both splits at once); cp2 alone is `slow` (make test-slow)
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["cp2 x dp1", "tp2 x cp2"])
def test_cp2_matches_cp1(tiny, cp1, tp, tmp_path):
    one, two = cp1, _worker(tiny, tmp_path, 2, tp)
    assert float(one["opd"]["sums"][OPD_SUM]) != 0 and float(one["opd"]["sums"][OPD_KL_SUM]) != 0  # OPD sums to compare
    for name in ("packed fused", "padded unfused recompute", "lora full recompute", "opd"):
        a, b = one[name], two[name]
        assert b["crossing"] > 0, name  # samples do cross the chunk boundaries
        assert a["counts"] == b["counts"] and a["counts"][0] > 0 and a["counts"][1] > 0, name
        assert_layout_close(b["sums"], a["sums"], f"{name} loss sums")
        assert float(a["sums"][SFT_SUM]) > 0, name  # the SFT term is there to compare
        assert_layout_close(torch.tensor(b["grad_norm"]), torch.tensor(a["grad_norm"]), f"{name} grad norm")
        assert_layout_close(b["grads"], a["grads"], f"{name} grads")
    for run in (one, two):
        al = run["alignment"]
        assert al["active"] > 50 and al["crossing"] > 0
        assert al["loss"] < 2e-4, al  # codec quantisation only
        assert al["shifted"] > 100 * max(al["loss"], 1e-4), al
    assert abs(two["alignment"]["loss"] - one["alignment"]["loss"]) < 1e-5


def _train_args(tiny: dict, save: Path, *extra: str) -> list[str]:
    return [f"student={tiny['student']}", f"cache=[{tiny['cache']}]", "micro_batch_size=2", "global_batch_size=4",
            "seq_length=32", "train_steps=3", "warmup_steps=0", "optimizer=sgd", "lr=0.5", "min_lr=0.5",
            "sft_alpha=0.5", f"save_dir={save}", "save_interval=1", "progress=false", *extra]


@pytest.mark.distributed
@pytest.mark.slow  # CI: resume bit-identical at TP/DP/PP (tests/train/test_run.py, test_pipeline_parallel.py)
def test_cp2_training_run_resumes_and_matches_cp1(tiny, tmp_path):
    """Through the CLI: 3 SGD steps at CP=2 under torchrun, stopped after step 2 and resumed from its checkpoint,
    against 3 steps at CP=1: the loop's reduced losses per step and what training changed in the exported weights."""
    from safetensors.torch import load_file

    from pipeline.cli import main as cli

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "cp1", tmp_path / "cp2"
    assert cli(["train", *_train_args(tiny, one)]) == 0
    for stop in (("exit_after=2",), ()):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "pipeline.train.run", *_train_args(tiny, two, "context_parallel_size=2", *stop)],
                       check=True, env=env, cwd=REPO, timeout=1800)
    weights = {}
    for save in (one, two):
        assert cli(["export", "--checkpoint", str(save), "--out", str(save / "hf")]) == 0
        weights[save] = load_file(save / "hf" / "model.safetensors")
    metrics = {save: [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()] for save in (one, two)}
    assert [m["step"] for m in metrics[two]] == [1, 2, 3]
    for a, b in zip(metrics[one], metrics[two], strict=True):
        assert a["active_tokens"] == b["active_tokens"] and a["samples"] == b["samples"]
        assert_layout_close(torch.tensor([b["jsd"], b["sft"]]), torch.tensor([a["jsd"], a["sft"]]), f"step {a['step']}")
    start = load_file(tiny["student"] / "model.safetensors")
    assert_layout_close({k: weights[two][k] - start[k] for k in start}, {k: weights[one][k] - start[k] for k in start},
                        "trained change")
