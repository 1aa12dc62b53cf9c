"""Reading a teacher cache back: the read-side types and the decoding of scored shards into them.

`ScoredBatch` is many cached sequences at once (metadata columns and their decoded top-k), `ScoredSample` one
sequence as numpy arrays (the public read API, `read_cache`). `TeacherCache.iter_batches` / `iter_samples`
(pipeline/store/cache.py) read through here; the cache's writing, index and checks stay there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.store import codec
from pipeline.store.shards import ShardError, open_shard

META_COLUMNS = ["key", "sample_id", "source", "policy_version", "input_ids", "first_scored", "num_scored"]


@dataclass
class ScoredSample:
    """One cached sequence as numpy arrays. Row i of the top-k arrays is the teacher distribution of token
    input_ids[first_scored + i] given the tokens before it."""

    key: str
    sample_id: str
    source: str
    policy_version: int | None
    input_ids: np.ndarray  # int32 [L]
    first_scored: int  # P
    topk_ids: np.ndarray  # int32 [L-P, k]
    topk_logprobs: np.ndarray  # float32 [L-P, k]
    tail_logprobs: np.ndarray  # float32 [L-P]: log teacher mass outside the top-k
    actual_logprobs: np.ndarray  # float32 [L-P]: teacher logprob of input_ids[P:]
    actual_ranks: np.ndarray  # int32 [L-P]
    # top-p cache: entries kept per position, int32 [L-P]; the rest of a row is padding (id 0, logprob -inf)
    topk_counts: np.ndarray | None = None


@dataclass
class ScoredBatch:
    """Many cached sequences at once (what `TeacherCache.iter_batches` yields: `gkd cache export` and the tests read
    through it; the trainer's loader decodes shards itself, pipeline/train/data/blocks.py): metadata columns as an Arrow
    table and the decoded top-k of all their scored positions concatenated (see codec.DecodedBatch)."""

    path: Path
    meta: pa.RecordBatch
    topk: codec.DecodedBatch


def iter_batches(paths: Iterable[Path], root: Path, *, batch_rows: int = 64, checksum: bool = True) -> Iterator[ScoredBatch]:
    """Stream decoded batches of `batch_rows` sequences from the scored shards `paths` of the cache at `root` (which
    a failed read names); memory is bounded by one batch."""
    for p in paths:
        pf = open_shard(p, "scored", checksum=checksum)
        decoder = codec.open_decoder(pf.schema_arrow.metadata or {}, where=str(p))
        try:
            for batch in pf.iter_batches(batch_size=batch_rows):
                num = batch.column("num_scored").to_numpy(zero_copy_only=False)
                yield ScoredBatch(Path(p), batch.select(META_COLUMNS), decoder.decode(batch, num))
        except codec.CodecError as e:
            raise ShardError(f"{p}: {e}") from e
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{p}: read failed ({e}); run `gkd cache verify {root}`") from e


def iter_samples(batches: Iterable[ScoredBatch], keys: Iterable[str] | None = None) -> Iterator[ScoredSample]:
    """Per-sample numpy arrays of the given batches; optionally only the given keys."""
    wanted = set(keys) if keys is not None else None
    for b in batches:
        cols = {name: b.meta.column(name).to_pylist() for name in ("key", "sample_id", "source", "policy_version", "first_scored")}
        input_ids = b.meta.column("input_ids")
        for i, key in enumerate(cols["key"]):
            if wanted is not None and key not in wanted:
                continue
            lo, hi = int(b.topk.offsets[i]), int(b.topk.offsets[i + 1])
            yield ScoredSample(
                key=key,
                sample_id=cols["sample_id"][i],
                source=cols["source"][i],
                policy_version=cols["policy_version"][i],
                input_ids=input_ids[i].values.to_numpy(zero_copy_only=False).astype(np.int32),
                first_scored=int(cols["first_scored"][i]),
                topk_ids=b.topk.topk_ids[lo:hi],
                topk_logprobs=b.topk.topk_logprobs[lo:hi],
                tail_logprobs=b.topk.tail_logprobs[lo:hi],
                actual_logprobs=b.topk.actual_logprobs[lo:hi],
                actual_ranks=b.topk.actual_ranks[lo:hi],
                topk_counts=None if b.topk.counts is None else b.topk.counts[lo:hi],
            )
