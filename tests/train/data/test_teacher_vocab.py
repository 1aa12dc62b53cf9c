"""A teacher with more embedding rows than the student (same tokenizer, as Qwen2.5-7B's 152,064 vs 0.5B's 151,936):
teacher ids past the student's vocab are marked invalid and their mass lands in the tail; training runs.

Run: ``python -m pytest tests/train/data/test_teacher_vocab.py`` (tiny random Llamas built with transformers' config).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_cache import random_samples, score_into_cache
from tiny_cache import train_tiny

from pipeline.store import read_cache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.data.sources import TokenizerMismatchError

EXTRA = 48  # padding rows of the teacher's embedding past the tokenizer's vocab


@pytest.fixture(scope="module")
def big_teacher(tiny, tmp_path_factory) -> dict:
    """A teacher whose config.vocab_size is the student's + EXTRA, with the student's tokenizer files; its extra
    output rows are scaled up so that they show up in the top-k (real padding rows rarely do: the test needs them)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("bigvocab")
    out = root / "teacher"
    AutoTokenizer.from_pretrained(tiny["student"]).save_pretrained(out)
    vocab = tiny["vocab"]
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=vocab + EXTRA, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        model.lm_head.weight[vocab:].mul_(1.6)
    model.save_pretrained(out, safe_serialization=True)
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(tiny["student"])  # what makes the pair acceptable
    score_into_cache(out, root / "cache", random_samples(16, vocab, seed=4))
    return {"cache": root / "cache", "vocab": vocab, "fingerprint": tokenizer_fingerprint(out),
            "rows": {s.key: s for s in read_cache(root / "cache")}}


def _loader(big_teacher, **kw) -> ScoredLoader:
    args = dict(micro_batch_size=4, seq_length=64, seed=0, vocab_size=big_teacher["vocab"],
                tokenizer_fingerprint=big_teacher["fingerprint"])
    return ScoredLoader([big_teacher["cache"]], **{**args, **kw})


def test_ids_past_the_student_vocab_fold_into_the_tail(big_teacher):
    vocab = big_teacher["vocab"]
    loader = _loader(big_teacher)
    checked = folded = 0
    for m in range(4):
        mb = loader.micro_batch(m)
        for i, key in enumerate(mb.keys):
            s = big_teacher["rows"][key]
            p, n = s.first_scored, len(s.input_ids)
            for t in range(p - 1, n - 1):
                ids, lps, tail = s.topk_ids[t + 1 - p], s.topk_logprobs[t + 1 - p], s.tail_logprobs[t + 1 - p]
                bad = ids >= vocab
                assert mb.teacher_valid[i, t].tolist() == (~bad).tolist()
                assert mb.teacher_ids[i, t].tolist() == np.where(bad, 0, ids).tolist()
                assert mb.teacher_logprobs[i, t].tolist() == np.where(bad, -np.inf, lps).tolist()
                # hand computation: log(exp(tail) + sum of the folded entries' probabilities), in float64
                mass = math.fsum([math.exp(float(tail))] + [math.exp(float(x)) for x in lps[bad]])
                assert mb.teacher_tail[i, t].item() == pytest.approx(math.log(mass), rel=1e-6, abs=1e-6)
                folded += bool(bad.any())
                checked += 1
        assert mb.folded_positions == int((mb.loss_mask & ~mb.teacher_valid.all(-1)).sum())
    assert checked > 100 and 10 < folded < checked  # both kinds of positions were seen


def test_larger_teacher_vocab_needs_a_matching_tokenizer(big_teacher):
    with pytest.raises(TokenizerMismatchError, match="exceeds the student's"):
        _loader(big_teacher, tokenizer_fingerprint=None)
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        _loader(big_teacher, tokenizer_fingerprint="y" * 32)


def test_student_with_fewer_rows_trains(tiny, big_teacher, tmp_path):
    metrics = train_tiny(tiny["student"], big_teacher["cache"], tmp_path / "run", steps=3)
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    assert sum(m["folded_positions"] for m in metrics) > 0
