"""Rollout shards: prompts with completions as token ids (schemas/rollout.json).

Written by `gkd generate` (student samples) and `gkd import` (dataset responses); read by `gkd score`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa

from pipeline.store.fingerprint import sample_id as make_sample_id
from pipeline.store.schema import load_schema
from pipeline.store.shards import ShardInfo, complete_shards, iter_batches, write_shard

SOURCES = ("dataset", "student")


def shard_name(prefix: str, index: int, count: int) -> str:
    """Deterministic per-task output name: a rerun of task `index` writes the same file."""
    return f"{prefix}-{index:05d}-of-{count:05d}"


def assign_shard(key: str, num_shards: int) -> int:
    """Which of `num_shards` tasks owns an item: a pure function of its key (stable under reordering)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % num_shards


def array_spec(indices: list[int]) -> str:
    """Task indices as sbatch `--array` syntax: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    out, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        out.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(out)


def rollout_row(
    *,
    prompt_id: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    source: str,
    policy_version: int | None = None,
    completion_logprobs: Sequence[float] | None = None,
    finish_reason: str | None = None,
    tags: dict[str, str] | None = None,
) -> dict:
    """Build one rollout row, computing its stable sample_id."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "student" and policy_version is None:
        raise ValueError("student rollouts need the policy_version (trainer step) of the weights that sampled them")
    return {
        "sample_id": make_sample_id(prompt_id, prompt_ids, completion_ids),
        "prompt_id": str(prompt_id),
        "source": source,
        "policy_version": policy_version,
        "prompt_ids": [int(t) for t in prompt_ids],
        "completion_ids": [int(t) for t in completion_ids],
        "completion_logprobs": None if completion_logprobs is None else [float(x) for x in completion_logprobs],
        "finish_reason": finish_reason,
        "tags": dict(tags or {}),
    }


def write_rollouts(path: str | Path, rows: Sequence[dict], *, extra: dict | None = None) -> ShardInfo:
    """Atomically write rollout rows as one complete shard."""
    schema = load_schema("rollout").arrow
    table = pa.Table.from_pylist([{**r, "tags": list(r.get("tags", {}).items())} for r in rows], schema=schema)
    return write_shard(path, table, "rollout", extra=extra)


def rollout_shards(directory: str | Path) -> list[Path]:
    """Complete rollout shards in a directory, sorted."""
    return complete_shards(directory, "*.parquet")


def iter_rollouts(paths: Sequence[str | Path], *, batch_size: int = 512) -> Iterator[dict]:
    """Rows of the given rollout shards as dicts (tags as a dict); every shard is verified before reading."""
    for _, batch in iter_batches(paths, "rollout", batch_size=batch_size):
        for row in batch.to_pylist():
            row["tags"] = dict(row["tags"] or [])
            yield row
