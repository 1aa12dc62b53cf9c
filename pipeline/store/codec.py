"""The top-k codec: teacher top-k ids and logprobs <-> compact per-row byte strings.

Layout, chosen by measurement (BENCHMARKS.md, `make bench`):
- Entries are kept in **rank order** (descending logprob), the order vLLM returns them in.
- **Ids** are lossless. Each shard carries a frequency remap (ids sorted by how often they occur in the shard's top-k
  lists, stored once in the Parquet footer); an entry stores the remapped index, so frequent tokens get small numbers.
  Numbers are split into byte planes (all low bytes of a row, then the next byte, ...): the high planes are mostly
  zero and Parquet's zstd squeezes them.
- **Logprobs** are quantised to multiples of 1/64 nat (round to nearest: max abs error 1/128 nat) and stored as the
  first value then rank-to-rank differences, which are small and non-negative. Values below -1000 nats are clamped to
  -1000; -inf is kept exactly (sentinel). NaN is refused.
- **The tail**: log of the teacher mass outside the top-k, computed in float64 from the unquantised values and
  quantised like the others, so the k+1-bin distribution (`tail` loss mode) decodes with the same per-bin relative
  error instead of inheriting the sum of k rounding errors (1 - sum(p) is ill-conditioned when the tail is small).
- **The actual next token**: its rank (1-based, may exceed k) and, only when it is not found in the top-k at that
  rank, its own quantised logprob; otherwise the decoder takes the top-k value, so a common case costs nothing.

Measured on SmolLM2-135M top-64 (prose): order-0 entropy of the id *set* alone is ~54 B/token, so any codec that
keeps ids exact and decodes with vectorised numpy lands near 100 B/token; see BENCHMARKS.md for the numbers.
Decoding is vectorised over a whole record batch (no per-row Python work in the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

NAME = "rank-q64-remap"
STEP = 64  # quanta per nat
MIN_LOGPROB = -1000.0
_NEG_INF_Q = 0xFFFF  # quantised -logprob sentinel for -inf
_MAX_Q = int(-MIN_LOGPROB * STEP)  # 64000 < sentinel


class CodecError(ValueError):
    """Input the codec cannot store faithfully (NaN, wrong shapes, ids outside the vocabulary)."""


def params() -> dict[str, str]:
    return {"name": NAME, "step": f"1/{STEP} nat", "max_abs_error": f"1/{2 * STEP} nat", "min_logprob": str(MIN_LOGPROB)}


def _nplanes(max_value: int) -> int:
    return max(1, (int(max_value).bit_length() + 7) // 8)


def _to_planes(values: np.ndarray, nb: int) -> bytes:
    """uint32 values -> nb byte planes, low byte first."""
    v = values.astype(np.uint32, copy=False).ravel()
    out = np.empty((nb, v.size), dtype=np.uint8)
    for p in range(nb):
        out[p] = (v >> (8 * p)) & 0xFF
    return out.tobytes()


def _from_planes(buf: np.ndarray, offsets: np.ndarray, nb: int) -> np.ndarray:
    """Inverse of _to_planes for many rows: `buf` is the concatenation of row blobs, `offsets` their starts
    (len rows + 1). Returns all rows' values concatenated, as uint32. One small loop over rows; the work inside is
    contiguous numpy (a global gather index measured ~3x slower)."""
    lens = np.diff(offsets)
    if np.any(lens % nb):
        raise CodecError(f"blob lengths {lens[lens % nb != 0][:3].tolist()} are not a multiple of {nb} planes")
    counts = lens // nb
    out = np.empty(int(counts.sum()), dtype=np.uint32)
    pos = 0
    for start, n in zip(offsets[:-1].tolist(), counts.tolist(), strict=True):
        if n == 0:
            continue
        planes = buf[start : start + n * nb].reshape(nb, n)
        dst = out[pos : pos + n]
        if nb == 1:
            dst[:] = planes[0]
        elif nb == 2:
            np.bitwise_or(planes[0], planes[1].astype(np.uint32) << 8, out=dst)
        else:
            dst[:] = planes[0]
            for p in range(1, nb):
                dst |= planes[p].astype(np.uint32) << (8 * p)
        pos += n
    return out


@dataclass
class EncodedRows:
    """Per-row blobs for the four binary columns, plus the footer entries of the shard they go into."""

    topk_ids: list[bytes]
    topk_logprobs: list[bytes]
    tail_logprobs: list[bytes]
    actual_rank: list[bytes]
    actual_logprobs: list[bytes]
    footer: dict[bytes, bytes]


def _quantise(lp: np.ndarray, where: str) -> np.ndarray:
    if np.isnan(lp).any():
        raise CodecError(f"{where}: NaN logprob; the teacher produced an invalid distribution")
    if (lp > 1e-3).any():
        raise CodecError(f"{where}: logprob {float(lp.max()):.4f} > 0; expected log-probabilities")
    q = np.rint(-np.clip(lp, MIN_LOGPROB, 0.0) * STEP).astype(np.int64)
    q[np.isneginf(lp)] = _NEG_INF_Q
    return q


def tail_logprob(topk_logprobs: np.ndarray) -> np.ndarray:
    """log(1 - sum(exp(top-k))) per position, in float64; -inf when the top-k hold all the mass (up to rounding)."""
    mass = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(axis=-1)
    with np.errstate(divide="ignore"):
        return np.where(mass < 1.0, np.log1p(-np.minimum(mass, 1.0)), -np.inf).astype(np.float64)


def _dequantise(q: np.ndarray) -> np.ndarray:
    out = np.multiply(q, np.float32(-1.0 / STEP), dtype=np.float32)
    sentinel = q == _NEG_INF_Q
    if sentinel.any():
        out[sentinel] = -np.inf
    return out


def _row_cumsum(deltas: np.ndarray, k: int) -> np.ndarray:
    """Per-position prefix sums of [positions * k] deltas, via one flat cumsum: uint32 arithmetic wraps, but each
    position's own sum is < 2**16, so subtracting the running total at the position's start is exact mod 2**32
    (measured ~2x faster than cumsum along axis 1 of short rows)."""
    c = np.cumsum(deltas, dtype=np.uint32).reshape(-1, k)
    if c.shape[0] == 0:
        return c
    start = np.empty(c.shape[0], dtype=np.uint32)
    start[0] = 0
    start[1:] = c[:-1, -1]
    c -= start[:, None]
    return c


def encode(
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    *,
    k: int,
    vocab_size: int,
) -> EncodedRows:
    """Encode rows of (topk_ids [n,k], topk_logprobs [n,k], actual_ids [n], actual_ranks [n], actual_logprobs [n]).

    Entries of a position are put in rank order (stable sort by descending logprob) before encoding.
    """
    norm = []
    for r, (ids, lps, aid, arank, alp) in enumerate(rows):
        ids = np.asarray(ids, dtype=np.int64)
        lps = np.asarray(lps, dtype=np.float32)
        n = ids.shape[0]
        if ids.shape != (n, k) or lps.shape != (n, k):
            raise CodecError(f"row {r}: top-k arrays have shapes {ids.shape}, {lps.shape}; expected ({n}, {k})")
        aid, arank, alp = (np.asarray(a).reshape(-1) for a in (aid, arank, alp))
        if not (aid.size == arank.size == alp.size == n):
            raise CodecError(f"row {r}: actual-token arrays must have {n} entries")
        if n and (ids.min() < 0 or ids.max() >= vocab_size or aid.min() < 0 or aid.max() >= vocab_size):
            raise CodecError(f"row {r}: token id outside [0, {vocab_size})")
        if n and arank.min() < 1:
            raise CodecError(f"row {r}: actual-token rank must be >= 1")
        order = np.argsort(-lps, axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, 1)
        lps = np.take_along_axis(lps, order, 1)
        tail = tail_logprob(lps)
        norm.append(
            (
                ids,
                _quantise(lps, f"row {r}"),
                _quantise(tail, f"row {r} tail"),
                aid.astype(np.int64),
                arank.astype(np.int64),
                _quantise(alp, f"row {r} actual"),
            )
        )

    all_ids = np.concatenate([x[0].ravel() for x in norm]) if norm else np.zeros(0, np.int64)
    counts = np.bincount(all_ids, minlength=vocab_size) if all_ids.size else np.zeros(vocab_size, np.int64)
    used = np.flatnonzero(counts)
    by_freq = used[np.argsort(-counts[used], kind="stable")]  # remapped index -> original id
    remap = np.zeros(vocab_size, dtype=np.int64)
    remap[by_freq] = np.arange(by_freq.size)
    nb_ids = _nplanes(max(by_freq.size - 1, 0))
    nb_rank = _nplanes(vocab_size)

    out = EncodedRows([], [], [], [], [], {})
    for ids, q, tq, aid, arank, aq in norm:
        n = ids.shape[0]
        out.topk_ids.append(_to_planes(remap[ids], nb_ids))
        dq = q.copy()
        if n:
            dq[:, 1:] = np.diff(q, axis=1)  # >= 0 in rank order; -inf sentinel sorts last
        out.topk_logprobs.append(_to_planes(dq, 2))
        out.tail_logprobs.append(_to_planes(tq, 2))
        out.actual_rank.append(_to_planes(arank, nb_rank))
        # 0 = "the value is the top-k entry at that rank"; else quantised -logprob + 1.
        in_topk = np.zeros(n, dtype=bool)
        inside = arank <= k
        if inside.any():
            idx = np.flatnonzero(inside)
            in_topk[idx] = ids[idx, arank[idx] - 1] == aid[idx]
        out.actual_logprobs.append(_to_planes(np.where(in_topk, 0, aq + 1), 3))
    out.footer = {
        b"gkd.codec": NAME.encode(),
        b"gkd.codec.k": str(k).encode(),
        b"gkd.codec.vocab_size": str(vocab_size).encode(),
        b"gkd.codec.id_planes": str(nb_ids).encode(),
        b"gkd.codec.rank_planes": str(nb_rank).encode(),
        b"gkd.codec.id_table": zstandard.ZstdCompressor(level=9).compress(by_freq.astype("<u4").tobytes()),
    }
    return out


@dataclass
class DecodedBatch:
    """Scored positions of many rows, concatenated: row i owns positions offsets[i]:offsets[i+1]."""

    offsets: np.ndarray  # int64 [rows + 1]
    topk_ids: np.ndarray  # int32 [positions, k]
    topk_logprobs: np.ndarray  # float32 [positions, k]
    tail_logprobs: np.ndarray  # float32 [positions]: log teacher mass outside the top-k
    actual_ranks: np.ndarray  # int32 [positions]
    actual_logprobs: np.ndarray  # float32 [positions]


class Decoder:
    """Decodes record batches of one shard; built once per shard from its footer metadata."""

    def __init__(self, footer: dict[bytes, bytes], where: str = "shard") -> None:
        if footer.get(b"gkd.codec") != NAME.encode():
            raise CodecError(f"{where}: codec {footer.get(b'gkd.codec')!r} is not {NAME!r}")
        try:
            self.k = int(footer[b"gkd.codec.k"])
            self.nb_ids = int(footer[b"gkd.codec.id_planes"])
            self.nb_rank = int(footer[b"gkd.codec.rank_planes"])
            table = zstandard.ZstdDecompressor().decompress(footer[b"gkd.codec.id_table"])
        except (KeyError, ValueError, zstandard.ZstdError) as e:
            raise CodecError(f"{where}: codec footer damaged ({e})") from e
        self.id_table = np.frombuffer(table, dtype="<u4").astype(np.int32)
        self.where = where

    @staticmethod
    def _column(batch, name: str) -> tuple[np.ndarray, np.ndarray]:
        col = batch.column(name)
        if col.null_count:
            raise CodecError(f"null entries in column {name!r}")
        bufs = col.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + len(col) + 1].astype(np.int64)
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return data, offsets

    def decode(self, batch, num_scored: np.ndarray) -> DecodedBatch:
        """Decode the four codec columns of a pyarrow RecordBatch; `num_scored` = positions per row."""
        k = self.k
        num_scored = np.asarray(num_scored, dtype=np.int64)
        pos_off = np.concatenate([[0], np.cumsum(num_scored)])
        try:
            data, off = self._column(batch, "topk_ids")
            rid = _from_planes(data, off, self.nb_ids)
            if rid.size != pos_off[-1] * k:
                raise CodecError(f"topk_ids holds {rid.size} entries, rows declare {pos_off[-1]} x {k}")
            if rid.size and rid.max() >= self.id_table.size:
                raise CodecError("topk_ids refers past the id table")
            ids = self.id_table[rid].reshape(-1, k)

            data, off = self._column(batch, "topk_logprobs")
            dq = _from_planes(data, off, 2)
            if dq.size != ids.size:
                raise CodecError("topk_logprobs and topk_ids disagree in length")
            q = _row_cumsum(dq, k)
            lps = _dequantise(q)

            data, off = self._column(batch, "tail_logprobs")
            tail = _dequantise(_from_planes(data, off, 2))
            data, off = self._column(batch, "actual_rank")
            ranks = _from_planes(data, off, self.nb_rank).astype(np.int32)
            data, off = self._column(batch, "actual_logprobs")
            aq = _from_planes(data, off, 3).astype(np.int64)
            if not (ranks.size == aq.size == tail.size == ids.shape[0]):
                raise CodecError("actual-token columns disagree in length with the top-k columns")
        except IndexError as e:
            raise CodecError(f"{self.where}: damaged codec data ({e})") from e
        from_topk = aq == 0
        alp = _dequantise(np.maximum(aq - 1, 0))
        if from_topk.any():
            idx = np.flatnonzero(from_topk)
            alp[idx] = lps[idx, np.clip(ranks[idx] - 1, 0, k - 1)]
        return DecodedBatch(pos_off, ids, lps, tail, ranks, alp)
