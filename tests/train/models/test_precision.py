"""The trainer with the fused loss and in bf16: a step with fused_loss on equals one with it off, bf16 tracks fp32,
bf16 resume is exact, a checkpoint refuses the other precision, export writes the dtype asked for, and the train
loss equals pipeline/evaluate.py's held-out KL on the same rows and weights (one teacher distribution).

Run: ``python -m pytest tests/train/models/test_precision.py``. Tiny random Llamas and a cache scored from one of them
(tests/train/conftest.py).

Precision is always passed explicitly: the trainer's default (bf16 unset) means bf16 where CUDA is available and
fp32 elsewhere (TrainConfig.precision), so a run meant as fp32 says bf16=false and runs fp32 on a CUDA machine too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerance import assert_layout_close

from pipeline.cli import main as cli


def _args(tiny: dict, save_dir: Path, student: Path | None = None, **kw) -> list[str]:
    args = dict(student=str(student or tiny["student"]), cache=f"[{tiny['cache']}]", micro_batch_size=2,
                global_batch_size=4, seq_length=32, train_steps=4, save_interval=2, lr=1e-2, warmup_steps=1,
                sft_alpha=0.5, save_dir=str(save_dir), progress=False, prefetch=1)
    return ["train", *(f"{k}={v}" for k, v in {**args, **kw}.items())]


def _metrics(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def _export(save_dir: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    assert cli(["export", "--checkpoint", str(save_dir), "--out", str(out), *extra]) == 0
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def tied_student(tiny, tmp_path_factory) -> Path:
    """A student with tied embeddings (as SmolLM2): the fused loss's weight gradient lands in the embedding."""
    from tiny_models import build_llama

    out = tmp_path_factory.mktemp("tied") / "student"
    shutil.copytree(tiny["student"], out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    return build_llama(out, vocab_size=tiny["vocab"], layers=2, hidden=64, heads=2, kv_heads=2, seed=2, tie=True)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_fused_step_equals_unfused(tiny, tied_student, tmp_path, which):
    """A trainer step (KD + SFT, tail mode, τ = 2) with fused_loss on and off: same loss, same trained weights under
    the cross-layout rule (same math, other summation order; SGD so that noise stays noise: tests/tolerance.py).
    Two steps, the first at lr 0 (warmup): the update is lr · (momentum · g1 + g2), linear in the gradients."""
    student = tied_student if which == "tied" else tiny["student"]
    start = load_file(student / "model.safetensors")
    runs = {}
    for fused in (True, False):
        save = tmp_path / f"fused-{fused}"
        assert cli(_args(tiny, save, student, train_steps=2, optimizer="sgd", lr=0.5, temperature=2.0,
                         fused_loss=str(fused).lower(), bf16="false")) == 0  # the rule's float32 tolerance
        runs[fused] = (_metrics(save), _export(save, tmp_path / f"hf-{fused}"))
    (m_on, w_on), (m_off, w_off) = runs[True], runs[False]
    for a, b in zip(m_on, m_off, strict=True):
        assert_layout_close(torch.tensor([a["jsd"], a["sft"]]), torch.tensor([b["jsd"], b["sft"]]), "losses")
    assert set(w_on) == set(start)
    assert_layout_close({k: w_on[k] - start[k] for k in start}, {k: w_off[k] - start[k] for k in start}, "update")
    assert all((w_on[k] - start[k]).abs().max() > 0 for k in start)  # every tensor trained (embedding too)


@pytest.fixture(scope="module")
def fp32_run(tiny, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("fp32") / "run"
    assert cli(_args(tiny, save, train_steps=20, save_interval=10, lr=5e-3, bf16="false")) == 0
    return save


@pytest.fixture(scope="module")
def bf16_run(tiny, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("bf16") / "run"
    assert cli(_args(tiny, save, train_steps=20, save_interval=10, lr=5e-3, bf16="true")) == 0
    return save


def test_bf16_tracks_fp32(tiny, fp32_run, bf16_run, tmp_path):
    """bf16 mixed precision: the first step's loss within 1e-2 relative of fp32 (same weights, bf16 rounding of
    weights and activations only), and after 20 steps the held-out KL of each exported student within 5 %."""
    from pipeline.evaluate import heldout_kl

    m32, m16 = _metrics(fp32_run), _metrics(bf16_run)
    assert abs(m16[0]["loss"] - m32[0]["loss"]) <= 1e-2 * m32[0]["loss"]
    assert m16[-1]["loss"] < 0.9 * m16[0]["loss"]  # it trains
    json32 = json.loads((fp32_run / "step_0000020" / "trainer.json").read_text())
    json16 = json.loads((bf16_run / "step_0000020" / "trainer.json").read_text())
    assert (json32["precision"], json16["precision"]) == ("fp32", "bf16")
    w16 = _export(bf16_run, tmp_path / "hf16", "--dtype", "float32")
    assert all(v.dtype == torch.float32 for v in w16.values())
    _export(fp32_run, tmp_path / "hf32")
    kl32 = heldout_kl(tmp_path / "hf32", tiny["cache"])["heldout_kl"]
    kl16 = heldout_kl(tmp_path / "hf16", tiny["cache"])["heldout_kl"]
    start = heldout_kl(tiny["student"], tiny["cache"])["heldout_kl"]
    assert kl32 < 0.9 * start  # 20 steps moved the student
    assert abs(kl16 - kl32) <= 0.05 * kl32, (kl16, kl32)


def test_bf16_resume_is_bit_identical(tiny, bf16_run, tmp_path):
    save = tmp_path / "resumed"
    common = dict(train_steps=20, save_interval=10, lr=5e-3, bf16="true")
    assert cli(_args(tiny, save, exit_after=7, **common)) == 0
    assert cli(_args(tiny, save, **common)) == 0
    keys = ("step", "loss", "jsd", "sft", "lr", "grad_norm", "data_position")
    assert [[m[k] for k in keys] for m in _metrics(save)] == [[m[k] for k in keys] for m in _metrics(bf16_run)]
    a, b = _export(save, tmp_path / "a", "--dtype", "bfloat16"), _export(bf16_run, tmp_path / "b", "--dtype", "bfloat16")
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["dtype"] == "bfloat16"


def test_resume_in_the_other_precision_is_refused(tiny, bf16_run, tmp_path, capsys):
    save = tmp_path / "copy"
    shutil.copytree(bf16_run, save)
    assert cli(_args(tiny, save, train_steps=30, bf16="false")) == 2
    err = capsys.readouterr().err
    assert "trained in bf16" in err and "bf16=true" in err


def test_train_loss_equals_heldout_kl_on_the_same_rows(tiny, tmp_path):
    """One step at lr 0 whose global batch is the whole cache (24 samples one per row, none truncated): the β = 0 loss
    per token is KL(teacher ‖ student) over the top-k + stored-tail bins, which is what pipeline/evaluate.py
    computes with a plain transformers forward of the same weights."""
    from pipeline.evaluate import heldout_kl

    save = tmp_path / "lr0"
    assert cli(_args(tiny, save, train_steps=1, micro_batch_size=4, global_batch_size=24, seq_length=64, lr=0.0,
                     min_lr=0.0, warmup_steps=0, beta=0.0, sft_alpha=0.0, packing="false",
                     bf16="false")) == 0  # 24 rows: 24 samples; fp32 (evaluate.py: float64)
    (m,) = _metrics(save)
    ref = heldout_kl(tiny["student"], tiny["cache"])
    assert m["active_tokens"] == ref["heldout_tokens"]
    assert abs(m["jsd"] - ref["heldout_kl"]) <= 1e-4 * ref["heldout_kl"], (m["jsd"], ref["heldout_kl"])
