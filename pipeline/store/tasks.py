"""Task bookkeeping: when a task is done and which of N tasks are missing, read from their outputs on disk.

Outputs are the truth, never job states: a task is done when the marker of what it writes is there (and verifies),
so a rerun of a done task is a no-op and `--status` / `gkd slurm resubmit` / the on-policy Slurm driver resubmit
exactly the tasks whose markers are missing. A finished task leaves one of three markers, each written last:
- a rollout shard's completion marker `NAME.parquet.ok` (`store/shards.py`): a generate or import task;
- a score task's marker `tasks/<name>.done` in the cache (its summary, listing the part shards it wrote, which
  must verify too): `task_marker`, `task_done`;
- a result file, a task's JSON summary (`write_result`): the score task's marker is one, and so are the on-policy
  Slurm jobs' `slurm/results/*.json`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from pipeline.store.cache import SHARDS
from pipeline.store.locks import FileLock
from pipeline.store.rollouts import shard_path
from pipeline.store.shards import WriteError, atomic_write_bytes, is_complete, read_marker, verify_shard

TASKS = "tasks"  # the cache's folder of score task markers and locks


def missing(num_tasks: int, done: Callable[[int], bool]) -> list[int]:
    """The indices of `num_tasks` tasks that are not `done`, ascending (an `--array=` list, `slurm.arrays`)."""
    return [i for i in range(num_tasks) if not done(i)]


def missing_rollout_shards(directory: str | Path, num_shards: int, prefix: str = "rollouts", *,
                           checksum: bool = True) -> list[int]:
    """The tasks of `num_shards` whose rollout shard in `directory` is not complete (no marker, or it does not
    verify; `checksum=False`: sizes and rows only, for a quick `--status`)."""
    return missing(num_shards, lambda i: is_complete(shard_path(directory, prefix, i, num_shards), "rollout",
                                                     checksum=checksum))


def write_result(path: str | Path, summary: dict) -> None:
    """A task's JSON summary, written atomically (its folder made if needed): when it is there, the task is done."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(summary, indent=1, default=str).encode())


# -- score tasks -------------------------------------------------------------------------------------------------


def rollouts_tag(paths: list[Path], tags: list[str] | None = None, tag_key: str = "") -> str:
    """Identity of a rollout set, from its shards' names and checksums (cheap: markers only), and of the tag
    selection scored from it (scoring tags A then tags B into one cache are two tasks, not one done twice)."""
    h = hashlib.blake2b(digest_size=6)
    for p in paths:
        m = read_marker(p) or {}
        h.update(f"{p.name}:{m.get('sha256')}\n".encode())
    if tags:
        h.update(f"tags|{tag_key}|{json.dumps(sorted(set(tags)))}".encode())
    return h.hexdigest()


def task_name(tag: str, shard: int, num_shards: int) -> str:
    """Score task `shard` of `num_shards` over the rollout set `tag` (`rollouts_tag`); its parts are `NAME-pNNNN`."""
    return f"scored-{tag}-{shard:05d}-of-{num_shards:05d}"


def task_marker(cache_root: Path, name: str) -> Path:
    return Path(cache_root) / TASKS / f"{name}.done"


def task_done(cache_root: Path, name: str) -> bool:
    """A task is done when its marker exists and every part it lists verifies."""
    marker = task_marker(cache_root, name)
    if not marker.exists():
        return False
    parts = json.loads(marker.read_text()).get("parts", [])
    return all(not verify_shard(Path(cache_root) / SHARDS / f"{p}.parquet", "scored", checksum=False) for p in parts)


def missing_score_tasks(cache_root: str | Path, tag: str, num_shards: int) -> list[int]:
    """The score tasks of `num_shards` over the rollout set `tag` that are not done in the cache `cache_root`."""
    return missing(num_shards, lambda i: task_done(Path(cache_root), task_name(tag, i, num_shards)))


def task_lock(cache_root: Path, name: str) -> FileLock:
    """The lock one score task holds while it runs (pipeline/store/locks.py): `tasks/<task>.lock`."""
    marker = task_marker(cache_root, name)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(marker.parent, e, "cannot write into the cache") from e
    return FileLock(marker.with_suffix(".lock"), f"score task {name} (same rollouts, shard and num_shards)")
