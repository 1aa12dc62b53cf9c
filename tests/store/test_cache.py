import json

import numpy as np
import pytest
from scored_rows import make_descriptor, make_row

from pipeline.store import CacheMismatchError, SchemaError, TeacherCache, read_cache
from pipeline.store.shards import ShardError


def _cache_with_rows(tmp_path, n_rows=5, seed=0):
    d = make_descriptor()
    cache = TeacherCache.create_or_open(tmp_path / "cache", d)
    rng = np.random.default_rng(seed)
    rows = [make_row(rng, d, length=int(rng.integers(3, 30)), prompt_len=2, source=("dataset", "student")[i % 2]) for i in range(n_rows)]
    cache.write_shard("scored-00000-of-00001", rows)
    return cache, rows


def test_round_trip_numpy_api(tmp_path):
    cache, rows = _cache_with_rows(tmp_path)
    got = {s.key: s for s in read_cache(cache.root)}
    assert set(got) == {r["key"] for r in rows}
    for r in rows:
        s = got[r["key"]]
        n = len(r["input_ids"]) - r["first_scored"]
        assert s.topk_ids.shape == (n, 8) and s.topk_logprobs.shape == (n, 8) and s.actual_logprobs.shape == (n,)
        np.testing.assert_array_equal(s.input_ids, r["input_ids"])
        np.testing.assert_array_equal(s.topk_ids, r["topk_ids"])
        assert np.abs(s.topk_logprobs - r["topk_logprobs"]).max() <= 1 / 64 + 1e-6
        assert np.abs(s.actual_logprobs - r["actual_logprobs"]).max() <= 1 / 64 + 1e-6
        np.testing.assert_array_equal(s.actual_ranks, r["actual_ranks"])
        assert s.source == r["source"] and s.first_scored == r["first_scored"]


def test_keys_lookup_and_missing(tmp_path):
    cache, rows = _cache_with_rows(tmp_path)
    assert cache.keys() == {r["key"] for r in rows}
    assert cache.missing(["nope", rows[0]["key"]]) == ["nope"]


def test_refuses_other_teacher_tokenizer_or_k(tmp_path):
    _cache_with_rows(tmp_path)
    for other in (
        make_descriptor(teacher="x" * 32),
        make_descriptor(tokenizer="y" * 32),
        make_descriptor(k=16),
    ):
        with pytest.raises(CacheMismatchError, match="cannot be mixed"):
            TeacherCache.create_or_open(tmp_path / "cache", other)
    TeacherCache.create_or_open(tmp_path / "cache", make_descriptor())  # same identity reopens


def test_rewriting_a_complete_shard_is_refused_not_overwritten(tmp_path):
    cache, rows = _cache_with_rows(tmp_path)
    with pytest.raises(ShardError, match="already complete"):
        cache.write_shard("scored-00000-of-00001", rows)


def test_stats(tmp_path):
    cache, rows = _cache_with_rows(tmp_path)
    st = cache.stats()
    tokens = sum(len(r["input_ids"]) - r["first_scored"] for r in rows)
    assert st["samples"] == len(rows) and st["scored_tokens"] == tokens and st["shards"] == 1
    assert st["bytes_per_scored_token"] == pytest.approx(st["bytes"] / tokens, rel=1e-3)


def test_flipped_byte_caught_by_verify_and_reader(tmp_path):
    cache, _ = _cache_with_rows(tmp_path)
    assert cache.verify() == []
    path = cache.shard_paths()[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))
    problems = cache.verify()
    assert problems and str(path) in problems[0] and "sha256" in problems[0]
    with pytest.raises(ShardError, match=str(path)):
        list(read_cache(cache.root))


def test_truncated_shard_caught_by_verify_and_reader(tmp_path):
    cache, _ = _cache_with_rows(tmp_path)
    path = cache.shard_paths()[0]
    path.write_bytes(path.read_bytes()[:-100])
    problems = cache.verify()
    assert problems and str(path) in problems[0] and "truncated" in problems[0]
    with pytest.raises(ShardError, match=str(path)):
        list(read_cache(cache.root))


def test_unknown_descriptor_version_refused(tmp_path):
    cache, _ = _cache_with_rows(tmp_path)
    path = cache.root / "cache.json"
    data = json.loads(path.read_text())
    data["descriptor_version"] = "7.0"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"cache.json.*7\.0"):
        TeacherCache.open(cache.root)


def test_duplicate_keys_across_shards_reported(tmp_path):
    cache, rows = _cache_with_rows(tmp_path)
    cache.write_shard("scored-extra", rows[:1])
    problems = cache.verify()
    assert any("duplicate" in p and rows[0]["key"] in p for p in problems)


FP32 = {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto"}


def test_numerics_are_part_of_the_identity(tmp_path):
    """Rows scored in bfloat16 cannot join an fp32 cache: both values are named."""
    from dataclasses import replace

    TeacherCache.create_or_open(tmp_path / "cache", replace(make_descriptor(), numerics=FP32))
    with pytest.raises(CacheMismatchError, match="numerics.dtype: cache has 'float32', this run has 'bfloat16'"):
        TeacherCache.create_or_open(tmp_path / "cache", replace(make_descriptor(), numerics={**FP32, "dtype": "bfloat16"}))
    with pytest.raises(CacheMismatchError, match="numerics.engine_extra.hf_overrides: cache has '.unset.', this run"):
        TeacherCache.create_or_open(tmp_path / "cache", replace(
            make_descriptor(), numerics={**FP32, "engine_extra.hf_overrides": '{"rope_theta": 1.0}'}))
    assert TeacherCache.create_or_open(tmp_path / "cache", replace(make_descriptor(), numerics=dict(FP32)))


def test_a_1_0_descriptor_is_read_but_takes_no_rows_until_it_says_how_it_was_scored(tmp_path):
    """A cache of descriptor 1.0 (no `numerics`): readable as before; a writer that records numerics is refused
    with the exact line to add; once added (the user vouches for how the rows were scored), it is a normal cache."""
    from dataclasses import replace

    cache, rows = _cache_with_rows(tmp_path)
    path = cache.root / "cache.json"
    data = json.loads(path.read_text())
    del data["numerics"]
    data["descriptor_version"] = "1.0"
    path.write_text(json.dumps(data))
    old = TeacherCache.open(cache.root)
    assert old.descriptor.numerics is None and len(list(read_cache(cache.root))) == len(rows)
    assert old.stats()["numerics"] is None
    with pytest.raises(CacheMismatchError, match="does not record how its rows were scored") as e:
        TeacherCache.create_or_open(cache.root, replace(make_descriptor(), numerics=FP32))
    line = '"numerics": ' + json.dumps(FP32, sort_keys=True)
    assert line in str(e.value)
    path.write_text(path.read_text().rstrip()[:-1] + ", " + line + "}")
    assert TeacherCache.create_or_open(cache.root, replace(make_descriptor(), numerics=FP32)).descriptor.numerics == FP32


def test_a_killed_image_writers_temporary_is_removed_by_the_next_writer_unless_one_is_under_way(tmp_path):
    """An image put killed between its temporary and the rename leaves `.HASH.*.tmp` in CACHE/images/; the next
    writer's first commit removes it, but not while another put holds the store's writer lock (it may be that
    put's own temporary)."""
    import fcntl
    import os

    from pipeline.store import images

    d = make_descriptor()
    cache = TeacherCache.create_or_open(tmp_path / "cache", d)
    digest = cache.add_image(b"\x89PNG not really")
    stale = images.image_dir(cache.root) / f".{digest}.dead1234.tmp"
    stale.write_bytes(b"half")
    # a writer under way: its shared lock (flock locks belong to the open file, so this fd stands for another put)
    fd = os.open(cache.root / images.WRITERS_LOCK, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)
    assert images.remove_stale_temporaries(cache.root) == 0 and stale.exists()
    os.close(fd)  # that writer ends (or is killed: the kernel drops its lock the same way)
    rng = np.random.default_rng(0)
    TeacherCache.create_or_open(cache.root, d).add_rows("p0", [make_row(rng, d, length=8, prompt_len=2)])
    assert not stale.exists()
    assert sorted(p.name for p in images.image_dir(cache.root).iterdir()) == [digest]  # the stored image stays
