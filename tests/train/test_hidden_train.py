"""Training from a hidden-state cache (gkd score teacher_rows=hidden, scored here by the real vLLM pooling engine):
the loader's alignment (the scoring model as the student: exact divergences ~0, one-position shift large), a real
`gkd train` run, and the refusals before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cli import main as gkd


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> dict:
    from tiny_cache import build_tiny, random_samples, score_into_cache

    from pipeline.score.config import ScoreConfig
    from pipeline.score.scorer import score
    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import rollout_row, write_rollouts

    root = tmp_path_factory.mktemp("hidden_train")
    model = build_tiny(root / "model")
    student = build_tiny(root / "student", seed=1)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    samples = random_samples(16, vocab)
    rows = [rollout_row(prompt_id=f"p{i}", prompt_ids=ids[:p].tolist(), completion_ids=ids[p:].tolist(), source=src,
                        policy_version=None if src == "dataset" else 0)
            for i, (ids, p, src) in enumerate(samples)]
    write_rollouts(root / "rollouts" / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(model))
    score(ScoreConfig(rollouts=str(root / "rollouts"), cache=str(root / "hidden"), teacher=str(model),
                      teacher_rows="hidden", max_model_len=64, part_rows=8, enforce_eager=True, kv_cache_gib=0.05))
    score_into_cache(model, root / "topk", samples[:4])  # a top-k cache of the same teacher (the mixing refusal)
    return {"model": model, "student": student, "cache": root / "hidden", "topk": root / "topk", "vocab": vocab,
            "root": root}


def test_scoring_model_as_student_gives_zero_exact_divergence(hidden):
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.exact import exact_gkd_loss
    from pipeline.train.losses.fused import output_hidden_states, output_weight
    from pipeline.train.models.megatron import build_model, load_hf_weights
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_model(hidden["model"])
        load_hf_weights(model, hidden["model"])
        output_hidden_states(model)
        loader = ScoredLoader([hidden["cache"]], micro_batch_size=8, seq_length=64, seed=0)
        mb = loader.micro_batch(0)
        assert mb.exact is not None and mb.exact.hidden.dtype == torch.bfloat16 and mb.teacher_ids.shape[-1] == 0
        with torch.no_grad():
            h = model(mb.input_ids, mb.position_ids, None)
        w = output_weight(model)
        for beta in (0.0, 0.5, 1.0):
            for tau in (1.0, 0.5):
                out = exact_gkd_loss(h, w, mb.exact.hidden, mb.exact.weight, mb.loss_mask, beta=beta,
                                     temperature=tau, vocab_size=hidden["vocab"])
                n = int(out.kd_count)
                assert n > 50 and (out.kd_sum / n).item() < 2e-4, (beta, tau, (out.kd_sum / n).item())
                shifted = exact_gkd_loss(h, w, torch.roll(mb.exact.hidden, 1, dims=1), mb.exact.weight,
                                         torch.roll(mb.loss_mask, 1, dims=1), beta=beta, temperature=tau,
                                         vocab_size=hidden["vocab"])
                assert (shifted.kd_sum / shifted.kd_count).item() > 100 * max((out.kd_sum / n).item(), 1e-4)
    finally:
        destroy_distributed()


def test_topk_view_of_a_hidden_state_cache(hidden):
    """topk_from_hidden=K: the micro-batch's top-k and tail from the cached states; the scoring model as the student
    gives ~0 for the top-k losses on it (bf16 states), and its ids are the teacher's top-k of transformers' logits."""
    from transformers import AutoModelForCausalLM

    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.step import topk_view

    loader = ScoredLoader([hidden["cache"]], micro_batch_size=4, seq_length=64, seed=0)
    mb = loader.micro_batch(0)
    view = topk_view(mb, 8, hidden["vocab"])
    assert view.exact is None and view.teacher_ids.shape[-1] == 8
    model = AutoModelForCausalLM.from_pretrained(hidden["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(mb.input_ids, position_ids=mb.position_ids).logits if not mb.packed else None
    assert logits is not None  # padded micro-batches: one sample per row
    lp = torch.log_softmax(logits, -1)
    m = mb.loss_mask
    same = (lp[m].topk(8).indices.sort(-1).values == view.teacher_ids[m].long().sort(-1).values).all(-1)
    assert same.float().mean() > 0.95  # near-ties may swap under bf16 states
    torch.testing.assert_close(view.teacher_logprobs[m], lp[m].gather(1, view.teacher_ids[m].long()), atol=0.05, rtol=0)
    for beta in (0.0, 0.5, 1.0):
        s, n = gkd_loss(logits, view.teacher_ids, view.teacher_logprobs, m, beta=beta, mode="tail",
                        teacher_tail=view.teacher_tail, teacher_valid=view.teacher_valid)
        assert n > 20 and (s / n).item() < 2e-3, (beta, (s / n).item())


def _args(hidden: dict, save: Path, **kw) -> list[str]:
    args = dict(student=str(hidden["student"]), cache=f"[{hidden['cache']}]", micro_batch_size=2, global_batch_size=4,
                seq_length=64, train_steps=2, save_interval=2, lr=1e-3, warmup_steps=1, save_dir=str(save),
                progress=False, prefetch=1, beta=1.0, temperature=0.7, sft_alpha=0.5)
    return [f"{k}={v}" for k, v in {**args, **kw}.items()]


def test_gkd_train_from_a_hidden_state_cache(hidden, tmp_path):
    assert gkd(["train", *_args(hidden, tmp_path / "run")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # beta=1: the reported divergence ("jsd") is the exact reverse KL per position at temperature 0.7
    assert all(np.isfinite([r["jsd"], r["sft"], r["loss"]]).all() and r["jsd"] > 0.01 for r in rows), rows


_SGD = dict(optimizer="sgd", lr=0.3, min_lr=0.3, warmup_steps=0)


def _metrics(save: Path) -> list[dict]:
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(hidden, tmp_path_factory) -> list[dict]:
    """2 SGD steps of the exact loss on the Megatron backend, one process: what the other layouts must reproduce."""
    save = tmp_path_factory.mktemp("exact_one") / "run"
    assert gkd(["train", *_args(hidden, save, backend="megatron", **_SGD)]) == 0
    return _metrics(save)


def _same_steps(runs: list[dict], expected: list[dict], name: str) -> None:
    """Per step: the same exact reverse KL, CE and grad norm (tests/tolerance.py), and the first step moved the
    student (so the second step's equality is not two untrained copies)."""
    from tolerance import assert_layout_close

    for a, b in zip(runs, expected, strict=True):
        assert a["active_tokens"] == b["active_tokens"] and a["jsd"] > 0.01
        assert_layout_close(torch.tensor([a["jsd"], a["sft"], a["grad_norm"]]),
                            torch.tensor([b["jsd"], b["sft"], b["grad_norm"]]), f"{name} vs one process, step {a['step']}")
    assert runs[0]["lr"] > 0 and runs[1]["jsd"] != runs[0]["jsd"]


def test_hf_backend_trains_the_exact_loss_as_megatron_does(hidden, one_process, tmp_path):
    """The exact-teacher loss on the transformers backend (same loss call, step._loss_terms): the same per-step
    exact reverse KL, CE and grad norm as the Megatron backend, 2 SGD steps, within tests/tolerance.py."""
    assert gkd(["train", *_args(hidden, tmp_path / "hf", backend="hf", **_SGD)]) == 0
    _same_steps(_metrics(tmp_path / "hf"), one_process, "hf backend")


@pytest.mark.distributed
# CI: TP=2; CP=2 and PP=2 are `slow` (make test-slow)
@pytest.mark.parametrize("key", ["tensor_model_parallel_size", pytest.param("context_parallel_size", marks=pytest.mark.slow),
                                 pytest.param("pipeline_model_parallel_size", marks=pytest.mark.slow)])
def test_two_way_model_parallel_trains_the_exact_loss_as_one_process(hidden, one_process, tmp_path, key):
    """`gkd train` under torchrun, 2 gloo processes, TP=2 (the output layers split by vocabulary, losses/exact.py),
    CP=2 (the cached states split with their positions, parallel/context_parallel.py) or PP=2 (the last stage runs
    the loss on the micro-batch it read): the same steps as one process."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    save = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "pipeline.train.run", *_args(hidden, save, backend="megatron", **_SGD, **{key: 2})],
                   check=True, env=env, cwd=repo, timeout=1800)
    _same_steps(_metrics(save), one_process, f"{key}=2")


def test_gkd_train_from_the_topk_view(hidden, tmp_path):
    assert gkd(["train", *_args(hidden, tmp_path / "run", topk_from_hidden=8, fused_loss="false")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["jsd"]) and r["jsd"] > 0.01 for r in rows), rows


@pytest.mark.parametrize("kw, match", [
    (dict(fused_loss="false"), "drop fused_loss=false"),
    (dict(loss="gold"), "loss=gkd or loss=opd"),
    (dict(temperature=0), "temperature must be > 0"),
])
def test_refusals_before_any_work(hidden, tmp_path, capsys, kw, match):
    assert gkd(["train", *_args(hidden, tmp_path / "run", **kw)]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_mixed_with_a_top_k_cache_is_refused_by_file(hidden, tmp_path, capsys):
    cache = f"[{hidden['cache']},{hidden['topk']}]"
    assert gkd(["train", *_args(hidden, tmp_path / "run", cache=cache)]) == 2
    err = capsys.readouterr().err
    assert f"{hidden['cache'] / 'cache.json'}: teacher_rows=hidden, but {hidden['topk'] / 'cache.json'}" in err, err


def test_a_student_of_another_vocabulary_is_refused(hidden, tmp_path, capsys):
    from tiny_models import build_llama, build_tokenizer

    out = tmp_path / "wide"
    tok = build_tokenizer(out)
    build_llama(out, vocab_size=len(tok) + 16, layers=1, hidden=64, heads=2, kv_heads=2)
    assert gkd(["train", *_args(hidden, tmp_path / "run", student=str(out))]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'config.json'}: vocab_size={len(tok) + 16}, the teacher's is {hidden['vocab']}" in err, err
