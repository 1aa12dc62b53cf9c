"""A served teacher's answer -> the in-process engine's layout: vLLM's JSON `prompt_logprobs` (entry 0 null, then per
position an object keyed by token-id strings: the actual token with its true rank plus ranks 1..K, K entries when
the actual token is itself in the top K) as `FlatLogprobs` (`flat_from_json`), which the score stage's `extract`
reads as it reads an in-process engine's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.score.served.access import ServedTeacherError

# vLLM writes -inf logprobs as -9999.0 in JSON (clamp_prompt_logprobs); mapped back so check_finite sees them.
CLAMPED_LOGPROB = -9999.0


@dataclass
class FlatLogprobs:
    """The layout of vLLM's FlatLogprobs (what `extract` reads): per position [start, end) into the entry arrays."""

    start_indices: np.ndarray
    end_indices: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray


def flat_from_json(prompt_logprobs: list, ids: np.ndarray, k: int) -> FlatLogprobs:
    """A completion's `prompt_logprobs` -> the flat layout with exactly k+1 entries per position j >= 1: entry 0
    the actual token x_j with its true rank, then ranks 1..k, as the in-process engine returns them (a dict holds
    x_j once: when it is in the top k, it is both entry 0 and its top-k entry here, as in the flat form)."""
    n = len(ids)
    if len(prompt_logprobs) != n:
        raise ServedTeacherError(f"the server returned prompt_logprobs for {len(prompt_logprobs)} positions, the "
                                 f"request had {n} tokens")
    tok = np.empty((max(n - 1, 0), k + 1), np.int64)
    lp = np.empty((max(n - 1, 0), k + 1), np.float64)
    rank = np.empty((max(n - 1, 0), k + 1), np.int64)
    for j in range(1, n):
        d = prompt_logprobs[j] or {}
        actual = str(int(ids[j]))
        if actual not in d:
            raise ServedTeacherError(f"position {j}: the server's prompt_logprobs lack the actual token {actual} "
                                     "(did it tokenize the prompt itself, or add a BOS token?)")
        # the top k by rank: every entry but the actual one when the dict holds k+1, else all k (x_j among them)
        top = sorted(((e["rank"], int(t), e["logprob"]) for t, e in d.items() if len(d) <= k or t != actual))[:k]
        if len(top) < k:
            raise ServedTeacherError(f"position {j}: the server returned {len(d)} logprobs, expected {k} or {k + 1}: "
                                     f"start it with --max-logprobs >= {k}")
        a = d[actual]
        tok[j - 1, 0], lp[j - 1, 0], rank[j - 1, 0] = int(actual), a["logprob"], a["rank"]
        for i, (r, t, v) in enumerate(top, 1):
            tok[j - 1, i], lp[j - 1, i], rank[j - 1, i] = t, v, r
    lp[lp == CLAMPED_LOGPROB] = -np.inf
    ends = np.concatenate([[0], np.arange(1, n) * (k + 1)]).astype(np.int64)  # position 0: empty
    starts = np.concatenate([[0], np.arange(0, n - 1) * (k + 1)]).astype(np.int64)
    return FlatLogprobs(starts, ends, tok.ravel(), lp.astype(np.float32).ravel(), rank.ravel())
