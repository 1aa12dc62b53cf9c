"""The cache index: one append-only file listing every committed shard, so opening a cache of 10^5 shards reads one
file instead of 10^5 footers, markers and key columns (issue 33).

    CACHE/index.jsonl    line 1: {"gkd_index": 1, "identity": ...}; then one line per committed shard:
                         {"shard", "bytes", "sha256", "rows", "row_groups", "scored_tokens",
                          "keys", "first_scored", "num_scored"}

What each reader needs is there: keys (the writers' "is this key already there", the on-policy view), lengths and
first scored positions and row-group sizes (the trainer's packing plan and order), rows / scored tokens / bytes
(`gkd cache stats`), bytes and sha256 (verification, truncation). `identity` hashes the descriptor's identity fields,
so an index copied in from another cache is refused (`IndexError`), not trusted.

Writes: `TeacherCache` appends one line per shard under the cache's commit lock, after the shard and its marker are
published (one `write` of a whole line + fsync: the cost does not depend on the cache's size). A reader ignores an
unterminated last line (a writer being killed or still writing); the next writer cuts it off before appending.
`gkd cache index DIR` (`rebuild`) rewrites the file from the shards' footers, atomically.

Reads (`load`): the index, then one listing of `shards/` (names only, no stat per file), in that order, so a shard
committed in between shows as "not in the index" and is read from its footer, never missed. A shard the index lists
that is gone, or a complete shard it lacks (deleted, or copied in, behind its back) is reconciled with a message
naming it (`CacheIndex.changes`); truncation (size vs `bytes`) is caught where a shard is opened or verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store import images
from pipeline.store.shards import (
    MARKER_SUFFIX,
    ShardError,
    WriteError,
    atomic_write_bytes,
    read_marker,
    remove_stale_temporaries_in,
)

INDEX = "index.jsonl"
VERSION = 1


class IndexError(ShardError):  # noqa: A001 - a ShardError (the CLI's exit-2 family) about the index file
    """The cache index belongs to another cache or is unreadable; the message names the file and the fix."""


_ALWAYS = ("teacher_fingerprint", "tokenizer_fingerprint", "k", "topp", "min_k", "logprob_mode", "numerics")


def identity(descriptor) -> str:
    """What the index must agree with: the descriptor's identity fields and codec (cache.py `Descriptor.IDENTITY`)."""
    # a field that is None is left out, so a field added later (student_tokenizer_fingerprint) keeps older caches'
    # identity, and their index files, as they were
    fields = {name: getattr(descriptor, name) for name in descriptor.IDENTITY
              if getattr(descriptor, name) is not None or name in _ALWAYS}
    fields["codec"] = (descriptor.codec or {}).get("name")
    return hashlib.blake2b(json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def header(descriptor) -> bytes:
    return (json.dumps({"gkd_index": VERSION, "identity": identity(descriptor)}) + "\n").encode()


def entry_line(path: Path, rows: int, nbytes: int, sha256: str, scored_tokens: int) -> bytes:
    """The index line of a just-published shard: its footer (row groups) and three cheap columns are read back."""
    try:
        pf = pq.ParquetFile(path)
        table = pf.read(columns=["key", "first_scored", "num_scored"])
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: cannot read its key and length columns ({e}); run `gkd cache verify`") from e
    return line(path.name[: -len(".parquet")], nbytes, sha256, rows,
                [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)], scored_tokens,
                table.column("key").to_pylist(), table.column("first_scored").to_pylist(),
                table.column("num_scored").to_pylist())


def line(name: str, nbytes: int, sha256: str, rows: int, row_groups: list[int], scored_tokens: int,
         keys: list[str], first_scored: list[int], num_scored: list[int]) -> bytes:
    """One shard's index line."""
    e = {"shard": name, "bytes": int(nbytes), "sha256": sha256, "rows": int(rows), "row_groups": row_groups,
         "scored_tokens": int(scored_tokens), "keys": keys, "first_scored": first_scored, "num_scored": num_scored}
    return (json.dumps(e, separators=(",", ":")) + "\n").encode()


def listing(shard_dir: Path) -> list[str]:
    """Names (without .parquet) of the complete shards: one directory listing, no stat per file."""
    try:
        names = {e.name for e in os.scandir(shard_dir)}
    except FileNotFoundError:
        return []
    return sorted(n[: -len(".parquet")] for n in names
                  if n.endswith(".parquet") and not n.startswith(".") and n + MARKER_SUFFIX in names)


@dataclass
class CacheIndex:
    """Every complete shard of a cache, sorted by name, with its rows' keys and lengths as flat arrays: shard s
    holds rows [row_starts[s], row_starts[s+1])."""

    path: Path
    names: list[str]
    nbytes: np.ndarray  # int64 [shards]
    sha256: list[str]
    scored_tokens: np.ndarray  # int64 [shards]
    row_groups: list[list[int]]
    row_starts: np.ndarray  # int64 [shards + 1]
    keys: np.ndarray  # S32 [rows]
    first_scored: np.ndarray  # int64 [rows]
    num_scored: np.ndarray  # int64 [rows]
    changes: list[str]  # what the listing check found behind the index's back (empty: the index was exact)

    def shard_keys(self, s: int) -> np.ndarray:
        return self.keys[self.row_starts[s]: self.row_starts[s + 1]]


def _parse(data: bytes, path: Path, want: str) -> tuple[dict[str, tuple], int]:
    """Shard name -> its fields, and the byte length of the complete lines (a last line without its newline is a
    write in progress or a killed writer's, and is ignored)."""
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")[:-1]
    if not lines:
        raise IndexError(f"{path}: empty cache index; rebuild it with `gkd cache index {path.parent}`")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = {}
    if head.get("gkd_index") != VERSION:
        raise IndexError(f"{path}: not a cache index of version {VERSION} (first line {lines[0][:80]!r}); rebuild it "
                         f"with `gkd cache index {path.parent}`")
    if head.get("identity") != want:
        raise IndexError(f"{path}: index of another cache (identity {head.get('identity')}, this cache's "
                         f"{path.parent / 'cache.json'} gives {want}); it was copied in or the descriptor was edited. "
                         f"Rebuild it from this cache's shards with `gkd cache index {path.parent}`")
    out: dict[str, tuple] = {}
    for n, raw in enumerate(lines[1:], start=2):
        try:
            e = json.loads(raw)
            out[e["shard"]] = (e["bytes"], e["sha256"], e["scored_tokens"], e["row_groups"], e["keys"],
                               e["first_scored"], e["num_scored"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise IndexError(f"{path}:{n}: unreadable index line ({err}); rebuild it with "
                             f"`gkd cache index {path.parent}`") from err
    return out, end


def _from_footer(shard_dir: Path, name: str) -> tuple:
    path = shard_dir / f"{name}.parquet"
    marker = read_marker(path) or {}
    e = json.loads(entry_line(path, marker.get("rows", 0), marker.get("bytes", path.stat().st_size),
                              marker.get("sha256", ""), marker.get("scored_tokens", 0)))
    return (e["bytes"], e["sha256"], e["scored_tokens"], e["row_groups"], e["keys"], e["first_scored"],
            e["num_scored"])


def _assemble(path: Path, entries: dict[str, tuple], changes: list[str]) -> CacheIndex:
    names = sorted(entries)
    cols = [entries[n] for n in names]
    counts = np.asarray([len(c[4]) for c in cols], np.int64)
    flat = [x for c in cols for x in c[4]]
    return CacheIndex(
        path=path, names=names, nbytes=np.asarray([c[0] for c in cols], np.int64), sha256=[c[1] for c in cols],
        scored_tokens=np.asarray([c[2] for c in cols], np.int64), row_groups=[list(c[3]) for c in cols],
        row_starts=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        keys=np.asarray(flat, dtype="S32") if flat else np.zeros(0, "S32"),
        first_scored=np.fromiter((x for c in cols for x in c[5]), np.int64, int(counts.sum())),
        num_scored=np.fromiter((x for c in cols for x in c[6]), np.int64, int(counts.sum())),
        changes=changes)


def load(root: Path, descriptor, *, say: Callable[[str], None] | None = None) -> CacheIndex:
    """The cache's index reconciled with one listing of its shards. No index (a cache written before it existed):
    built from the footers in memory, and `say`s so. Shards added or removed behind the index: taken as the listing
    says, each named in `changes` and `say`. Another cache's index: IndexError."""
    say = say or _stderr
    path, shard_dir = root / INDEX, root / "shards"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    if data is None:
        names = listing(shard_dir)  # read after the (absent) index: same order as below
        if names:
            say(f"[cache] {root}: no shard index (a cache written before {INDEX} existed); reading {len(names)} "
                f"shard footers instead. `gkd cache index {root}` writes it once, so later opens read one file")
        return _assemble(path, {n: _from_footer(shard_dir, n) for n in names}, [])
    entries, _ = _parse(data, path, identity(descriptor))
    names = listing(shard_dir)
    present = set(names)
    gone = sorted(n for n in entries if n not in present)
    added = [n for n in names if n not in entries]
    changes = [f"{shard_dir / n}.parquet: in the index but gone (removed behind it); not read" for n in gone]
    changes += [f"{shard_dir / n}.parquet: complete but not in the index (added behind it, or being committed now); "
                f"read from its footer" for n in added]
    for n in gone:
        del entries[n]
    for n in added:
        entries[n] = _from_footer(shard_dir, n)
    if changes:
        shown = "; ".join(changes[:5]) + (f"; ... ({len(changes) - 5} more)" if len(changes) > 5 else "")
        say(f"[cache] {path}: {len(gone)} shard(s) removed and {len(added)} added behind the index: {shown}. "
            f"`gkd cache index {root}` brings it up to date")
    return _assemble(path, entries, changes)


def rebuild(root: Path, descriptor) -> CacheIndex:
    """Rewrite the index from the shards' footers and markers (the caller holds the commit lock)."""
    shard_dir = root / "shards"
    names = listing(shard_dir)
    lines = [header(descriptor)]
    for n in names:
        p = shard_dir / f"{n}.parquet"
        marker = read_marker(p) or {}
        lines.append(entry_line(p, marker.get("rows", 0), marker.get("bytes", p.stat().st_size),
                                marker.get("sha256", ""), marker.get("scored_tokens", 0)))
    atomic_write_bytes(root / INDEX, b"".join(lines))
    return load(root, descriptor, say=lambda _: None)


class IndexAppender:
    """A writer's view of the index (the caller holds the commit lock around each method): the keys committed so
    far, kept up to date by reading only the lines appended since its last look, and `append` for one shard."""

    def __init__(self, root: Path, descriptor) -> None:
        self.root, self.descriptor, self.path = root, descriptor, root / INDEX
        self.keys: set[str] = set()
        self._offset = 0
        self._inode: int | None = None  # `gkd cache index` replaces the file: then it is read again from the start

    def sync(self) -> None:
        """Read the lines other writers appended since the last call; the first call reads the whole file, building
        it from the footers when absent (an old cache) and reconciling it once with the listing."""
        try:
            inode = self.path.stat().st_ino
        except FileNotFoundError:
            inode = None
        if inode is None or inode != self._inode:
            if inode is None:
                if listing(self.root / "shards"):
                    _stderr(f"[cache] {self.root}: no shard index (a cache written before {INDEX} existed); "
                            f"building it once from the shard footers")
                rebuild(self.root, self.descriptor)
            index = load(self.root, self.descriptor, say=lambda _: None)  # a reader of the same process said it
            if index.changes:  # make the file agree with the disk before adding to it
                index = rebuild(self.root, self.descriptor)
            self.keys = set(index.keys.astype(str).tolist())
            remove_stale_temporaries_in(self.root / "shards")  # under the commit lock: every one is a killed writer's
            images.remove_stale_temporaries(self.root)  # once per writer too; see images.WRITERS_LOCK
            self._offset = _cut_torn_tail(self.path)
            self._inode = self.path.stat().st_ino
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError as e:
            raise ShardError(f"{self.path}: cannot read the cache index ({e})") from e
        end = data.rfind(b"\n") + 1
        for raw in data[:end].split(b"\n")[:-1]:
            e = json.loads(raw)
            self.keys.update(e["keys"])
        self._offset += end

    def append(self, line: bytes, keys: Iterable[str]) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, line)  # one write of a whole line: a reader sees it all or (unterminated) not at all
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise WriteError(self.path, e, "cannot append to the cache index") from e
        self.keys.update(keys)
        self._offset += len(line)


def _cut_torn_tail(path: Path) -> int:
    """Truncate an unterminated last line (a killed writer's) and return the file's length."""
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        back = min(size, 1 << 22)
        f.seek(size - back)
        tail = f.read()
        end = size - back + tail.rfind(b"\n") + 1
        if end != size:
            f.truncate(end)
            os.fsync(f.fileno())
        return end


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)
