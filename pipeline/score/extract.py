"""The teacher's output -> what a cache row stores: a sequence's flat prompt logprobs (vLLM's FlatLogprobs, the
engine core's arrays, or a served teacher's answer in the same layout) as top-k ids/logprobs and the actual token's
rank/logprob per scored position (`extract`), refused when not finite (`check_finite`)."""

from __future__ import annotations

import array
from pathlib import Path

import numpy as np

from pipeline.engine import ArrayPromptLogprobs
from pipeline.score.config import ScoreConfig
from pipeline.score.errors import TeacherOutputError


def _array(values, code: str, dtype) -> np.ndarray:
    """A vLLM output list (Python ints or floats) as an array: through `array.array`, ~25 % faster than
    `np.asarray` on lists (the same C casts; measured 19 vs 25 ns an entry), the larger part of this stage's
    per-token work at k=64 (k + 1 ids and logprobs per position)."""
    if isinstance(values, list):
        return np.frombuffer(array.array(code, values), dtype)
    return np.asarray(values, dtype=dtype)


def extract(flat, ids: np.ndarray, first: int, k: int) -> dict:
    """vLLM flat prompt logprobs of one sequence -> arrays for positions first..L-1.

    Each position j >= 1 holds entry 0 = the actual token x_j with its true rank, then ranks 1..k. (Should an
    engine drop the duplicate when x_j is itself in the top-k, the position has k entries and x_j is found there.)
    """
    if isinstance(flat, ArrayPromptLogprobs):
        return _extract_arrays(flat, ids, first, k)
    start = _array(flat.start_indices[first:], "q", np.int64)
    end = _array(flat.end_indices[first:], "q", np.int64)
    tok = _array(flat.token_ids, "q", np.int64)
    lp = _array(flat.logprobs, "f", np.float32)
    n = len(ids) - first
    if len(start) != n or np.any(end - start < k):
        raise RuntimeError(f"engine returned {len(start)} positions / short top-k rows; expected {n} x {k}+1")
    if np.all(end - start == k + 1):  # the common case, vectorised
        idx = start[:, None] + np.arange(1, k + 1)[None, :]
        actual_lp = lp[start]
        ranks = np.fromiter(map(flat.ranks.__getitem__, start.tolist()), np.int64, n)  # not all k + 1 per position
        if np.any(tok[start] != ids[first:]):
            raise RuntimeError("engine's actual-token entries do not match the input ids (alignment broken)")
        return {"topk_ids": tok[idx], "topk_logprobs": lp[idx], "actual_ranks": ranks, "actual_logprobs": actual_lp}
    top_ids = np.empty((n, k), np.int64)
    top_lp = np.empty((n, k), np.float32)
    actual_lp = np.empty(n, np.float32)
    ranks = np.empty(n, np.int64)
    for i, (s, e) in enumerate(zip(start, end, strict=True)):
        top_ids[i], top_lp[i] = tok[e - k : e], lp[e - k : e]
        hit = np.flatnonzero(top_ids[i] == ids[first + i])
        if e - s == k + 1:
            actual_lp[i], ranks[i] = lp[s], flat.ranks[s]
        elif hit.size:
            actual_lp[i], ranks[i] = top_lp[i, hit[0]], hit[0] + 1
        else:
            raise RuntimeError(f"position {first + i}: the actual token is missing from the engine output")
    return {"topk_ids": top_ids, "topk_logprobs": top_lp, "actual_ranks": ranks, "actual_logprobs": actual_lp}


def _extract_arrays(flat: ArrayPromptLogprobs, ids: np.ndarray, first: int, k: int) -> dict:
    """`extract` for the engine core's arrays (pipeline/engine.py): the same dict, dtypes and checks."""
    tok, lp, ranks = (a[first - 1:] for a in flat.arrays())  # row r: position r + 1
    n = len(ids) - first
    if first < 1 or len(tok) != n or tok.shape[1] != k + 1:
        raise RuntimeError(f"engine returned {len(tok)} positions of {tok.shape[1]} entries from position {first}; "
                           f"expected {n} x {k}+1")
    if np.any(tok[:, 0] != ids[first:]):
        raise RuntimeError("engine's actual-token entries do not match the input ids (alignment broken)")
    return {"topk_ids": tok[:, 1:].astype(np.int64), "topk_logprobs": np.ascontiguousarray(lp[:, 1:]),
            "actual_ranks": ranks.astype(np.int64), "actual_logprobs": lp[:, 0].copy()}


def check_finite(got: dict, row: dict, teacher: Path, cfg: ScoreConfig) -> None:
    """Refuse NaN/inf logprobs before they reach the cache (the codec would store garbage or fail later)."""
    for name in ("topk_logprobs", "actual_logprobs"):
        values = np.asarray(got[name]).reshape(len(got[name]), -1)
        bad = np.flatnonzero(~np.isfinite(values).all(1))
        if bad.size:
            raise TeacherOutputError(
                f"{teacher}: the engine returned {values[bad[0]][~np.isfinite(values[bad[0]])][0]} in {name} for "
                f"sample {row['sample_id']} of {cfg.rollouts} at position {row['first_scored'] + int(bad[0])} "
                f"({bad.size} position(s)); nothing of this part was written. The teacher's weights hold non-finite "
                f"values or overflow in dtype={cfg.dtype}: check the model folder, or score with dtype=float32")
