"""Rollout shards: prompts with completions as token ids (schemas/rollout.json).

Written by `gkd generate` (student samples) and `gkd import` (dataset responses); read by `gkd score`.

Each shard records the fingerprint of the tokenizer that made its ids (`TOKENIZER_KEY` in the Parquet footer, covered
by the shard's checksum, and `tokenizer_fingerprint` in its marker, where rollout shards of schema 1.0 written by
generate/import already had it): `gkd score` compares it with the teacher's before any teacher work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import pause
from pipeline.store.fingerprint import content_key
from pipeline.store.fingerprint import sample_id as make_sample_id
from pipeline.store.locks import FileLock
from pipeline.store.schema import load_schema
from pipeline.store.shards import (
    ShardError,
    ShardInfo,
    WriteError,
    complete_shards,
    iter_batches,
    read_marker,
    write_shard,
)

SOURCES = ("dataset", "student")
TOKENIZER_KEY = b"gkd.tokenizer_fingerprint"


def shard_name(prefix: str, index: int, count: int) -> str:
    """Deterministic per-task output name: a rerun of task `index` writes the same file."""
    return f"{prefix}-{index:05d}-of-{count:05d}"


def shard_path(directory: str | Path, prefix: str, index: int, count: int) -> Path:
    """The rollout shard task `index` of `count` writes into `directory` (`gkd generate`: prefix `rollouts`,
    `gkd import`: `dataset`); its completion marker is `store.shards.marker_path` of it."""
    return Path(directory) / f"{shard_name(prefix, index, count)}.parquet"


def assign_shard(key: str, num_shards: int) -> int:
    """Which of `num_shards` tasks owns an item: a pure function of its key (stable under reordering)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % num_shards


def first_scored(row: dict, score_prompt: bool = False) -> int:
    """P, the first scored position of a rollout row's x = prompt_ids + completion_ids: its completion's first
    token, or with `score_prompt` every position from x_1 on."""
    return int(scored_from(len(row["prompt_ids"]), score_prompt))


def scored_from(prompt_lengths: int | np.ndarray, score_prompt: bool = False) -> int | np.ndarray:
    """`first_scored` of rollouts whose prompts hold `prompt_lengths` tokens (one length, or an array of them, for
    a reader of a whole column: the live teacher's loader)."""
    return np.ones_like(prompt_lengths) if score_prompt else prompt_lengths


def rollout_key(row: dict, teacher_fp: str, k: int, mode: str, *, score_prompt: bool = False,
                cross: tuple[str, str] | None = None) -> str | None:
    """The content key (`fingerprint.content_key`) the score stage gives a rollout row: its x = prompt_ids +
    completion_ids scored from P = len(prompt_ids) (1 with `score_prompt`), a privileged teacher prompt part of the
    key; None for a row the score stage skips as empty (no completion, fewer than 2 tokens, or no context before
    the first scored token, i.e. an empty prompt). `cross`: a cross-tokenizer cache's (teacher, student) tokenizer
    fingerprints (the key stays one of the rollout's own ids). The score stage's row selection
    (`score/rows.select_rows`) calls this."""
    ids = np.asarray(row["prompt_ids"] + row["completion_ids"], dtype=np.int64)
    first = first_scored(row, score_prompt)
    if len(row["completion_ids"]) == 0 or len(ids) < 2 or first < 1:
        return None
    return content_key(teacher_fp, ids, first, k, mode, teacher_prompt=row.get("teacher_prompt_ids"),
                       images=row.get("images"), cross=cross)


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
    teacher_prompt_ids: Sequence[int] | None = None,
    images: Sequence[str] | None = None,
) -> dict:
    """Build one rollout row, computing its stable sample_id. `teacher_prompt_ids` (OPSD): the privileged prompt
    the teacher sees before the completion instead of `prompt_ids` (the student still sees `prompt_ids`).
    `images`: content hashes of the prompt's images (pipeline/store/images.py `put`), in placeholder order; they
    are part of the sample id, so the same text with another image is another sample."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "student" and policy_version is None:
        raise ValueError("student rollouts need the policy_version (trainer step) of the weights that sampled them")
    return {
        "sample_id": make_sample_id(prompt_id, prompt_ids, completion_ids, images=images),
        "prompt_id": str(prompt_id),
        "source": source,
        "policy_version": policy_version,
        "prompt_ids": [int(t) for t in prompt_ids],
        "completion_ids": [int(t) for t in completion_ids],
        "completion_logprobs": None if completion_logprobs is None else [float(x) for x in completion_logprobs],
        "finish_reason": finish_reason,
        "tags": dict(tags or {}),
        "teacher_prompt_ids": None if teacher_prompt_ids is None else [int(t) for t in teacher_prompt_ids],
        "images": list(images) if images else None,
    }


def write_rollouts(path: str | Path, rows: Sequence[dict], *, tokenizer_fingerprint: str | None = None,
                   extra: dict | None = None) -> ShardInfo:
    """Atomically write rollout rows as one complete shard, recording the fingerprint of the tokenizer that made
    their ids (`gkd score` refuses shards without one)."""
    schema = load_schema("rollout").arrow
    table = pa.Table.from_pylist([{**r, "tags": list(r.get("tags", {}).items())} for r in rows], schema=schema)
    extra = dict(extra or {})
    footer = None
    if tokenizer_fingerprint is not None:
        footer = {TOKENIZER_KEY: tokenizer_fingerprint.encode()}
        extra["tokenizer_fingerprint"] = tokenizer_fingerprint
    info = write_shard(path, table, "rollout", extra=extra, footer=footer)
    pause.point("rollout-shard")
    return info


def rollout_tokenizer(path: str | Path) -> str | None:
    """The tokenizer fingerprint a complete rollout shard records (footer first, then its marker), or None."""
    try:
        footer = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: unreadable Parquet footer ({e})") from e
    if TOKENIZER_KEY in footer:
        return footer[TOKENIZER_KEY].decode()
    return (read_marker(path) or {}).get("tokenizer_fingerprint")


def tokenizer_mismatches(paths: Sequence[str | Path], expected: str) -> list[tuple[Path, str | None]]:
    """The shards of `paths` whose ids were not made by the tokenizer of fingerprint `expected`, in order, with the
    fingerprint each records (None: it records none). Every reader of rollouts refuses them: ids of another tokenizer
    of the same vocabulary size pass every range check and poison a cache or a run silently."""
    found = ((Path(p), rollout_tokenizer(p)) for p in paths)
    return [(p, fp) for p, fp in found if fp != expected]


def shard_lock(path: str | Path, what: str):
    """The lock a generate/import task holds while it makes the rollout shard `path` (`.NAME.lock` beside it): a
    second process of the same task is refused at once, naming the first (pipeline/store/locks.py)."""

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(path.parent, e, "cannot create the output folder") from e
    return FileLock(path.with_name(f".{path.name}.lock"), what)


def rollout_shards(directory: str | Path) -> list[Path]:
    """Complete rollout shards in a directory, sorted."""
    return complete_shards(directory, "*.parquet")


def iter_rollouts(paths: Sequence[str | Path], *, batch_size: int = 512) -> Iterator[dict]:
    """Rows of the given rollout shards as dicts (tags as a dict); every shard is verified before reading."""
    for _, batch in iter_batches(paths, "rollout", batch_size=batch_size):
        for row in batch.to_pylist():
            row["tags"] = dict(row["tags"] or [])
            row.setdefault("teacher_prompt_ids", None)  # shards before rollout schema 1.2
            row.setdefault("images", None)  # shards before rollout schema 1.3
            yield row
