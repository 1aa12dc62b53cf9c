"""Fixtures of the export/import tests: rollouts and the teacher cache scored on them (a tiny model, an HF forward:
tests/tiny_cache.py), shared by tests/store/test_export.py and test_imports.py."""

from __future__ import annotations

import numpy as np
import pytest

K = 8


@pytest.fixture(scope="module")
def scored_rollouts(tmp_path_factory):
    """A tiny teacher, 6 rollouts (prompt 3-6 tokens, completion 4-12; every other one the teacher's greedy
    continuation, so its actual tokens are in the teacher's top-k, the others random, so they are not) in one
    shard, and their cache (exact-f32 codec: what an export holds is what the cache decodes, bit for bit), in two
    shards."""
    from tiny_cache import build_tiny, score_into_cache

    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import rollout_row, write_rollouts

    tmp = tmp_path_factory.mktemp("interop")
    model = build_tiny(tmp / "teacher")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        prompt = rng.integers(5, 200, int(rng.integers(3, 7))).tolist()
        n = int(rng.integers(4, 13))
        rows.append(rollout_row(prompt_id="p", prompt_ids=prompt, source="dataset",
                                completion_ids=_greedy(model, prompt, n) if i % 2 else rng.integers(5, 200, n).tolist()))
    write_rollouts(tmp / "rollouts" / "r-00000-of-00001.parquet", rows,
                   tokenizer_fingerprint=tokenizer_fingerprint(model))
    samples = [(np.asarray(r["prompt_ids"] + r["completion_ids"], np.int32), len(r["prompt_ids"]), "dataset")
               for r in rows]
    score_into_cache(model, tmp / "cache", samples, k=K, shard_rows=4, codec="exact-f32")
    return {"tmp": tmp, "model": model, "rollouts": tmp / "rollouts", "cache": tmp / "cache", "rows": rows}


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(m(torch.as_tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
