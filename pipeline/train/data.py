"""Scored shards -> student micro-batches: a deterministic, resumable, streaming loader.

Alignment (docs/architecture.md, "Alignment convention"): a cached row holds tokens x_0..x_{L-1}, P = first_scored, and teacher row r for
token j = P + r (the distribution of x_j given x_<j). Student logits at position t predict x_{t+1}, so, for a sample
laid out at columns [o, o + n) of its row,

    labels[o + t]       = x_{t+1}                  (inputs rolled by -1; the sample's last token has no label: -100)
    loss_mask[o + t]    = P - 1 <= t <= n - 2      (exactly the positions whose NEXT token is scored)
    teacher_*[o + t]    = teacher row of token j = t + 1

Sequences longer than `seq_length` are truncated: tokens x_j with j >= seq_length and their teacher rows are dropped
(a sample whose prompt alone fills seq_length then has no active position; it is still consumed, so the order and
the resume position do not depend on seq_length). Truncated samples are counted (`MicroBatch.truncated`).

Micro-batches, two layouts (`packing`):
- **packed** (the trainer's default): a micro-batch is `micro_batch_size` rows of `seq_length` tokens, a token
  budget; a step's rows hold the longest run of samples from its start position that `packing.pack` fits into
  them (first-fit, repacked first-fit-decreasing when a sample fits nowhere; lengths only, see packing.py).
  `doc_ids` numbers the samples of each row (-1 = padding) and the trainer turns it into per-sample attention
  spans (`attention.attention_inputs`; a block-diagonal causal mask for `attention: local`), so no token sees
  another sample; no label crosses a sample boundary.
- **padded** (`packing: false`): micro-batch m = samples [mB, (m+1)B), one per row.
Both right-pad with `pad_id` to the longest row of the micro-batch rounded up to a multiple of 8 (at most
seq_length; attention cost is quadratic).

Order: global sample g (counting across epochs) is row order(g // N)[g % N] of the N unique rows (duplicate keys
across shards/caches are kept once, rows with no scored position are skipped). The epoch permutation is a pure
function of (seed, epoch): Parquet row groups ("blocks") are shuffled, grouped into windows of >= `window_rows`
rows, and rows are shuffled within each window, so a reader holds about two windows of *decoded* rows in memory,
never the cache (the shuffle of mosaicml streaming's py1b, simplified). Blocks are decoded whole: decoding the few
rows of one micro-batch at a time measured ~5x slower (per-call overhead).

Index: a cache directory's shards, keys, lengths and row groups come from its index (pipeline/store/index.py: one file
and one directory listing, whatever the number of shards); no shard is opened until its rows are read, when its size
is checked against the index's, and with `verify_checksums` its sha256 too, once, by each rank that reads it (not
every shard on every rank at start).
`use_index=False` (and routing, which reads each row's tags) reads every shard's footer and columns instead: the
reference tests/store/test_index.py compares the index loader with, micro-batch for micro-batch.

Data parallelism and resume: padded, micro-batch m goes to data-parallel rank m % dp and a step is dp * grad_accum
consecutive micro-batches. Packed, the plan is made per optimizer step: the longest run of samples from the step's
start that fits into `global_batch_size` rows (`rows_per_step`), cut into micro-batches of `micro_batch_size` rows,
micro-batch q of the step going to rank q % dp; it is a pure function of the step's start position, computed from
the cheap length columns, so every rank computes the same plan, and the samples of a step — hence its loss and
gradient — do not depend on how it is split over accumulation steps and ranks (tests/train/test_dp.py). Either way
the resume state is one integer, the global sample position after the step (= (epoch, index) via divmod), equal on
every rank.

Teacher vocab larger than the student's (same tokenizer, extra embedding rows, e.g. Qwen2.5-7B -> 0.5B): top-k
entries with ids >= the student's vocab cannot be represented. They are marked `teacher_valid = False` (id 0,
logprob -inf) and their mass is added to `teacher_tail` (log-add-exp in float64), so the tail mode's k+1-th bin
holds it and the renorm mode drops it; positions with such entries are counted (`folded_positions`).

Where the parts live: the sources and their descriptor checks in sources.py, micro-batch layout in batch.py, the
packing plan's first-fit in packing.py, the prefetch thread in prefetch.py; the loader's throughput is measured by
benchmarks/train_bench.py (`loader_throughput`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import ConfigError
from pipeline.errors import InputError
from pipeline.store.cache import Descriptor, cache_root
from pipeline.store.codec import CodecError, Decoder, open_decoder
from pipeline.store.rollouts import scored_from
from pipeline.store.shards import ShardError, file_sha256, verify_shard
from pipeline.train.batch import Block, MicroBatch, assemble, fold_past_vocab, matched_ids, student_layout
from pipeline.train.live_xtok import LiveXtok, rollout_block
from pipeline.train.packing import pack, row_offsets
from pipeline.train.prefetch import prefetched
from pipeline.train.sources import (
    IndexedShard,
    check_sources,
    resolve_rollouts,
    resolve_sources,
    student_lengths,
)

# what a micro-batch needs (not sample_id, policy_version, the actual token's rank and logprob)
_COLUMNS = ["key", "source", "input_ids", "first_scored", "num_scored", "topk_ids", "topk_logprobs", "tail_logprobs"]


@dataclass
class _Shard:
    path: Path
    descriptor: Descriptor | None  # None: a rollout shard (live teacher)
    rg_starts: np.ndarray  # first global row of each row group, plus the end
    fold: bool  # teacher vocab larger than the student's: fold ids past it into the tail
    nbytes: int | None = None  # the cache index's size of the file (checked when it is opened), None: footer-read
    sha256: str | None = None  # the cache index's checksum (verify_checksums: checked when this rank first reads it)


def batch_split_problem(global_batch_size: int, micro_batch_size: int, dp: int, why: str = "") -> str | None:
    """What is wrong with splitting a step's `global_batch_size` rows into micro-batches of `micro_batch_size` rows
    over `dp` data-parallel ranks (None: it divides); `why` says where dp came from. The one check: the trainer's
    config validation, its process groups and the loader ask it."""
    rows = micro_batch_size * dp
    if global_batch_size % rows == 0:
        return None
    return (f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} x "
            f"data-parallel size {dp}{why} = {rows}; set global_batch_size to a multiple of {rows}, "
            f"e.g. {max(rows, global_batch_size // rows * rows)}")


class ScoredLoader:
    """Iterate micro-batches for one data-parallel rank from `start` (a global sample position) onwards."""

    def __init__(
        self,
        sources: Sequence[str | Path],
        *,
        micro_batch_size: int,
        seq_length: int,
        seed: int,
        pad_id: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        tokenizer_fingerprint: str | None = None,
        vocab_size: int | None = None,
        window_rows: int = 512,
        verify_checksums: bool = True,
        packing: bool = False,
        rows_per_step: int | None = None,
        live_k: int | None = None,
        actual: bool = False,
        routes: dict[str, str | Path] | None = None,
        route_key: str = "data_source",
        on_unrouted: str = "error",
        use_index: bool = True,
        xtok_map: np.ndarray | None = None,
        live_xtok: LiveXtok | None = None,
    ) -> None:
        self.B, self.S, self.seed, self.pad_id = micro_batch_size, seq_length, seed, pad_id
        self.dp_rank, self.dp_size, self.window_rows, self.packing = dp_rank, dp_size, window_rows, packing
        # Packed: one plan per optimizer step (global_batch_size rows), cut into micro-batches of B rows, so the
        # samples of a step do not depend on how it is split across accumulation steps and data-parallel ranks.
        self.G = rows_per_step or micro_batch_size * dp_size
        if problem := batch_split_problem(self.G, micro_batch_size, dp_size):
            raise ConfigError(problem)
        self.vocab_size = vocab_size
        self.actual = actual  # also decode the actual token's teacher logprob (MicroBatch.teacher_actual: loss=opd)
        # live_k: the sources are rollout shards (`gkd train teacher_live=...`); the teacher arrays of each
        # micro-batch are placeholders of width live_k that the trainer fills from its live teacher.
        self.live = live_k is not None
        # Routing: `routes` {TAG: cache dir, "default": cache dir} replaces `sources`; a sample (sample_id) is taken
        # from the cache of its tags[route_key] (or "default"); see _route.
        self.route_names = sorted(routes) if routes else []
        self.route_key, self.on_unrouted, self.unrouted = route_key, on_unrouted, 0
        self._routes = {n: Path(routes[n]).resolve() for n in self.route_names}
        if routes:
            sources = sorted({str(v) for v in self._routes.values()})
        # A cross-tokenizer cache (store/align.py) sets these below; rollouts for a live teacher are never one.
        self.cross, self.xtok_map, self.xtok_matched, self.xtok_teacher_vocab = False, None, None, 0
        if self.live:
            resolved = [(p, d, None) for p, d in resolve_rollouts(sources, tokenizer_fingerprint)]
            self.k = int(live_k)
            self.topp = self.min_k = None
            self.live_xtok = live_xtok  # a live teacher with another tokenizer (train/live_xtok.py)
            if live_xtok is not None:
                self.cross, self.xtok_map = True, live_xtok.vmap
                self.xtok_matched, self.xtok_teacher_vocab = live_xtok.matched, live_xtok.teacher_vocab
            self._build_index(resolved, verify_checksums)
            self._init_state()
            return
        # The cache index (store/index.py) instead of every shard's footer and columns; routing reads each row's
        # tags, which the index does not hold, so it stays on the footers.
        indexed = use_index and not self.route_names
        resolved = resolve_sources(sources, indexed=indexed)
        if not indexed:
            resolved = [(p, d, None) for p, d in resolved]
        agreed = check_sources(resolved, tokenizer_fingerprint, vocab_size)
        # A cross-tokenizer cache (store/align.py): rows in the teacher's tokens with spans, laid out in the
        # student's (batch.student_layout); `xtok_map` maps teacher ids to student ids (GOLD; None: ULD).
        self.cross, self.xtok_map = agreed.cross, xtok_map
        if self.cross:
            self.actual = True  # the span merge reads the later teacher tokens' actual logprobs
            self.xtok_teacher_vocab = max(r[1].vocab_size for r in resolved)
            if xtok_map is not None:
                self.xtok_matched = matched_ids(xtok_map, vocab_size)
        self.k, self.topp, self.min_k = agreed.k, agreed.topp, agreed.min_k
        self._build_index(resolved, verify_checksums)
        self._init_state()

    def _init_state(self) -> None:
        self._files: OrderedDict[int, tuple[pq.ParquetFile, Decoder]] = OrderedDict()
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._plans: OrderedDict[int, tuple[int, np.ndarray, np.ndarray]] = OrderedDict()
        self._bounds = [0]  # packed: start positions of steps 0, 1, ... counted from position 0 (for micro_batch(m))

    # -- index: cheap columns only ----------------------------------------------------------------------------
    def _build_index(self, resolved: list[tuple[Path, Descriptor | None, IndexedShard | None]], verify_checksums: bool
                     ) -> None:
        """Keys, lengths and row groups of every shard: from the cache index where `resolved` carries it (no file is
        opened here; with `verify_checksums` a shard's sha256 is checked against the index's where this rank first
        reads it, `_file`, so start-up does not grow with the cache and each rank checks only what it trains on),
        else from each shard's footer and cheap columns (verified on every rank, here)."""
        self.shards: list[_Shard] = []
        keys, nums, firsts, starts = [], [], [], [0]
        route_rows: list[np.ndarray] = []  # routing: per row, the teacher index it is kept for (-1 drop, -2 no route)
        self._route_ids: list[np.ndarray] = []  # routing: sample ids and tags of every row, for the checks
        self._route_tags: list[str | None] = []
        h = hashlib.blake2b(digest_size=16)
        self._verified: set[int] = set()  # shards whose checksum this process has checked (index mode)
        for path, desc, ix in resolved:
            if ix is not None:
                key, num, first, rg, nrows = ix.keys, ix.num_scored, ix.first_scored, ix.row_groups, len(ix.keys)
                if desc is not None and desc.cross_tokenizer:  # the student's lengths lay the samples out
                    num, first = student_lengths(path)
                self.shards.append(_Shard(path, desc, starts[-1] + np.concatenate([[0], np.cumsum(rg)]),
                                          desc is not None and self.vocab_size is not None
                                          and desc.vocab_size > self.vocab_size, ix.nbytes,
                                          ix.sha256 if verify_checksums else None))
                keys.append(key)
                nums.append(np.asarray(num, dtype=np.int64))
                firsts.append(np.asarray(first, dtype=np.int64))
                starts.append(starts[-1] + nrows)
                h.update(f"{path}|{nrows}|".encode())  # resolve_sources resolved the cache root once
                continue
            problems = verify_shard(path, "rollout" if self.live else "scored", checksum=verify_checksums)
            if problems:
                raise ShardError("; ".join(problems))
            try:
                pf = pq.ParquetFile(path)
                if self.live:  # a rollout: key = sample_id, first scored by the score stage's rule
                    table = pf.read(columns=["sample_id", "prompt_ids", "completion_ids"])
                    key = table.column("sample_id")
                    first = scored_from(pc.list_value_length(table.column("prompt_ids")).to_numpy(zero_copy_only=False))
                    num = pc.list_value_length(table.column("completion_ids")).to_numpy(zero_copy_only=False)
                    if "teacher_prompt_ids" in pf.schema_arrow.names and pf.read(
                            columns=["teacher_prompt_ids"]).column(0).null_count != pf.metadata.num_rows:
                        raise ShardError(
                            f"{path}: rollouts with a privileged teacher_prompt_ids (OPSD) cannot be scored by a live "
                            "teacher (it sees the student's prompt); score them with `gkd score` into a cache")
                else:
                    table = pf.read(columns=["key", "num_scored", "first_scored"])
                    key, num = table.column("key"), table.column("num_scored").to_numpy()
                    first = table.column("first_scored").to_numpy()
                    if desc is not None and desc.cross_tokenizer:
                        num, first = student_lengths(path)
                    if self.route_names:
                        route_rows.append(self._route(pf, path))
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{path}: cannot read its key and length columns ({e})") from e
            rg = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
            fold = desc is not None and self.vocab_size is not None and desc.vocab_size > self.vocab_size
            self.shards.append(_Shard(path, desc, starts[-1] + np.concatenate([[0], np.cumsum(rg)]), fold))
            keys.append(np.asarray(key.to_pylist(), dtype="S32"))
            nums.append(np.asarray(num, dtype=np.int64))
            firsts.append(np.asarray(first, dtype=np.int64))
            starts.append(starts[-1] + table.num_rows)
            h.update(f"{path.resolve()}|{table.num_rows}|".encode())
        if self.route_names:  # other routes keep other rows: another order
            h.update(f"routes|{self.route_key}|{sorted((n, str(v)) for n, v in self._routes.items())}".encode())
        self.fingerprint = h.hexdigest()  # changes when the set of shards changes: the order would too
        all_keys = np.concatenate(keys) if keys else np.zeros(0, "S32")
        num = np.concatenate(nums).astype(np.int64) if nums else np.zeros(0, np.int64)
        # L = P + num_scored (schemas/scored.json); checked against input_ids when a block is decoded
        self.lengths = num + (np.concatenate(firsts).astype(np.int64) if firsts else 0)
        _, first = np.unique(all_keys, return_index=True)  # a key seen twice (two caches) is used once
        keep = np.zeros(len(all_keys), bool)
        keep[first] = True
        keep &= num > 0
        self.route_of = None
        if self.route_names:
            keep &= self._check_routes(np.concatenate(route_rows), keep)
        self.valid = keep
        self.num_samples = int(keep.sum())
        self.duplicates = len(all_keys) - len(first)
        self._shard_starts = np.asarray(starts, np.int64)
        self._block_starts = np.unique(np.concatenate([s.rg_starts for s in self.shards]))
        if self.num_samples == 0:
            raise ShardError(f"no scored rows in {', '.join(str(s.path) for s in self.shards)}")
        self._mean_length = float(np.minimum(self.lengths[keep], self.S).mean())

    def _route(self, pf: pq.ParquetFile, path: Path) -> np.ndarray:
        """Per row of a scored shard: the index of the teacher (route) it is kept for; -1: its sample routes to
        another cache; -2: its tag has no route (and there is no default)."""
        if "tags" not in pf.schema_arrow.names:
            raise ShardError(f"{path}: scored before schema 1.1, its rows carry no tags to route on; rescore it with "
                             "gkd score, or train on it with cache=[...] instead of teachers")
        cache = cache_root(path).resolve()
        table = pf.read(columns=["sample_id", "tags"])
        self._route_ids.append(np.asarray(table.column("sample_id").to_pylist(), "U"))
        out = np.empty(table.num_rows, np.int64)
        for i, tags in enumerate(table.column("tags").to_pylist()):
            tag = dict(tags or []).get(self.route_key)
            name = tag if tag in self._routes and tag != "default" else "default" if "default" in self._routes else None
            self._route_tags.append(tag)
            if name is None:
                out[i] = -2
            else:
                out[i] = self.route_names.index(name) if self._routes[name] == cache else -1
        return out

    def _check_routes(self, route: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Which rows to keep under routing; refuses (or skips and counts) samples whose tag has no route, and
        samples whose route's cache has no row for them."""
        ids, tags = np.concatenate(self._route_ids), self._route_tags
        unrouted = route == -2
        if unrouted.any():
            found = sorted({str(tags[i]) for i in np.flatnonzero(unrouted)})
            if self.on_unrouted == "error":
                raise InputError(
                    f"{int(unrouted.sum())} cached row(s) have {self.route_key}={', '.join(found)}, which no teacher "
                    f"route covers (teachers: {', '.join(self.route_names)}); add a route or `default`, or "
                    "on_unrouted=skip to skip and count them")
            self.unrouted = len(set(ids[unrouted]))
        kept = route >= 0
        missing = set(ids[(route != -2)]) - set(ids[kept & keep])
        if missing:
            first = sorted(missing)[:5]
            where = {str(ids[i]): (tags[i], self.route_names[route[i]] if route[i] >= 0 else None) for i in range(len(ids))}
            raise ShardError(
                f"{len(missing)} sample(s) route to a teacher cache that has no row for them, e.g. "
                + ", ".join(f"{s} ({self.route_key}={where[s][0]})" for s in first)
                + "; score them into that cache (gkd score --tags TAG --cache CACHE)")
        self.route_of = route
        return kept

    def order(self, epoch: int) -> np.ndarray:
        """Global row ids of one epoch, in training order: a pure function of (seed, epoch) and the shards."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            starts = self._block_starts
            parts, window, size = [], [], 0
            for b in rng.permutation(len(starts) - 1):
                rows = np.arange(starts[b], starts[b + 1])
                window.append(rows[self.valid[rows]])
                size += len(window[-1])
                if size >= self.window_rows:
                    parts.append(rng.permutation(np.concatenate(window)))
                    window, size = [], 0
            if window:
                parts.append(rng.permutation(np.concatenate(window)))
            self._orders[epoch] = np.concatenate(parts)
            while len(self._orders) > 2:  # a micro-batch crossing an epoch boundary needs both
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def sample_rows(self, start: int, count: int) -> np.ndarray:
        """Global row ids of global samples [start, start + count) (crossing epochs as needed)."""
        e0, e1 = start // self.num_samples, (start + count - 1) // self.num_samples if count else 0
        if e0 == e1:
            i = start - e0 * self.num_samples
            return self.order(e0)[i : i + count]
        g = np.arange(start, start + count)
        epochs, idx = np.divmod(g, self.num_samples)
        out = np.empty(count, np.int64)
        for e in range(e0, e1 + 1):
            out[epochs == e] = self.order(e)[idx[epochs == e]]
        return out

    # -- the packing plan: lengths only ------------------------------------------------------------------------
    def plan(self, start: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Packed step starting at global sample `start`: (end position, row in [0, G) of each sample in
        [start, end), its first column). A pure function of (seed, shards, start, G, seq_length); micro-batch q of
        the step is its rows [qB, (q+1)B)."""
        if start in self._plans:
            return self._plans[start]
        budget = self.G * self.S
        count = int(2 * budget / self._mean_length) + self.G
        while True:
            lengths = np.minimum(self.lengths[self.sample_rows(start, count)], self.S)
            over = np.flatnonzero(np.cumsum(lengths) > budget)
            if over.size:  # that sample cannot be in the packed run: enough lengths
                lengths = lengths[: over[0] + 1]
                break
            count *= 2
        row_of = pack(lengths, self.G, self.S)
        out = (start + len(row_of), row_of, row_offsets(row_of, lengths[: len(row_of)]))
        self._plans[start] = out
        while len(self._plans) > 4:
            self._plans.popitem(last=False)
        return out

    def _step_start(self, step: int) -> int:
        """Packed: start position of step `step` counted from position 0."""
        while len(self._bounds) <= step + 1:
            self._bounds.append(self.plan(self._bounds[-1])[0])
        return self._bounds[step]

    def _packed_micro_batch(self, start: int, q: int) -> MicroBatch:
        """Micro-batch q (rows [qB, (q+1)B)) of the packed step starting at `start`."""
        end, row_of, offsets = self.plan(start)
        sel = np.flatnonzero(row_of // self.B == q)
        rows = self.sample_rows(start, len(row_of))[sel]
        mb = assemble(self._fetch(rows), row_of[sel] % self.B, offsets[sel], self.lengths[rows], rows=self.B,
                      seq_length=self.S, k=self.k, pad_id=self.pad_id, packed=True, round_end=end)
        return self._with_xtok(mb)

    # -- reading ----------------------------------------------------------------------------------------------
    def _file(self, s: int) -> tuple[pq.ParquetFile, Decoder]:
        if s not in self._files:
            path = self.shards[s].path
            expected = self.shards[s].nbytes
            try:
                fix = (f"restore it, or delete it and its .ok marker, run `gkd cache index {cache_root(path)}` and "
                       "rescore")
                if expected is not None and path.stat().st_size != expected:
                    raise ShardError(f"{path}: size {path.stat().st_size} bytes, the cache index says {expected} "
                                     f"(truncated or replaced behind the index); {fix}")
                if self.shards[s].sha256 is not None and s not in self._verified:
                    if file_sha256(path) != self.shards[s].sha256:  # the file's bytes, once per process
                        raise ShardError(f"{path}: sha256 differs from the cache index (corrupted on disk, or "
                                         f"replaced behind the index); {fix}")
                    self._verified.add(s)
                pf = pq.ParquetFile(path, page_checksum_verification=True)
                self._files[s] = (pf, open_decoder(pf.schema_arrow.metadata or {}, where=str(path)))
            except (pa.ArrowException, OSError, CodecError) as e:
                raise ShardError(f"{path}: cannot open ({e})") from e
            while len(self._files) > 16:
                self._files.popitem(last=False)
        self._files.move_to_end(s)
        return self._files[s]

    def _rollout_block(self, s: int, rg: int) -> Block:
        """A rollout row group as a block: tokens = prompt + completion, and zero teacher arrays for the live
        teacher to fill (their shapes are what the layout needs)."""
        path = self.shards[s].path
        try:
            t = pq.ParquetFile(path).read_row_group(rg, columns=["sample_id", "source", "prompt_ids", "completion_ids"],
                                                   use_threads=False)
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: row group {rg} unreadable ({e})") from e
        prompts, completions = t.column("prompt_ids").to_pylist(), t.column("completion_ids").to_pylist()
        if self.live_xtok is not None:  # in the layout of a cross-tokenizer cache row, with the teacher's tokens
            return rollout_block(self.live_xtok, t.column("sample_id").to_pylist(), pc.equal(
                t.column("source"), "dataset").to_numpy(zero_copy_only=False), prompts, completions, self.k)
        seqs = [np.asarray(p + c, dtype=np.int64) for p, c in zip(prompts, completions, strict=True)]
        num = np.asarray([len(c) for c in completions], np.int64)
        positions = int(num.sum())
        return Block(
            token_offsets=np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64),
            tokens=np.concatenate(seqs) if seqs else np.zeros(0, np.int64),
            first_scored=scored_from(np.asarray([len(p) for p in prompts], np.int64)),
            is_dataset=pc.equal(t.column("source"), "dataset").to_numpy(zero_copy_only=False),
            keys=t.column("sample_id").to_pylist(), row_offsets=np.concatenate([[0], np.cumsum(num)]),
            topk_ids=np.zeros((positions, self.k), np.int32), topk_logprobs=np.zeros((positions, self.k), np.float32),
            tail=np.zeros(positions, np.float32), valid=None, folded=None,
        )

    def _block(self, b: int) -> Block:
        """One row group, decoded whole (decoding row by row costs ~5x more); an LRU of a window's blocks bounds
        memory to about `window_rows` decoded rows."""
        if b not in self._blocks and self.live:
            s = int(np.searchsorted(self._shard_starts, self._block_starts[b], side="right") - 1)
            self._blocks[b] = self._rollout_block(s, int(np.searchsorted(self.shards[s].rg_starts, self._block_starts[b])))
        if b not in self._blocks:
            s = int(np.searchsorted(self._shard_starts, self._block_starts[b], side="right") - 1)
            rg = int(np.searchsorted(self.shards[s].rg_starts, self._block_starts[b]))
            pf, decoder = self._file(s)
            path = self.shards[s].path
            try:
                columns = _COLUMNS + (["actual_rank", "actual_logprobs"] if self.actual else [])
                table = pf.read_row_group(rg, columns=columns, use_threads=False).combine_chunks()
                batch = table.to_batches(max_chunksize=table.num_rows)[0] if table.num_rows else None
                num_scored = table.column("num_scored").to_numpy()
                topk = decoder.decode(batch, num_scored, actual=self.actual)
                ids = table.column("input_ids").chunk(0)
                offsets = ids.offsets.to_numpy().astype(np.int64)
                first = table.column("first_scored").to_numpy().astype(np.int64)
                is_dataset = pc.equal(table.column("source"), "dataset").to_numpy(zero_copy_only=False)
                images = None
                if "images" in pf.schema_arrow.names:
                    images = pf.read_row_group(rg, columns=["images"], use_threads=False).column(0).to_pylist()
                    images = images if any(images) else None
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{path}: row group {rg} unreadable ({e})") from e
            except CodecError as e:
                raise ShardError(f"{path}: {e}") from e
            if not np.array_equal(np.diff(offsets), first + num_scored):
                raise ShardError(f"{path}: row group {rg}: len(input_ids) != first_scored + num_scored")
            if self.cross:
                self._blocks[b] = self._student_block(pf, rg, path, table, is_dataset, topk)
                self._trim_blocks()
                self._blocks.move_to_end(b)
                return self._blocks[b]
            tids, tlp, tail, valid, folded = topk.topk_ids, topk.topk_logprobs, topk.tail_logprobs, None, None
            if self.shards[s].fold:
                tids, tlp, tail, valid, folded = fold_past_vocab(tids, tlp, tail, self.vocab_size)
            kept = topk.valid()  # a top-p cache: the padding after each position's kept entries is not a bin
            if kept is not None:
                valid = kept if valid is None else valid & kept
                folded = np.zeros(len(tail), bool) if folded is None else folded
            self._blocks[b] = Block(
                token_offsets=offsets - offsets[0], tokens=ids.values.to_numpy().astype(np.int64)[offsets[0]:],
                first_scored=first, is_dataset=is_dataset, keys=table.column("key").to_pylist(),
                row_offsets=topk.offsets, topk_ids=tids, topk_logprobs=tlp, tail=tail, valid=valid, folded=folded,
                actual=topk.actual_logprobs if self.actual else None,
                route=None if self.route_of is None else
                self.route_of[self._block_starts[b]: self._block_starts[b] + table.num_rows],
                images=images, root=str(cache_root(path)),
            )
            self._trim_blocks()
        self._blocks.move_to_end(b)
        return self._blocks[b]

    def _trim_blocks(self) -> None:
        max_blocks = 2 * max(1, -(-self.window_rows // max(1, int(np.diff(self._block_starts).min())))) + 2
        while len(self._blocks) > max_blocks:
            self._blocks.popitem(last=False)

    def _student_block(self, pf: pq.ParquetFile, rg: int, path: Path, table: pa.Table, is_dataset: np.ndarray,
                       topk) -> Block:
        """A cross-tokenizer row group in the student's tokens (batch.student_layout)."""
        try:
            t = pf.read_row_group(rg, columns=["student_ids", "student_first", "span_student", "span_teacher"],
                                  use_threads=False)
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: row group {rg}: cannot read its cross-tokenizer columns ({e})") from e
        valid = topk.valid()
        return student_layout(
            table.column("key").to_pylist(), is_dataset, topk.offsets, topk.topk_ids, topk.topk_logprobs,
            topk.tail_logprobs, valid, topk.actual_logprobs,
            [np.asarray(x, np.int64) for x in t.column("student_ids").to_pylist()],
            t.column("student_first").to_numpy().astype(np.int64),
            t.column("span_student").to_pylist(), t.column("span_teacher").to_pylist(), self.xtok_map,
            root=str(cache_root(path)))

    def _fetch(self, rows: np.ndarray) -> list[tuple[Block, int]]:
        """(decoded block, row within it) for the given global rows, in their given order."""
        blocks = np.searchsorted(self._block_starts, rows, side="right") - 1
        return [(self._block(b), r - self._block_starts[b]) for b, r in zip(blocks.tolist(), rows.tolist(), strict=True)]

    # -- micro-batches ----------------------------------------------------------------------------------------
    def micro_batch(self, m: int) -> MicroBatch:
        """Global micro-batch number m (counted from position 0), whichever rank it belongs to."""
        if not self.packing:
            round_end = (m - m % self.dp_size + self.dp_size) * self.B
            return self._assemble(m * self.B, np.arange(self.B), np.zeros(self.B, np.int64), round_end)
        step, q = divmod(m, self.G // self.B)
        return self._packed_micro_batch(self._step_start(step), q)

    def _assemble(self, start: int, row_of: np.ndarray, offsets: np.ndarray, round_end: int) -> MicroBatch:
        """Samples [start, start + len(row_of)) laid out at (row_of, offsets) into one micro-batch."""
        rows = self.sample_rows(start, len(row_of))
        fetched = self._fetch(rows)
        mb = assemble(fetched, row_of, offsets, self.lengths[rows], rows=self.B, seq_length=self.S,
                      k=self.k, pad_id=self.pad_id, packed=self.packing, round_end=round_end)
        mb = self._with_xtok(mb)
        if any(block.images is not None for block, _ in fetched):
            if self.packing:
                raise ShardError(f"{fetched[0][0].root}: rows with images cannot be packed (a vision-language "
                                 "student computes its own positions per row); train with packing=false")
            mb.images = [[(block.root, h) for h in (block.images[r] if block.images is not None else None) or ()]
                         for block, r in fetched]
        return mb

    def _with_xtok(self, mb: MicroBatch) -> MicroBatch:
        """A cross-tokenizer micro-batch carries the vocabulary map's student side and the teacher's vocabulary."""
        if self.cross:
            mb.xtok_matched, mb.xtok_teacher_vocab = self.xtok_matched, self.xtok_teacher_vocab
        if mb.xtok_live is not None:
            mb.xtok_live.vmap = self.xtok_map
        return mb

    def iter_from(self, start: int = 0, *, prefetch: int = 2) -> Iterator[MicroBatch]:
        """This rank's micro-batches from global sample position `start` (a step boundary), forever. Padded: rounds
        of dp micro-batches, the rank's one of each. Packed: per step, its micro-batches q = rank, rank + dp, ...
        With prefetch > 0 a background thread reads, decodes and packs ahead into a bounded queue (order
        unchanged), off the training step's critical path."""

        def padded() -> Iterator[MicroBatch]:  # from a multiple of B * dp these are micro_batch(m), m = rank mod dp
            pos, rows, zeros = start, np.arange(self.B), np.zeros(self.B, np.int64)
            while True:
                pos += self.B * self.dp_size
                yield self._assemble(pos - (self.dp_size - self.dp_rank) * self.B, rows, zeros, pos)

        def packed() -> Iterator[MicroBatch]:
            pos = start
            while True:  # every rank plans the whole step and assembles its own micro-batches of it
                for q in range(self.dp_rank, self.G // self.B, self.dp_size):
                    yield self._packed_micro_batch(pos, q)
                pos = self.plan(pos)[0]

        it = packed() if self.packing else padded()
        return it if prefetch <= 0 else prefetched(it, prefetch)
