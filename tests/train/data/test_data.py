"""The scored-shard loader: alignment against a hand computation, truncation, order, resume, DP slices, refusals.

Run: ``python -m pytest tests/train/data/test_data.py`` (synthetic rows, no model: a few seconds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scored_rows import make_descriptor, make_row

from pipeline.store import ShardError, TeacherCache
from pipeline.train.data.batch import IGNORE_INDEX
from pipeline.train.data.loader import ScoredLoader
from pipeline.train.data.sources import TokenizerMismatchError

K = 4


def _cache(root, n_shards=3, rows=6, seed=0, tokenizer="z" * 32, lengths=(6, 30)):
    d = make_descriptor(k=K, vocab=50, tokenizer=tokenizer)
    rng = np.random.default_rng(seed)
    cache = TeacherCache.create_or_open(root, d)
    all_rows = []
    for s in range(n_shards):
        batch = []
        for i in range(rows):
            length = int(rng.integers(*lengths))
            batch.append(make_row(rng, d, length, int(rng.integers(1, length)), "dataset" if i % 2 else "student"))
        cache.write_shard(f"scored-{s:05d}", batch)
        all_rows += batch
    return cache, {r["key"]: r for r in all_rows}


def _loader(root, **kw):
    args = dict(micro_batch_size=4, seq_length=64, seed=1, pad_id=0)
    return ScoredLoader([root], **{**args, **kw})


def test_alignment_matches_hand_computation(tmp_path):
    _, rows = _cache(tmp_path)
    loader = _loader(tmp_path)
    for m in range(3):
        mb = loader.micro_batch(m)
        for i, key in enumerate(mb.keys):
            r = rows[key]
            ids, p = r["input_ids"], r["first_scored"]
            n = len(ids)
            assert mb.input_ids[i, :n].tolist() == ids.tolist()
            assert (mb.input_ids[i, n:] == 0).all()  # right padding with pad_id
            # labels = inputs rolled by -1, last real position and padding ignored
            assert mb.labels[i, : n - 1].tolist() == ids[1:].tolist()
            assert (mb.labels[i, n - 1 :] == IGNORE_INDEX).all()
            # mask exactly at t in [P-1, L-2]: the positions whose next token is scored
            expect = np.zeros(mb.loss_mask.shape[1], bool)
            expect[p - 1 : n - 1] = True
            assert mb.loss_mask[i].numpy().tolist() == expect.tolist()
            for t in range(p - 1, n - 1):  # teacher row of token j = t + 1 sits at t
                j = t + 1
                assert mb.teacher_ids[i, t].tolist() == r["topk_ids"][j - p].tolist()
                np.testing.assert_allclose(mb.teacher_logprobs[i, t], r["topk_logprobs"][j - p], atol=1 / 64)
                assert mb.labels[i, t] == ids[j]
            assert mb.sft_mask[i].tolist() == (expect & (r["source"] == "dataset")).tolist()
            assert mb.doc_ids[i].tolist() == [0] * n + [-1] * (mb.doc_ids.shape[1] - n)
            assert mb.teacher_valid[i].any(-1).tolist() == expect.tolist()
        assert mb.input_ids.shape[1] % 8 == 0 or mb.input_ids.shape[1] == 64


def test_truncation_drops_positions_beyond_seq_length(tmp_path):
    _, rows = _cache(tmp_path, lengths=(20, 30))
    loader = _loader(tmp_path, seq_length=16)
    mb = loader.micro_batch(0)
    assert mb.input_ids.shape[1] == 16
    for i, key in enumerate(mb.keys):
        r = rows[key]
        p = r["first_scored"]
        assert mb.input_ids[i].tolist() == r["input_ids"][:16].tolist()
        assert mb.loss_mask[i].nonzero().flatten().tolist() == list(range(p - 1, 15))  # empty if the prompt fills it
        assert mb.labels[i, 15] == IGNORE_INDEX
        if p <= 15:
            assert mb.teacher_ids[i, 14].tolist() == r["topk_ids"][15 - p].tolist()


def test_order_is_a_seeded_permutation_and_resumes(tmp_path):
    _, rows = _cache(tmp_path)
    n = len(rows)
    a, b = _loader(tmp_path), _loader(tmp_path)
    assert a.order(0).tolist() == b.order(0).tolist()  # pure function of (seed, epoch)
    assert sorted(a.order(0).tolist()) == list(range(n))  # each row once per epoch
    assert a.order(1).tolist() != a.order(0).tolist()
    assert _loader(tmp_path, seed=2).order(0).tolist() != a.order(0).tolist()

    def keys(it, count):
        return [k for _ in range(count) for k in next(it).keys]

    # Two epochs from the start == one epoch, then a fresh loader resumed at that position (crossing the epoch).
    whole = keys(a.iter_from(0), 2 * n // 4)
    first = keys(b.iter_from(0, prefetch=0), 3)
    resumed = keys(_loader(tmp_path).iter_from(12), 2 * n // 4 - 3)
    assert first + resumed == whole
    assert sorted(whole[:n]) == sorted(rows) and sorted(whole[n:]) == sorted(rows)


def test_data_parallel_ranks_take_disjoint_slices(tmp_path):
    _, rows = _cache(tmp_path)
    got = []
    for rank in range(2):
        it = _loader(tmp_path, micro_batch_size=3, dp_rank=rank, dp_size=2).iter_from(0)
        mbs = [next(it) for _ in range(3)]
        assert [mb.end for mb in mbs] == [6, 12, 18]  # the position after each round, equal on every rank
        got.append([k for mb in mbs for k in mb.keys])
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == sorted(rows)


def test_duplicate_keys_across_caches_are_used_once(tmp_path):
    _cache(tmp_path / "a", seed=0)
    _cache(tmp_path / "b", seed=0)  # the same rows again
    loader = ScoredLoader([tmp_path / "a", tmp_path / "b"], micro_batch_size=2, seq_length=64, seed=0)
    assert loader.num_samples == 18 and loader.duplicates == 18


def test_refuses_other_tokenizer(tmp_path):
    _cache(tmp_path)
    with pytest.raises(TokenizerMismatchError, match=str(tmp_path)):
        _loader(tmp_path, tokenizer_fingerprint="y" * 32)


def test_refuses_corrupt_or_missing_shard_naming_it(tmp_path):
    cache, _ = _cache(tmp_path)
    bad = cache.shard_paths()[1]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=bad.name):  # from the footers: at start
        _loader(tmp_path, use_index=False)
    loader = _loader(tmp_path)  # through the cache index: where the shard is first read, before it is decoded
    with pytest.raises(ShardError, match=f"{bad.name}: sha256 differs from the cache index"):
        for m in range(3 * 6 // 4 + 1):
            loader.micro_batch(m)
    missing = tmp_path / "shards" / "scored-00009.parquet"
    with pytest.raises(ShardError, match=missing.name):
        ScoredLoader([cache.shard_paths()[0], missing], micro_batch_size=2, seq_length=8, seed=0)


def _todays_padded(rows: dict, keys: list[str], seq_length: int, k: int) -> dict:
    """The padded layout as the loader built it before packing existed (restated from its rules): one sample per
    row, width = longest sample rounded up to 8 (at most seq_length), zeros/-100 elsewhere."""
    lengths = [min(len(rows[key]["input_ids"]), seq_length) for key in keys]
    width = min(seq_length, -(-max(lengths) // 8) * 8)
    b = len(keys)
    out = {"input_ids": np.zeros((b, width), np.int64), "labels": np.full((b, width), IGNORE_INDEX, np.int64),
           "loss_mask": np.zeros((b, width), bool), "teacher_ids": np.zeros((b, width, k), np.int32)}
    for i, (key, n) in enumerate(zip(keys, lengths, strict=True)):
        r = rows[key]
        out["input_ids"][i, :n] = r["input_ids"][:n]
        out["labels"][i, : n - 1] = r["input_ids"][1:n]
        p = r["first_scored"]
        for t in range(max(p - 1, 0), n - 1):
            out["loss_mask"][i, t] = True
            out["teacher_ids"][i, t] = r["topk_ids"][t + 1 - p]
    return out


def test_packing_false_keeps_todays_batches(tmp_path):
    _, rows = _cache(tmp_path, lengths=(6, 40))
    loader = _loader(tmp_path, seq_length=32)
    for m in range(6):
        mb = loader.micro_batch(m)
        assert not mb.packed and mb.samples == 4 and mb.end == 4 * (m + 1)
        for name, want in _todays_padded(rows, mb.keys, 32, K).items():
            assert getattr(mb, name).numpy().tolist() == want.tolist(), (m, name)
        assert (mb.position_ids == torch.arange(mb.input_ids.shape[1])).all()
    # a start that is not a multiple of B * dp (a packed run's checkpoint resumed with packing: false)
    it = _loader(tmp_path, seq_length=32).iter_from(6, prefetch=0)
    assert next(it).keys == [k for m in (1, 2) for k in loader.micro_batch(m).keys][2:6]
