"""Fixtures for the train-stage tests: a tiny random Llama with a real fast tokenizer, and a teacher cache scored
from it by a plain transformers forward (log_softmax -> top-k), standing in for the score stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.store import Descriptor, TeacherCache
from pipeline.store.fingerprint import content_key, sample_id, teacher_fingerprint, tokenizer_fingerprint

K = 8


def build_tiny(out: Path, seed: int = 0) -> Path:
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(out)
    return build_llama(out, vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2, seed=seed, scale=25.0)  # sharp, context-dependent distributions


def score_into_cache(model_dir: Path, cache_dir: Path, samples: list[tuple[np.ndarray, int, str]], *, k: int = K,
                     shard_rows: int = 8) -> TeacherCache:
    """Score (input_ids, first_scored, source) samples with an HF forward; row r = teacher of token P + r."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    desc = Descriptor(
        teacher_fingerprint=teacher_fingerprint(model_dir), tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
        k=k, logprob_mode="raw_logprobs", vocab_size=model.config.vocab_size,
    )
    cache = TeacherCache.create_or_open(cache_dir, desc)
    rows = []
    for ids, p, source in samples:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].float(), -1)
        dist = lp[p - 1 : len(ids) - 1]  # logits at t predict token t + 1
        top = dist.topk(k, dim=-1)
        actual = torch.as_tensor(ids[p:], dtype=torch.long)
        actual_lp = dist.gather(1, actual[:, None])[:, 0]
        rows.append({
            "key": content_key(desc.teacher_fingerprint, ids, p, k, desc.logprob_mode),
            "sample_id": sample_id("p", ids[:p], ids[p:]),
            "source": source,
            "policy_version": None if source == "dataset" else 0,
            "input_ids": ids,
            "first_scored": p,
            "topk_ids": top.indices.numpy().astype(np.int32),
            "topk_logprobs": top.values.numpy().astype(np.float32),
            "actual_ranks": ((dist > actual_lp[:, None]).sum(1) + 1).numpy().astype(np.int32),
            "actual_logprobs": actual_lp.numpy().astype(np.float32),
        })
    for i in range(0, len(rows), shard_rows):
        cache.write_shard(f"scored-{i // shard_rows:05d}", rows[i : i + shard_rows])
    return cache


def random_samples(n: int, vocab: int, seed: int = 0, lengths=(12, 40)) -> list[tuple[np.ndarray, int, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(*lengths))
        p = int(rng.integers(1, length // 2))
        out.append((rng.integers(3, vocab, size=length).astype(np.int32), p, "dataset" if i % 2 else "student"))
    return out


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
    from pipeline.train.parallel import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0)
    yield
    destroy_distributed()
