"""A tiny random Llama with a real fast tokenizer, and a teacher cache scored from a model by a plain transformers
forward (log_softmax -> top-k), standing in for the score stage. Shared by tests/train (conftest fixtures) and the
Slurm trainer test (imported by name: tests/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.store import Descriptor, TeacherCache
from pipeline.store.fingerprint import content_key, sample_id, teacher_fingerprint, tokenizer_fingerprint

K = 8


def build_tiny(out: Path, seed: int = 0) -> Path:
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(out)
    return build_llama(out, vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2, seed=seed, scale=25.0)  # sharp, context-dependent distributions


def score_into_cache(model_dir: Path, cache_dir: Path, samples: list[tuple[np.ndarray, int, str]], *, k: int = K,
                     shard_rows: int = 8, codec: str = "rank-grid-esc", topp: float | None = None,
                     min_k: int | None = None, tags: list[dict] | None = None) -> TeacherCache:
    """Score (input_ids, first_scored, source) samples with an HF forward; row r = teacher of token P + r.
    `topp`/`min_k`: a variable-k cache with cap k (the codec truncates each position, as in `gkd score`).
    `tags`: the rollout tags of each sample (what the trainer routes on), stored with its row."""
    from transformers import AutoModelForCausalLM

    from pipeline.store.codec import params as codec_params

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    desc = Descriptor(
        teacher_fingerprint=teacher_fingerprint(model_dir), tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
        k=k, logprob_mode="raw_logprobs", vocab_size=model.config.vocab_size, codec=codec_params(codec, topp),
        topp=topp, min_k=min_k,
    )
    cache = TeacherCache.create_or_open(cache_dir, desc)
    rows = []
    for i, (ids, p, source) in enumerate(samples):
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
            "tags": None if tags is None else tags[i],
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


def train_tiny(student: Path, cache: Path, save: Path, steps: int) -> list[dict]:
    """`gkd train` (in-process CLI) of a tiny student on one cache, micro-batches of 2 x 64; its metrics.jsonl rows."""
    import json

    from pipeline.cli import main as cli

    args = dict(student=str(student), cache=f"[{cache}]", micro_batch_size=2, global_batch_size=2, seq_length=64,
                train_steps=steps, warmup_steps=1, save_interval=steps, save_dir=str(save), progress=False)
    assert cli(["train", *[f"{k}={v}" for k, v in args.items()]]) == 0
    return [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()]
