"""Synthetic scored rows for store tests: random but valid top-k distributions."""

from __future__ import annotations

import numpy as np

from pipeline.store import Descriptor
from pipeline.store.fingerprint import content_key, sample_id


def make_descriptor(k: int = 8, vocab: int = 1000, teacher: str = "t" * 32, tokenizer: str = "z" * 32) -> Descriptor:
    return Descriptor(
        teacher_fingerprint=teacher, tokenizer_fingerprint=tokenizer, k=k, logprob_mode="raw_logprobs", vocab_size=vocab
    )


def make_row(rng: np.random.Generator, d: Descriptor, length: int, prompt_len: int, source: str = "dataset") -> dict:
    ids = rng.integers(0, d.vocab_size, size=length).astype(np.int32)
    n = length - prompt_len
    logits = rng.normal(size=(n, d.vocab_size)) * 3
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    top = np.argsort(-lp, axis=1, kind="stable")[:, : d.k]
    actual = ids[prompt_len:]
    actual_lp = lp[np.arange(n), actual]
    ranks = (lp > actual_lp[:, None]).sum(1) + 1
    return {
        "key": content_key(d.teacher_fingerprint, ids, prompt_len, d.k, d.logprob_mode),
        "sample_id": sample_id("p", ids[:prompt_len], ids[prompt_len:]),
        "source": source,
        "policy_version": None if source == "dataset" else 3,
        "input_ids": ids,
        "first_scored": prompt_len,
        "topk_ids": top.astype(np.int32),
        "topk_logprobs": np.take_along_axis(lp, top, 1).astype(np.float32),
        "actual_ranks": ranks.astype(np.int32),
        "actual_logprobs": actual_lp.astype(np.float32),
    }


def write_random_rollouts(path, teacher, specs, seed: int = 0) -> list[dict]:
    """Rollouts of random token ids (prompt, completion lengths from `specs`) written at `path` with the teacher's
    tokenizer fingerprint: the score tests' rollouts."""
    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import rollout_row, write_rollouts

    rng = np.random.default_rng(seed)
    rows = [rollout_row(prompt_id=f"q{seed}-{i}", prompt_ids=rng.integers(3, 384, p).tolist(),
                        completion_ids=rng.integers(3, 384, c).tolist(), source="dataset")
            for i, (p, c) in enumerate(specs)]
    write_rollouts(path, rows, tokenizer_fingerprint=tokenizer_fingerprint(teacher))
    return rows
