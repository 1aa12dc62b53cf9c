"""The shared store: schemas, shard I/O, fingerprints, the top-k codec and the teacher cache.

Public read API (see README "Reading a cache"):

    from pipeline.store import read_cache
    for s in read_cache("runs/cache"):
        s.input_ids, s.first_scored, s.topk_ids, s.topk_logprobs, s.actual_logprobs
"""

from pipeline.store.cache import CacheMismatchError, Descriptor, TeacherCache, read_cache
from pipeline.store.reader import ScoredSample
from pipeline.store.schema import SchemaError, load_schema
from pipeline.store.shards import ShardError

__all__ = [
    "CacheMismatchError",
    "Descriptor",
    "SchemaError",
    "ScoredSample",
    "ShardError",
    "TeacherCache",
    "load_schema",
    "read_cache",
]
