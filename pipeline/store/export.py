"""A teacher cache as plain Parquet that every tool reads (pandas, DuckDB, polars, `datasets`, Spark).

    gkd cache export runs/cache --out runs/cache-plain

The cache's own shards hold the codec's blobs (compact, but bytes to any other reader). An export is a folder of
`part-NNNNN.parquet` files (one per cache shard, in the cache's shard order) with **one row per scored position**:

    key             string          the cache's content key of the sample (groups a sample's rows)
    sample_id       string          the rollout's sample_id
    position        int32           j: this row is the teacher's distribution of token j given tokens 0..j-1
    token_id        int32           x_j, the actual token at position j
    topk_ids        list<int32>     the teacher's top-k ids at j, by rank (a top-p cache: its kept entries only)
    topk_logprobs   list<float32>   their logprobs (temperature 1, natural log)
    tail_logprob    float32         log of the teacher mass outside topk_ids
    actual_logprob  float32         the teacher's logprob of x_j
    actual_rank     int32           x_j's rank under the teacher (1 = top)

Why per position and not per sample: a question about what the teacher said ("which tokens, what probability at
this token") is then a plain filter or join on scalar columns; per-sample rows would make `position`, `token_id`,
`tail_logprob` and `actual_logprob` lists and `topk_*` lists of lists, which every tool reads but few query without
unnesting first. The price is the repeated `key`/`sample_id` strings, which Parquet's dictionary encoding stores
once per row group. A sample's rows are contiguous and in position order (what `gkd cache import --from plain`
expects of any file it reads). The cache's descriptor (cache.json) is in every file's key-value metadata under
`gkd.descriptor`, the layout under `gkd.export`.

Streaming: one cache row group (`batch_rows` samples) is decoded and written at a time, so memory stays bounded
whatever the cache's size; the folder is written as `OUT.partial` and renamed when complete (`staged_dir`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import InputError
from pipeline.store.cache import TeacherCache
from pipeline.store.reader import ScoredBatch
from pipeline.store.shards import ShardError, staged_dir

EXPORT_VERSION = "1"
DESCRIPTOR_KEY = b"gkd.descriptor"
LAYOUT_KEY = b"gkd.export"
PLAIN_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("sample_id", pa.string()),
    ("position", pa.int32()),
    ("token_id", pa.int32()),
    ("topk_ids", pa.list_(pa.int32())),
    ("topk_logprobs", pa.list_(pa.float32())),
    ("tail_logprob", pa.float32()),
    ("actual_logprob", pa.float32()),
    ("actual_rank", pa.int32()),
])


def plain_table(b: ScoredBatch) -> pa.Table:
    """One decoded cache batch as per-position rows (PLAIN_SCHEMA)."""
    t = b.topk
    n = np.diff(t.offsets).astype(np.int64)  # scored positions per sample
    first = b.meta.column("first_scored").to_numpy(zero_copy_only=False).astype(np.int64)
    ids = b.meta.column("input_ids")
    starts = ids.offsets.to_numpy()[:-1].astype(np.int64)
    flat_ids = ids.values.to_numpy(zero_copy_only=False)
    row_sample = np.repeat(np.arange(len(n)), n)
    position = (np.arange(int(n.sum())) - np.repeat(t.offsets[:-1], n) + first[row_sample]).astype(np.int32)
    token_id = flat_ids[starts[row_sample] + position].astype(np.int32)
    k = t.topk_ids.shape[1]
    counts = t.counts if t.counts is not None else np.full(len(position), k, np.int64)
    valid = np.arange(k) < np.asarray(counts)[:, None]
    list_offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    keys = np.asarray(b.meta.column("key").to_pylist(), dtype=object)
    sids = np.asarray(b.meta.column("sample_id").to_pylist(), dtype=object)
    return pa.table({
        "key": pa.array(keys[row_sample], pa.string()),
        "sample_id": pa.array(sids[row_sample], pa.string()),
        "position": pa.array(position, pa.int32()),
        "token_id": pa.array(token_id, pa.int32()),
        "topk_ids": pa.ListArray.from_arrays(list_offsets, pa.array(t.topk_ids[valid].astype(np.int32))),
        "topk_logprobs": pa.ListArray.from_arrays(list_offsets, pa.array(t.topk_logprobs[valid].astype(np.float32))),
        "tail_logprob": pa.array(t.tail_logprobs.astype(np.float32)),
        "actual_logprob": pa.array(t.actual_logprobs.astype(np.float32)),
        "actual_rank": pa.array(t.actual_ranks.astype(np.int32)),
    }, schema=PLAIN_SCHEMA)


def export_plain(cache_dir: str | Path, out: str | Path, *, batch_rows: int = 64,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Write the cache at `cache_dir` as a plain Parquet folder `out` (module doc); returns counts. `progress` is
    called with the positions of each written batch. Refuses an existing `out` (an export is not merged)."""
    cache = TeacherCache.open(cache_dir)
    if cache.descriptor.hidden_rows:  # its rows are the teacher's states, which the per-position top-k layout lacks
        raise InputError(f"{cache.root / 'cache.json'}: teacher_rows=hidden: a hidden-state cache holds the teacher's "
                         "final hidden states and its output layer, not top-k rows, and `gkd cache export` writes "
                         "top-k rows (exporting it would drop the states); read it through the trainer "
                         "(topk_from_hidden=K gives its top-k), or score the rollouts into a top-k cache to export")
    out = Path(out)
    if out.exists():
        raise ShardError(f"{out}: already exists; pass --out a new folder (or delete this one)")
    metadata = {DESCRIPTOR_KEY: json.dumps(asdict(cache.descriptor), sort_keys=True).encode(),
                LAYOUT_KEY: json.dumps({"version": EXPORT_VERSION, "rows": "one per scored position",
                                        "doc": "pipeline/store/export.py"}).encode()}
    schema = PLAIN_SCHEMA.with_metadata(metadata)
    samples = positions = 0
    with staged_dir(out) as partial:
        for i, shard in enumerate(cache.shard_paths()):
            with pq.ParquetWriter(partial / f"part-{i:05d}.parquet", schema, compression="zstd") as writer:
                for b in cache.iter_batches([shard], batch_rows=batch_rows):
                    table = plain_table(b).replace_schema_metadata(metadata)
                    writer.write_table(table)
                    samples += b.meta.num_rows
                    positions += table.num_rows
                    if progress is not None:
                        progress(table.num_rows)
    return {"out": str(out), "files": len(cache.shard_paths()), "samples": samples, "positions": positions}
