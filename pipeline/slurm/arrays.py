"""Slurm array rules every stage shares: which task this process is, and the `--array` index syntax.

Light on purpose (no Slurm command, no third-party import): the stages' entries and the store import it.
"""

from __future__ import annotations

import os

from pipeline.config import ConfigError

TASK_ID = "SLURM_ARRAY_TASK_ID"


def task_index(shard: int | None, num_shards: int) -> int:
    """The task this process runs out of `num_shards`: `shard` when given, else $SLURM_ARRAY_TASK_ID, else 0 when
    there is only one task. A task of several that knows neither is refused (it would silently redo task 0), and
    so is an index outside [0, num_shards). Entries call it (the executor's state is theirs to read) and hand the
    index to the library, which checks it with `shard_index`."""
    where = ""
    if shard is None:
        env = os.environ.get(TASK_ID)
        if env is None and num_shards > 1:
            raise ConfigError(f"shard: not given and ${TASK_ID} is unset; pass --shard I with --num-shards N")
        shard, where = int(env or 0), f" (${TASK_ID})" if env is not None else ""
    return shard_index(shard, num_shards, where)


def shard_index(shard: int | None, num_shards: int, where: str = "") -> int:
    """`shard` checked against [0, num_shards); None: 0 when there is only one task, else refused. Reads nothing
    of the executor (a library's check of the index its entry resolved with `task_index`)."""
    if shard is None:
        if num_shards > 1:
            raise ConfigError("shard: not given; pass --shard I with --num-shards N")
        shard = 0
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard}{where} is outside [0, num_shards={num_shards})")
    return shard


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


def parse_array(spec: str) -> list[int]:
    """ "0-2,5,7-8" -> [0, 1, 2, 5, 7, 8]; a `%max` throttle suffix is ignored."""
    out: list[int] = []
    for part in spec.split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))
