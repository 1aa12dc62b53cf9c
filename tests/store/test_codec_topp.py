"""Variable-k (top-p) and k = 0 rows through the codec: kept counts, padding, tail = 1 - kept mass, edges."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.store import codec

COLUMNS = ("topk_ids", "topk_logprobs", "tail_logprobs", "actual_rank", "actual_logprobs")
STEP_ERR = 1 / 64 + 1e-6  # the grid's max abs error in log space (codec docstring), plus float32 slack


def dist_rows(seed: int, k: int, vocab: int, lengths: list[int], sharp: float) -> tuple[list[tuple], list[np.ndarray]]:
    """Rows as the score stage hands them over: the top k of a full softmax (so the mass outside is real), in a
    shuffled order, and the sampled actual token with its true rank. Also returns each row's full logprobs."""
    rng = np.random.default_rng(seed)
    rows, full = [], []
    for n in lengths:
        z = rng.standard_normal((n, vocab)) * sharp
        lp = z - np.logaddexp.reduce(z, axis=1, keepdims=True)
        by_rank = np.argsort(-lp, axis=1, kind="stable")
        top = by_rank[:, :k]
        shuffle = np.argsort(rng.random((n, k)), axis=1)
        ids = np.take_along_axis(top, shuffle, 1)
        lps = np.take_along_axis(lp, ids, 1).astype(np.float32)
        actual = np.array([rng.choice(vocab, p=np.exp(row) / np.exp(row).sum()) for row in lp], dtype=np.int64)
        ranks = np.array([int(np.flatnonzero(by_rank[i] == actual[i])[0]) + 1 for i in range(n)], dtype=np.int64)
        alp = lp[np.arange(n), actual].astype(np.float32)
        rows.append((ids, lps, actual, ranks, alp))
        full.append(lp)
    return rows, full


def decode(rows: list[tuple], k: int, vocab: int, use_kernel: bool = True, **kw) -> codec.DecodedBatch:
    enc = codec.encode(rows, k=k, vocab_size=vocab, **kw)
    batch = pa.RecordBatch.from_pydict({c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS})
    return codec.Decoder(enc.footer).decode(batch, np.array([len(r[0]) for r in rows]), use_kernel=use_kernel)


def expected_counts(lps_sorted: np.ndarray, topp: float, min_k: int) -> np.ndarray:
    """Independent of codec.top_p_counts: a plain loop over each position's running mass."""
    out = []
    for row in lps_sorted.astype(np.float64):
        mass, n = 0.0, len(row)
        for i, lp in enumerate(row):
            mass += np.exp(lp)
            if mass >= topp:
                n = i + 1
                break
        out.append(min(max(n, min_k), len(row)))
    return np.array(out, dtype=np.int64)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.sampled_from([1, 4, 64]),
    topp=st.sampled_from([0.3, 0.9, 0.99, 0.995, 1.0]),
    min_frac=st.sampled_from([0.0, 0.5, 1.0]),
    lengths=st.lists(st.integers(0, 10), min_size=1, max_size=4),
    sharp=st.sampled_from([0.5, 3.0, 8.0]),
)
@example(seed=10, k=64, topp=0.3, min_frac=1.0, lengths=[10, 9], sharp=0.5)  # a float32 tie (found in CI)
def test_top_p_round_trip(seed: int, k: int, topp: float, min_frac: float, lengths: list[int], sharp: float) -> None:
    vocab = 300
    min_k = max(1, int(round(min_frac * k)))
    rows, full = dist_rows(seed, k, vocab, lengths, sharp)
    out = decode(rows, k, vocab, topp=topp, min_k=min_k)
    slow = decode(rows, k, vocab, use_kernel=False, topp=topp, min_k=min_k)
    for name in ("topk_ids", "topk_logprobs", "tail_logprobs", "actual_ranks", "actual_logprobs", "counts"):
        assert np.array_equal(getattr(out, name), getattr(slow, name)), name  # kernel == numpy fallback
    lp = np.concatenate(full) if full else np.zeros((0, vocab))
    by_rank = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    # the float32 values the codec was given (its "unquantised" input), in rank order
    lps_sorted = np.take_along_axis(lp, by_rank, 1).astype(np.float32).astype(np.float64)
    counts = expected_counts(lps_sorted, topp, min_k)
    assert out.counts.dtype == np.int32 and np.array_equal(out.counts, counts)
    kept = np.arange(k) < counts[:, None]
    assert np.array_equal(out.valid(), kept)
    # The codec ranks the float32 values it is given: ids whose float64 logprobs differ but round to one float32
    # (seen: 2 of 1,216 entries on a flat row) may come in either order. Everywhere else the ids are the ranks'.
    got = np.take_along_axis(lp, out.topk_ids.astype(np.int64), 1).astype(np.float32).astype(np.float64)
    swapped = kept & (out.topk_ids != by_rank)
    np.testing.assert_array_equal(got[swapped], lps_sorted[swapped])  # only float32 ties swap
    assert all(len(set(row[m])) == m.sum() for row, m in zip(out.topk_ids, kept, strict=True))  # no id twice
    assert np.all(out.topk_ids[~kept] == 0) and np.all(np.isneginf(out.topk_logprobs[~kept]))  # padding
    assert np.all(np.abs(out.topk_logprobs[kept] - lps_sorted[kept]) <= STEP_ERR)
    # The tail bin is the mass outside the *kept* entries, within the grid's bound in log space.
    tail_mass = 1.0 - np.where(kept, np.exp(lps_sorted), 0.0).sum(axis=1)
    fin = tail_mass > 1e-12
    assert np.all(np.abs(out.tail_logprobs[fin] - np.log(tail_mass[fin])) <= STEP_ERR)
    np.testing.assert_array_equal(out.actual_ranks, np.concatenate([r[3] for r in rows]))
    alp = np.concatenate([r[4] for r in rows]).astype(np.float64)
    assert np.all(np.abs(out.actual_logprobs - alp) <= STEP_ERR)


def test_edges_min_k_equals_k_and_cap() -> None:
    """min_k = K keeps every entry: the same arrays as the fixed-k codec. P = 1 never reached below K: all K kept.
    A tiny P keeps exactly min_k."""
    k, vocab = 8, 200
    rows, _ = dist_rows(5, k, vocab, [9, 4], 2.0)
    fixed = decode(rows, k, vocab)
    for topp, min_k in ((0.5, k), (1.0, 1)):
        out = decode(rows, k, vocab, topp=topp, min_k=min_k)
        assert np.all(out.counts == k)
        for name in ("topk_ids", "topk_logprobs", "tail_logprobs", "actual_ranks", "actual_logprobs"):
            assert np.array_equal(getattr(out, name), getattr(fixed, name)), name
    out = decode(rows, k, vocab, topp=1e-9, min_k=3)
    assert np.all(out.counts == 3)


def test_top_p_is_smaller_on_confident_rows() -> None:
    rows, _ = dist_rows(2, 64, 2000, [200], 6.0)
    size = lambda enc: sum(len(b) for c in COLUMNS for b in getattr(enc, c))  # noqa: E731
    fixed = size(codec.encode(rows, k=64, vocab_size=2000))
    topp = size(codec.encode(rows, k=64, vocab_size=2000, topp=0.99, min_k=1))
    assert topp < 0.5 * fixed


def test_k_zero_keeps_only_the_actual_token() -> None:
    rows, _ = dist_rows(3, 4, 100, [6, 0, 3], 2.0)
    rows = [(ids[:, :0], lps[:, :0], a, r, alp) for ids, lps, a, r, alp in rows]
    for use_kernel in (True, False):
        out = decode(rows, 0, 100, use_kernel=use_kernel)
        assert out.topk_ids.shape == (9, 0) and out.counts is None
        assert np.all(out.tail_logprobs == 0.0)  # all the mass is outside an empty top-k
        np.testing.assert_array_equal(out.actual_ranks, np.concatenate([r[3] for r in rows]))
        assert np.all(np.abs(out.actual_logprobs - np.concatenate([r[4] for r in rows])) <= STEP_ERR)


def test_bad_top_p_settings_refused() -> None:
    rows, _ = dist_rows(1, 4, 100, [2], 1.0)
    for kw, match in (({"topp": 0.0, "min_k": 1}, "topp must be"), ({"topp": 0.9, "min_k": 5}, "min_k must be"),
                      ({"topp": None, "min_k": 2}, "without topp")):
        with pytest.raises(codec.CodecError, match=match):
            codec.encode(rows, k=4, vocab_size=100, **kw)
    with pytest.raises(codec.CodecError, match="needs codec"):
        codec.encode(rows, k=4, vocab_size=100, name="exact-f32", topp=0.9, min_k=1)
    enc = codec.encode(rows, k=4, vocab_size=100, topp=1e-9, min_k=2)  # every position keeps 2
    cols = {c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS}
    with pytest.raises(codec.CodecError, match="kept counts"):  # a footer saying min_k=3 disagrees with the rows
        codec.Decoder({**enc.footer, b"gkd.codec.min_k": b"3"}).decode(pa.RecordBatch.from_pydict(cols), np.array([2]))


def test_concat_of_top_p_shards_decodes_as_each_did() -> None:
    """On-policy views concatenate encoded rows of several shards (codec.concat_encoded): top-p rows too."""
    parts, decoded = [], []
    for seed in (1, 2):
        rows, _ = dist_rows(seed, 16, 400, [7, 3], 3.0)
        enc = codec.encode(rows, k=16, vocab_size=400, topp=0.99, min_k=2)
        table = pa.table({"num_scored": pa.array([7, 3], pa.int32()),
                          **{c: pa.array(getattr(enc, c), pa.binary()) for c in COLUMNS}})
        parts.append((table, enc.footer))
        decoded.append(codec.Decoder(enc.footer).decode(table.to_batches()[0], np.array([7, 3])))
    table, footer = codec.concat_encoded(parts)
    out = codec.Decoder(footer).decode(table.combine_chunks().to_batches()[0], np.array([7, 3, 7, 3]))
    for name in ("topk_ids", "topk_logprobs", "tail_logprobs", "counts", "actual_logprobs"):
        assert np.array_equal(getattr(out, name), np.concatenate([getattr(d, name) for d in decoded])), name
    fixed = codec.encode(dist_rows(3, 16, 400, [2], 3.0)[0], k=16, vocab_size=400)
    with pytest.raises(codec.CodecError, match="different codec parameters"):
        codec.concat_encoded([parts[0], (pa.table({"num_scored": pa.array([2], pa.int32()), **{
            c: pa.array(getattr(fixed, c), pa.binary()) for c in COLUMNS}}), fixed.footer)])
