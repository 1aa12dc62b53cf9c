"""Reading the loader's blocks: Parquet row groups decoded whole (decoding the few rows of one micro-batch at a
time measured ~5x slower: per-call overhead), kept in an LRU of about two windows of rows, so a reader holds its
window, never the cache.

A shard is opened where it is first read: its size checked against the cache index's and, with
`verify_checksums`, its sha256 too, once per process (so start-up does not grow with the cache, and each rank checks
only what it trains on). A scored block is decoded by the cache's codec, with the teacher ids past the student's
vocabulary folded into the tail (batch.fold_past_vocab) and a top-p cache's padding marked invalid; a
cross-tokenizer block is laid out in the student's tokens (batch.student_layout); a rollout block (a live teacher)
holds the tokens and zero teacher arrays the trainer fills.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.store import hidden as hidden_store
from pipeline.store.cache import BEHAVIOR_COLUMN, cache_root
from pipeline.store.codec import CodecError, Decoder, open_decoder
from pipeline.store.rollouts import scored_from
from pipeline.store.shards import ShardError, file_sha256
from pipeline.train.data.batch import Block, fold_past_vocab, student_layout
from pipeline.train.data.shard_table import ShardTable
from pipeline.train.data.xtok_rows import LiveXtok, rollout_block

# what a micro-batch needs (not sample_id, the actual token's rank and logprob); policy_version: the step's staleness
COLUMNS = ["key", "source", "policy_version", "input_ids", "first_scored", "num_scored", "topk_ids", "topk_logprobs",
           "tail_logprobs"]


class BlockReader:
    """Block b holds global rows [block_starts[b], block_starts[b+1]); shard s holds rows
    [shard_starts[s], shard_starts[s+1])."""

    def __init__(self, shards: ShardTable, shard_starts: np.ndarray, block_starts: np.ndarray, *, k: int,
                 window_rows: int, actual: bool = False, cross: bool = False, vocab_size: int | None = None,
                 xtok_map: np.ndarray | None = None, route_of: np.ndarray | None = None, live: bool = False,
                 live_xtok: LiveXtok | None = None, hidden: dict | None = None) -> None:
        self.shards, self.shard_starts, self.block_starts = shards, shard_starts, block_starts
        self.k, self.actual, self.cross, self.vocab_size, self.xtok_map = k, actual, cross, vocab_size, xtok_map
        self.route_of, self.live, self.live_xtok = route_of, live, live_xtok
        self.hidden = hidden  # a hidden-state cache's `hidden` (store/hidden.py): dtype and size of its states
        self.rg_starts = shards.row_group_starts()
        self.files: OrderedDict[int, tuple[pq.ParquetFile, Decoder]] = OrderedDict()
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self.verified: set[int] = set()  # shards whose checksum this process has checked
        self.max_blocks = 2 * max(1, -(-window_rows // max(1, int(np.diff(block_starts).min())))) + 2

    def fetch(self, rows: np.ndarray) -> list[tuple[Block, int]]:
        """(decoded block, row within it) for the given global rows, in their given order."""
        blocks = np.searchsorted(self.block_starts, rows, side="right") - 1
        return [(self.block(b), r - self.block_starts[b]) for b, r in zip(blocks.tolist(), rows.tolist(), strict=True)]

    def block(self, b: int) -> Block:
        if b not in self.blocks:
            start = self.block_starts[b]
            s = int(np.searchsorted(self.shard_starts, start, side="right") - 1)
            rg = self.shards.row_group(s, self.rg_starts, start)
            self.blocks[b] = self._rollout(s, rg) if self.live else self._scored(b, s, rg)
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)
        self.blocks.move_to_end(b)
        return self.blocks[b]

    def file(self, s: int) -> tuple[pq.ParquetFile, Decoder]:
        """Shard s opened (size and, once per process, checksum checked against the index), in an LRU of 16."""
        if s not in self.files:
            path = self.shards.path(s)
            expected, sha = self.shards.expected_bytes(s), self.shards.expected_sha256(s)
            try:
                fix = (f"restore it, or delete it and its .ok marker, run `gkd cache index {cache_root(path)}` and "
                       "rescore")
                if expected is not None and path.stat().st_size != expected:
                    raise ShardError(f"{path}: size {path.stat().st_size} bytes, the cache index says {expected} "
                                     f"(truncated or replaced behind the index); {fix}")
                if sha is not None and s not in self.verified:
                    if file_sha256(path) != sha:  # the file's bytes, once per process
                        raise ShardError(f"{path}: sha256 differs from the cache index (corrupted on disk, or "
                                         f"replaced behind the index); {fix}")
                    self.verified.add(s)
                pf = pq.ParquetFile(path, page_checksum_verification=True)
                self.files[s] = (pf, open_decoder(pf.schema_arrow.metadata or {}, where=str(path)))
            except (pa.ArrowException, OSError, CodecError) as e:
                raise ShardError(f"{path}: cannot open ({e})") from e
            while len(self.files) > 16:
                self.files.popitem(last=False)
        self.files.move_to_end(s)
        return self.files[s]

    def _scored(self, b: int, s: int, rg: int) -> Block:
        """A scored row group, decoded whole."""
        pf, decoder = self.file(s)
        path = self.shards.path(s)
        try:
            columns = COLUMNS + (["actual_rank", "actual_logprobs"] if self.actual else [])
            table = pf.read_row_group(rg, columns=columns, use_threads=False).combine_chunks()
            batch = table.to_batches(max_chunksize=table.num_rows)[0] if table.num_rows else None
            num_scored = table.column("num_scored").to_numpy()
            topk = decoder.decode(batch, num_scored, actual=self.actual)
            ids = table.column("input_ids").chunk(0)
            offsets = ids.offsets.to_numpy().astype(np.int64)
            first = table.column("first_scored").to_numpy().astype(np.int64)
            is_dataset = pc.equal(table.column("source"), "dataset").to_numpy(zero_copy_only=False)
            states = None
            if self.hidden is not None:  # [positions, H_t], the rows' states concatenated like their teacher rows
                column = pf.read_row_group(rg, columns=[hidden_store.COLUMN], use_threads=False).column(0).to_pylist()
                size, dtype = int(self.hidden["size"]), self.hidden["dtype"]
                states = np.concatenate([hidden_store.decode(b, int(n), size, dtype)
                                         for b, n in zip(column, num_scored.tolist(), strict=True)])
            behavior = None
            if self.actual and not self.cross and BEHAVIOR_COLUMN in pf.schema_arrow.names:  # loss=opd's weights
                column = pf.read_row_group(rg, columns=[BEHAVIOR_COLUMN], use_threads=False).column(0).to_pylist()
                behavior = behavior_rows(column, num_scored)
            images = None
            if "images" in pf.schema_arrow.names:
                images = pf.read_row_group(rg, columns=["images"], use_threads=False).column(0).to_pylist()
                images = images if any(images) else None
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: row group {rg} unreadable ({e})") from e
        except (CodecError, ValueError) as e:
            raise ShardError(f"{path}: {e}") from e
        if not np.array_equal(np.diff(offsets), first + num_scored):
            raise ShardError(f"{path}: row group {rg}: len(input_ids) != first_scored + num_scored")
        versions = _versions(table)
        if self.cross:
            blk = self._student(pf, rg, path, table, is_dataset, topk)
            blk.versions = versions
            return blk
        tids, tlp, tail, valid, folded = topk.topk_ids, topk.topk_logprobs, topk.tail_logprobs, None, None
        if self.shards.fold(s):
            tids, tlp, tail, valid, folded = fold_past_vocab(tids, tlp, tail, self.vocab_size)
        kept = topk.valid()  # a top-p cache: the padding after each position's kept entries is not a bin
        if kept is not None:
            valid = kept if valid is None else valid & kept
            folded = np.zeros(len(tail), bool) if folded is None else folded
        start = self.block_starts[b]
        return Block(
            token_offsets=offsets - offsets[0], tokens=ids.values.to_numpy().astype(np.int64)[offsets[0]:],
            first_scored=first, is_dataset=is_dataset, keys=table.column("key").to_pylist(),
            row_offsets=topk.offsets, topk_ids=tids, topk_logprobs=tlp, tail=tail, valid=valid, folded=folded,
            actual=topk.actual_logprobs if self.actual else None,
            route=None if self.route_of is None else self.route_of[start: start + table.num_rows],
            images=images, root=str(cache_root(path)), hidden=states, versions=versions, behavior=behavior,
        )

    def _student(self, pf: pq.ParquetFile, rg: int, path: Path, table: pa.Table, is_dataset: np.ndarray,
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

    def _rollout(self, s: int, rg: int) -> Block:
        """A rollout row group as a block: tokens = prompt + completion, and zero teacher arrays for the live
        teacher to fill (their shapes are what the layout needs)."""
        path = self.shards.path(s)
        try:
            t = pq.ParquetFile(path).read_row_group(
                rg, columns=["sample_id", "source", "policy_version", "prompt_ids", "completion_ids"], use_threads=False)
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: row group {rg} unreadable ({e})") from e
        prompts, completions = t.column("prompt_ids").to_pylist(), t.column("completion_ids").to_pylist()
        is_dataset = pc.equal(t.column("source"), "dataset").to_numpy(zero_copy_only=False)
        if self.live_xtok is not None:  # in the layout of a cross-tokenizer cache row, with the teacher's tokens
            return rollout_block(self.live_xtok, t.column("sample_id").to_pylist(), is_dataset, prompts, completions,
                                 self.k)
        seqs = [np.asarray(p + c, dtype=np.int64) for p, c in zip(prompts, completions, strict=True)]
        num = np.asarray([len(c) for c in completions], np.int64)
        positions = int(num.sum())
        return Block(
            token_offsets=np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64),
            tokens=np.concatenate(seqs) if seqs else np.zeros(0, np.int64),
            first_scored=scored_from(np.asarray([len(p) for p in prompts], np.int64)),
            is_dataset=is_dataset, keys=t.column("sample_id").to_pylist(), row_offsets=np.concatenate([[0], np.cumsum(num)]),
            topk_ids=np.zeros((positions, self.k), np.int32), topk_logprobs=np.zeros((positions, self.k), np.float32),
            tail=np.zeros(positions, np.float32), valid=None, folded=None, versions=_versions(t),
        )


def behavior_rows(logprobs: list, num_scored: np.ndarray) -> np.ndarray | None:
    """The rows' completion_logprobs laid out like their teacher rows: float32 [positions], position q of row j (its
    token first_scored + q) holding the sampler's logprob of that token, NaN where the row has none (a dataset row,
    a prompt token under score_prompt). None when no row carries them. A row's logprobs are its last tokens'."""
    if all(x is None for x in logprobs):
        return None
    out = np.full(int(num_scored.sum()), np.nan, np.float32)
    ends = np.cumsum(num_scored)
    for lp, n, end in zip(logprobs, num_scored.tolist(), ends.tolist(), strict=True):
        if lp is None:
            continue
        m = min(len(lp), n)  # the last m scored positions are completion tokens
        out[end - m : end] = np.asarray(lp[len(lp) - m :], np.float32)
    return out


def _versions(table: pa.Table) -> np.ndarray:
    """The rows' policy_version, -1 where none (dataset rows, imports)."""
    return pc.fill_null(table.column("policy_version"), -1).to_numpy().astype(np.int64)
