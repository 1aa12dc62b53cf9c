"""The teacher cache: a directory of scored shards plus a descriptor saying what produced them.

    CACHE/cache.json                                   descriptor (schemas/descriptor.json), written once, atomically
    CACHE/shards/<name>.parquet + <name>.parquet.ok    scored shards (schemas/scored.json) and completion markers
    CACHE/index.jsonl                                  every committed shard's keys and lengths (store/index.py)

Rows are keyed by content (`fingerprint.content_key`), so a cache grows incrementally (score only the keys it lacks),
is shared read-only by any number of trainers, and refuses rows of another teacher, tokenizer, k, top-p setting
(`topp`, `min_k`: a variable-k cache, codec.py "Top-p"), logprob mode or
scoring numerics (dtype, quantization, ...: `Descriptor.numerics`). Numerics are refused rather than keyed apart:
one cache holds rows of one scoring setup, so every row a trainer reads from it has the same meaning.
Rows are decoded back into `ScoredBatch` / `ScoredSample` by store/reader.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import pause
from pipeline.errors import MissingInputError, UserError
from pipeline.store import align, codec, images, reader
from pipeline.store import hidden as hidden_store
from pipeline.store import index as shard_index
from pipeline.store.fingerprint import FINGERPRINT_SCHEME
from pipeline.store.locks import FileLock
from pipeline.store.schema import SchemaError, load_schema
from pipeline.store.shards import (
    SCORED_ZSTD_LEVEL,
    ShardError,
    ShardInfo,
    WriteError,
    atomic_write_bytes,
    complete_shards,
    read_marker,
    verify_shard,
    write_shard,
)

DESCRIPTOR = "cache.json"
SHARDS = "shards"
COMMIT_LOCK = ".commit.lock"  # held around cache.json creation and each add_rows (pipeline/store/locks.py)
COMMIT_WAIT_S = 600.0  # a commit takes milliseconds; this long means a holder hangs (e.g. a stalled filesystem)
ROW_GROUP_ROWS = 128  # the trainer's loader decodes whole row groups: small ones bound its memory
# a cross-tokenizer row's own columns (scored 1.3, pipeline/store/align.py)
CROSS_COLUMNS = ["student_ids", "student_first", "teacher_char_ends", "student_char_ends", "span_student",
                 "span_teacher"]
# the sampler's logprob of each completion token, copied from the rollout (scored 1.5): loss=opd's importance weights
BEHAVIOR_COLUMN = "completion_logprobs"



def cache_root(shard: str | Path) -> Path:
    """The cache a scored shard file belongs to: shards live in CACHE/shards/ (`TeacherCache.shard_dir`)."""
    return Path(shard).parent.parent

class CacheMismatchError(UserError, ValueError):
    """The cache was built with another teacher, tokenizer, k, logprob mode, numerics or codec."""


@dataclass(frozen=True)
class Descriptor:
    teacher_fingerprint: str
    tokenizer_fingerprint: str
    k: int
    logprob_mode: str
    teacher: str = ""
    vocab_size: int = 0
    engine: str = ""
    codec: dict = field(default_factory=codec.params)
    # the scored version of the shards: a same-tokenizer cache writes no sparse (cross-tokenizer) field, so 1.2
    schema_version: str = field(default_factory=lambda: load_schema("scored").written(set()).version)
    # Engine settings that change the stored logprobs (score/numerics.py `scoring_numerics`); None = not recorded.
    numerics: dict | None = None
    # Top-p (variable-k) cache: per position the fewest entries with mass >= topp, >= min_k, <= k; None = fixed k.
    topp: float | None = None
    min_k: int | None = None
    # A served teacher (score/served/probe.py): its model name and logprobs of the fixed probe sequence, which a
    # later run against this cache compares with its server's (within a tolerance: float noise must not refuse the
    # same server); informational for the identity check itself, whose teacher_fingerprint hashes them rounded.
    teacher_probe: dict | None = None
    # Rows brought in by `gkd cache import` (store/imports.py): one record per import (format, source, layout
    # version read, rows, when); informational, not identity.
    imports: list | None = None
    # How teacher_fingerprint was computed (fingerprint.FINGERPRINT_SCHEMES); None: scheme 1 (a cache before
    # descriptor 1.5) or a served teacher (fingerprinted by its probe). A run computes its teacher's fingerprint the
    # way the cache it writes to did, so an old cache keeps its keys.
    fingerprint_scheme: int | None = FINGERPRINT_SCHEME
    # A cross-tokenizer cache (pipeline/store/align.py): the rollouts' (student's) tokenizer; tokenizer_fingerprint
    # is then the teacher's. None: one tokenizer for both (and cache.json is written without the field).
    student_tokenizer_fingerprint: str | None = None
    # A hidden-state cache (store/hidden.py): teacher_rows "hidden" and its `hidden` map (dtype, size, the output
    # layer's file and sha256, the route). None: a top-k cache (cache.json is written without the fields).
    teacher_rows: str | None = None
    hidden: dict | None = None

    # What must agree for two producers to share one cache (the rest is informational).
    IDENTITY = ("teacher_fingerprint", "tokenizer_fingerprint", "k", "topp", "min_k", "logprob_mode", "numerics",
                "student_tokenizer_fingerprint", "teacher_rows", "hidden")

    @property
    def teacher_fingerprint_scheme(self) -> int:
        """How teacher_fingerprint was computed: the recorded scheme, 1 where none is recorded (a cache before
        descriptor 1.5)."""
        return self.fingerprint_scheme or 1

    @property
    def hidden_rows(self) -> bool:
        """A hidden-state cache (store/hidden.py), not a top-k one."""
        return self.teacher_rows == hidden_store.KIND

    @property
    def key_mode(self) -> str:
        """The logprob-mode part of this cache's content keys (`fingerprint.content_key`): a hidden-state cache's
        names its kind and dtype too (`hidden.key_mode`), as the score stage's (`ScoreConfig.key_mode`) does."""
        return hidden_store.key_mode(self.logprob_mode, self.hidden["dtype"]) if self.hidden_rows else self.logprob_mode

    @property
    def cross_tokenizer(self) -> bool:
        return self.student_tokenizer_fingerprint is not None

    @classmethod
    def read(cls, path: Path) -> Descriptor:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise MissingInputError(f"{path.parent}: not a teacher cache (no {DESCRIPTOR}); run `gkd score` first") from None
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: unreadable descriptor ({e})") from e
        schema = load_schema("descriptor")
        version = str(data.get("descriptor_version", "?"))
        if version.split(".")[0] != str(schema.major):
            raise SchemaError(f"{path}: descriptor version {version} is not readable by this code (reads {schema.major}.x)")
        missing = [f["name"] for f in schema.fields if f["name"] not in data and "since" not in f]
        if missing:
            raise SchemaError(f"{path}: descriptor lacks field(s) {', '.join(missing)}")
        scored_major = load_schema("scored").major
        if str(data["schema_version"]).split(".")[0] != str(scored_major):
            raise SchemaError(
                f"{path}: shards follow scored schema {data['schema_version']}; this code reads {scored_major}.x"
            )
        return cls(**{f["name"]: data.get(f["name"]) for f in schema.fields})  # absent `since` fields: None

    def write(self, path: Path) -> None:
        schema = load_schema("descriptor")
        fields = {k: v for k, v in asdict(self).items() if v is not None or k not in schema.sparse}
        data = {"descriptor_version": schema.written(set(fields) & schema.sparse).version, **fields}
        atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())

    def mismatches(self, other: Descriptor) -> list[str]:
        out = [
            f"{name}: cache has {getattr(self, name)!r}, this run has {getattr(other, name)!r}"
            for name in self.IDENTITY
            if name != "numerics" and getattr(self, name) != getattr(other, name)
        ]
        out += _numerics_mismatches(self.numerics, other.numerics)
        if self.codec.get("name") != other.codec.get("name"):
            out.append(f"codec: cache has {self.codec.get('name')!r}, this run writes {other.codec.get('name')!r}")
        return out


def _numerics_mismatches(cache: dict | None, run: dict | None) -> list[str]:
    if cache == run:
        return []
    if cache is None:
        return [f"numerics: this cache does not record how its rows were scored (a descriptor 1.0 cache: dtype, "
                f"quantization, ... unknown); this run scores with {json.dumps(run, sort_keys=True)}. If its rows were "
                f"scored exactly so, add \"numerics\": {json.dumps(run, sort_keys=True)} to its {DESCRIPTOR}"]
    if run is None:
        return [f"numerics: cache has {json.dumps(cache, sort_keys=True)}, this writer does not say how it scored"]
    return [f"numerics.{k}: cache has {cache.get(k, '(unset)')!r}, this run has {run.get(k, '(unset)')!r}"
            for k in sorted(set(cache) | set(run)) if cache.get(k) != run.get(k)]


class TeacherCache:
    def __init__(self, root: str | Path, descriptor: Descriptor) -> None:
        self.root = Path(root)
        self.descriptor = descriptor
        self._writer: shard_index.IndexAppender | None = None  # the committed keys, kept up to date under the lock

    # -- opening --------------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | Path) -> TeacherCache:
        """Open an existing cache for reading."""
        root = Path(root)
        return cls(root, Descriptor.read(root / DESCRIPTOR))

    @classmethod
    def create_or_open(cls, root: str | Path, descriptor: Descriptor) -> TeacherCache:
        """Open the cache at `root` for writing rows described by `descriptor`; create it if absent.
        Refuses (before any work is done) a cache built with another teacher, tokenizer, k or logprob mode."""
        root = Path(root)
        path = root / DESCRIPTOR
        if root.exists() and not root.is_dir():
            raise ShardError(f"{root}: is a file, not a teacher cache directory; pass --cache a directory (a new "
                             "one is created, an existing cache grows)")
        if not path.exists():  # two writers starting together on a new cache: one creates it, both check it
            try:
                (root / SHARDS).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise WriteError(root, e, "cannot create the cache directory") from e
            with FileLock(root / COMMIT_LOCK, "a writer of this cache", wait_s=COMMIT_WAIT_S):
                if not path.exists():
                    atomic_write_bytes(root / shard_index.INDEX, shard_index.header(descriptor))
                    descriptor.write(path)
                    return cls(root, descriptor)
        existing = Descriptor.read(path)
        problems = existing.mismatches(descriptor)
        if problems:
            raise CacheMismatchError(
                f"{path}: this cache was scored differently and cannot be mixed:\n  - "
                + "\n  - ".join(problems)
                + "\nUse another --cache directory for this teacher/tokenizer/k/numerics."
            )
        return cls(root, existing)

    # -- shards ---------------------------------------------------------------------------------------------------
    @property
    def shard_dir(self) -> Path:
        return self.root / SHARDS

    def shard_paths(self) -> list[Path]:
        """Complete shards (those with a completion marker), sorted by name."""
        return complete_shards(self.shard_dir)

    def index(self) -> shard_index.CacheIndex:
        """Every complete shard with its keys and lengths, from the index file and one listing (store/index.py)."""
        return shard_index.load(self.root, self.descriptor)

    def rebuild_index(self) -> shard_index.CacheIndex:
        """`gkd cache index`: rewrite the index from the shards' footers, under the commit lock (writers wait)."""
        with self._commit_lock():
            return shard_index.rebuild(self.root, self.descriptor)

    def keys(self, paths: Sequence[Path] | None = None) -> set[str]:
        """Content keys: of the whole cache from its index; of the given shards from their `key` columns."""
        if paths is None:
            return set(self.index().keys.astype(str).tolist())
        out: set[str] = set()
        for p in paths:
            try:
                out.update(pq.read_table(p, columns=["key"]).column("key").to_pylist())
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{p}: cannot read its key column ({e}); run `gkd cache verify {self.root}`") from e
        return out

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The given keys that are not in the cache yet, in their given order."""
        have = self.keys()
        return [k for k in keys if k not in have]

    def add_rows(self, name: str, rows: Sequence[dict], *, extra: dict | None = None) -> tuple[ShardInfo | None, int]:
        """Publish `rows` as shard `name`, leaving out keys the cache already holds, under the cache's commit lock:
        writers of overlapping rows (score tasks of two rollout sets, or of two splits) each write a key once
        however their runs interleave. Returns (the shard, or None when every row was already there; rows left
        out). Which keys are there comes from the index: only the lines other writers appended since this writer's
        last commit are read, so a commit costs the same in an empty cache and in one of 10^5 shards."""
        with self._commit_lock():
            self._writer.sync()
            fresh = [r for r in rows if r["key"] not in self._writer.keys]
            if not fresh:
                return None, len(rows)
            info = self._publish(name, fresh, extra)
        pause.point("cache-commit")  # outside the lock: a command stopped here holds up no other writer
        return info, len(rows) - len(fresh)

    def write_shard(self, name: str, rows: Sequence[dict], *, extra: dict | None = None) -> ShardInfo:
        """Encode and atomically write scored rows as shard `name` (e.g. "scored-00003-of-00008"), and index it.

        Each row: key, sample_id, source, policy_version, input_ids, first_scored, topk_ids [n,k],
        topk_logprobs [n,k], actual_ranks [n], actual_logprobs [n] with n = len(input_ids) - first_scored;
        optionally tags (the rollout's, for routing), teacher_prompt_ids (OPSD: what the teacher saw instead of
        the prompt) and images (content hashes; the files must be in `images/` of this cache already: `add_image`).
        Unlike add_rows, keys already in the cache are written again.
        """
        with self._commit_lock():
            self._writer.sync()
            info = self._publish(name, rows, extra)
        pause.point("cache-commit")
        return info

    def _commit_lock(self) -> FileLock:
        if self._writer is None:
            self._writer = shard_index.IndexAppender(self.root, self.descriptor)
        return FileLock(self.root / COMMIT_LOCK, "a writer of this cache", wait_s=COMMIT_WAIT_S)

    def _publish(self, name: str, rows: Sequence[dict], extra: dict | None) -> ShardInfo:
        """Shard, marker, then its index line (the caller holds the commit lock): a crash between the marker and
        the line leaves a complete shard that the next open finds in the listing and reads from its footer."""
        info = self._write_shard(name, rows, extra=extra)
        # the line from the rows in hand (reading the file back would cost a footer read per commit); pyarrow
        # cuts row groups of exactly ROW_GROUP_ROWS (tests/store/test_index.py compares with the footers)
        n = len(rows)
        groups = [min(ROW_GROUP_ROWS, n - i) for i in range(0, n, ROW_GROUP_ROWS)]
        keys = [r["key"] for r in rows]
        first = [int(r["first_scored"]) for r in rows]
        num = [len(r["input_ids"]) - f for r, f in zip(rows, first, strict=True)]
        line = shard_index.line(name, info.bytes, info.sha256, info.rows, groups, info.extra["scored_tokens"],
                                keys, first, num)
        self._writer.append(line, keys)
        return info

    def _write_shard(self, name: str, rows: Sequence[dict], *, extra: dict | None = None) -> ShardInfo:
        """Encode and atomically write the shard (no index line: `_publish`)."""
        d = self.descriptor
        enc_rows = []
        for r in rows:
            ids = np.asarray(r["input_ids"], dtype=np.int32)
            n = len(ids) - int(r["first_scored"])
            if n < 0 or np.asarray(r["topk_ids"]).shape[0] != n:
                raise ValueError(
                    f"sample {r['sample_id']}: {np.asarray(r['topk_ids']).shape[0]} scored positions, "
                    f"expected len(input_ids) - first_scored = {n}"
                )
            enc_rows.append((r["topk_ids"], r["topk_logprobs"], ids[int(r["first_scored"]) :], r["actual_ranks"], r["actual_logprobs"]))
        enc = codec.encode(enc_rows, k=d.k, vocab_size=d.vocab_size, name=d.codec.get("name", codec.NAME),
                           topp=d.topp, min_k=d.min_k)
        table = pa.table(
            {
                "key": [r["key"] for r in rows],
                "sample_id": [r["sample_id"] for r in rows],
                "source": [r["source"] for r in rows],
                "policy_version": pa.array([r.get("policy_version") for r in rows], pa.int64()),
                "input_ids": pa.array([np.asarray(r["input_ids"], np.int32) for r in rows], pa.list_(pa.int32())),
                "first_scored": pa.array([int(r["first_scored"]) for r in rows], pa.int32()),
                "num_scored": pa.array([len(e[2]) for e in enc_rows], pa.int32()),
                "topk_ids": pa.array(enc.topk_ids, pa.binary()),
                "topk_logprobs": pa.array(enc.topk_logprobs, pa.binary()),
                "tail_logprobs": pa.array(enc.tail_logprobs, pa.binary()),
                "actual_rank": pa.array(enc.actual_rank, pa.binary()),
                "actual_logprobs": pa.array(enc.actual_logprobs, pa.binary()),
                "tags": pa.array([None if r.get("tags") is None else list(r["tags"].items()) for r in rows],
                                 pa.map_(pa.string(), pa.string())),
                "teacher_prompt_ids": pa.array([None if r.get("teacher_prompt_ids") is None
                                                else np.asarray(r["teacher_prompt_ids"], np.int32) for r in rows],
                                               pa.list_(pa.int32())),
                "images": pa.array([r.get("images") or None for r in rows], pa.list_(pa.string())),
            }
        )
        if d.hidden_rows:  # scored 1.4's hidden_states: only a hidden-state cache has them
            dtype = d.hidden["dtype"]
            table = table.append_column(hidden_store.COLUMN, pa.array(
                [hidden_store.encode(r["hidden_states"], dtype) for r in rows], pa.binary()))
        if d.cross_tokenizer:  # scored 1.3's sparse columns: only a cross-tokenizer cache has (and needs) them
            for column in CROSS_COLUMNS:
                values = [r[column] for r in rows]
                if column == "student_first":
                    table = table.append_column(column, pa.array([int(v) for v in values], pa.int32()))
                else:
                    table = table.append_column(column, pa.array([np.asarray(v, np.int32) for v in values],
                                                                 pa.list_(pa.int32())))
        # scored 1.5's sparse column: only where some row carries the sampler's logprobs (gkd generate --logprobs);
        # a cross-tokenizer row's would be in the student's tokens, beside teacher-token positions: not written
        if not d.cross_tokenizer and any(r.get("completion_logprobs") is not None for r in rows):
            table = table.append_column(BEHAVIOR_COLUMN, pa.array(
                [None if r.get("completion_logprobs") is None else np.asarray(r["completion_logprobs"], np.float32)
                 for r in rows], pa.list_(pa.float32())))
        scored_tokens = int(sum(len(e[2]) for e in enc_rows))
        return write_shard(
            self.shard_dir / f"{name}.parquet", table, "scored", extra={"scored_tokens": scored_tokens, **(extra or {})},
            footer=enc.footer,
            row_group_size=ROW_GROUP_ROWS,
            clean_stale=False,  # the index writer's first sync did, under the commit lock (one listing per writer)
            zstd_level=SCORED_ZSTD_LEVEL,
        )

    def add_image(self, data: bytes) -> str:
        """Store an image's bytes in this cache (`images/<hash>`, once); returns the hash rows name it by."""
        return images.put(self.root, data)

    # -- reading --------------------------------------------------------------------------------------------------
    def iter_batches(
        self, paths: Sequence[Path] | None = None, *, batch_rows: int = 64, checksum: bool = True
    ) -> Iterator[reader.ScoredBatch]:
        """Stream decoded batches of `batch_rows` sequences (store/reader.py); memory is bounded by one batch."""
        yield from reader.iter_batches(paths if paths is not None else self.shard_paths(), self.root,
                                       batch_rows=batch_rows, checksum=checksum)

    def iter_samples(self, paths: Sequence[Path] | None = None, *, keys: Iterable[str] | None = None) -> Iterator[reader.ScoredSample]:
        """Per-sample numpy arrays (the public read API); optionally only the given keys."""
        yield from reader.iter_samples(self.iter_batches(paths), keys)

    # -- inspection -----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts from the index (cheap: one file and one listing; no footer, marker or top-k data is read)."""
        idx = self.index()
        samples, tokens, nbytes = len(idx.keys), int(idx.scored_tokens.sum()), int(idx.nbytes.sum())
        paths = idx.names
        d = self.descriptor
        stored = [p for p in images.image_dir(self.root).glob("*") if not p.name.startswith(".")]
        image_bytes = sum(p.stat().st_size for p in stored)
        return {
            "cache": str(self.root),
            "shards": len(paths),
            "samples": samples,
            "scored_tokens": tokens,
            "bytes": nbytes,
            "bytes_per_scored_token": round(nbytes / tokens, 2) if tokens else None,
            "images": len(stored),
            "image_bytes": image_bytes,
            "image_share": round(image_bytes / (image_bytes + nbytes), 4) if image_bytes else 0.0,
            "k": d.k,
            "topp": d.topp,
            "min_k": d.min_k,
            "logprob_mode": d.logprob_mode,
            "teacher": d.teacher,
            "teacher_fingerprint": d.teacher_fingerprint,
            "tokenizer_fingerprint": d.tokenizer_fingerprint,
            "engine": d.engine,
            "numerics": d.numerics,
            "codec": d.codec.get("name"),
            "bytes_per_position": round(nbytes / tokens, 2) if tokens else None,
            **(hidden_store.stats(d, tokens, nbytes) if d.hidden_rows
               else {"teacher_rows": "topk", "trains": hidden_store.TOPK_TRAINS}),
            **({"student_tokenizer_fingerprint": d.student_tokenizer_fingerprint,
                "alignment": self.alignment_stats()} if d.cross_tokenizer else {}),
        }

    def alignment_stats(self) -> dict:
        """A cross-tokenizer cache's alignment (store/align.py `span_stats`): share of student tokens in 1:1 spans,
        mean span length per side. Reads the two span columns of every shard (not the top-k data)."""
        spans_s, spans_t = [], []
        for p in self.shard_paths():
            table = pq.read_table(p, columns=["span_student", "span_teacher"])
            spans_s += [np.asarray(v, np.int64) for v in table.column("span_student").to_pylist()]
            spans_t += [np.asarray(v, np.int64) for v in table.column("span_teacher").to_pylist()]
        return align.span_stats(spans_s, spans_t)

    def verify(self, *, decode: bool = True) -> list[str]:
        """Every problem in the cache, each naming its file: descriptor, markers, checksums, schema, codec, keys."""
        problems: list[str] = []
        d = self.descriptor
        try:
            codec.params(d.codec.get("name", ""))
        except codec.CodecError as e:
            problems.append(f"{self.root / DESCRIPTOR}: {e}")
        try:
            idx = shard_index.load(self.root, d, say=lambda _: None)
            problems += [f"{self.root / shard_index.INDEX}: {c}; run `gkd cache index {self.root}`" for c in idx.changes]
            for name, size, sha in zip(idx.names, idx.nbytes.tolist(), idx.sha256.astype(str), strict=True):
                p = self.shard_dir / f"{name}.parquet"
                if p.exists() and (p.stat().st_size != size or (read_marker(p) or {}).get("sha256") != sha):
                    problems.append(f"{p}: size or sha256 differs from the cache index (replaced or truncated "
                                    f"behind it); run `gkd cache verify` after restoring it, or `gkd cache index "
                                    f"{self.root}`")
        except ShardError as e:
            problems.append(str(e))
        for orphan in sorted(self.shard_dir.glob("*.parquet")):
            if read_marker(orphan) is None:
                problems.append(f"{orphan}: no completion marker (an interrupted write); delete it or rerun its task")
        if d.hidden_rows:
            problems += hidden_store.verify_problems(self.root, d)
        seen: dict[str, Path] = {}
        for p in self.shard_paths():
            shard_problems = verify_shard(p, "scored")
            if shard_problems:
                problems.extend(shard_problems)
                continue
            md = pq.read_schema(p).metadata or {}
            if int(md.get(b"gkd.codec.k", b"-1")) != d.k:
                problems.append(f"{p}: k={md.get(b'gkd.codec.k', b'?').decode()} but the cache descriptor says k={d.k}")
            topp = float(md[b"gkd.codec.topp"]) if b"gkd.codec.topp" in md else None
            min_k = int(md[b"gkd.codec.min_k"]) if b"gkd.codec.min_k" in md else None
            if (topp, min_k) != (d.topp, d.min_k):
                problems.append(f"{p}: topp={topp}, min_k={min_k} but the cache descriptor says topp={d.topp}, "
                                f"min_k={d.min_k}")
            for key in pq.read_table(p, columns=["key"]).column("key").to_pylist():
                if key in seen:
                    problems.append(f"{p}: key {key} is also in {seen[key]} (duplicate row)")
                seen.setdefault(key, p)
            if decode:
                try:
                    for _ in self.iter_batches([p], batch_rows=256, checksum=False):
                        pass
                except (ShardError, codec.CodecError) as e:
                    problems.append(str(e))
                if d.hidden_rows:
                    problems += hidden_store.shard_problems(p, d)
        return problems


def read_cache(root: str | Path, keys: Iterable[str] | None = None) -> Iterator[reader.ScoredSample]:
    """Read a cache back as numpy arrays per sample: `for s in read_cache("cache/"): s.topk_ids ...`."""
    return TeacherCache.open(root).iter_samples(keys=keys)
