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
from pipeline.store.cache import DESCRIPTOR, SHARDS, Descriptor, TeacherCache, cache_root
from pipeline.store.rollouts import rollout_shards, tokenizer_mismatches
from pipeline.store.shards import ShardError


class TokenizerMismatchError(UserError, ValueError):
    """The cache was scored with another tokenizer than the student's."""


@dataclass(frozen=True)
class IndexedShard:
    """What the cache index says of one shard (pipeline/store/index.py): the columns _build_index reads."""

    keys: np.ndarray  # S32
    num_scored: np.ndarray
    first_scored: np.ndarray
    row_groups: list[int]
    nbytes: int
    sha256: str


def resolve_sources(sources: Sequence[str | Path], *, indexed: bool = False
                    ) -> list[tuple[Path, Descriptor]] | list[tuple[Path, Descriptor, IndexedShard | None]]:
    """Cache directories (all complete shards) or explicit shard files (descriptor from their cache root).
    `indexed`: a directory's shards come from its index (store/index.py: one file and one listing instead of every
    footer), each with a third element, its `IndexedShard` columns (None for an explicit shard file)."""
    out: list = []
    for src in sources:
        src = Path(src)
        if not src.exists() and src.suffix != ".parquet":
            raise MissingInputError(f"{src}: no such teacher cache (`gkd score` writes it)")
        if src.is_dir():
            cache = TeacherCache.open(src)
            if indexed:
                idx = cache.index()
                shard_dir = src.resolve() / SHARDS  # once, not a realpath per shard
                out += [(shard_dir / f"{n}.parquet", cache.descriptor, IndexedShard(
                    idx.keys[idx.row_starts[s]: idx.row_starts[s + 1]],
                    idx.num_scored[idx.row_starts[s]: idx.row_starts[s + 1]],
                    idx.first_scored[idx.row_starts[s]: idx.row_starts[s + 1]],
                    idx.row_groups[s], int(idx.nbytes[s]), idx.sha256[s])) for s, n in enumerate(idx.names)]
                if not idx.names:
                    raise ShardError(f"{src}: teacher cache has no complete shards")
                continue
            shards = cache.shard_paths()
            if not shards:
                raise ShardError(f"{src}: teacher cache has no complete shards")
            out += [(p, cache.descriptor) for p in shards]
        elif src.suffix == ".parquet":
            if not src.exists():
                raise ShardError(f"{src}: shard file is missing")
            out.append((src, Descriptor.read(cache_root(src) / DESCRIPTOR)) + ((None,) if indexed else ()))
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


def resolve_rollouts(sources: Sequence[str | Path], tokenizer_fingerprint: str | None) -> list[tuple[Path, None]]:
    """Rollout directories (all complete shards) or shard files, for a live teacher; each must record the student's
    tokenizer (a rollout tokenized by another one would be trained on the wrong tokens)."""
    out: list[tuple[Path, None]] = []
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
        out += [(p, None) for p in paths]
    return out


@dataclass(frozen=True)
class Agreement:
    """What every source of a run shares (`check_sources`)."""

    cross: bool  # cross-tokenizer caches (store/align.py): rows in the teacher's tokens, with spans
    k: int
    topp: float | None
    min_k: int | None


def _roots(resolved: list) -> str:
    """The sources' cache roots, sorted, for a refusal that names them."""
    return ", ".join(sorted({str(cache_root(r[0])) for r in resolved}))


def check_sources(resolved: list, tokenizer_fingerprint: str | None, vocab_size: int | None) -> Agreement:
    """Refuse sources that cannot be read together, before any row is read: cross- and same-tokenizer caches, a
    cache of another tokenizer than the student's (`tokenizer_fingerprint`), a larger vocabulary unverified by a
    fingerprint, different k, different top-p settings. `resolved`: `resolve_sources`' (path, descriptor, ...)."""
    kinds = {r[1].cross_tokenizer for r in resolved}
    if len(kinds) != 1:
        raise InputError(f"cross-tokenizer and same-tokenizer caches cannot be read together ({_roots(resolved)}): "
                         "train from one kind")
    for where, desc in {cache_root(r[0]): r[1] for r in resolved}.items():
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
    ks = {r[1].k for r in resolved}
    if len(ks) != 1:
        per_cache = {str(cache_root(r[0])): r[1].k for r in resolved}
        raise InputError(f"caches with different k ({sorted(ks)}) cannot share a micro-batch: "
                         f"{', '.join(f'{c}: k={k}' for c, k in per_cache.items())}; train from caches of one k "
                         "(score them with the same --topk)")
    # (rows of one content key are the same sequence in every cache: which top-p setting a row comes from
    # would then depend on which cache is listed first)
    tops = {(r[1].topp, r[1].min_k) for r in resolved}
    if len(tops) != 1:
        raise InputError(f"caches with different top-p settings (topp, min_k) {sorted(tops, key=str)} cannot be "
                         f"read together ({_roots(resolved)}); train from one of them")
    ((topp, min_k),) = tops
    return Agreement(cross=kinds.pop(), k=ks.pop(), topp=topp, min_k=min_k)
