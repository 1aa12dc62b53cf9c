"""A reduced `make demo` through the same code: tiny random teacher/student instead of SmolLM2, a few steps."""

import json

import pytest

from pipeline.demo import QUICK, DemoConfig, run


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_models import build_llama, build_tokenizer

    root = tmp_path_factory.mktemp("models")
    teacher, student = root / "teacher", root / "student"
    tok = build_tokenizer(teacher)
    build_llama(teacher, vocab_size=len(tok), layers=2, seed=0, scale=20.0, max_pos=2048)
    tok.save_pretrained(student)
    build_llama(student, vocab_size=len(tok), layers=1, seed=1, max_pos=2048)
    return teacher, student


def test_reduced_demo_kl_falls_and_second_run_scores_nothing(tmp_path, models):
    teacher, student = models
    cfg = DemoConfig(**{**QUICK, "out": str(tmp_path / "demo"), "teacher": str(teacher), "student": str(student),
                        "kv_cache_gib": 0.1, "lr": 3e-3, "steps": 6, "eval_every": 3, "topk": 16})
    report = run(cfg)
    assert report["heldout_kl_after"] < report["heldout_kl_before"]
    assert report["teacher_forwards_first_score"] > 0
    assert report["teacher_forwards_second_run"] == 0
    assert (tmp_path / "demo" / "report.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert saved["cache"]["samples"] > 0 and saved["cache_bytes_per_token"] > 0
    assert [p["step"] for p in saved["curve"]] == [0, 3, 6]
