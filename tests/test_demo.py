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
    be = saved["break_even"]  # measured, not a token ratio: both step times come from real runs
    assert be["teacher_pass_seconds"] > 0 and be["cached_step_seconds"] > 0 and be["live_teacher_step_seconds"] > 0
    live = [json.loads(x) for x in (tmp_path / "demo" / "live-probe" / "metrics.jsonl").read_text().splitlines()]
    assert len(live) == cfg.live_probe_steps and all(m["loss"] > 0 for m in live)
    assert 0 <= saved["top1_agreement_before"] <= 1 and 0 <= saved["top1_agreement_after"] <= 1
    acc = saved["task_accuracy"]
    assert acc["reported"] == (acc["teacher"] >= 0.2) and "%" in acc["note"]


def test_answer_accuracy_matches_the_last_number(tmp_path):
    import reasoning_gym
    from tiny_models import build_tokenizer

    from pipeline.demo import answer_accuracy

    tok = build_tokenizer(tmp_path / "tok")
    items = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=7))
    texts = [f"The answer is {items[0]['answer']}", f"so 1 and then {items[1]['answer']}", "no idea", "3 4 5 6 7 8 9"]
    rows = [{"prompt_id": f"rg:basic_arithmetic:7:{i}", "completion_ids": tok(t, add_special_tokens=False)["input_ids"]}
            for i, t in enumerate(texts)]
    expected = sum(str(items[3]["answer"]).lstrip("-").isdigit() and float(items[3]["answer"]) == 9 for _ in [0])
    assert answer_accuracy(rows, tok) == (2 + expected) / 4
