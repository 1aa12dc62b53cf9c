"""Digests of a model folder's weight files, computed once per file state: the fingerprint record.

    gkd fingerprint MODEL          # hash MODEL's weights (files in parallel) and keep the record
    gkd fingerprint MODEL --rehash # ignore the record: read every byte again

A 70B teacher is ~141 GB of weights: hashing them at every score task costs minutes of idle GPUs and re-reads the
weights from a shared filesystem once per array task. So each weight file's digest is kept in a record with the
file's state when it was hashed (size, mtime in ns, inode); a later call whose `os.stat` shows the same state takes
the digest from the record instead of reading the file. A file whose state differs is hashed again, never trusted.

The record is a JSON file per model folder under `$GKD_FINGERPRINT_DIR` (default `$XDG_CACHE_HOME/gkd/fingerprints`,
else `~/.cache/gkd/fingerprints`), named by the folder's resolved path, never inside the model folder: teachers
are often read-only (a shared model store, a Hugging Face hub snapshot), and a folder a record lives in need not
be writable. Point `GKD_FINGERPRINT_DIR` at a shared filesystem to share one record between the machines of an
array. The state leaves out the device number (`st_dev`), which differs between machines mounting the same
filesystem; the inode, size and mtime come from the filesystem itself.

The record's limit (docs/architecture.md, "The fingerprint record"): a rewrite that keeps a file's size and its
mtime (e.g. `touch -r` after editing it) is not seen; `--rehash` reads every byte again. A file modified within
`RACY_NS` of being hashed is not recorded as clean (git's "racily clean" rule): a write landing in the same mtime
tick as the hash would otherwise go unseen.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.errors import UserError

RECORD_VERSION = 1
RECORD_ENV = "GKD_FINGERPRINT_DIR"
RACY_NS = 2_000_000_000  # coarse-mtime filesystems tick in 1-2 s (FAT: 2 s); newer files are re-hashed next time
_CHUNK = 1 << 23


class FingerprintError(UserError, ValueError):
    """A weight file could not be hashed (unreadable, or changing while it was read): the message names it."""


def unreadable(path: Path, e: OSError) -> FingerprintError:
    """The one message for a weight file that cannot be stat-ed or read."""
    return FingerprintError(
        f"{path}: cannot read this weight file ({e.strerror or e}); the teacher fingerprint hashes every weight file "
        "of the folder: make it readable (chmod a+r), download the model again (a snapshot symlink whose blob is "
        "gone), or remove the file from the model folder")


def record_dir() -> Path:
    """Where fingerprint records are kept ($GKD_FINGERPRINT_DIR, else the user's cache folder)."""
    if os.environ.get(RECORD_ENV):
        return Path(os.environ[RECORD_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gkd" / "fingerprints"


def record_path(model_dir: str | Path) -> Path:
    real = os.path.realpath(model_dir)
    return record_dir() / f"{hashlib.blake2b(real.encode(), digest_size=12).hexdigest()}.json"


def _state(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _read_record(path: Path, model_dir: str) -> dict:
    """The record's entries, or {} when there is none, it is unreadable, or another version wrote it (then every
    file is hashed again: a record is only ever a shortcut, never the identity)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("record_version") != RECORD_VERSION or data.get("folder") != model_dir:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_record(path: Path, model_dir: str, entries: dict) -> bool:
    """Replace the record atomically (a unique temporary, then rename: tasks of an array may write it at once, each
    with the same content). False when it cannot be written: the digests are still right, only not kept."""
    data = json.dumps({"record_version": RECORD_VERSION, "folder": model_dir, "entries": entries}, indent=1,
                      sort_keys=True).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


def hash_file(path: Path, new: Callable[[], object]) -> tuple[str, dict]:
    """(hex digest of the file's bytes, its state when read). The state is taken before and after the read; a file
    that changed meanwhile is read once more, and refused if it changes again."""
    for _attempt in range(2):
        try:
            with open(path, "rb") as f:
                before = _state(os.fstat(f.fileno()))
                h = new()
                view = memoryview(bytearray(_CHUNK))
                left = before["size"]  # no further: a file still growing (a download) must not keep this loop going
                while left > 0 and (n := f.readinto(view[: min(_CHUNK, left)])):
                    h.update(view[:n])  # hashlib drops the GIL on large updates: files hash in parallel threads
                    left -= n
            after = _state(os.stat(path))
        except OSError as e:
            raise unreadable(path, e) from e
        if after == before:
            return h.hexdigest(), before
    raise FingerprintError(
        f"{path}: the file changed while it was being hashed (size/mtime before {before}, after {after}); wait "
        "until whatever writes the model folder is done (a download, a copy), then rerun"
    )


def digests(model_dir: str | Path, paths: list[Path], algo: str, *, rehash: bool = False,
            threads: int | None = None) -> tuple[dict[str, str], dict]:
    """{file name: hex digest of its bytes} for `paths` (files of `model_dir`), taken from the record where a
    file's state matches it, the rest hashed in parallel threads (largest first) and written back to the record.
    Also returns what happened: {"hashed": names, "reused": names, "record": path, "kept": bool}."""
    folder = os.path.realpath(model_dir)
    rec_path = record_path(folder)
    entries = {} if rehash else _read_record(rec_path, folder)
    out: dict[str, str] = {}
    todo: list[Path] = []
    for p in paths:
        try:
            state = _state(os.stat(p))
        except OSError as e:
            raise unreadable(p, e) from e
        entry = entries.get(p.name)
        if entry and entry.get("algo") == algo and entry.get("state") == state and entry.get("clean"):
            out[p.name] = entry["digest"]
        else:
            todo.append(p)
    new = (lambda: hashlib.new(algo)) if algo != "blake2b-128" else (lambda: hashlib.blake2b(digest_size=16))
    todo.sort(key=lambda p: -p.stat().st_size)
    workers = max(1, min(len(todo), threads or os.cpu_count() or 1, 16))
    if todo:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda p: hash_file(p, new), todo))
        now = time.time_ns()
        for p, (digest, state) in zip(todo, results, strict=True):
            out[p.name] = digest
            entries[p.name] = {"algo": algo, "digest": digest, "state": state,
                               "clean": now - state["mtime_ns"] >= RACY_NS}
    kept = _write_record(rec_path, folder, entries) if todo else rec_path.exists()
    info = {"hashed": [p.name for p in todo], "reused": sorted(set(out) - {p.name for p in todo}),
            "record": str(rec_path), "kept": kept}
    return out, info


def stream_digest(model_dir: str | Path, paths: list[Path], prefix: bytes, *, rehash: bool = False) -> tuple[str, dict]:
    """The fingerprint of scheme 1 (caches of descriptor < 1.5): one blake2b-128 stream over `prefix` (the canonical
    config) and each file's name, a NUL and its bytes, in order. It cannot be split over files, so it is hashed in
    one thread; the record keeps the result under the states of all files and the prefix, reused only if all agree."""
    folder = os.path.realpath(model_dir)
    rec_path = record_path(folder)
    entries = {} if rehash else _read_record(rec_path, folder)
    try:
        states = {p.name: _state(os.stat(p)) for p in paths}
    except OSError as e:
        raise unreadable(Path(e.filename), e) from e
    key = "stream-v1:" + hashlib.sha256(prefix).hexdigest()
    entry = entries.get(key)
    if entry and entry.get("states") == states and entry.get("clean"):
        return entry["digest"], {"hashed": [], "reused": [p.name for p in paths], "record": str(rec_path),
                                 "kept": True}
    h = hashlib.blake2b(digest_size=16)
    h.update(prefix)
    seen = {}
    for p in paths:
        h.update(p.name.encode() + b"\0")
        part = _Tee(h)
        _digest, seen[p.name] = hash_file(p, part)
        if part.restarted:
            raise FingerprintError(f"{p}: the file changed while it was being hashed; wait until whatever writes "
                                   "the model folder is done (a download, a copy), then rerun")
    now = time.time_ns()
    entries[key] = {"digest": h.hexdigest(), "states": seen,
                    "clean": all(now - s["mtime_ns"] >= RACY_NS for s in seen.values())}
    kept = _write_record(rec_path, folder, entries)
    return h.hexdigest(), {"hashed": [p.name for p in paths], "reused": [], "record": str(rec_path), "kept": kept}


class _Tee:
    """Feeds one file's bytes into a running stream hash (scheme 1). A second read of the same file (it changed
    while read) would feed its bytes twice, so it is flagged and refused instead."""

    def __init__(self, h) -> None:
        self.h, self.calls, self.restarted = h, 0, False

    def __call__(self) -> _Tee:
        self.calls += 1
        self.restarted = self.calls > 1
        return self

    def update(self, data) -> None:
        if not self.restarted:
            self.h.update(data)

    def hexdigest(self) -> str:
        return ""
