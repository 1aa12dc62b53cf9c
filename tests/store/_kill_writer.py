"""Subprocess for test_shards: writes N scored shards (skipping complete ones), like a score task would."""

import sys
from pathlib import Path

import numpy as np
from scored_rows import make_descriptor, make_row

from pipeline.store import TeacherCache
from pipeline.store.shards import is_complete

root, n_shards = Path(sys.argv[1]), int(sys.argv[2])
d = make_descriptor(k=16, vocab=5000)
cache = TeacherCache.create_or_open(root, d)
for i in range(n_shards):
    name = f"scored-{i:05d}-of-{n_shards:05d}"
    if is_complete(cache.shard_dir / f"{name}.parquet", "scored"):
        continue
    rng = np.random.default_rng(i)
    rows = [make_row(rng, d, length=60, prompt_len=10) for _ in range(40)]
    print("writing", name, flush=True)  # the test kills between this line and the shard's marker
    cache.write_shard(name, rows)
print("done", flush=True)
