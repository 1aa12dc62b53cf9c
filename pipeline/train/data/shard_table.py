"""The shards a loader reads, as flat arrays: no object per shard, so a cache of 10^5 shards costs a few arrays
(and the cache index's own list of names, shared, not copied), not 10^5 Python objects (issue 33: a rank's memory
must not grow with the cache beyond its keys and lengths).

Shard s belongs to group g = `group[s]` (one cache directory read through its index, or one shard file read
through its footer) and is the file `dirs[g] / f"{names[g][s - first[g]]}.parquet"`. Its row groups are
`rg_rows[rg_starts[s]: rg_starts[s + 1]]` (rows each); shards are laid end to end in global row order, so the
global first row of every row group is a prefix sum of `rg_rows` (`row_group_starts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.store.cache import Descriptor


@dataclass(frozen=True)
class ShardView:
    """One shard's entry, built on demand (tests, messages): not stored."""

    path: Path
    descriptor: Descriptor | None  # None: a rollout shard (live teacher)
    fold: bool  # teacher vocab larger than the student's: fold ids past it into the tail
    nbytes: int | None  # the cache index's size of the file (checked when it is opened); None: footer-read
    sha256: str | None  # the cache index's checksum (checked when this rank first reads it); None: not checked


class ShardTable:
    """Shards added group by group (`add`), then `freeze`d into arrays."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.names: list[Sequence[str]] = []
        self.descriptors: list[Descriptor | None] = []
        self.folds: list[bool] = []
        self.first: list[int] = [0]
        self._rg_rows: list[np.ndarray] = []
        self._rg_counts: list[np.ndarray] = []
        self._nbytes: list[np.ndarray] = []
        self._sha256: list[np.ndarray] = []

    def add(self, directory: Path, names: Sequence[str], descriptor: Descriptor | None, fold: bool,
            rg_rows: np.ndarray, rg_counts: np.ndarray, nbytes: np.ndarray | None = None,
            sha256: np.ndarray | None = None) -> None:
        """A group of shards `directory/NAME.parquet`, with their row groups' sizes (flat, `rg_counts` per shard)
        and, where the cache index gave them, their sizes and checksums (hex, S64; b"" or None: not checked)."""
        n = len(names)
        self.dirs.append(directory)
        self.names.append(names)
        self.descriptors.append(descriptor)
        self.folds.append(fold)
        self.first.append(self.first[-1] + n)
        self._rg_rows.append(np.asarray(rg_rows, np.int64))
        self._rg_counts.append(np.asarray(rg_counts, np.int64))
        self._nbytes.append(np.full(n, -1, np.int64) if nbytes is None else np.asarray(nbytes, np.int64))
        self._sha256.append(np.zeros(n, "S64") if sha256 is None else np.asarray(sha256, "S64"))

    def freeze(self) -> None:
        """Concatenate the groups' arrays (after the last `add`)."""
        counts = np.diff(np.asarray(self.first, np.int64))
        self.group = np.repeat(np.arange(len(self.dirs), dtype=np.int64), counts)
        self.rg_rows = np.concatenate(self._rg_rows) if self._rg_rows else np.zeros(0, np.int64)
        rg_counts = np.concatenate(self._rg_counts) if self._rg_counts else np.zeros(0, np.int64)
        self.rg_starts = np.concatenate([[0], np.cumsum(rg_counts)]).astype(np.int64)
        self.nbytes = np.concatenate(self._nbytes) if self._nbytes else np.zeros(0, np.int64)
        self.sha256 = np.concatenate(self._sha256) if self._sha256 else np.zeros(0, "S64")
        del self._rg_rows, self._rg_counts, self._nbytes, self._sha256

    def __len__(self) -> int:
        return self.first[-1]

    def path(self, s: int) -> Path:
        g = int(self.group[s])
        return self.dirs[g] / f"{self.names[g][s - self.first[g]]}.parquet"

    def paths(self) -> list[str]:
        """Every shard's path as a string (the checkpoint's record of the data set), without a Path per shard."""
        return [f"{d}/{n}.parquet" for d, names in zip(self.dirs, self.names, strict=True) for n in names]

    def fold(self, s: int) -> bool:
        return self.folds[int(self.group[s])]

    def expected_bytes(self, s: int) -> int | None:
        n = int(self.nbytes[s])
        return None if n < 0 else n

    def expected_sha256(self, s: int) -> str | None:
        sha = self.sha256[s]
        return sha.decode() if sha else None

    def row_group_starts(self) -> np.ndarray:
        """Global first row of every row group, shard after shard (shards lie end to end)."""
        return np.concatenate([[0], np.cumsum(self.rg_rows)[:-1]]).astype(np.int64) if len(self.rg_rows) else \
            np.zeros(0, np.int64)

    def row_group(self, s: int, rg_global_starts: np.ndarray, row: int) -> int:
        """The row group of shard s that starts at global row `row`."""
        lo, hi = self.rg_starts[s], self.rg_starts[s + 1]
        return int(np.searchsorted(rg_global_starts[lo:hi], row))

    def __getitem__(self, s: int) -> ShardView:
        s = range(len(self))[s]  # negative indices as a list's
        g = int(self.group[s])
        return ShardView(self.path(s), self.descriptors[g], self.folds[g], self.expected_bytes(s),
                         self.expected_sha256(s))

    def __iter__(self):
        return (self[s] for s in range(len(self)))
