"""The train stage's sources: which shards a run reads and whether they can be read together.

Cache directories (through their index, store/index.py) or explicit shard files (`resolve_sources`), rollout shards
for a live teacher (`resolve_rollouts`), and the checks on their descriptors before any row is read
(`check_sources`): one kind (cross- or same-tokenizer), the student's tokenizer, one k, one top-p setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.errors import InputError, MissingInputError, UserError
from pipeline.store import images
from pipeline.store.cache import DESCRIPTOR, SHARDS, Descriptor, TeacherCache, cache_root
from pipeline.store.index import CacheIndex
from pipeline.store.rollouts import rollout_shards, tokenizer_mismatches
from pipeline.store.shards import ShardError


class TokenizerMismatchError(UserError, ValueError):
    """The cache was scored with another tokenizer than the student's."""


@dataclass(frozen=True)
class Source:
    """What a run reads from one place: a cache directory through its index (`index`; store/index.py), or one shard
    file through its footer (`shard`; a rollout shard for a live teacher has no descriptor)."""

    root: Path  # the cache directory (a rollout shard: its folder)
    descriptor: Descriptor | None
    index: CacheIndex | None = None
    shard: Path | None = None

    @property
    def shard_dir(self) -> Path:
        return self.root / SHARDS

    def shard_paths(self) -> list[Path]:
        if self.index is None:
            return [self.shard]
        return [self.shard_dir / f"{n}.parquet" for n in self.index.names]


def resolve_sources(sources: Sequence[str | Path], *, indexed: bool = False) -> list[Source]:
    """Cache directories (all complete shards) or explicit shard files (descriptor from their cache root).
    `indexed`: a directory is one `Source` read through its index (one file and one listing instead of every
    footer); else every shard is its own `Source`, read through its footer."""
    out: list[Source] = []
    for src in sources:
        src = Path(src)
        if not src.exists() and src.suffix != ".parquet":
            raise MissingInputError(f"{src}: no such teacher cache (`gkd score` writes it)")
        if src.is_dir():
            cache = TeacherCache.open(src)
            if indexed:
                idx = cache.index()
                if not idx.names:
                    raise ShardError(f"{src}: teacher cache has no complete shards")
                out.append(Source(src.resolve(), cache.descriptor, index=idx))  # resolved once, not per shard
                continue
            shards = cache.shard_paths()
            if not shards:
                raise ShardError(f"{src}: teacher cache has no complete shards")
            out += [Source(cache_root(p), cache.descriptor, shard=p) for p in shards]
        elif src.suffix == ".parquet":
            if not src.exists():
                raise ShardError(f"{src}: shard file is missing")
            out.append(Source(cache_root(src), Descriptor.read(cache_root(src) / DESCRIPTOR), shard=src))
        else:
            raise MissingInputError(f"{src}: neither a teacher cache directory nor a .parquet shard")
    return out


def student_lengths(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(completion length, prompt length) of each cross-tokenizer row in the student's tokens."""
    try:
        t = pq.read_table(path, columns=["student_ids", "student_first"])
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: cannot read its cross-tokenizer columns ({e})") from e
    first = t.column("student_first").to_numpy().astype(np.int64)
    return pc.list_value_length(t.column("student_ids")).to_numpy().astype(np.int64) - first, first


def image_rows(resolved: Sequence[Source]) -> Path | None:
    """The first cache root (or rollout shard) of `resolved` whose rows carry images, else None. A cache (or rollout
    folder) without a stored image (`images.stored`: one listing) has none; one with stored images is confirmed on
    its shards' `images` column, stopping at the first shard that names one (no descriptor field: caches written
    before this check are read the same way, and a text-only cache is not touched)."""
    for src in resolved:
        if not images.stored(src.root):
            continue
        for path in src.shard_paths():
            try:
                pf = pq.ParquetFile(path)
                if "images" not in pf.schema_arrow.names:
                    continue
                column = pf.read(columns=["images"]).column(0)
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{path}: cannot read its images column ({e})") from e
            if column.null_count < len(column) and pc.sum(pc.list_value_length(column)).as_py():
                return src.root if src.descriptor is not None else path
    return None


def resolve_rollouts(sources: Sequence[str | Path], tokenizer_fingerprint: str | None) -> list[Source]:
    """Rollout directories (all complete shards) or shard files, for a live teacher; each must record the student's
    tokenizer (a rollout tokenized by another one would be trained on the wrong tokens)."""
    out: list[Source] = []
    for src in map(Path, sources):
        if not src.exists():
            raise MissingInputError(f"{src}: no such rollout directory or shard (`gkd generate` / `gkd import` write them)")
        paths = rollout_shards(src) if src.is_dir() else [src]
        if not paths:
            raise ShardError(f"{src}: no complete rollout shards (*.parquet with a .ok marker)")
        if tokenizer_fingerprint is not None and (wrong := tokenizer_mismatches(paths, tokenizer_fingerprint)):
            p, recorded = wrong[0]
            raise TokenizerMismatchError(
                f"{p}: rollouts tokenized with {recorded or 'an unrecorded tokenizer'}, the student's is "
                f"{tokenizer_fingerprint}; regenerate them with the student's tokenizer")
        out += [Source(p.parent, None, shard=p) for p in paths]
    return out


@dataclass(frozen=True)
class Agreement:
    """What every source of a run shares (`check_sources`)."""

    cross: bool  # cross-tokenizer caches (store/align.py): rows in the teacher's tokens, with spans
    k: int
    topp: float | None
    min_k: int | None
    hidden: dict | None = None  # hidden-state caches (store/hidden.py): their shared `hidden` (dtype, size, layer)
    hidden_root: Path | None = None  # the first of them (where the output layer is read)


def _roots(resolved: list[Source]) -> str:
    """The sources' cache roots, sorted, for a refusal that names them."""
    return ", ".join(sorted({str(r.root) for r in resolved}))


def check_sources(resolved: list[Source], tokenizer_fingerprint: str | None, vocab_size: int | None) -> Agreement:
    """Refuse sources that cannot be read together, before any row is read: cross- and same-tokenizer caches, a
    cache of another tokenizer than the student's (`tokenizer_fingerprint`), a larger vocabulary unverified by a
    fingerprint, different k, different top-p settings."""
    hidden = hidden_agreement(resolved)
    kinds = {r.descriptor.cross_tokenizer for r in resolved}
    if len(kinds) != 1:
        raise InputError(f"cross-tokenizer and same-tokenizer caches cannot be read together ({_roots(resolved)}): "
                         "train from one kind")
    for where, desc in {r.root: r.descriptor for r in resolved}.items():
        if desc.cross_tokenizer:
            if tokenizer_fingerprint is not None and desc.student_tokenizer_fingerprint != tokenizer_fingerprint:
                raise TokenizerMismatchError(
                    f"{where}: cross-tokenizer cache of rollouts tokenized with {desc.student_tokenizer_fingerprint}, "
                    f"the student's tokenizer is {tokenizer_fingerprint}; score the student's own rollouts "
                    "(gkd score cross_tokenizer=true student_tokenizer=STUDENT)")
            continue
        if tokenizer_fingerprint is not None and desc.tokenizer_fingerprint != tokenizer_fingerprint:
            raise TokenizerMismatchError(
                f"{where}: cache scored with tokenizer {desc.tokenizer_fingerprint}, the student's is "
                f"{tokenizer_fingerprint}; teacher ids would index the wrong tokens"
            )
        if vocab_size is not None and desc.vocab_size > vocab_size and tokenizer_fingerprint is None:
            # Same tokenizer, more embedding rows is fine (the loader folds them); unverified, it may be another vocab.
            raise TokenizerMismatchError(
                f"{where}: cache vocab {desc.vocab_size} exceeds the student's {vocab_size} and no tokenizer "
                "fingerprint was given to show they share a tokenizer"
            )
    ks = {r.descriptor.k for r in resolved}
    if len(ks) != 1:
        per_cache = {str(r.root): r.descriptor.k for r in resolved}
        raise InputError(f"caches with different k ({sorted(ks)}) cannot share a micro-batch: "
                         f"{', '.join(f'{c}: k={k}' for c, k in per_cache.items())}; train from caches of one k "
                         "(score them with the same --topk)")
    # (rows of one content key are the same sequence in every cache: which top-p setting a row comes from
    # would then depend on which cache is listed first)
    tops = {(r.descriptor.topp, r.descriptor.min_k) for r in resolved}
    if len(tops) != 1:
        raise InputError(f"caches with different top-p settings (topp, min_k) {sorted(tops, key=str)} cannot be "
                         f"read together ({_roots(resolved)}); train from one of them")
    ((topp, min_k),) = tops
    return Agreement(cross=kinds.pop(), k=ks.pop(), topp=topp, min_k=min_k,
                     hidden=None if hidden is None else hidden.descriptor.hidden,
                     hidden_root=None if hidden is None else hidden.root)


def hidden_agreement(resolved: list[Source]) -> Source | None:
    """The first hidden-state cache of a run (None: none), after refusing, by file, a hidden-state cache mixed with a
    top-k cache, and hidden-state caches of other teachers' output layers or other state dtypes."""
    roots = {r.root: r.descriptor for r in resolved}
    hidden = [w for w, d in roots.items() if d.hidden_rows]
    if not hidden:
        return None
    topk = [w for w, d in roots.items() if not d.hidden_rows]
    if topk:
        raise InputError(
            f"{hidden[0] / DESCRIPTOR}: teacher_rows=hidden, but {topk[0] / DESCRIPTOR} is a top-k cache (no "
            "teacher_rows): a run trains from one kind (cache: lists them); train the hidden-state caches alone, or "
            "score the top-k cache's rollouts with teacher_rows=hidden into the hidden-state cache")
    first = roots[hidden[0]].hidden
    for w in hidden[1:]:
        if roots[w].hidden != first:
            raise InputError(f"{w / DESCRIPTOR}: hidden {roots[w].hidden} differs from {hidden[0] / DESCRIPTOR}'s "
                             f"{first} (another teacher's output layer or state dtype); train from caches of one teacher")
    return next(r for r in resolved if r.root == hidden[0])
