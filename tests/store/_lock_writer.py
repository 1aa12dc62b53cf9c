"""Subprocess for test_locks: add overlapping rows to one cache part by part (as a score task does), or hold a lock.

    _lock_writer.py add CACHE NAME SEED0 SEED1   rows of seeds SEED0..SEED1-1, parts of 3 rows, via add_rows
    _lock_writer.py hold LOCKFILE                take a FileLock, print "held", sleep until killed
"""

import sys
import time
from pathlib import Path

import numpy as np
from scored_rows import make_descriptor, make_row

from pipeline.store import TeacherCache
from pipeline.store.locks import FileLock

if sys.argv[1] == "hold":
    with FileLock(sys.argv[2], "a test holder"):
        print("held", flush=True)
        time.sleep(600)
    raise SystemExit(0)

root, name, lo, hi = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
d = make_descriptor(k=4, vocab=200)
cache = TeacherCache.create_or_open(root, d)
rows = [make_row(np.random.default_rng(s), d, length=20, prompt_len=4) for s in range(lo, hi)]
dropped = 0
for i in range(0, len(rows), 3):
    _, n = cache.add_rows(f"{name}-p{i // 3:04d}", rows[i : i + 3])
    dropped += n
print("dropped", dropped, flush=True)
