"""The `exact` codec: teacher top-k stored without any loss (`gkd score ... codec=exact`).

For users who want no quantisation at all, and so that a cache-trained student can be compared exactly with one
trained against a live teacher (`gkd train teacher_live=DIR`). Per row, each column is the raw little-endian array:
ids int32 [n, k] in rank order, logprobs float32 [n, k], the log tail mass float32 [n] (computed in float64 from the
float32 values, like the default codec), the actual token's rank int32 [n] and logprob float32 [n]; Parquet's zstd
compresses the columns. Measured cost: see BENCHMARKS.md (several times the default codec's bytes per token).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.store.codec_kernels import CodecError
from pipeline.store.codec_rows import DecodedBatch, EncodedRows, check_logprobs, check_row, tail_logprob

NAME = "exact-f32"


def params() -> dict[str, str]:
    return {"name": NAME, "max_abs_error": "0 (float32 logprobs as the engine returned them)"}


def encode(rows: Sequence[tuple], *, k: int, vocab_size: int) -> EncodedRows:
    """Same rows and checks as `codec.encode`; entries put in rank order (stable by descending logprob)."""
    out = EncodedRows([], [], [], [], [], {})
    for r, row in enumerate(rows):
        ids, lps, aid, arank, alp = check_row(r, row, k=k, vocab_size=vocab_size)
        check_logprobs(lps, f"row {r}", nan_in=(alp,))
        order = np.argsort(-lps, axis=1, kind="stable")
        ids, lps = np.take_along_axis(ids, order, 1), np.take_along_axis(lps, order, 1)
        out.topk_ids.append(ids.astype("<i4").tobytes())
        out.topk_logprobs.append(lps.astype("<f4").tobytes())
        out.tail_logprobs.append(tail_logprob(lps).astype("<f4").tobytes())
        out.actual_rank.append(arank.astype("<i4").tobytes())
        out.actual_logprobs.append(np.asarray(alp, dtype="<f4").tobytes())
    out.footer = {b"gkd.codec": NAME.encode(), b"gkd.codec.k": str(k).encode(),
                  b"gkd.codec.vocab_size": str(vocab_size).encode()}
    return out


class ExactDecoder:
    """Decodes record batches of one exact-codec shard (the interface of `codec.Decoder`)."""

    def __init__(self, footer: dict[bytes, bytes], where: str = "shard") -> None:
        if footer.get(b"gkd.codec") != NAME.encode():
            raise CodecError(f"{where}: codec {footer.get(b'gkd.codec')!r} is not {NAME!r}")
        try:
            self.k = int(footer[b"gkd.codec.k"])
        except (KeyError, ValueError) as e:
            raise CodecError(f"{where}: codec footer damaged ({e})") from e
        self.where = where

    def _column(self, batch, name: str, dtype: str, width: int, num: np.ndarray) -> np.ndarray:
        col = batch.column(name)
        if col.null_count:
            raise CodecError(f"{self.where}: null entries in column {name!r}")
        bufs = col.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset: col.offset + len(col) + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        if not np.array_equal(np.diff(offsets), num * width * 4):
            raise CodecError(f"{self.where}: column {name!r} does not hold {width} x 4 bytes per scored position")
        return data[offsets[0]: offsets[-1]].view(dtype)

    def decode(self, batch, num_scored: np.ndarray, actual: bool = True) -> DecodedBatch:
        """`actual=False`: the actual token's columns are not read (the trainer's loader needs none)."""
        num = np.asarray(num_scored, dtype=np.int64)
        k = self.k
        ids = self._column(batch, "topk_ids", "<i4", k, num).reshape(-1, k).astype(np.int32)
        lps = self._column(batch, "topk_logprobs", "<f4", k, num).reshape(-1, k).astype(np.float32)
        tail = self._column(batch, "tail_logprobs", "<f4", 1, num).astype(np.float32)
        if actual:
            ranks = self._column(batch, "actual_rank", "<i4", 1, num).astype(np.int32)
            alp = self._column(batch, "actual_logprobs", "<f4", 1, num).astype(np.float32)
        else:
            ranks, alp = np.zeros(tail.size, np.int32), np.zeros(tail.size, np.float32)
        return DecodedBatch(np.concatenate([[0], np.cumsum(num)]), ids, lps, tail, ranks, alp)
