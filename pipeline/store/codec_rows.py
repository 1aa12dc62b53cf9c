"""What every codec shares (pipeline/store/codec.py, the compact default; pipeline/store/exact_codec.py, lossless):
the encoded and decoded row types, the shape and id checks of an input row, the logprob refusal, the tail mass.

A leaf of the two codecs: both import it, it imports neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.store.codec_kernels import CodecError


def check_logprobs(lp: Any, where: str, *, nan_in: tuple = ()) -> None:
    """Refuse what no codec stores: a NaN logprob (in `lp` or in any of `nan_in`, e.g. the actual tokens'), or a
    logprob above 0 (beyond 1e-3 of rounding) in `lp`; `where` names the rows."""
    lp = np.asarray(lp, dtype=np.float64)
    if np.isnan(lp).any() or any(np.isnan(np.asarray(a, dtype=np.float64)).any() for a in nan_in):
        raise CodecError(f"{where}: NaN logprob; the teacher produced an invalid distribution")
    if lp.size and (lp > 1e-3).any():
        raise CodecError(f"{where}: logprob {float(lp.max()):.4f} > 0; expected log-probabilities")


@dataclass
class EncodedRows:
    """Per-row blobs for the five binary columns, plus the footer entries of the shard they go into."""

    topk_ids: list[bytes]
    topk_logprobs: list[bytes]
    tail_logprobs: list[bytes]
    actual_rank: list[bytes]
    actual_logprobs: list[bytes]
    footer: dict[bytes, bytes]


def tail_logprob(topk_logprobs: Any, xp: Any = np) -> Any:
    """log(1 - sum(exp(top-k))) per position, in float64; -inf when the top-k hold all the mass (up to rounding).
    `xp`: the array library of `topk_logprobs`, numpy or torch (the live teacher's tensors, on their device), so
    the tail a live teacher gives is the one the score stage stores."""
    mass = xp.exp(xp.asarray(topk_logprobs, dtype=xp.float64)).sum(-1)
    with np.errstate(divide="ignore"):  # numpy's log1p(-1) where the mass is 1: not chosen by the where
        return xp.where(mass < 1.0, xp.log1p(-xp.clip(mass, None, 1.0)), -math.inf)


def check_row(r: int, row: tuple, *, k: int, vocab_size: int) -> tuple[np.ndarray, ...]:
    """Row `r` of an encoder's input as arrays (ids int64 [n,k], logprobs float32 [n,k], actual ids, ranks,
    logprobs [n]), or a CodecError naming what is wrong: the shape and id checks both codecs share."""
    ids, lps, aid, arank, alp = row
    ids = np.asarray(ids, dtype=np.int64)
    lps = np.asarray(lps, dtype=np.float32)
    n = ids.shape[0] if ids.ndim else 0
    if ids.shape != (n, k) or lps.shape != (n, k):
        raise CodecError(f"row {r}: top-k arrays have shapes {ids.shape}, {lps.shape}; expected ({n}, {k})")
    aid, arank, alp = (np.asarray(a).reshape(-1) for a in (aid, arank, alp))
    if not (aid.size == arank.size == alp.size == n):
        raise CodecError(f"row {r}: actual-token arrays must have {n} entries")
    if n and ((ids.size and (ids.min() < 0 or ids.max() >= vocab_size)) or aid.min() < 0
              or aid.max() >= vocab_size):
        raise CodecError(f"row {r}: token id outside [0, {vocab_size})")
    if n and arank.min() < 1:
        raise CodecError(f"row {r}: actual-token rank must be >= 1")
    return ids, lps, aid, arank, alp


@dataclass
class DecodedBatch:
    """Scored positions of many rows, concatenated: row i owns positions offsets[i]:offsets[i+1]."""

    offsets: np.ndarray  # int64 [rows + 1]
    topk_ids: np.ndarray  # int32 [positions, k]
    topk_logprobs: np.ndarray  # float32 [positions, k]
    tail_logprobs: np.ndarray  # float32 [positions]: log teacher mass outside the top-k
    actual_ranks: np.ndarray | None  # int32 [positions] (None: decoded with actual=False)
    actual_logprobs: np.ndarray | None  # float32 [positions]
    # top-p cache: entries kept per position, int32 [positions]; entries past it are padding (id 0, logprob -inf)
    # that are not teacher entries at all. None: every position holds k.
    counts: np.ndarray | None = None

    def valid(self) -> np.ndarray | None:
        """bool [positions, k]: which entries are teacher entries (None: all of them)."""
        if self.counts is None:
            return None
        return np.arange(self.topk_ids.shape[1]) < self.counts[:, None]
