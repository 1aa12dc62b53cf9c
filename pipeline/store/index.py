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
import pyarrow.compute as pc
import pyarrow.json as pj
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
    """Every complete shard of a cache, sorted by name, as flat arrays (no object per shard or row, so 10^5 shards
    cost arrays, not a Python heap): shard s holds rows [row_starts[s], row_starts[s+1]) and row groups
    [rg_starts[s], rg_starts[s+1]) of `rg_rows`."""

    path: Path
    names: list[str]
    nbytes: np.ndarray  # int64 [shards]
    sha256: np.ndarray  # S64 [shards] (hex)
    scored_tokens: np.ndarray  # int64 [shards]
    rg_rows: np.ndarray  # int64 [row groups]: the rows of each row group, shard after shard
    rg_starts: np.ndarray  # int64 [shards + 1]
    row_starts: np.ndarray  # int64 [shards + 1]
    keys: np.ndarray  # S32 [rows]
    first_scored: np.ndarray  # int64 [rows]
    num_scored: np.ndarray  # int64 [rows]
    changes: list[str]  # what the listing check found behind the index's back (empty: the index was exact)

    def shard_keys(self, s: int) -> np.ndarray:
        return self.keys[self.row_starts[s]: self.row_starts[s + 1]]

    def row_groups(self, s: int) -> np.ndarray:
        return self.rg_rows[self.rg_starts[s]: self.rg_starts[s + 1]]


# One index line's fields, as pyarrow's JSON reader parses them (all of them: a line missing one is unreadable).
_SCHEMA = pa.schema([("shard", pa.string()), ("bytes", pa.int64()), ("sha256", pa.string()),
                     ("scored_tokens", pa.int64()), ("row_groups", pa.list_(pa.int64())),
                     ("keys", pa.list_(pa.string())), ("first_scored", pa.list_(pa.int64())),
                     ("num_scored", pa.list_(pa.int64()))])


def _header(lines_end: int, data: bytes, path: Path, want: str) -> int:
    """Check the first line (version, identity); returns where the shard lines start."""
    if lines_end == 0:
        raise IndexError(f"{path}: empty cache index; rebuild it with `gkd cache index {path.parent}`")
    first = data[: data.index(b"\n") + 1]
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = {}
    if not isinstance(head, dict) or head.get("gkd_index") != VERSION:
        raise IndexError(f"{path}: not a cache index of version {VERSION} (first line {first[:80]!r}); rebuild it "
                         f"with `gkd cache index {path.parent}`")
    if head.get("identity") != want:
        raise IndexError(f"{path}: index of another cache (identity {head.get('identity')}, this cache's "
                         f"{path.parent / 'cache.json'} gives {want}); it was copied in or the descriptor was edited. "
                         f"Rebuild it from this cache's shards with `gkd cache index {path.parent}`")
    return len(first)


def _bad_line(body: bytes, path: Path, err: Exception) -> IndexError:
    """The refusal naming the first unreadable line (found line by line, only once the fast read has failed)."""
    for n, raw in enumerate(body.split(b"\n")[:-1], start=2):
        try:
            e = json.loads(raw)
            missing = [f.name for f in _SCHEMA if e.get(f.name) is None]
            if missing:
                raise KeyError(missing[0])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as line_err:
            return IndexError(f"{path}:{n}: unreadable index line ({line_err!r}); rebuild it with "
                              f"`gkd cache index {path.parent}`")
    return IndexError(f"{path}: unreadable cache index ({err}); rebuild it with `gkd cache index {path.parent}`")


def _parse(data: bytes, path: Path, want: str) -> tuple[pa.Table, int]:
    """The shard lines as one table (pyarrow's JSON reader: columns, not a dict per line), and the byte length of
    the complete lines (a last line without its newline is a write in progress or a killed writer's, and is
    ignored). A shard listed twice keeps its last line."""
    end = data.rfind(b"\n") + 1
    start = _header(end, data, path, want)
    if start == end:
        return _SCHEMA.empty_table(), end
    body = pa.py_buffer(data)[start:end]  # a view, not a copy of the file
    try:  # one block: a line is never split between blocks, however many keys a shard holds
        table = pj.read_json(pa.BufferReader(body), read_options=pj.ReadOptions(block_size=len(body) + 1),
                             parse_options=pj.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore"))
    except pa.ArrowException as e:
        raise _bad_line(data[start:end], path, e) from e
    pa.default_memory_pool().release_unused()  # the reader's working buffers: as large again as the table
    if any(table.column(f.name).null_count for f in _SCHEMA) or any(
            pc.sum(pc.is_null(pc.list_flatten(table.column(c)))).as_py() for c in ("keys", "row_groups", "first_scored",
                                                                             "num_scored")):
        raise _bad_line(data[start:end], path, ValueError("a field is missing or null"))
    if pc.count_distinct(table.column("shard")).as_py() != table.num_rows:  # the last line of a shard wins
        last = {n: i for i, n in enumerate(table.column("shard").to_pylist())}
        table = table.take(sorted(last.values()))
    return table, end


def _from_footer(shard_dir: Path, name: str) -> dict:
    path = shard_dir / f"{name}.parquet"
    marker = read_marker(path) or {}
    return json.loads(entry_line(path, marker.get("rows", 0), marker.get("bytes", path.stat().st_size),
                                 marker.get("sha256", ""), marker.get("scored_tokens", 0)))


def _flat(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """A list column's values and the lengths of its lists."""
    arr = column.combine_chunks()
    return arr.flatten(), pc.list_value_length(arr).fill_null(0).to_numpy().astype(np.int64)


def _fixed(values: pa.Array, width: int) -> np.ndarray:
    """Strings as a numpy S`width` array, straight from the Arrow buffer when every one is `width` bytes (content
    keys are 32, sha256 hex digests 64): no Python string per row."""
    if len(values) == 0:
        return np.zeros(0, f"S{width}")
    kind = np.int64 if values.type == pa.large_string() else np.int32
    offsets = np.frombuffer(values.buffers()[1], kind)[values.offset: values.offset + len(values) + 1]
    if np.all(np.diff(offsets) == width):
        data = np.frombuffer(values.buffers()[2], np.uint8)[offsets[0]: offsets[-1]]
        return data.view(f"S{width}").copy()
    return np.asarray(values.to_pylist(), dtype=f"S{width}")


def _assemble(path: Path, table: pa.Table, changes: list[str]) -> CacheIndex:
    order = pc.sort_indices(table.column("shard"))
    if not pc.all(pc.equal(order, pa.array(np.arange(len(table)), pa.uint64()))).as_py() and len(table):
        table = table.take(order)  # appended in commit order; the index is in name order (the listing's)
    del order
    rg_values, rg_counts = _flat(table.column("row_groups"))
    key_values, counts = _flat(table.column("keys"))
    return CacheIndex(
        path=path, names=table.column("shard").to_pylist(),
        nbytes=table.column("bytes").to_numpy().astype(np.int64),
        sha256=_fixed(table.column("sha256").combine_chunks(), 64),
        scored_tokens=table.column("scored_tokens").to_numpy().astype(np.int64),
        rg_rows=rg_values.to_numpy(zero_copy_only=False).astype(np.int64),
        rg_starts=np.concatenate([[0], np.cumsum(rg_counts)]).astype(np.int64),
        row_starts=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        keys=_fixed(key_values, 32),
        first_scored=_flat(table.column("first_scored"))[0].to_numpy(zero_copy_only=False).astype(np.int64),
        num_scored=_flat(table.column("num_scored"))[0].to_numpy(zero_copy_only=False).astype(np.int64),
        changes=changes)


def _with_footers(table: pa.Table, shard_dir: Path, names: list[str]) -> pa.Table:
    """The table with the given shards' entries read from their footers appended."""
    if not names:
        return table
    return pa.concat_tables([table, pa.Table.from_pylist([_from_footer(shard_dir, n) for n in names], _SCHEMA)])


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
        return _assemble(path, _with_footers(_SCHEMA.empty_table(), shard_dir, names), [])
    table, _ = _parse(data, path, identity(descriptor))
    del data
    names = listing(shard_dir)
    present = set(names)
    indexed = table.column("shard").to_pylist()
    known = set(indexed)
    gone = sorted(n for n in indexed if n not in present)
    added = [n for n in names if n not in known]
    changes = [f"{shard_dir / n}.parquet: in the index but gone (removed behind it); not read" for n in gone]
    changes += [f"{shard_dir / n}.parquet: complete but not in the index (added behind it, or being committed now); "
                f"read from its footer" for n in added]
    if gone:
        table = table.filter(pa.array([n in present for n in indexed]))
    table = _with_footers(table, shard_dir, added)
    del indexed, known, present, names
    if changes:
        shown = "; ".join(changes[:5]) + (f"; ... ({len(changes) - 5} more)" if len(changes) > 5 else "")
        say(f"[cache] {path}: {len(gone)} shard(s) removed and {len(added)} added behind the index: {shown}. "
            f"`gkd cache index {root}` brings it up to date")
    index = _assemble(path, table, changes)
    del table
    # The parse's Arrow buffers are freed by now, but the allocator keeps their pages: give them back, so a process
    # that opens the index twice (the trainer's checks, then its loader) does not hold two parses.
    pa.default_memory_pool().release_unused()
    return index


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
