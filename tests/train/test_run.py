"""The trainer: end-to-end alignment, exact resume through the CLI, export, refusals, TP=2 == TP=1.

Run: ``python -m pytest tests/train/test_run.py`` (``-m "not distributed"`` skips the torchrun test).
Tiny random Llamas (hidden 64, 2 layers) and a cache scored from one of them by a plain transformers forward.
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

from pipeline.config import ConfigError, load_config
from pipeline.train.config import TrainConfig
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.data.sources import TokenizerMismatchError
from pipeline.train.loop import train
from pipeline.train.run import DEFAULT_CONFIG


def train_main(argv: list[str]) -> int:  # through the real CLI: gkd train [key=value ...]
    from pipeline.cli import main as cli

    return cli(["train", *argv])

REPO = Path(__file__).resolve().parents[2]


def _overrides(tiny: dict, save_dir: Path, **kw) -> list[str]:
    args = dict(student=str(tiny["student"]), cache=f"[{tiny['cache']}]", micro_batch_size=2, global_batch_size=4,
                 seq_length=32, train_steps=5, save_interval=2, lr=1e-3, warmup_steps=1, sft_alpha=0.5,
                 save_dir=str(save_dir), progress=False, prefetch=1)
    return [f"{k}={v}" for k, v in {**args, **kw}.items()]


def _metrics(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def test_shipped_config_loads_and_unknown_keys_fail():
    cfg = load_config(TrainConfig, DEFAULT_CONFIG)
    assert cfg.topk_mode == "tail" and cfg.seq_length == 512 and cfg.packing == "auto"
    with pytest.raises(ConfigError, match="unknown key 'lrr'"):
        load_config(TrainConfig, DEFAULT_CONFIG, ["lrr=1"])
    with pytest.raises(ConfigError, match="beta must be.*topk_mode must be"):
        load_config(TrainConfig, DEFAULT_CONFIG, ["beta=2", "topk_mode=full"])
    # beta: null (the shipped default) is the loss's own β: GKD's JSD 0.5, gold's forward KL 0; a set beta wins
    assert cfg.beta is None and cfg.kd_beta == 0.5
    assert load_config(TrainConfig, DEFAULT_CONFIG, ["loss=gold"]).kd_beta == 0.0
    assert load_config(TrainConfig, DEFAULT_CONFIG, ["loss=gold", "beta=0.5"]).kd_beta == 0.5
    assert load_config(TrainConfig, DEFAULT_CONFIG, ["beta=0.2"]).kd_beta == 0.2


def test_end_to_end_alignment(tiny):
    """Student initialised to the scoring model: loss ~ 0 (codec quantisation only); off by one: large."""
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.models.megatron import build_model, load_hf_weights
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_model(tiny["model"])
        load_hf_weights(model, tiny["model"])
        loader = ScoredLoader([tiny["cache"]], micro_batch_size=8, seq_length=64, seed=0)
        mb = loader.micro_batch(0)
        with torch.no_grad():
            logits = model(mb.input_ids, mb.position_ids, None)
        for beta in (0.0, 0.5, 1.0):
            s, n = gkd_loss(logits, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=beta, mode="tail")
            assert n > 50 and (s / n).item() < 2e-4, beta
            # The classic bug: teacher row for token j paired with logits at j instead of j - 1.
            shifted = (torch.roll(mb.teacher_ids, 1, dims=1), torch.roll(mb.teacher_logprobs, 1, dims=1))
            mask = torch.roll(mb.loss_mask, 1, dims=1)
            s2, n2 = gkd_loss(logits, *shifted, mask, beta=beta, mode="tail")
            assert (s2 / n2).item() > 100 * max((s / n).item(), 1e-4), beta
    finally:
        destroy_distributed()


def _packing(packing: bool) -> dict:
    # packed: rows of 64 tokens hold several 12..39-token samples; padded: today's 32-token rows
    return dict(packing=True, seq_length=64) if packing else dict(packing=False)


def _uninterrupted(tiny, tmp_path_factory, packing: bool) -> Path:
    save_dir = tmp_path_factory.mktemp("run") / "a"
    assert train_main(_overrides(tiny, save_dir, **_packing(packing))) == 0
    return save_dir


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory) -> Path:
    return _uninterrupted(tiny, tmp_path_factory, packing=True)


@pytest.fixture(scope="module")
def uninterrupted_padded(tiny, tmp_path_factory) -> Path:
    return _uninterrupted(tiny, tmp_path_factory, packing=False)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_resume_is_bit_identical(tiny, packing, request, tmp_path):
    """Stop after 3 steps (checkpoint), rerun the same command: the trajectory equals an uninterrupted run."""
    reference = request.getfixturevalue("uninterrupted" if packing else "uninterrupted_padded")
    save_dir = tmp_path / "b"
    assert train_main(_overrides(tiny, save_dir, exit_after=3, **_packing(packing))) == 0
    assert [m["step"] for m in _metrics(save_dir)] == [1, 2, 3]
    assert train_main(_overrides(tiny, save_dir, **_packing(packing))) == 0
    a, b = _metrics(reference), _metrics(save_dir)
    keys = ("step", "loss", "jsd", "sft", "lr", "grad_norm", "active_tokens", "data_position", "real_tokens",
            "padding_fraction", "samples", "truncated")
    assert [[m[k] for k in keys] for m in b] == [[m[k] for k in keys] for m in a]  # exact floats
    positions = [0] + [m["data_position"] for m in a]
    assert [y - x for x, y in zip(positions, positions[1:], strict=False)] == [m["samples"] for m in a]
    if packing:  # 4 rows of 64 tokens a step, 12..39-token samples: about 2 per row, little padding
        assert all(m["samples"] >= 6 for m in a) and max(m["padding_fraction"] for m in a) < 0.2
    else:
        assert positions[1:] == [4, 8, 12, 16, 20]  # 4 samples a step: none skipped or repeated
    assert a[0]["sft"] > 0 and a[0]["jsd"] > 0
    # Final model and optimizer state, read back from the torch_dist files without a process group.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for name, d in (("a.pt", reference), ("b.pt", save_dir)):
        dcp_to_torch_save(d / "step_0000005", tmp_path / name)
    wa, wb = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert wa.keys() == wb.keys() and len(wa) > 20
    assert all(torch.equal(wa[k], wb[k]) for k in wa if torch.is_tensor(wa[k]))


def test_sgd_resume_is_bit_identical(tiny, tmp_path):
    """optimizer=sgd (what cross-layout tests train with, tests/tolerance.py) resumes exactly too: its momentum
    buffers go through the checkpoint."""
    runs = {}
    for name, stops in (("a", []), ("b", [3])):
        save_dir = tmp_path / name
        for stop in stops:
            assert train_main(_overrides(tiny, save_dir, optimizer="sgd", lr=0.3, exit_after=stop)) == 0
        assert train_main(_overrides(tiny, save_dir, optimizer="sgd", lr=0.3)) == 0
        runs[name] = [(m["step"], m["loss"], m["grad_norm"]) for m in _metrics(save_dir)]
    assert runs["a"] == runs["b"] and len(runs["a"]) == 5  # exact floats


@pytest.mark.parametrize("fused", [True, False])
def test_sft_applies_to_dataset_rows_only(tiny, tmp_path, fused):
    """sft_alpha > 0 adds cross-entropy on dataset-sourced rows only: on a cache of student samples it changes
    nothing (bit-identical run), on the same tokens marked as dataset rows it adds a positive CE term."""
    from tiny_cache import random_samples, score_into_cache
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny["model"]).vocab_size
    runs = {}
    for source in ("student", "dataset"):
        samples = [(ids, p, source) for ids, p, _ in random_samples(8, vocab, seed=5)]
        score_into_cache(tiny["model"], tmp_path / source, samples)
        for alpha in (0.0, 1.0):
            save = tmp_path / f"{source}-{alpha}"
            args = _overrides(tiny, save, cache=f"[{tmp_path / source}]", sft_alpha=alpha, train_steps=2,
                              fused_loss=str(fused).lower())
            assert train_main(args) == 0
            runs[source, alpha] = [(m["loss"], m["jsd"], m["sft"], m["grad_norm"]) for m in _metrics(save)]
    assert all(m[2] == 0 for m in runs["student", 1.0])
    assert runs["student", 1.0] == runs["student", 0.0]  # exact: student rows contribute no CE
    assert all(m[2] > 0 for m in runs["dataset", 1.0])
    assert runs["dataset", 1.0][0][3] != runs["dataset", 0.0][0][3]  # and dataset rows do, in the gradient too


def test_kd_alpha_zero_is_an_sft_step(tiny, tmp_path):
    """kd_alpha=0 sft_alpha=1: plain cross-entropy on the dataset rows through the same loop (the SFT baseline of
    benchmarks/exact_bench.py): no divergence computed (jsd 0), the same CE as the distillation run's first step
    (same student, same tokens), another gradient; the fused kernel (teacher columns cut to k = 0) agrees with the
    unfused logits path (vocab_parallel_ce), an independent computation of the same CE. Its refusals:
    tests/test_bad_inputs.py."""
    from tiny_cache import random_samples, score_into_cache
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny["model"]).vocab_size
    samples = [(ids, p, "dataset") for ids, p, _ in random_samples(8, vocab, seed=5)]
    score_into_cache(tiny["model"], tmp_path / "cache", samples)
    runs = {}
    for name, kw in (("sft", dict(kd_alpha=0)), ("sft-unfused", dict(kd_alpha=0, fused_loss="false")),
                     ("gkd+sft", {})):
        save = tmp_path / name
        assert train_main(_overrides(tiny, save, cache=f"[{tmp_path / 'cache'}]", sft_alpha=1, train_steps=2, **kw)) == 0
        runs[name] = _metrics(save)
    assert all(m["jsd"] == 0 and m["loss"] == m["sft"] > 0 for m in runs["sft"] + runs["sft-unfused"])
    a, b, kd = runs["sft"][0], runs["sft-unfused"][0], runs["gkd+sft"][0]
    assert a["sft"] == pytest.approx(b["sft"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["sft"] == pytest.approx(kd["sft"], rel=1e-6) and kd["jsd"] > 0  # same CE; the distillation run adds KD
    assert a["grad_norm"] != pytest.approx(kd["grad_norm"], rel=1e-3)


def test_each_step_logs_the_staleness_of_its_student_rows(tiny, tmp_path):
    """metrics.jsonl's `staleness` per step: the weights' step minus the policy_version of each student row it trained
    on (min / mean / max); dataset rows count for nothing. Student rows of versions 0, 6, 12, ... (every other sample),
    so each reported bound is i - v of a version v in the cache, and steps differ."""
    from tiny_cache import random_samples, score_into_cache
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny["model"]).vocab_size
    samples = random_samples(12, vocab, seed=7)  # every other one a student sample
    versions = [3 * i for i in range(len(samples))]
    score_into_cache(tiny["model"], tmp_path / "cache", samples, versions=versions)
    student = {v for v, (_, _, source) in zip(versions, samples, strict=True) if source == "student"}
    save = tmp_path / "run"
    assert train_main(_overrides(tiny, save, cache=f"[{tmp_path / 'cache'}]", train_steps=3, packing="false",
                                 micro_batch_size=2, global_batch_size=4)) == 0
    rows = _metrics(save)
    assert [r["staleness"] is not None for r in rows] == [True] * 3  # 4 random samples a step: student ones among them
    for i, row in enumerate(rows):  # the weights of step i+1 have taken i steps
        st = row["staleness"]
        assert i - st["min"] in student and i - st["max"] in student and st["min"] <= st["mean"] <= st["max"]
    assert len({tuple(r["staleness"].values()) for r in rows}) > 1


def test_staleness_over_micro_batches():
    """metrics.staleness against the same numbers worked out by hand (one gloo rank)."""
    from types import SimpleNamespace

    from pipeline.train import metrics
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    try:
        micro = [SimpleNamespace(policy_versions=(4, 6)), SimpleNamespace(policy_versions=()),
                 SimpleNamespace(policy_versions=(10,))]
        assert metrics.staleness(micro, 12, None, torch.device("cpu")) == {"min": 2, "mean": 12 - 20 / 3, "max": 8}
        assert metrics.staleness(micro[1:2], 12, None, torch.device("cpu")) is None
    finally:
        destroy_distributed()


def test_export_loads_in_transformers(tiny, uninterrupted, tmp_path):
    """The exported folder, loaded by plain transformers, computes the trained Megatron model's logits (to float32
    rounding: 1e-5 of the logit scale; the mapping itself is exact, test_model.py) — and not the start's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.cli import main as cli
    from pipeline.train import checkpoint
    from pipeline.train.models.megatron import build_model
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    assert cli(["export", "--checkpoint", str(uninterrupted), "--out", str(tmp_path / "hf")]) == 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(tiny["student"], dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").vocab == AutoTokenizer.from_pretrained(tiny["student"]).vocab
    ids = torch.arange(3, 40)[None]
    init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_model(tiny["student"])
        checkpoint.load(checkpoint.latest(uninterrupted), model)
        with torch.no_grad():
            ref = model(ids, torch.arange(ids.shape[1])[None], None)[..., : model.hf_vocab_size]
    finally:
        destroy_distributed()
    with torch.no_grad():
        ours, before = trained(ids).logits, start(ids).logits
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 1e-5 * scale
    assert (before - ref).abs().max().item() > 1e-3 * scale  # training moved it: the check above is not vacuous


def test_refuses_student_with_another_tokenizer(tiny, tmp_path):
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(tmp_path / "other", vocab_size=300)
    build_llama(tmp_path / "other", vocab_size=len(tok), layers=1, hidden=64, heads=2, kv_heads=2)
    cfg = TrainConfig(student=str(tmp_path / "other"), cache=[str(tiny["cache"])], save_dir=str(tmp_path / "run"),
                      seq_length=32, micro_batch_size=2, global_batch_size=2, progress=False)
    with pytest.raises(TokenizerMismatchError, match=str(tiny["cache"])):
        train(cfg)


@pytest.mark.distributed
def test_tp2_matches_tp1(tiny, tmp_path):
    """One trainer step at TP=2 (torchrun, gloo) vs TP=1: same loss sums, same gradients (HF layout)."""
    worker = str(Path(__file__).with_name("_train_tp_worker.py"))
    args = [str(tiny["student"]), str(tiny["cache"]), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, worker, *args, "1"], check=True, env=env, cwd=REPO, timeout=1800)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    worker, *args, "2"], check=True, env=env, cwd=REPO, timeout=1800)
    one, two = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert one["counts"] == two["counts"]
    assert_layout_close(two["sums"], one["sums"], "loss sums")
    assert_layout_close(torch.tensor(two["grad_norm"]), torch.tensor(one["grad_norm"]), "grad norm")
    assert_layout_close(two["grads"], one["grads"], "grads")
