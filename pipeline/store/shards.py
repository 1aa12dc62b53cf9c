"""Parquet shards: atomic writes, a completion marker with a checksum, verification and streaming reads.

A shard `NAME.parquet` is complete when its marker `NAME.parquet.ok` (JSON: sha256, bytes, rows, schema tag) exists
and matches. Both files are written to a temporary name in the same directory, fsynced and renamed, the marker
last, so a reader never sees a partial shard and a killed writer leaves only dot-prefixed temporaries that readers
ignore and the next writer of the same shard removes. Rewriting a complete, verifying shard is a no-op.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.schema import SchemaError, check_arrow_schema, load_schema

MARKER_SUFFIX = ".ok"
ZSTD_LEVEL = 9  # measured: level 9 is within 1-2 % of level 19 on the cache columns at a fraction of the time


class ShardError(RuntimeError):
    """A shard is missing, incomplete, corrupt or of the wrong kind. The message names the file."""


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def staging_dir(out: Path) -> Path:
    """An empty `<out>.partial` folder beside `out`, to be filled and then `publish_dir`-ed."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish_dir(partial: Path, out: Path) -> None:
    """fsync every file of a filled staging folder and rename it to `out`, replacing an older `out`: a reader sees
    the old folder, no folder, or the complete new one, never a half-written file (exports polled by a sampler)."""
    for f in partial.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
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


def write_shard(
    path: str | Path,
    table: pa.Table,
    kind: str,
    *,
    extra: dict | None = None,
    footer: dict[bytes, bytes] | None = None,
    row_group_size: int = 1024,
    zstd_level: int = ZSTD_LEVEL,
) -> ShardInfo:
    """Write `table` as the complete shard `path` atomically (data, then marker). Refuses to replace a complete one.

    `table` is cast to the `kind` schema (column order and types from schemas/<kind>.json). `extra` is stored in
    the marker (e.g. the shard index, counts by skip reason); `footer` entries go into the Parquet key-value
    metadata (e.g. the codec's tables).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = load_schema(kind)
    try:
        for name in schema.optional - set(table.column_names):  # rows of an older minor version: nulls
            table = table.append_column(schema.arrow.field(name), pa.nulls(table.num_rows, schema.arrow.field(name).type))
        table = table.select(schema.names).cast(schema.arrow)
        table = table.replace_schema_metadata({**(footer or {}), **schema.arrow.metadata})
    except (KeyError, pa.ArrowInvalid, ValueError) as e:
        raise SchemaError(f"{path}: rows do not match schemas/{kind}.json: {e}") from e
    if marker_path(path).exists():
        raise ShardError(f"{path}: already complete; delete it and {marker_path(path).name} to rewrite it")
    remove_stale_temporaries(path)

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    # store_schema=False: pyarrow's default also writes the Arrow schema into the footer, base64, metadata
    # included, so the codec's tables were stored twice (27 of a 1k-position shard's 51 KB footer); the
    # key-value metadata is written once instead, and readers rebuild the same Arrow types from the Parquet schema.
    with pq.ParquetWriter(tmp, table.schema, compression="zstd", compression_level=zstd_level,
                          write_page_checksum=True,  # lets streaming readers catch a flipped byte page by page
                          use_dictionary=False,  # ids/keys are high-cardinality; the codec transformed the big columns
                          store_schema=False) as writer:
        writer.write_table(table, row_group_size=row_group_size)
        writer.add_key_value_metadata(table.schema.metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    info = ShardInfo(
        path=path,
        rows=table.num_rows,
        bytes=tmp.stat().st_size,
        sha256=file_sha256(tmp),
        schema=schema.tag.decode(),
        extra=dict(extra or {}),
    )
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    marker = {"sha256": info.sha256, "bytes": info.bytes, "rows": info.rows, "schema": info.schema, **info.extra}
    atomic_write_bytes(marker_path(path), json.dumps(marker, indent=1, sort_keys=True).encode())
    return info


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
    """Sorted shards in `directory` that have a completion marker (not yet verified)."""
    directory = Path(directory)
    return sorted(p for p in directory.glob(pattern) if marker_path(p).exists())


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
