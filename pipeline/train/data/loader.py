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
- **packed** (`packing: true`, or auto where the student keeps samples apart; never rows with images, refused by
  name): a micro-batch is `micro_batch_size` rows of `seq_length` tokens, a token
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
gradient — do not depend on how it is split over accumulation steps and ranks (tests/train/parallel/test_dp.py). Either way
the resume state is one integer, the global sample position after the step (= (epoch, index) via divmod), equal on
every rank.

Teacher vocab larger than the student's (same tokenizer, extra embedding rows, e.g. Qwen2.5-7B -> 0.5B): top-k
entries with ids >= the student's vocab cannot be represented. They are marked `teacher_valid = False` (id 0,
logprob -inf) and their mass is added to `teacher_tail` (log-add-exp in float64), so the tail mode's k+1-th bin
holds it and the renorm mode drops it; positions with such entries are counted (`folded_positions`).

Where the parts live: the sources and their descriptor checks in sources.py, the shards as arrays in shard_table.py,
routing in routing.py, the epoch order and the packing plan in order.py (its first-fit in packing.py), reading and
decoding blocks in blocks.py, micro-batch layout in batch.py, the prefetch thread in prefetch.py; this file joins
them: the index of keys and lengths, and the micro-batches. The loader's throughput is measured by
benchmarks/train_bench.py (`loader_throughput`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import ConfigError
from pipeline.store.hidden import load_output_layer
from pipeline.store.rollouts import scored_from
from pipeline.store.shards import ShardError, verify_shard
from pipeline.train.data.batch import Images, MicroBatch, assemble, matched_ids
from pipeline.train.data.blocks import BlockReader
from pipeline.train.data.order import EpochOrder, StepPlan
from pipeline.train.data.prefetch import prefetched
from pipeline.train.data.routing import Router
from pipeline.train.data.shard_table import ShardTable
from pipeline.train.data.sources import Source, check_sources, resolve_rollouts, resolve_sources, student_lengths
from pipeline.train.data.xtok_rows import LiveXtok


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


@dataclasses.dataclass(frozen=True)
class LiveRows:
    """The loader's live mode: its sources are rollout shards and a live teacher computes each micro-batch's rows
    (`gkd train teacher_live=DIR`): `k` entries per position; `xtok` for a teacher with another tokenizer."""

    k: int
    xtok: LiveXtok | None = None


@dataclasses.dataclass(frozen=True)
class Routing:
    """The loader's routed mode (`teachers: {TAG: CACHE}`, data/routing.py): each sample's row comes from the cache its
    `tags[key]` names (`default` for the rest); `on_unrouted`: error | skip for a sample no route covers."""

    caches: dict[str, str | Path]
    key: str = "data_source"
    on_unrouted: str = "error"


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
        actual: bool = False,
        use_index: bool = True,
        xtok_map: np.ndarray | None = None,
        live: LiveRows | None = None,
        routing: Routing | None = None,
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
        # live: the sources are rollout shards (`gkd train teacher_live=...`); the teacher arrays of each
        # micro-batch are placeholders of width live.k that the trainer fills from its live teacher.
        self.live = live is not None
        # Routing (routing.py): `routing.caches` {TAG: cache dir, "default": cache dir} replaces `sources`.
        self.router = Router(routing.caches, routing.key, routing.on_unrouted) if routing and routing.caches else None
        self.route_names = self.router.names if self.router else []
        if self.router:
            sources = self.router.caches()
        # A cross-tokenizer cache (store/align.py) sets these below; rollouts for a live teacher are never one.
        self.cross, self.xtok_map, self.xtok_matched, self.xtok_teacher_vocab = False, None, None, 0
        self.hidden, self.teacher_weight = None, None  # a hidden-state cache (store/hidden.py) sets these below
        live_xtok = live.xtok if live is not None else None
        self.live_xtok = live_xtok  # a live teacher with another tokenizer (data/xtok_rows.py, teacher/live_xtok.py)
        if live is not None:
            resolved = resolve_rollouts(sources, tokenizer_fingerprint)
            self.k = int(live.k)
            self.topp = self.min_k = None
            if live_xtok is not None:
                self.cross, self.xtok_map = True, live_xtok.vmap
                self.xtok_matched, self.xtok_teacher_vocab = live_xtok.matched, live_xtok.teacher_vocab
        else:
            # The cache index (store/index.py) instead of every shard's footer and columns; routing reads each
            # row's tags, which the index does not hold, so it stays on the footers.
            resolved = resolve_sources(sources, indexed=use_index and not self.router)
            agreed = check_sources(resolved, tokenizer_fingerprint, vocab_size)
            # A cross-tokenizer cache (store/align.py): rows in the teacher's tokens with spans, laid out in the
            # student's (batch.student_layout); `xtok_map` maps teacher ids to student ids (GOLD; None: ULD).
            self.cross, self.xtok_map = agreed.cross, xtok_map
            if self.cross:
                self.actual = True  # the span merge reads the later teacher tokens' actual logprobs
                self.xtok_teacher_vocab = max(r.descriptor.vocab_size for r in resolved)
                if xtok_map is not None:
                    self.xtok_matched = matched_ids(xtok_map, vocab_size)
            self.k, self.topp, self.min_k = agreed.k, agreed.topp, agreed.min_k
            if agreed.hidden is not None:  # the teacher's output layer, read once for the run
                self.hidden = agreed.hidden
                self.teacher_weight = load_output_layer(agreed.hidden_root,
                                                        next(r.descriptor for r in resolved if r.root == agreed.hidden_root))
        self._build_index(resolved, verify_checksums)
        self.epochs = EpochOrder(self._block_starts, self.valid, seed, window_rows)
        self.steps = StepPlan(self.epochs, self.lengths, self.G, self.S)
        self.reader = BlockReader(self.shards, self._shard_starts, self._block_starts, k=self.k,
                                  window_rows=window_rows, actual=self.actual, cross=self.cross,
                                  vocab_size=vocab_size, xtok_map=self.xtok_map, route_of=self.route_of,
                                  live=self.live, live_xtok=self.live_xtok, hidden=self.hidden)

    @property
    def unrouted(self) -> int:
        """Samples skipped under on_unrouted=skip (the trainer's metrics)."""
        return self.router.unrouted if self.router else 0

    # -- index: cheap columns only ----------------------------------------------------------------------------
    def _build_index(self, resolved: list[Source], verify_checksums: bool) -> None:
        """Keys, lengths and row groups of every shard: from the cache index where a source is read through it
        (no file is opened here; with `verify_checksums` a shard's sha256 is checked against the index's where this
        rank first reads it, blocks.py, so start-up does not grow with the cache and each rank checks only what it
        trains on), else from each shard's footer and cheap columns (verified on every rank, here)."""
        self.shards = ShardTable()
        keys, nums, firsts, rows_of = [], [], [], []  # rows_of: each source's rows per shard
        route_rows: list[np.ndarray] = []  # routing: per row, the teacher index it is kept for (routing.py)
        h = hashlib.blake2b(digest_size=16)
        for src in resolved:
            desc = src.descriptor
            fold = desc is not None and self.vocab_size is not None and desc.vocab_size > self.vocab_size
            if src.index is not None:
                ix, shard_dir = src.index, src.shard_dir
                self.shards.add(shard_dir, ix.names, desc, fold, ix.rg_rows, np.diff(ix.rg_starts), ix.nbytes,
                                ix.sha256 if verify_checksums else None)
                num, first = ix.num_scored, ix.first_scored
                if desc.cross_tokenizer:  # the student's lengths lay the samples out
                    parts = [student_lengths(shard_dir / f"{n}.parquet") for n in ix.names]
                    num = np.concatenate([p[0] for p in parts]) if parts else num
                    first = np.concatenate([p[1] for p in parts]) if parts else first
                keys.append(ix.keys)
                nums.append(np.asarray(num, dtype=np.int64))
                firsts.append(np.asarray(first, dtype=np.int64))
                rows_of.append(np.diff(ix.row_starts))
                for n, rows in zip(ix.names, rows_of[-1].tolist(), strict=True):
                    h.update(f"{shard_dir}/{n}.parquet|{rows}|".encode())  # the root resolved once, not per shard
                continue
            path = src.shard
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
                    if self.router:
                        route_rows.append(self.router.rows(pf, path))
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{path}: cannot read its key and length columns ({e})") from e
            rg = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
            resolved_path = path.resolve()
            self.shards.add(resolved_path.parent, [resolved_path.name[: -len(".parquet")]], desc, fold,
                            np.asarray(rg, np.int64), np.asarray([len(rg)]))
            keys.append(np.asarray(key.to_pylist(), dtype="S32"))
            nums.append(np.asarray(num, dtype=np.int64))
            firsts.append(np.asarray(first, dtype=np.int64))
            rows_of.append(np.asarray([table.num_rows], np.int64))
            h.update(f"{resolved_path}|{table.num_rows}|".encode())
        self.shards.freeze()
        if self.router:  # other routes keep other rows: another order
            h.update(self.router.fingerprint().encode())
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
        if self.router:
            self.route_of = np.concatenate(route_rows)
            keep &= self.router.check(self.route_of, keep)
        self.valid = keep
        self.num_samples = int(keep.sum())
        self.duplicates = len(all_keys) - len(first)
        self._shard_starts = np.concatenate([[0], np.cumsum(np.concatenate(rows_of))]).astype(np.int64)
        self._block_starts = np.unique(np.concatenate([self.shards.row_group_starts(), self._shard_starts]))
        if self.num_samples == 0:
            raise ShardError(f"no scored rows in {', '.join(self.shards.paths())}")

    # -- order and plan (order.py) ----------------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        return self.epochs.order(epoch)

    def sample_rows(self, start: int, count: int) -> np.ndarray:
        return self.epochs.sample_rows(start, count)

    def plan(self, start: int) -> tuple[int, np.ndarray, np.ndarray]:
        return self.steps.plan(start)

    # -- micro-batches ----------------------------------------------------------------------------------------
    def _packed_micro_batch(self, start: int, q: int) -> MicroBatch:
        """Micro-batch q (rows [qB, (q+1)B)) of the packed step starting at `start`."""
        end, row_of, offsets = self.plan(start)
        sel = np.flatnonzero(row_of // self.B == q)
        rows = self.sample_rows(start, len(row_of))[sel]
        fetched = self.reader.fetch(rows)
        _refuse_packed_images(fetched)
        mb = assemble(fetched, row_of[sel] % self.B, offsets[sel], self.lengths[rows], rows=self.B,
                      seq_length=self.S, k=self.k, pad_id=self.pad_id, packed=True, round_end=end)
        return self._with_xtok(mb)

    def micro_batch(self, m: int) -> MicroBatch:
        """Global micro-batch number m (counted from position 0), whichever rank it belongs to."""
        if not self.packing:
            round_end = (m - m % self.dp_size + self.dp_size) * self.B
            return self._assemble(m * self.B, np.arange(self.B), np.zeros(self.B, np.int64), round_end)
        step, q = divmod(m, self.G // self.B)
        return self._packed_micro_batch(self.steps.step_start(step), q)

    def _assemble(self, start: int, row_of: np.ndarray, offsets: np.ndarray, round_end: int) -> MicroBatch:
        """Samples [start, start + len(row_of)) laid out at (row_of, offsets) into one micro-batch."""
        rows = self.sample_rows(start, len(row_of))
        fetched = self.reader.fetch(rows)
        mb = assemble(fetched, row_of, offsets, self.lengths[rows], rows=self.B, seq_length=self.S,
                      k=self.k, pad_id=self.pad_id, packed=self.packing, round_end=round_end)
        mb = self._with_xtok(mb)
        if self.packing:
            _refuse_packed_images(fetched)
        else:
            rows = [[(block.root, h) for h in (block.images[r] if block.images is not None else None) or ()]
                    for block, r in fetched]
            mb.images = Images(rows) if any(rows) else None  # the part only where some row has an image
        return mb

    def _with_xtok(self, mb: MicroBatch) -> MicroBatch:
        """A cross-tokenizer micro-batch's spans carry the vocabulary map's student side and the teacher's
        vocabulary."""
        if self.cross and mb.spans is not None:
            mb.spans = dataclasses.replace(mb.spans, matched=self.xtok_matched, teacher_vocab=self.xtok_teacher_vocab)
        if mb.xtok_live is not None:
            mb.xtok_live.vmap = self.xtok_map
        if mb.exact is not None:
            mb.exact.weight = self.teacher_weight
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


def _refuse_packed_images(fetched) -> None:
    """Packed micro-batches carry no images: rows with images are refused by name, never laid out without them (the
    trainer pads image caches before it gets here, setup.plan_packing)."""
    for block, r in fetched:
        if block.images is not None and block.images[r]:
            raise ShardError(f"{block.root}: rows with images cannot be packed (a vision-language student computes "
                             "its own positions per row); train with packing=false (or packing=auto)")
