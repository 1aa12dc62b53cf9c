"""The transformers student backend (backend=hf): equal to the Megatron backend where both train a student, and
Qwen3.5 (hybrid Gated DeltaNet), which only it trains, end to end.

Run: ``python -m pytest tests/train/models/test_hf_backend.py``. Cross-backend comparisons follow tests/tolerance.py
(SGD; per-step losses and the trained update, final − initial); resume is compared exactly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import killing
import pytest
import torch
from alignment import assert_aligned
from safetensors.torch import load_file
from tiny_cache import random_samples, score_into_cache
from tiny_models import build_qwen35
from tolerance import assert_layout_close

from pipeline.cli import main as cli
from pipeline.config import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _args(student: Path, cache: Path, save: Path, **kw) -> list[str]:
    args = dict(student=student, cache=f"[{cache}]", micro_batch_size=2, global_batch_size=4, seq_length=64,
                train_steps=4, save_interval=2, lr=0.3, min_lr=0.3, warmup_steps=0, optimizer="sgd", sft_alpha=0.5,
                save_dir=save, progress="false", prefetch=1)
    return [f"{k}={v}" for k, v in {**args, **kw}.items()]


def _metrics(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def _train_export(tiny: dict, save: Path, **kw) -> tuple[list[dict], dict]:
    assert cli(["train", *_args(tiny["student"], tiny["cache"], save, **kw)]) == 0
    assert cli(["export", "--checkpoint", str(save), "--out", str(save / "hf")]) == 0
    return _metrics(save), load_file(save / "hf" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory) -> dict:
    """The tiny Llama student trained 4 SGD steps (packed rows) on each backend, and on hf with the unfused loss."""
    root = tmp_path_factory.mktemp("hf_backend")
    out = {name: _train_export(tiny, root / name, backend=backend, fused_loss=fused)
           for name, backend, fused in (("megatron", "megatron", "true"), ("hf", "hf", "true"),
                                        ("hf_unfused", "hf", "false"))}
    out["root"] = root
    return out


def _compare(tiny: dict, a: tuple, b: tuple, name: str) -> None:
    start = load_file(tiny["student"] / "model.safetensors")
    (ma, wa), (mb, wb) = a, b
    assert [m["active_tokens"] for m in ma] == [m["active_tokens"] for m in mb], name  # the same samples per step
    for x, y in zip(ma, mb, strict=True):
        assert_layout_close(torch.tensor([x["jsd"], x["sft"], x["grad_norm"]]),
                            torch.tensor([y["jsd"], y["sft"], y["grad_norm"]]), f"{name} step {x['step']}")
    assert set(wa) == set(wb) == set(start), name
    assert_layout_close({k: wa[k] - start[k] for k in start}, {k: wb[k] - start[k] for k in start}, name)


def test_hf_backend_equals_megatron(tiny, runs):
    """Same Llama student, same micro-batches (packed), fused loss: the same losses, grad norms and SGD updates."""
    assert all(m["samples"] > 4 for m in runs["hf"][0])  # packed: more than one sample per row somewhere
    _compare(tiny, runs["hf"], runs["megatron"], "hf vs megatron")
    update = max(float((runs["hf"][1][k] - load_file(tiny["student"] / "model.safetensors")[k]).abs().max())
                 for k in runs["hf"][1])
    assert update > 1e-3  # it trained


def test_hf_fused_equals_unfused(tiny, runs):
    _compare(tiny, runs["hf"], runs["hf_unfused"], "hf fused vs unfused")


def test_first_log_line_and_trainer_json_name_the_backend(tiny, runs, capsys, tmp_path):
    meta = json.loads((runs["root"] / "hf" / "step_0000004" / "trainer.json").read_text())
    assert meta["backend"] == "hf" and meta["student_arch"]["model_type"] == "llama"
    assert json.loads((runs["root"] / "megatron" / "step_0000004" / "trainer.json").read_text())["backend"] == "megatron"
    assert cli(["train", *_args(tiny["student"], tiny["cache"], tmp_path / "s", train_steps=1)]) == 0
    assert capsys.readouterr().err.splitlines()[0] == "[train] backend=megatron: Megatron-Core maps model_type llama exactly"


def test_hf_resume_after_kill_is_bit_identical(tiny, runs, tmp_path):
    """kill -9 during training (after the step-2 checkpoint), rerun the same command: the metrics and the final
    weights equal the uninterrupted run's exactly."""
    save = tmp_path / "killed"
    args = _args(tiny["student"], tiny["cache"], save, backend="hf", save_interval=1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = killing.start([sys.executable, "-m", "pipeline.train.run", *args], "checkpoint:2", env=env, cwd=REPO)
    try:
        killing.wait_stopped(proc)  # stopped right after its step-2 checkpoint: the kill lands there exactly
    finally:
        killing.kill(proc, group=True)
    assert [m["step"] for m in _metrics(save)] == [1, 2]  # killed mid-run, after step 2
    assert cli(["train", *args]) == 0
    keys = ("step", "loss", "jsd", "sft", "lr", "grad_norm", "active_tokens", "data_position")
    ref = runs["root"] / "hf"
    assert [[m[k] for k in keys] for m in _metrics(save)] == [[m[k] for k in keys] for m in _metrics(ref)]
    a, b = load_file(ref / "step_0000004" / "student.safetensors"), load_file(save / "step_0000004" / "student.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(d / "step_0000004" / "optimizer.pt", weights_only=True) for d in (ref, save))
    assert all(torch.equal(oa["state"][i]["momentum_buffer"], ob["state"][i]["momentum_buffer"]) for i in oa["state"])


def test_hf_packing_equals_one_sample_per_row(tiny):
    """A packed micro-batch through the hf student (positions restarting per sample, block-diagonal mask) gives
    every sample the logits it has alone; the same rows with the loader's continuous positions and no mask do not."""
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.models import hf_model

    student = hf_model.build(tiny["student"], fused_loss=False, packing=True, trainable=False)
    mb = ScoredLoader([tiny["cache"]], micro_batch_size=4, seq_length=64, seed=0, packing=True).micro_batch(0)
    assert mb.packed and int(mb.doc_ids.max()) >= 1
    with torch.no_grad():
        packed = student(mb.input_ids, **hf_model.inputs(mb.doc_ids, mb.position_ids, True, "sdpa"))
        unmasked = student(mb.input_ids, mb.position_ids)
    gaps, leak = [], []
    for r in range(mb.input_ids.shape[0]):
        for d in range(int(mb.doc_ids[r].max()) + 1):
            cols = (mb.doc_ids[r] == d).nonzero().squeeze(-1)
            with torch.no_grad():
                alone = student(mb.input_ids[r, cols][None], torch.arange(len(cols))[None])[0]
            gaps.append(float((packed[r, cols] - alone).abs().max() / alone.abs().max()))
            leak.append(float((unmasked[r, cols] - alone).abs().max() / alone.abs().max()))
    assert len(gaps) > 4 and max(gaps) < 1e-5, gaps
    assert max(leak) > 1e-2  # the check can fail: later samples of a row see earlier ones without the mask


def test_hf_lora_adapter_export_is_peft_and_equals_merged(tiny, tmp_path):
    """LoRA on the hf backend (peft, all-linear): the checkpoint holds only the adapter, `--adapter-only` writes a
    folder peft loads onto the base, and that model's logits equal the merged export's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save = tmp_path / "lora"
    assert cli(["train", *_args(tiny["student"], tiny["cache"], save, backend="hf", train_steps=2, lora_rank=4,
                                lora_alpha=8, optimizer="adam", lr=1e-2, min_lr=1e-2, **{"lora_targets": "[all-linear]"})]) == 0
    held = load_file(save / "step_0000002" / "student.safetensors")
    assert held and all("lora_" in k for k in held)
    assert cli(["export", "--checkpoint", str(save), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert cli(["export", "--checkpoint", str(save), "--out", str(tmp_path / "merged")]) == 0
    base = AutoModelForCausalLM.from_pretrained(tiny["student"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny["student"], dtype=torch.float32).eval()
    ids = torch.randint(3, tiny["vocab"], (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, m, p = adapted(ids).logits, merged(ids).logits, plain(ids).logits
    assert float((a - m).abs().max()) < 1e-4 * float(m.abs().max())
    assert float((m - p).abs().max()) > 1e-3  # the adapter changed the model


def test_lora_target_matching_nothing_names_the_modules(tiny, tmp_path, capsys):
    rc = cli(["train", *_args(tiny["student"], tiny["cache"], tmp_path / "x", backend="hf", lora_rank=4,
                              lora_targets="[in_proj_qkv]")])
    err = capsys.readouterr().err
    assert rc == 2 and "in_proj_qkv match(es) no linear layer of this llama model" in err
    assert "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in err and "Traceback" not in err


def test_refusals_name_model_type_key_and_backends(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from pipeline.train.models.families import resolve_backend

    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match=r"no backend trains model_type 'bert' \(megatron: model_type = \"bert\" "
                                          r"is not supported.*; hf: model_type bert is an encoder-only family"):
        resolve_backend(tmp_path / "bert", "auto", 64)
    q = build_qwen35(tmp_path / "q")
    with pytest.raises(ConfigError, match=r"model_type = \"qwen3_5_text\" is not supported.*backend=hf trains it"):
        resolve_backend(q, "megatron", 64)
    backend, why = resolve_backend(q, "auto", 64)
    assert backend == "hf" and "qwen3_5_text" in why


# ---------------------------------------------------------------- Qwen3.5 (3 Gated DeltaNet + 1 full attention)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> dict:
    """A tiny Qwen3.5 teacher, a cache scored from it by a transformers forward (tiny_cache), and a second random
    Qwen3.5 as the student."""
    root = tmp_path_factory.mktemp("qwen35")
    teacher, student = build_qwen35(root / "teacher"), build_qwen35(root / "student", seed=1)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(teacher).vocab_size
    score_into_cache(teacher, root / "cache", random_samples(16, vocab))
    return {"teacher": teacher, "student": student, "cache": root / "cache", "root": root}


def test_qwen35_alignment_student_equals_teacher(qwen35):
    """Student initialised to the scoring Qwen3.5: the loss is ~0 (codec quantisation only); the teacher row for
    token j paired with logits at j instead of j - 1 (the shift-by-one bug) makes it large."""
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.models import hf_model

    model = hf_model.build(qwen35["teacher"], fused_loss=False, trainable=False)
    mb = ScoredLoader([qwen35["cache"]], micro_batch_size=8, seq_length=64, seed=0, packing=False).micro_batch(0)
    with torch.no_grad():
        logits = model(mb.input_ids, **hf_model.inputs(mb.doc_ids, mb.position_ids, False, "sdpa"))
    # below 1e-3: the codec's 1/64-nat logprob grid only (5.8e-4 at beta = 1 measured on this model's sharp rows)
    assert_aligned(logits, mb, below=1e-3, min_positions=50, factor=100, floor=1e-4)


def test_qwen35_trains_through_the_cli(qwen35, tmp_path):
    """`gkd train` picks the hf backend for Qwen3.5 (auto), trains (the first step's loss is ~0 with student ==
    teacher, and a random student's forward KL falls over three epochs of the 16 samples), and the export loads in transformers with the trained logits."""
    from transformers import AutoModelForCausalLM

    same = tmp_path / "same"
    assert cli(["train", *_args(qwen35["teacher"], qwen35["cache"], same, packing="false", train_steps=1)]) == 0
    assert _metrics(same)[0]["jsd"] < 2e-4
    save = tmp_path / "q"
    assert cli(["train", *_args(qwen35["student"], qwen35["cache"], save, packing="false", train_steps=12,
                                save_interval=12, optimizer="adam", lr=1e-2, min_lr=1e-2, sft_alpha=0.0, beta=0.0)]) == 0
    jsd = [m["jsd"] for m in _metrics(save)]  # 4 steps an epoch of the 16 samples: epoch 3 against epoch 1
    assert sum(jsd[-4:]) < 0.8 * sum(jsd[:4]), jsd
    assert json.loads((save / "step_0000012" / "trainer.json").read_text())["backend"] == "hf"
    assert cli(["export", "--checkpoint", str(save), "--out", str(save / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(save / "hf", dtype=torch.float32).eval()
    assert exported.config.model_type == "qwen3_5_text"
    trained = load_file(save / "step_0000012" / "student.safetensors")
    written = load_file(save / "hf" / "model.safetensors")
    assert all(torch.equal(trained[f"lm.{k}"], v) for k, v in written.items())


def test_qwen35_packing_is_refused_naming_the_layer_type(qwen35, tmp_path, capsys):
    rc = cli(["train", *_args(qwen35["student"], qwen35["cache"], tmp_path / "p", packing="true")])
    err = capsys.readouterr().err
    assert rc == 2 and "layer_types has linear_attention (3 of 4 layers)" in err and "set packing=false" in err
    assert "Traceback" not in err


def test_hf_backend_refuses_tensor_parallelism(qwen35, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: the config's own TP check passes, the backend's refuses
    rc = cli(["train", *_args(qwen35["student"], qwen35["cache"], tmp_path / "t", packing="false",
                              tensor_model_parallel_size=2)])
    err = capsys.readouterr().err
    assert rc == 2 and "the hf backend" in err and "no tensor parallelism" in err


def test_hf_recompute_and_bf16(tiny, runs, tmp_path):
    """recompute=full (gradient checkpointing of every decoder layer) trains what the plain run trains; bf16
    (autocast over fp32 weights) gives losses within bf16's rounding of the fp32 run's and records its precision."""
    recompute = _train_export(tiny, tmp_path / "recompute", backend="hf", recompute="full")
    _compare(tiny, recompute, runs["hf"], "hf recompute=full vs none")
    assert cli(["train", *_args(tiny["student"], tiny["cache"], tmp_path / "bf16", backend="hf", bf16="true")]) == 0
    bf16, fp32 = _metrics(tmp_path / "bf16"), runs["hf"][0]
    assert all(abs(a["jsd"] - b["jsd"]) < 2e-2 * b["jsd"] for a, b in zip(bf16, fp32, strict=True)), (bf16, fp32)
    assert json.loads((tmp_path / "bf16" / "step_0000004" / "trainer.json").read_text())["precision"] == "bf16"
