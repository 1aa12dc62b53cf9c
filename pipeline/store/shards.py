"""Parquet shards: atomic writes, a completion marker with a checksum, verification and streaming reads.

A shard `NAME.parquet` is complete when its marker `NAME.parquet.ok` (JSON: sha256, bytes, rows, schema tag) exists
and matches. Both files are written to a temporary name in the same directory, fsynced and renamed, the marker
last, so a reader never sees a partial shard and a killed writer leaves only dot-prefixed temporaries that readers
ignore and the next writer of the same shard removes. Rewriting a complete, verifying shard is a no-op.

A write that fails (a full disk or quota, a read-only filesystem) removes its temporary and raises `WriteError`
naming the path and the cause: what readers see is unchanged, and the same command, rerun once space is free,
completes as if nothing had happened.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import pause
from pipeline.errors import UserError
from pipeline.store.schema import SchemaError, check_arrow_schema, load_schema

MARKER_SUFFIX = ".ok"
ZSTD_LEVEL = 9  # measured: level 9 is within 1-2 % of level 19 on the cache columns at a fraction of the time
# Scored shards (the teacher cache, written at the teacher's speed): level 3 measured 4.7x faster than 9 on the
# codec's columns (11k prose positions, k=64: 0.038 s vs 0.18 s, best of 5) for 0.4 % more bytes (130.6 vs 130.0
# B/token); at 9, the Parquet write alone held the score stage to ~60k tokens/s, below a GPU teacher's pace.
SCORED_ZSTD_LEVEL = 3


class ShardError(UserError, RuntimeError):
    """A shard is missing, incomplete, corrupt or of the wrong kind, or the store cannot be written. The message
    names the file."""


class WriteError(ShardError):
    """Writing to the store failed (ENOSPC, EDQUOT, EROFS, EACCES, ...); nothing partial was left visible."""

    def __init__(self, path: str | Path, cause: OSError, doing: str = "write failed") -> None:
        self.path, self.errno = Path(path), cause.errno
        fix = {errno.ENOSPC: "free space on that filesystem", errno.EDQUOT: "free space or raise the quota",
               errno.EROFS: "point the output at a writable filesystem",
               errno.EACCES: "fix the folder's permissions or write elsewhere",
               errno.EPERM: "fix the folder's permissions or write elsewhere"}.get(cause.errno, "fix the cause")
        super().__init__(f"{path}: {doing}: {cause.strerror or cause} (errno {errno.errorcode.get(cause.errno, cause.errno)}); "
                         f"nothing partial was kept. {fix[0].upper() + fix[1:]}, then rerun the same command")


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    rows: int
    bytes: int
    sha256: str
    schema: str
    extra: dict


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path: Path, data: bytes, *, clean_stale: bool = True) -> None:
    """Replace `path` by `data` atomically. Temporaries of `path` left by a killed writer are removed first: every
    file written so has one writer at a time (a task lock, the cache's commit lock, rank 0 of a trainer).
    `clean_stale=False`: the caller cleans them (finding them lists the whole folder: a cache's shard folder is
    cleaned once per writer instead, `remove_stale_temporaries_in`)."""
    path = Path(path)
    if clean_stale:
        for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
            stale.unlink(missing_ok=True)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(path, e) from e


def staging_dir(out: Path) -> Path:
    """An empty `<out>.partial` folder beside `out`, to be filled and then `publish_dir`-ed."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise WriteError(partial, e) from e
    return partial


@contextlib.contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """`with staged_dir(out) as partial:` fill `partial`; on success it is published as `out` (`publish_dir`); on
    any error it is removed (a full disk leaves neither a partial folder nor a half-replaced `out`) and an error of
    the filesystem (`os_error_in`: also when a library wrapped it) becomes a WriteError naming `out`."""
    out = Path(out)
    partial = staging_dir(out)
    try:
        yield partial
        publish_dir(partial, out)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        cause = None if isinstance(e, ShardError) else os_error_in(e)
        if cause is None:
            raise
        raise WriteError(out, cause) from e


def publish_dir(partial: Path, out: Path) -> None:
    """fsync every file of a filled staging folder and rename it to `out`, replacing an older `out`: a reader sees
    the old folder, no folder, or the complete new one, never a half-written file (exports polled by a sampler)."""
    for f in partial.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())  # data written by the filler reaches the disk here: ENOSPC may surface now
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    _fsync_dir(out.parent)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def remove_stale_temporaries(path: Path) -> int:
    """Remove temporaries a killed writer of this shard left behind; returns how many."""
    stale = glob.glob(str(path.parent / f".{glob.escape(path.name)}.tmp-*"))
    stale += glob.glob(str(path.parent / f".{glob.escape(marker_path(path).name)}.tmp-*"))
    for p in stale:
        Path(p).unlink(missing_ok=True)
    return len(stale)


def remove_stale_temporaries_in(directory: Path) -> int:
    """Remove every writer's temporary in `directory` (the caller holds the lock all its writers write under)."""
    stale = [Path(p) for p in glob.glob(str(Path(directory) / ".*.tmp-*"))]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def write_shard(
    path: str | Path,
    table: pa.Table,
    kind: str,
    *,
    extra: dict | None = None,
    footer: dict[bytes, bytes] | None = None,
    row_group_size: int = 1024,
    zstd_level: int = ZSTD_LEVEL,
    clean_stale: bool = True,
) -> ShardInfo:
    """Write `table` as the complete shard `path` atomically (data, then marker). Refuses to replace a complete one.

    `table` is cast to the `kind` schema (column order and types from schemas/<kind>.json). `extra` is stored in
    the marker (e.g. the shard index, counts by skip reason); `footer` entries go into the Parquet key-value
    metadata (e.g. the codec's tables). `clean_stale=False`: the caller removed killed writers' temporaries
    (`remove_stale_temporaries_in`), so no listing of the folder is made here.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = load_schema(kind)
    schema = schema.written(set(table.column_names) & schema.sparse)  # sparse fields only where the rows set them
    try:
        for name in schema.optional - set(table.column_names):  # rows of an older minor version: nulls
            table = table.append_column(schema.arrow.field(name), pa.nulls(table.num_rows, schema.arrow.field(name).type))
        table = table.select(schema.names).cast(schema.arrow)
        table = table.replace_schema_metadata({**(footer or {}), **schema.arrow.metadata})
    except (KeyError, pa.ArrowInvalid, ValueError) as e:
        raise SchemaError(f"{path}: rows do not match schemas/{kind}.json: {e}") from e
    if marker_path(path).exists():
        raise ShardError(f"{path}: already complete; delete it and {marker_path(path).name} to rewrite it")
    if clean_stale:
        remove_stale_temporaries(path)

    tmp = _tmp_name(path)
    try:
        # store_schema=False: pyarrow's default also writes the Arrow schema into the footer, base64, metadata
        # included, so the codec's tables were stored twice (27 of a 1k-position shard's 51 KB footer); the
        # key-value metadata is written once instead, and readers rebuild the same Arrow types from the Parquet schema.
        with pq.ParquetWriter(tmp, table.schema, compression="zstd", compression_level=zstd_level,
                              write_page_checksum=True,  # lets streaming readers catch a flipped byte page by page
                              use_dictionary=False,  # ids/keys are high-cardinality; the codec transformed them
                              store_schema=False) as writer:
            writer.write_table(table, row_group_size=row_group_size)
            writer.add_key_value_metadata(table.schema.metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as e:  # pyarrow raises OSError (ENOSPC, EDQUOT, ...) with the cause in its message
        tmp.unlink(missing_ok=True)
        raise WriteError(path, os_error_in(e) or e) from e
    info = ShardInfo(
        path=path,
        rows=table.num_rows,
        bytes=tmp.stat().st_size,
        sha256=file_sha256(tmp),
        schema=schema.tag.decode(),
        extra=dict(extra or {}),
    )
    pause.point("shard-temporary")  # the data is in the temporary, not yet renamed (kill tests of this function)
    try:
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(path, e) from e
    marker = {"sha256": info.sha256, "bytes": info.bytes, "rows": info.rows, "schema": info.schema, **info.extra}
    try:
        atomic_write_bytes(marker_path(path), json.dumps(marker, indent=1, sort_keys=True).encode(),
                           clean_stale=clean_stale)
    except WriteError:
        path.unlink(missing_ok=True)  # no marker, no shard: leave nothing a verify would call an orphan
        raise
    return info


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]|os error (\d+)")
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)


def os_error_in(e: BaseException | None) -> OSError | None:
    """The filesystem's error behind an exception, with its errno: libraries wrap it (pyarrow raises an OSError
    without errno, safetensors a SafetensorError saying "os error 28", dist_checkpointing a CheckpointException
    whose worker's "[Errno 28]" survives only as text). None when no errno can be found in the chain."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, OSError) and e.errno:
            return e
        text = str(e)
        m = _ERRNO_TEXT.search(text)
        code = int(m.group(1) or m.group(2)) if m else next((c for c in _WRITE_ERRNOS if os.strerror(c) in text), None)
        if code:
            return OSError(code, os.strerror(code))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def read_marker(path: str | Path) -> dict | None:
    """The completion marker of `path`, or None when the shard is not complete."""
    m = marker_path(Path(path))
    try:
        return json.loads(m.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ShardError(f"{m}: unreadable completion marker ({e}); delete it and rerun the task") from e


def verify_shard(path: str | Path, kind: str, *, checksum: bool = True) -> list[str]:
    """Every problem with one shard, as messages naming the file (empty list = good)."""
    path = Path(path)
    problems: list[str] = []
    try:
        marker = read_marker(path)
    except ShardError as e:
        return [str(e)]
    if marker is None:
        return [f"{path}: no completion marker {marker_path(path).name} (incomplete or interrupted write)"]
    if not path.exists():
        return [f"{path}: marker present but the shard file is missing"]
    size = path.stat().st_size
    if size != marker.get("bytes"):
        problems.append(f"{path}: size {size} bytes, marker says {marker.get('bytes')} (truncated or replaced)")
    elif checksum and file_sha256(path) != marker.get("sha256"):
        problems.append(f"{path}: sha256 differs from its marker (corrupted on disk)")
    if problems:
        return problems
    try:
        pf = pq.ParquetFile(path)
        check_arrow_schema(pf.schema_arrow, kind, path)
        if pf.metadata.num_rows != marker.get("rows"):
            problems.append(f"{path}: {pf.metadata.num_rows} rows, marker says {marker.get('rows')}")
    except SchemaError as e:
        problems.append(str(e))
    except (pa.ArrowException, OSError) as e:
        problems.append(f"{path}: unreadable Parquet ({e})")
    return problems


def is_complete(path: str | Path, kind: str, *, checksum: bool = True) -> bool:
    """True when the shard exists, has its marker and verifies: a rerun of its task has nothing to do."""
    return marker_path(Path(path)).exists() and not verify_shard(path, kind, checksum=checksum)


def open_shard(path: str | Path, kind: str, *, checksum: bool = True) -> pq.ParquetFile:
    """Open a complete shard for reading; raise ShardError naming the file if it does not verify."""
    problems = verify_shard(path, kind, checksum=checksum)
    if problems:
        raise ShardError("; ".join(problems))
    return pq.ParquetFile(path, page_checksum_verification=True)


def complete_shards(directory: str | Path, pattern: str = "*.parquet") -> list[Path]:
    """Sorted shards in `directory` that have a completion marker (not yet verified): one directory listing, no
    stat per file (a cache of 10^5 shards on a network filesystem would otherwise pay 10^5 metadata calls)."""
    directory = Path(directory)
    try:
        names = {e.name for e in os.scandir(directory)}
    except FileNotFoundError:
        return []
    return [directory / n for n in sorted(names) if fnmatch.fnmatchcase(n, pattern) and not n.startswith(".")
            and n + MARKER_SUFFIX in names]


def iter_batches(
    paths: Sequence[str | Path],
    kind: str,
    *,
    columns: Sequence[str] | None = None,
    batch_size: int = 256,
    checksum: bool = True,
) -> Iterator[tuple[Path, pa.RecordBatch]]:
    """Stream record batches over shards in order, reading only `columns`; memory is bounded by one batch."""
    for p in paths:
        pf = open_shard(p, kind, checksum=checksum)
        try:
            for batch in pf.iter_batches(batch_size=batch_size, columns=list(columns) if columns else None):
                yield Path(p), batch
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{p}: read failed ({e})") from e
