"""The top-k codec: teacher top-k ids and logprobs <-> compact per-row byte strings.

Layout, chosen by measurement on SmolLM2-135M top-64 (27,760 prose and 10,442 math positions; whole shard written
by Parquet with zstd 9, footer included):
- Entries are kept in **rank order** (descending logprob), the order vLLM returns them in. Ids compress best sorted
  (~53 B/token) and values best in rank order; whichever order is stored, the other costs ~40 B/token more (the
  permutation), so rank order with cheap monotone value deltas wins by a little (hybrids measured 125 vs 131).
- **Ids** are lossless. Each shard carries a frequency remap (ids sorted by how often they occur in the shard's top-k
  lists, stored once in the Parquet footer); an entry stores the remapped index, so frequent tokens get small numbers.
- **Escape bytes**: every number (id index, value delta) is one byte in a first stream when it is below a threshold T,
  else an escape byte T + (high bits) in the first stream and its low bytes in a second stream after it. zstd's order-0
  coder then sees the skewed small numbers undiluted by the near-uniform low bytes of big ones (~2 B/token better than
  plain byte planes on ids, ~1.7 on values).
- **Logprobs** are quantised on a non-uniform grid: 1/128 nat above -3.5, 1/64 down to -5, 1/32 below (max abs
  error 1/64 nat). KL(orig||decoded) over the k+1 bins is mass-weighted, so likely entries get the fine steps and
  the many unlikely ones the coarse: KL 5.9e-6 (uniform 1/64: 6.4e-6; uniform 1/32: 2.6e-5) at ~3.5 B/token less.
  Stored as the first grid index, then rank-to-rank differences (small, non-negative). Values below -1000 nats are
  clamped to -1000; -inf is kept exactly (a sentinel index past the grid). NaN is refused.
- **The tail**: log of the teacher mass outside the top-k, computed in float64 from the unquantised values and
  quantised like the others, so the k+1-bin distribution (`tail` loss mode) decodes with the same per-bin relative
  error instead of inheriting the sum of k rounding errors (1 - sum(p) is ill-conditioned when the tail is small).
- **The actual next token**: its rank (1-based, may exceed k) and, only when it is not found in the top-k at that
  rank, its own quantised logprob; otherwise the decoder takes the top-k value, so a common case costs nothing.
- **Top-p** (variable k, `encode(topp=P, min_k=M)`, k the cap): a position keeps its fewest leading entries whose
  mass (float64, from the unquantised values) reaches P, clipped to [M, k] (`top_p_counts`); only those are stored,
  value deltas restarting at each position, and the tail is the mass outside them. The kept count is one more byte
  plane (two when k > 255) of the tail column, so it costs ~1 B/token before zstd and needs no schema change; the
  footer records P and M. Decoded rows are padded to k (id 0, logprob -inf) with `DecodedBatch.counts`; the value
  sums are a segmented cumsum in numpy after the kernel's escape decode. k = 0 stores no entries at all (the
  actual token's rank and logprob, and a tail of all the mass).

Decoding works on a whole record batch at once. The hot loop (escape bytes -> number -> id remap, or running sum
-> grid value) is one numba pass per entry, branch-free or branchy by the share of escapes (codec_kernels.py;
numpy fallback). The measurements behind this layout and the decoder: docs/tuning.md; current sizes and speeds:
BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from pipeline.store import exact_codec
from pipeline.store.codec_kernels import CodecError, get_escape_kernel, get_quantise_kernel, lookup
from pipeline.store.codec_kernels import escape_decode as _escape_decode
from pipeline.store.codec_rows import DecodedBatch, EncodedRows, check_logprobs, check_row, tail_logprob

if TYPE_CHECKING:
    import pyarrow as pa

NAME = "rank-grid-esc"
MIN_LOGPROB = -1000.0
# Grid of -logprob values: 1/128 nat on [0, 3.5], 1/64 on (3.5, 5], 1/32 on (5, 1000]. All points exact in float32.
_GRID = np.concatenate([np.arange(449) / 128, 3.5 + np.arange(1, 97) / 64, 5 + np.arange(1, 31841) / 32])
_NEG_INF_Q = _GRID.size  # sentinel index for -inf; sorts after every grid point
_TABLE = np.append(-_GRID, -np.inf).astype(np.float32)  # index -> decoded logprob
_IDENTITY = np.arange(_NEG_INF_Q + 1, dtype=np.int64)  # index -> itself: the raw numbers of a variable-k row
# Every codec by name, the default first: the one list a codec name is checked against (`params`).
CODECS = (NAME, exact_codec.NAME)


def params(name: str = NAME, topp: float | None = None) -> dict[str, str]:
    """The codec's descriptor entry (cache.json `codec`); `name` is NAME (the default) or "exact-f32"; `topp` set:
    a variable-k (top-p) cache, which only this module's codec stores."""
    if name != NAME:
        if name not in CODECS:
            raise CodecError(f"unknown codec {name!r}: choose {NAME!r} (default, compact) or {exact_codec.NAME!r}")
        if topp is not None:
            raise CodecError(f"codec {name!r} stores a fixed k per position; topp (variable k) needs codec {NAME!r}")
        return exact_codec.params()
    return {
        "name": NAME,
        "grid": "1/128 nat to -3.5, 1/64 to -5, 1/32 below",
        "max_abs_error": "1/64 nat",
        "min_logprob": str(MIN_LOGPROB),
    }


def _nplanes(max_value: int) -> int:
    return max(1, (int(max_value).bit_length() + 7) // 8)


def _join_planes(planes: np.ndarray) -> np.ndarray:
    """[nb, n] uint8 planes -> n uint32 values."""
    out = planes[0].astype(np.uint32)
    for p in range(1, planes.shape[0]):
        out |= planes[p].astype(np.uint32) << (8 * p)
    return out


def _escape_params(max_value: int) -> tuple[int, int]:
    """(T, nb): numbers < T take one byte; others the escape byte T + (v - T) >> 8nb plus nb low bytes."""
    nb = 1
    while max_value >> (8 * nb) > 127:
        nb += 1
    return 255 - (max_value >> (8 * nb)), nb


_VALUE_ESC = _escape_params(_NEG_INF_Q)


def _from_planes(buf: np.ndarray, offsets: np.ndarray, nb: int) -> np.ndarray:
    """Inverse of _planes_rows (see _escape_decode for the arguments)."""
    lens = np.diff(offsets)
    if np.any(lens % nb):
        raise CodecError(f"blob lengths {lens[lens % nb != 0][:3].tolist()} are not a multiple of {nb} planes")
    rows = [buf[s:e].reshape(nb, -1) for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    return _join_planes(np.concatenate(rows, axis=1)) if rows else np.zeros(0, np.uint32)


def _quantise(lp: np.ndarray, where: str, use_kernel: bool = True) -> np.ndarray:
    """Logprobs -> nearest grid index (int64); -inf -> sentinel. One numba pass (codec_kernels.py) where numba is
    there, else `quantise_numpy`; both refuse NaN and positive logprobs with the same message."""
    kernel = get_quantise_kernel() if use_kernel else None
    if kernel is None:
        return quantise_numpy(lp, where)
    lp = np.asarray(lp)
    if lp.dtype not in (np.float32, np.float64):
        lp = lp.astype(np.float64)
    flat = np.ascontiguousarray(lp).reshape(-1)
    out = np.empty(flat.size, np.int64)
    if kernel(flat, _GRID, _NEG_INF_Q, MIN_LOGPROB, out) >= 0:
        return quantise_numpy(lp, where)  # raises, naming the problem
    return out.reshape(lp.shape)


def quantise_numpy(lp: np.ndarray, where: str) -> np.ndarray:
    """`_quantise` in whole-array numpy passes: the fallback without numba, and the kernel's reference."""
    lp = np.asarray(lp, dtype=np.float64)
    check_logprobs(lp, where)
    x = -np.clip(lp, MIN_LOGPROB, 0.0)
    i = np.searchsorted(_GRID, x).clip(1, _GRID.size - 1)
    q = np.where(x - _GRID[i - 1] <= _GRID[i] - x, i - 1, i)
    q[np.isneginf(lp)] = _NEG_INF_Q
    return q


def top_p_counts(lps: np.ndarray, topp: float, min_k: int) -> np.ndarray:
    """Per position (rows of rank-ordered logprobs [n, K]): the fewest leading entries whose mass, summed in float64
    from the unquantised values, reaches `topp`, at least `min_k`, at most K (all K where the mass never reaches it)."""
    lps = np.asarray(lps)
    n, k = lps.shape
    if n == 0 or k == 0:
        return np.zeros(n, np.int64)
    reached = np.cumsum(np.exp(lps.astype(np.float64)), axis=1) >= topp
    first = np.where(reached.any(axis=1), reached.argmax(axis=1) + 1, k)
    return np.clip(first, min(min_k, k), k).astype(np.int64)


def check_top_p(k: int, topp: float | None, min_k: int | None) -> None:
    """Refuse a top-p setting the codec cannot store (see `encode`)."""
    if topp is None:
        if min_k is not None:
            raise CodecError(f"min_k={min_k} given without topp: min_k is the floor of a top-p (variable-k) cache")
        return
    if not 0.0 < topp <= 1.0:
        raise CodecError(f"topp must be in (0, 1], got {topp}")
    if k < 1:
        raise CodecError(f"topp needs a cap k >= 1 (--topk K), got k={k}")
    if min_k is None or not 1 <= min_k <= k:
        raise CodecError(f"min_k must be in [1, k={k}] with topp, got {min_k}")
    if k > 0xFFFF:
        raise CodecError(f"top-p cap k={k} does not fit the 16-bit per-position count")


def encode(
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    *,
    k: int,
    vocab_size: int,
    name: str = NAME,
    topp: float | None = None,
    min_k: int | None = None,
) -> EncodedRows:
    """Encode rows of (topk_ids [n,k], topk_logprobs [n,k], actual_ids [n], actual_ranks [n], actual_logprobs [n]).

    Entries of a position are put in rank order (stable sort by descending logprob) before encoding. `name`
    selects the codec: this module's (default) or the lossless `exact_codec`. `topp`/`min_k` (a variable-k cache,
    "Top-p" in the module docstring): each position keeps its `top_p_counts` leading entries, the tail holds the
    rest; k = 0 stores only the actual token (rank and logprob) and a tail of all the mass.
    """
    check_top_p(k, topp, min_k)
    if name != NAME:
        params(name, topp)  # refuses an unknown name, and top-p with the exact codec
        return exact_codec.encode(rows, k=k, vocab_size=vocab_size)
    checked = [check_row(r, row, k=k, vocab_size=vocab_size) for r, row in enumerate(rows)]
    nb_rank = _nplanes(vocab_size)
    if not checked:
        by_freq = np.zeros(0, np.int64)
        out = EncodedRows([], [], [], [], [], {})
    else:
        ids, q, tq, aid, arank, aq, counts, kept, lens = _normalise(checked, k, topp, min_k)
        # Every column is encoded over all rows at once and cut into the rows' blobs at the end (`_row_blobs`): the
        # per-row calls were the larger part of the encoder's time at 100-token rows.
        kept_ids = ids[kept]
        by_freq, remap = _id_table(kept_ids, vocab_size)
        dq = np.empty_like(q)  # deltas within a position: >= 0 in rank order; the -inf sentinel sorts last
        dq[:, :1] = q[:, :1]
        np.subtract(q[:, 1:], q[:, :-1], out=dq[:, 1:])
        kept_lens = _per_row(counts, lens)  # entries per row: k per position, or the top-p counts
        # 0 = "the value is the top-k entry at that rank"; else grid index + 1.
        in_topk = np.zeros(aid.size, dtype=bool)
        idx = np.flatnonzero(arank <= counts)
        in_topk[idx] = ids[idx, arank[idx] - 1] == aid[idx]
        # top-p: the kept count rides as a third (fourth) plane of the tail column, so tail and count share a page
        tail = (_planes_rows(tq | counts << 16, lens, 2 + _count_planes(k)) if topp is not None
                else _planes_rows(tq, lens, 2))
        out = EncodedRows(_escape_rows(remap[kept_ids], kept_lens, *_escape_params(max(by_freq.size - 1, 0))),
                          _escape_rows(dq[kept], kept_lens, *_VALUE_ESC), tail,
                          _planes_rows(arank, lens, nb_rank),
                          _planes_rows(np.where(in_topk, 0, aq + 1), lens, 2), {})
    out.footer = {
        b"gkd.codec": NAME.encode(),
        b"gkd.codec.k": str(k).encode(),
        b"gkd.codec.vocab_size": str(vocab_size).encode(),
        b"gkd.codec.rank_planes": str(nb_rank).encode(),
        b"gkd.codec.id_table": _pack_id_table(by_freq),
    }
    if topp is not None:
        out.footer[b"gkd.codec.topp"] = repr(float(topp)).encode()
        out.footer[b"gkd.codec.min_k"] = str(min_k).encode()
    return out


def _normalise(checked: list[tuple], k: int, topp: float | None, min_k: int | None) -> tuple:
    """All rows' positions at once: rank-ordered ids, quantised values, quantised tail, actual ids/ranks/values,
    kept counts and mask, and each row's number of positions; a bad value is named by its row (the per-row pass)."""
    lens = np.array([c[0].shape[0] for c in checked], np.int64)
    ids, lps = np.concatenate([c[0] for c in checked]), np.concatenate([c[1] for c in checked])
    aid, arank, alp = (np.concatenate([c[i] for c in checked]) for i in (2, 3, 4))
    try:
        q, aq = _quantise(lps, "all rows"), _quantise(alp, "all rows actual")
    except CodecError:
        for r, c in enumerate(checked):  # the same checks row by row, to name the row
            _quantise(c[1], f"row {r}")
            _quantise(c[4], f"row {r} actual")
        raise
    if not np.all(lps[:, :-1] >= lps[:, 1:]):  # vLLM gives rank order already: then the stable sort is the identity
        order = np.argsort(-lps, axis=1, kind="stable")
        ids, lps, q = (np.take_along_axis(a, order, 1) for a in (ids, lps, q))
    counts = top_p_counts(lps, topp, min_k) if topp is not None else np.full(ids.shape[0], k, np.int64)
    kept = np.arange(k) < counts[:, None]
    tail = tail_logprob(np.where(kept, lps, -np.inf))  # the mass outside the kept entries, unquantised
    tq = _quantise(tail, "all rows tail")
    return ids, q, tq, aid.astype(np.int64), arank.astype(np.int64), aq, counts, kept, lens


def _starts(lens: np.ndarray) -> np.ndarray:
    """[0, cumulative lens...]: where each row's entries start in the flat array, and the end."""
    out = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _per_row(per_position: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Sums of a per-position count over each row's `lens` positions (rows of no positions included)."""
    c = _starts(per_position.astype(np.int64))
    s = _starts(lens)
    return c[s[1:]] - c[s[:-1]]


def _row_blobs(out: np.ndarray, ends: np.ndarray) -> list[bytes]:
    buf = out.tobytes()
    return [buf[a:b] for a, b in zip(ends[:-1].tolist(), ends[1:].tolist(), strict=True)]


def _planes_rows(values: np.ndarray, lens: np.ndarray, nb: int) -> list[bytes]:
    """Each row (`lens` entries each) of a flat array of uint32 values as nb byte planes, low byte first, in
    whole-array passes."""
    v = values.astype(np.uint32, copy=False).ravel()
    starts = _starts(lens)
    row = np.repeat(np.arange(lens.size), lens)
    at = np.arange(v.size) + (nb - 1) * starts[row]  # a row's blob: its plane 0, then plane 1, ...
    out = np.empty(v.size * nb, np.uint8)
    for p in range(nb):
        out[at + p * lens[row]] = (v >> (8 * p)) & 0xFF
    return _row_blobs(out, nb * starts)


def _escape_rows(values: np.ndarray, lens: np.ndarray, t: int, nb: int, use_kernel: bool = True) -> list[bytes]:
    """The escape coding of each row (`lens` entries each) of a flat array: a row's blob is its first bytes, then the
    low bytes of its m escapes as nb planes of m bytes. One numba pass per row (codec_kernels.py), or whole-array
    numpy passes (the fallback, and the kernel's reference; the scatters cost ~4x the kernel's time)."""
    v = np.ascontiguousarray(values, dtype=np.int64).ravel()
    kernel = get_escape_kernel() if use_kernel else None
    if kernel is not None:
        ends = np.empty(lens.size + 1, np.int64)
        out = np.empty(v.size * (nb + 1), np.uint8)  # the most a blob can take: every entry an escape
        kernel(v, np.ascontiguousarray(lens, dtype=np.int64), t, nb, ends, out)
        return _row_blobs(out, ends)
    big = v >= t
    starts, esc = _starts(lens), _starts(big)
    m = esc[starts[1:]] - esc[starts[:-1]]  # escapes per row
    ends = _starts(lens + nb * m)
    row = np.repeat(np.arange(lens.size), lens)
    out = np.empty(int(ends[-1]), np.uint8)
    out[np.arange(v.size) + (ends[:-1] - starts[:-1])[row]] = np.where(big, t + ((v - t) >> (8 * nb)), v)
    g = np.flatnonzero(big)
    if g.size:
        r = row[g]
        at = ends[r] + lens[r] + np.arange(g.size) - esc[starts[r]]  # escape i of its row: plane 0 at lens + i
        low = (v[g] - t) & ((1 << (8 * nb)) - 1)
        for p in range(nb):
            out[at + p * m[r]] = (low >> (8 * p)) & 0xFF
    return _row_blobs(out, ends)


def _count_planes(k: int) -> int:
    return 1 if k <= 0xFF else 2


def _id_table(all_ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The shard's id remap: ids by descending frequency (ties by id) = remapped index -> id, and its inverse."""
    counts = np.bincount(all_ids, minlength=vocab_size)
    used = np.flatnonzero(counts)
    by_freq = used[np.argsort(-counts[used], kind="stable")]
    remap = np.zeros(vocab_size, dtype=np.int64)
    remap[by_freq] = np.arange(by_freq.size)
    return by_freq, remap


def _pack_id_table(by_freq: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=9).compress(by_freq.astype("<u4").tobytes())


def concat_encoded(parts: Sequence[tuple[pa.Table, dict[bytes, bytes]]], where: str = "rows") -> tuple[pa.Table, dict[bytes, bytes]]:
    """Encoded rows of several shards (each `(table, footer)`) as one table under one footer, values untouched.

    Only the id column depends on its shard (the frequency remap in the footer): ids are mapped back to token ids
    and re-indexed with one table built from all the rows, which is lossless. Every other column, the quantised
    logprobs and the tail included, is copied byte for byte, so each row decodes exactly as it did in its own shard.
    """
    import pyarrow as pa

    shared = (b"gkd.codec", b"gkd.codec.k", b"gkd.codec.vocab_size", b"gkd.codec.rank_planes", b"gkd.codec.topp",
              b"gkd.codec.min_k")
    parts = [(t, f) for t, f in parts if t.num_rows]
    if not parts:
        raise CodecError(f"{where}: no rows to concatenate")
    first = parts[0][1]
    if first.get(b"gkd.codec") != NAME.encode():  # the exact codec's columns do not depend on their shard
        if any(footer.get(name) != first.get(name) for _, footer in parts for name in shared):
            raise CodecError(f"{where}: shards encoded with different codec parameters cannot be concatenated")
        open_decoder(first, where)  # refuses an unknown codec
        return _concat([t for t, _ in parts]), dict(first)
    row_ids: list[np.ndarray] = []  # per record batch: its rows' ids, flat
    row_lens: list[np.ndarray] = []
    for table, footer in parts:
        if any(footer.get(name) != first.get(name) for name in shared):
            raise CodecError(f"{where}: shards encoded with different codec parameters cannot be concatenated")
        decoder = Decoder(footer, where=where)
        for batch in table.combine_chunks().to_batches():
            num = decoder.entries(batch, batch.column("num_scored").to_numpy(zero_copy_only=False))[0]
            data, offsets = Decoder._column(batch, "topk_ids")
            row_ids.append(decoder.id_table[_escape_decode(data, offsets, num, *decoder.id_esc)].astype(np.int64))
            row_lens.append(np.asarray(num, np.int64))
    vocab_size = int(first[b"gkd.codec.vocab_size"])
    all_ids = np.concatenate(row_ids)
    by_freq, remap = _id_table(all_ids, vocab_size)
    merged = _concat([t for t, _ in parts])
    column = pa.array(_escape_rows(remap[all_ids], np.concatenate(row_lens), *_escape_params(max(by_freq.size - 1, 0))),
                      pa.binary())
    merged = merged.set_column(merged.schema.get_field_index("topk_ids"), "topk_ids", column)
    return merged, {**first, b"gkd.codec.id_table": _pack_id_table(by_freq)}


def _concat(tables: list) -> pa.Table:
    """The tables one after the other; a sparse column only some hold (scored 1.5's completion_logprobs: rows that
    recorded them beside rows that did not) is null in the others' rows."""
    import pyarrow as pa

    return pa.concat_tables(tables, promote_options="default")


class Decoder:
    """Decodes record batches of one shard; built once per shard from its footer metadata."""

    def __init__(self, footer: dict[bytes, bytes], where: str = "shard") -> None:
        if footer.get(b"gkd.codec") != NAME.encode():
            raise CodecError(f"{where}: codec {footer.get(b'gkd.codec')!r} is not {NAME!r}")
        try:
            self.k = int(footer[b"gkd.codec.k"])
            self.nb_rank = int(footer[b"gkd.codec.rank_planes"])
            table = zstandard.ZstdDecompressor().decompress(footer[b"gkd.codec.id_table"])
        except (KeyError, ValueError, zstandard.ZstdError) as e:
            raise CodecError(f"{where}: codec footer damaged ({e})") from e
        self.id_table = np.frombuffer(table, dtype="<u4").astype(np.int32)
        self.id_esc = _escape_params(max(self.id_table.size - 1, 0))
        self.where = where
        try:  # a top-p (variable-k) shard names its P and floor; k is then the cap
            self.topp = float(footer[b"gkd.codec.topp"]) if b"gkd.codec.topp" in footer else None
            self.min_k = int(footer[b"gkd.codec.min_k"]) if self.topp is not None else None
        except (KeyError, ValueError) as e:
            raise CodecError(f"{where}: codec footer damaged ({e})") from e

    def entries(self, batch, num_scored: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(entries per row, the tail column's grid indices [positions], kept count per position or None)."""
        num_scored = np.asarray(num_scored, dtype=np.int64)
        data, off = self._column(batch, "tail_logprobs")
        if self.topp is None:
            return num_scored * self.k, _from_planes(data, off, 2), None
        v = _from_planes(data, off, 2 + _count_planes(self.k))
        counts = (v >> 16).astype(np.int64)
        if v.size != num_scored.sum() or (counts.size and (counts.max() > self.k or counts.min() < self.min_k)):
            raise CodecError(f"{self.where}: tail column's kept counts disagree with the footer (k={self.k}, "
                             f"min_k={self.min_k}) or with num_scored")
        csum = np.concatenate([[0], np.cumsum(counts)])
        pos = np.concatenate([[0], np.cumsum(num_scored)])
        return csum[pos[1:]] - csum[pos[:-1]], v & 0xFFFF, counts

    @staticmethod
    def _column(batch, name: str) -> tuple[np.ndarray, np.ndarray]:
        col = batch.column(name)
        if col.null_count:
            raise CodecError(f"null entries in column {name!r}")
        bufs = col.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + len(col) + 1].astype(np.int64)
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return data, offsets

    def decode(self, batch, num_scored: np.ndarray, *, actual: bool = True, use_kernel: bool = True) -> DecodedBatch:
        """Decode the five codec columns of a pyarrow RecordBatch; `num_scored` = positions per row.
        `actual=False` skips the actual-token columns (None in the result; the trainer does not read them).
        `use_kernel=False` forces the numpy implementation of the hot loop (codec_kernels.py)."""
        k = self.k
        num_scored = np.asarray(num_scored, dtype=np.int64)
        pos_off = np.concatenate([[0], np.cumsum(num_scored)])
        n_pos = int(pos_off[-1])
        try:
            per_row, tq, counts = self.entries(batch, num_scored)
            if tq.size != n_pos:
                raise CodecError("tail column disagrees in length with the top-k columns")
            tail = _TABLE[tq]
            data, off = self._column(batch, "topk_ids")
            ids = lookup(data, off, per_row, *self.id_esc, self.id_table, use_kernel=use_kernel)
            if isinstance(ids, int):
                raise CodecError("topk_ids refers past the id table")
            # values: rank-to-rank deltas of grid indices, summed per position, then looked up on the grid
            data, off = self._column(batch, "topk_logprobs")
            if counts is None:
                ids = ids.reshape(n_pos, k)
                lps = lookup(data, off, per_row, *_VALUE_ESC, _TABLE, k, use_kernel=use_kernel)
                if isinstance(lps, int):
                    raise CodecError("topk_logprobs holds a value index past the grid")
                lps = lps.reshape(n_pos, k)
            else:
                ids, lps = self._variable(data, off, per_row, counts, ids, use_kernel)
            ranks = alp = None
            if actual:
                data, off = self._column(batch, "actual_rank")
                ranks = _from_planes(data, off, self.nb_rank).astype(np.int32)
                data, off = self._column(batch, "actual_logprobs")
                aq = _from_planes(data, off, 2)
                if not (ranks.size == aq.size == tq.size):
                    raise CodecError("actual-token columns disagree in length with the top-k columns")
                alp = _TABLE[np.maximum(aq, 1) - 1]
        except (IndexError, ValueError) as e:
            if isinstance(e, CodecError):
                raise
            raise CodecError(f"{self.where}: damaged codec data ({e})") from e
        if actual:
            from_topk = np.flatnonzero(aq == 0)
            if from_topk.size:  # a flat take: ~2x faster than 2-D fancy indexing
                alp[from_topk] = np.take(lps.reshape(-1), from_topk * k + np.clip(ranks[from_topk] - 1, 0, k - 1))
        return DecodedBatch(pos_off, ids, lps, tail, ranks, alp,
                            None if counts is None else counts.astype(np.int32))

    def _variable(self, data, off, per_row, counts, flat_ids, use_kernel) -> tuple[np.ndarray, np.ndarray]:
        """Top-p rows: the deltas' running sums restart at each position's first kept entry (a segmented cumsum
        over the raw numbers), then kept entries are laid into [positions, k] with padding after them."""
        d = lookup(data, off, per_row, *_VALUE_ESC, _IDENTITY, use_kernel=use_kernel)
        if isinstance(d, int):
            raise CodecError("topk_logprobs holds a value index past the grid")
        c = np.concatenate([[0], np.cumsum(d, dtype=np.int64)])
        q = c[1:] - np.repeat(c[np.concatenate([[0], np.cumsum(counts)[:-1]])], counts) if counts.size else c[1:]
        if q.size and q.max() > _NEG_INF_Q:
            raise CodecError("topk_logprobs holds a value index past the grid")
        kept = np.arange(self.k) < counts[:, None]
        ids = np.zeros(kept.shape, np.int32)
        lps = np.full(kept.shape, -np.inf, np.float32)
        ids[kept], lps[kept] = flat_ids, _TABLE[q]
        return ids, lps


def open_decoder(footer: dict[bytes, bytes], where: str = "shard"):
    """The decoder of a shard, by the codec its footer names (this module's, or the exact codec; any other name
    is refused by this module's Decoder, naming it)."""
    name = footer.get(b"gkd.codec", b"").decode(errors="replace")
    return (exact_codec.ExactDecoder if name == exact_codec.NAME else Decoder)(footer, where=where)
