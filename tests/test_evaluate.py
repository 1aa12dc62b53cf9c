"""pipeline/evaluate.py: the held-out KL and top-1 agreement of a plain transformers forward against cached rows."""

from __future__ import annotations

import pytest
from tiny_cache import build_tiny, random_samples, score_into_cache
from transformers import AutoConfig

from pipeline.evaluate import heldout_kl


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    teacher, student = build_tiny(root / "teacher"), build_tiny(root / "student", seed=1)
    score_into_cache(teacher, root / "cache", random_samples(6, AutoConfig.from_pretrained(teacher).vocab_size))
    return teacher, student, root / "cache"


def test_the_scoring_model_agrees_with_itself(models):
    """The teacher evaluated on its own rows: top-1 agreement 1 (its argmax is its rank-1 id) and KL ~ 0 (the
    codec's quantisation only)."""
    teacher, _, cache = models
    res = heldout_kl(teacher, cache)
    assert res["heldout_tokens"] > 50
    assert res["top1_agreement"] == 1.0
    assert res["heldout_kl"] < 1e-3


def test_another_model_disagrees(models):
    _, student, cache = models
    res = heldout_kl(student, cache)
    assert res["heldout_kl"] > 0.1
    assert res["top1_agreement"] < 0.5  # two random models: agreement near chance (1/vocab), not 1
