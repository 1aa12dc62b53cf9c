"""Fixtures for the train-stage tests: a tiny random Llama with a real fast tokenizer, and a teacher cache scored
from it by a plain transformers forward (tests/tiny_cache.py), standing in for the score stage."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_cache import build_tiny, random_samples, score_into_cache


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"model": HF dir, "cache": cache scored from that same model (24 samples, 3 shards), "student": another
    random model with the same tokenizer}."""
    root = tmp_path_factory.mktemp("train")
    model = build_tiny(root / "model")
    student = build_tiny(root / "student", seed=1)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    score_into_cache(model, root / "cache", random_samples(24, vocab))
    return {"model": model, "student": student, "cache": root / "cache", "vocab": vocab, "root": root}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The SMALL random Llama and Qwen2 folders of tiny_models.build_random_hf (no real tokenizer: not for vLLM)."""
    from tiny_models import build_random_hf
    from train_fixtures import ARCHS

    root = tmp_path_factory.mktemp("hf")
    return {arch: build_random_hf(arch, root / arch) for arch in ARCHS}


@pytest.fixture
def single_process():
    """Megatron's process groups for one process (TP=1), torn down after the test."""
    from pipeline.train.parallel.groups import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    yield
    destroy_distributed()
