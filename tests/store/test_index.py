"""The cache index (pipeline/store/index.py) on a cache of 2,000 tiny shards written by the codec (no engine).

The reference is the footer-reading loader (`ScoredLoader(use_index=False)`), which opens every shard: the index
loader must give exactly its micro-batches, and `gkd cache index` (built from the footers) must write back exactly
the lines the writers appended. The cache lives in /dev/shm where there is one (a shared disk under load took 84 s to
create its 8,000 files, tmpfs a few), with os.fsync a no-op: durability is not under test here
(tests/store/test_shards.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from scored_rows import make_descriptor, make_row

from pipeline.cli import main as gkd
from pipeline.store import ShardError, TeacherCache
from pipeline.store.index import INDEX
from pipeline.train.data.loader import ScoredLoader

SHARDS = 2000
ROWS = sum(1 + i % 3 for i in range(SHARDS))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = make_descriptor(k=4, vocab=64)
    shm = Path("/dev/shm")
    where = Path(tempfile.mkdtemp(prefix="gkd-index-", dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) \
        else tmp_path_factory.mktemp("index")
    cache = TeacherCache.create_or_open(where / "cache", d)
    rng = np.random.default_rng(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        for i in range(SHARDS):  # 1-3 rows a shard, 4-15 tokens a row, 1-3 prompt tokens
            cache.write_shard(f"scored-{i:05d}", [make_row(rng, d, int(rng.integers(4, 16)), int(rng.integers(1, 4)))
                                                  for _ in range(1 + i % 3)])
    yield cache
    shutil.rmtree(where, ignore_errors=True)


def _loader(cache: TeacherCache, **kw) -> ScoredLoader:
    return ScoredLoader([cache.root], micro_batch_size=4, seq_length=32, seed=3, packing=True, window_rows=64, **kw)


def _epoch(loader: ScoredLoader) -> list:
    out, it = [], loader.iter_from(0, prefetch=0)
    while not out or out[-1].end < loader.num_samples:
        out.append(next(it))
    return out


def test_index_loader_yields_the_footer_loaders_batches(big, capsys):
    via_index, via_footers = _loader(big), _loader(big, use_index=False)
    assert via_index.num_samples == via_footers.num_samples == ROWS - via_footers.duplicates
    assert via_index.fingerprint == via_footers.fingerprint  # a resume across the change keeps its data set
    a, b = _epoch(via_index), _epoch(via_footers)
    assert len(a) == len(b) > 100
    for x, y in zip(a, b, strict=True):
        for name, value in vars(x).items():
            other = getattr(y, name)
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), name
    assert big.stats()["samples"] == ROWS and big.stats()["shards"] == SHARDS
    # the appended lines are exactly what a rebuild from the shards' footers writes
    written = (big.root / INDEX).read_bytes()
    assert gkd(["cache", "index", str(big.root)]) == 0
    assert (big.root / INDEX).read_bytes() == written
    # a cache from before the index: read from the footers, said so, and `gkd cache index` writes it back
    (big.root / INDEX).unlink()
    capsys.readouterr()
    old = _loader(big)
    assert "no shard index" in capsys.readouterr().err and old.fingerprint == via_footers.fingerprint
    assert gkd(["cache", "index", str(big.root)]) == 0 and (big.root / INDEX).read_bytes() == written


def test_shards_removed_added_or_truncated_behind_the_index_are_named(big, capsys, tmp_path):
    n = _loader(big).num_samples
    gone = big.shard_dir / "scored-00100.parquet"
    aside = tmp_path / "aside"
    aside.mkdir()
    for f in (gone, gone.with_name(gone.name + ".ok")):
        shutil.move(f, aside / f.name)
    capsys.readouterr()
    try:
        loader = _loader(big)
        err = capsys.readouterr().err
        assert f"{gone}: in the index but gone" in err and "gkd cache index" in err, err
        assert loader.num_samples == n - 2 and all(s.path.name != gone.name for s in loader.shards)  # 100 % 3 + 1 rows
    finally:
        for f in aside.iterdir():
            shutil.move(f, big.shard_dir / f.name)
    rng = np.random.default_rng(1)
    big._write_shard("zz-behind", [make_row(rng, big.descriptor, 9, 2)])  # a writer that does not index
    behind = big.shard_dir / "zz-behind.parquet"
    try:
        loader = _loader(big)
        err = capsys.readouterr().err
        assert f"{behind}: complete but not in the index" in err, err
        assert loader.num_samples == n + 1 and loader.shards[-1].path.name == behind.name
    finally:
        behind.unlink()
        behind.with_name(behind.name + ".ok").unlink()
    bad = big.shard_dir / "scored-00007.parquet"
    data = bad.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    try:
        # start-up reads no shard; the loader refuses one where it first reads it (before decoding a byte of it)
        for content, verify, message in ((data[:-100], False, "size .* the cache index says .*truncated"),
                                         (bytes(flipped), True, "sha256 differs from the cache index")):
            bad.write_bytes(content)
            loader = _loader(big, verify_checksums=verify)
            with pytest.raises(ShardError, match=f"{bad}: {message}"):
                _epoch(loader)
    finally:
        bad.write_bytes(data)
    assert _loader(big).num_samples == n and not capsys.readouterr().err


def test_writers_see_each_others_keys_through_the_index(big):
    """add_rows leaves out keys another writer (another process, here another instance) committed meanwhile."""
    rng = np.random.default_rng(2)
    rows = [make_row(rng, big.descriptor, 10, 3) for _ in range(3)]
    one, two = TeacherCache.open(big.root), TeacherCache.open(big.root)
    assert one.add_rows("w-one", rows[:2])[1] == 0  # first sync of `one`: the whole index
    two.add_rows("w-two", rows[2:])
    info, dropped = one.add_rows("w-one-again", rows)  # `one` reads only the line `two` appended
    assert info is None and dropped == 3
    assert {r["key"] for r in rows} <= big.keys()
    for name in ("w-one", "w-two"):
        for f in (big.shard_dir / f"{name}.parquet", big.shard_dir / f"{name}.parquet.ok"):
            f.unlink()
    assert gkd(["cache", "index", str(big.root)]) == 0


def test_index_columns_equal_each_shards_footer_and_a_bad_line_is_named(big, tmp_path):
    """The columnar read (pyarrow's JSON reader) gives, shard by shard, the footer's keys, lengths and row groups;
    a line that does not parse, or lacks a field, is refused naming the file and its line number."""
    import pyarrow.parquet as pq

    from pipeline.store import index as shard_index

    idx = big.index()
    assert idx.names == sorted(idx.names) and len(idx.names) == SHARDS and len(idx.keys) == ROWS
    for s in (0, 1, 2, 997, SHARDS - 1):
        pf = pq.ParquetFile(big.shard_dir / f"{idx.names[s]}.parquet")
        t = pf.read(columns=["key", "first_scored", "num_scored"])
        assert idx.shard_keys(s).astype(str).tolist() == t.column("key").to_pylist()
        lo, hi = idx.row_starts[s], idx.row_starts[s + 1]
        assert idx.first_scored[lo:hi].tolist() == t.column("first_scored").to_pylist()
        assert idx.num_scored[lo:hi].tolist() == t.column("num_scored").to_pylist()
        assert idx.row_groups(s).tolist() == [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        assert idx.sha256[s].decode() == shard_index.read_marker(big.shard_dir / f"{idx.names[s]}.parquet")["sha256"]
    # lines in commit order, not name order (parallel score tasks), and a shard's line written twice: the same index
    original = (big.root / INDEX).read_bytes()
    head, *body = original.split(b"\n")[:-1]
    try:
        (big.root / INDEX).write_bytes(b"\n".join([head, *body[::-1], body[0]]) + b"\n")
        again = big.index()
    finally:
        (big.root / INDEX).write_bytes(original)
    assert again.names == idx.names and not again.changes
    for field in ("keys", "first_scored", "num_scored", "row_starts", "rg_rows", "rg_starts", "nbytes", "sha256"):
        assert np.array_equal(getattr(again, field), getattr(idx, field)), field
    copy = tmp_path / "copy"
    shutil.copytree(big.root, copy, ignore=shutil.ignore_patterns("shards"))
    (copy / "shards").mkdir()
    lines = (big.root / INDEX).read_bytes().split(b"\n")
    for n, bad in ((3, b"{not json"), (5, lines[4].replace(b'"keys"', b'"kees"'))):
        broken = lines[: n - 1] + [bad] + lines[n:]
        (copy / INDEX).write_bytes(b"\n".join(broken))
        with pytest.raises(ShardError, match=rf"{copy / INDEX}:{n}: unreadable index line .*gkd cache index {copy}"):
            shard_index.load(copy, big.descriptor, say=lambda _: None)
