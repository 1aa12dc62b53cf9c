"""Scored shards -> student micro-batches: a deterministic, resumable, streaming loader.

Alignment (DESIGN.md, "Alignment"): a cached row holds tokens x_0..x_{L-1}, P = first_scored, and teacher row r for
token j = P + r (the distribution of x_j given x_<j). Student logits at position t predict x_{t+1}, so

    labels[t]       = x_{t+1}                      (inputs rolled by -1; the last position has no label: -100)
    loss_mask[t]    = P - 1 <= t <= L - 2          (exactly the positions whose NEXT token is scored)
    teacher_*[t]    = teacher row of token j = t + 1

Sequences longer than `seq_length` are truncated: tokens x_j with j >= seq_length and their teacher rows are dropped
(a sample whose prompt alone fills seq_length then has no active position; it is still consumed, so the order and
the resume position do not depend on seq_length). Right padding with `pad_id`, to the longest sample of the
micro-batch rounded up to a multiple of 8 (not to seq_length: attention cost is quadratic; resume stays exact
because a micro-batch's composition, hence its shape, is a pure function of the position).

Order: global sample g (counting across epochs) is row order(g // N)[g % N] of the N unique rows (duplicate keys
across shards/caches are kept once, rows with no scored position are skipped). The epoch permutation is a pure
function of (seed, epoch): Parquet row groups ("blocks") are shuffled, grouped into windows of >= `window_rows`
rows, and rows are shuffled within each window, so a reader holds about two windows of *decoded* rows in memory,
never the cache (the shuffle of mosaicml streaming's py1b, simplified). Blocks are decoded whole: decoding the few
rows of one micro-batch at a time measured ~5x slower (per-call overhead). Micro-batch m = samples [mB, (m+1)B) goes to
data-parallel rank m % dp, so a step is dp * grad_accum consecutive micro-batches and the resume state is one
integer, the global sample position (= (epoch, index) via divmod), equal on every rank at a step boundary.

    python -m pipeline.train.data CACHE_DIR [STUDENT_DIR]     # loader throughput (tokens/s, one core)
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.store.cache import DESCRIPTOR, Descriptor, TeacherCache
from pipeline.store.codec import CodecError, DecodedBatch, Decoder
from pipeline.store.shards import ShardError, verify_shard

IGNORE_INDEX = -100
_PAD_MULTIPLE = 8


class TokenizerMismatchError(ValueError):
    """The cache was scored with another tokenizer than the student's."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [B, S]
    position_ids: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S]: x_{t+1}, IGNORE_INDEX where there is none
    loss_mask: torch.Tensor  # bool [B, S]: t in [P-1, L-2]
    teacher_ids: torch.Tensor  # int32 [B, S, k]: teacher top-k of token t+1 (zeros where inactive)
    teacher_logprobs: torch.Tensor  # float32 [B, S, k]
    teacher_tail: torch.Tensor  # float32 [B, S]: log teacher mass outside the top-k
    is_dataset: torch.Tensor  # bool [B]: source == "dataset" (SFT applies to these only)
    keys: list[str]
    end: int  # global sample position right after this micro-batch's round (the resume state at a step end)
    tokens: int  # real (non-pad) tokens

    def to(self, device: torch.device | str) -> MicroBatch:
        """The tensors moved to `device` (a no-op on CPU)."""
        moved = {k: v.to(device, non_blocking=True) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return MicroBatch(**{**vars(self), **moved})


@dataclass
class _Decoded:
    """A decoded row group: what micro-batches are cut from."""

    input_ids: list[np.ndarray]  # int64 per row
    first_scored: np.ndarray
    is_dataset: np.ndarray  # bool per row
    keys: list[str]
    topk: DecodedBatch


@dataclass
class _Shard:
    path: Path
    descriptor: Descriptor
    rg_starts: np.ndarray  # first global row of each row group, plus the end


def _resolve_sources(sources: Sequence[str | Path]) -> list[tuple[Path, Descriptor]]:
    """Cache directories (all complete shards) or explicit shard files (descriptor from their cache root)."""
    out: list[tuple[Path, Descriptor]] = []
    for src in sources:
        src = Path(src)
        if not src.exists() and src.suffix != ".parquet":
            raise FileNotFoundError(f"{src}: no such teacher cache (`gkd score` writes it)")
        if src.is_dir():
            cache = TeacherCache.open(src)
            shards = cache.shard_paths()
            if not shards:
                raise ShardError(f"{src}: teacher cache has no complete shards")
            out += [(p, cache.descriptor) for p in shards]
        elif src.suffix == ".parquet":
            if not src.exists():
                raise ShardError(f"{src}: shard file is missing")
            out.append((src, Descriptor.read(src.parent.parent / DESCRIPTOR)))
        else:
            raise FileNotFoundError(f"{src}: neither a teacher cache directory nor a .parquet shard")
    return out


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
    ) -> None:
        self.B, self.S, self.seed, self.pad_id = micro_batch_size, seq_length, seed, pad_id
        self.dp_rank, self.dp_size, self.window_rows = dp_rank, dp_size, window_rows
        resolved = _resolve_sources(sources)
        for where, desc in {p.parent.parent: d for p, d in resolved}.items():
            if tokenizer_fingerprint is not None and desc.tokenizer_fingerprint != tokenizer_fingerprint:
                raise TokenizerMismatchError(
                    f"{where}: cache scored with tokenizer {desc.tokenizer_fingerprint}, the student's is "
                    f"{tokenizer_fingerprint}; teacher ids would index the wrong tokens"
                )
            if vocab_size is not None and desc.vocab_size > vocab_size:
                raise TokenizerMismatchError(f"cache vocab {desc.vocab_size} exceeds the student's {vocab_size}")
        ks = {d.k for _, d in resolved}
        if len(ks) != 1:
            raise ValueError(f"caches with different k ({sorted(ks)}) cannot share a micro-batch")
        self.k = ks.pop()
        self._build_index(resolved, verify_checksums)
        self._files: OrderedDict[int, tuple[pq.ParquetFile, Decoder]] = OrderedDict()
        self._blocks: OrderedDict[int, _Decoded] = OrderedDict()
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    # -- index: cheap columns only ----------------------------------------------------------------------------
    def _build_index(self, resolved: list[tuple[Path, Descriptor]], verify_checksums: bool) -> None:
        self.shards: list[_Shard] = []
        keys, nums, starts = [], [], [0]
        h = hashlib.blake2b(digest_size=16)
        for path, desc in resolved:
            problems = verify_shard(path, "scored", checksum=verify_checksums)
            if problems:
                raise ShardError("; ".join(problems))
            try:
                pf = pq.ParquetFile(path)
                table = pf.read(columns=["key", "num_scored"])
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{path}: cannot read its key/num_scored columns ({e})") from e
            rg = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
            self.shards.append(_Shard(path, desc, starts[-1] + np.concatenate([[0], np.cumsum(rg)])))
            keys.append(np.asarray(table.column("key").to_pylist(), dtype="S32"))
            nums.append(table.column("num_scored").to_numpy())
            starts.append(starts[-1] + table.num_rows)
            h.update(f"{path.resolve()}|{table.num_rows}|".encode())
        self.fingerprint = h.hexdigest()  # changes when the set of shards changes: the order would too
        all_keys = np.concatenate(keys) if keys else np.zeros(0, "S32")
        num = np.concatenate(nums).astype(np.int64) if nums else np.zeros(0, np.int64)
        _, first = np.unique(all_keys, return_index=True)  # a key seen twice (two caches) is used once
        keep = np.zeros(len(all_keys), bool)
        keep[first] = True
        keep &= num > 0
        self.valid = keep
        self.num_samples = int(keep.sum())
        self.duplicates = len(all_keys) - len(first)
        self._shard_starts = np.asarray(starts, np.int64)
        self._block_starts = np.unique(np.concatenate([s.rg_starts for s in self.shards]))
        if self.num_samples == 0:
            raise ShardError(f"no scored rows in {', '.join(str(s.path) for s in self.shards)}")

    def order(self, epoch: int) -> np.ndarray:
        """Global row ids of one epoch, in training order: a pure function of (seed, epoch) and the shards."""
        if epoch != self._order_epoch:
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
            self._order, self._order_epoch = np.concatenate(parts), epoch
        return self._order

    def sample_rows(self, start: int, count: int) -> np.ndarray:
        """Global row ids of global samples [start, start + count) (crossing epochs as needed)."""
        g = np.arange(start, start + count)
        epochs, idx = np.divmod(g, self.num_samples)
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            out[epochs == e] = self.order(int(e))[idx[epochs == e]]
        return out

    # -- reading ----------------------------------------------------------------------------------------------
    def _file(self, s: int) -> tuple[pq.ParquetFile, Decoder]:
        if s not in self._files:
            path = self.shards[s].path
            try:
                pf = pq.ParquetFile(path, page_checksum_verification=True)
                self._files[s] = (pf, Decoder(pf.schema_arrow.metadata or {}, where=str(path)))
            except (pa.ArrowException, OSError, CodecError) as e:
                raise ShardError(f"{path}: cannot open ({e})") from e
            while len(self._files) > 16:
                self._files.popitem(last=False)
        self._files.move_to_end(s)
        return self._files[s]

    def _block(self, b: int) -> _Decoded:
        """One row group, decoded whole (decoding row by row costs ~5x more); an LRU of a window's blocks bounds
        memory to about `window_rows` decoded rows."""
        if b not in self._blocks:
            s = int(np.searchsorted(self._shard_starts, self._block_starts[b], side="right") - 1)
            rg = int(np.searchsorted(self.shards[s].rg_starts, self._block_starts[b]))
            pf, decoder = self._file(s)
            try:
                table = pf.read_row_group(rg).combine_chunks()
                batch = table.to_batches(max_chunksize=table.num_rows)[0] if table.num_rows else None
                topk = decoder.decode(batch, table.column("num_scored").to_numpy())
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{self.shards[s].path}: row group {rg} unreadable ({e})") from e
            except CodecError as e:
                raise ShardError(f"{self.shards[s].path}: {e}") from e
            ids = table.column("input_ids").chunk(0)
            offsets = ids.offsets.to_numpy()
            values = ids.values.to_numpy().astype(np.int64)
            self._blocks[b] = _Decoded(
                input_ids=[values[offsets[i]: offsets[i + 1]] for i in range(table.num_rows)],
                first_scored=table.column("first_scored").to_numpy(),
                is_dataset=np.asarray(table.column("source").to_pylist()) == "dataset",
                keys=table.column("key").to_pylist(),
                topk=topk,
            )
            max_blocks = 2 * max(1, -(-self.window_rows // max(1, int(np.diff(self._block_starts).min())))) + 2
            while len(self._blocks) > max_blocks:
                self._blocks.popitem(last=False)
        self._blocks.move_to_end(b)
        return self._blocks[b]

    def _fetch(self, rows: np.ndarray) -> list[tuple[_Decoded, int]]:
        """(decoded block, row within it) for the given global rows, in their given order."""
        blocks = np.searchsorted(self._block_starts, rows, side="right") - 1
        return [(self._block(int(b)), int(r - self._block_starts[b])) for b, r in zip(blocks, rows, strict=True)]

    def micro_batch(self, m: int) -> MicroBatch:
        """Global micro-batch number m (samples [mB, (m+1)B)), whichever rank it belongs to."""
        B, S, k = self.B, self.S, self.k
        fetched = self._fetch(self.sample_rows(m * B, B))
        lengths = np.array([min(len(blk.input_ids[j]), S) for blk, j in fetched])
        width = min(S, -(-int(lengths.max()) // _PAD_MULTIPLE) * _PAD_MULTIPLE)
        ids = np.full((B, width), self.pad_id, np.int64)
        labels = np.full((B, width), IGNORE_INDEX, np.int64)
        mask = np.zeros((B, width), bool)
        t_ids = np.zeros((B, width, k), np.int32)
        t_lp = np.zeros((B, width, k), np.float32)
        t_tail = np.zeros((B, width), np.float32)
        is_dataset, keys = np.zeros(B, bool), []
        for i, (blk, j) in enumerate(fetched):
            n = int(lengths[i])
            ids[i, :n] = blk.input_ids[j][:n]
            labels[i, : n - 1] = ids[i, 1:n]
            p = int(blk.first_scored[j])
            lo = int(blk.topk.offsets[j])
            # teacher row r is token j = p + r; it pairs with logits at t = j - 1, kept while j < n (truncation)
            # and t >= 0 (a row for token 0 has no student position to predict it).
            r0, r1 = max(0, 1 - p), max(0, n - p)
            if r1 > r0:
                t0, t1 = p + r0 - 1, p + r1 - 1
                mask[i, t0:t1] = True
                t_ids[i, t0:t1] = blk.topk.topk_ids[lo + r0 : lo + r1]
                t_lp[i, t0:t1] = blk.topk.topk_logprobs[lo + r0 : lo + r1]
                t_tail[i, t0:t1] = blk.topk.tail_logprobs[lo + r0 : lo + r1]
            is_dataset[i] = blk.is_dataset[j]
            keys.append(blk.keys[j])
        round_end = (m - m % self.dp_size + self.dp_size) * B
        return MicroBatch(
            input_ids=torch.from_numpy(ids),
            position_ids=torch.arange(width).expand(B, width),
            labels=torch.from_numpy(labels),
            loss_mask=torch.from_numpy(mask),
            teacher_ids=torch.from_numpy(t_ids),
            teacher_logprobs=torch.from_numpy(t_lp),
            teacher_tail=torch.from_numpy(t_tail),
            is_dataset=torch.from_numpy(is_dataset),
            keys=keys,
            end=round_end,
            tokens=int(lengths.sum()),
        )

    def iter_from(self, start: int = 0, *, prefetch: int = 2) -> Iterator[MicroBatch]:
        """This rank's micro-batches from global sample position `start` (a multiple of B * dp), forever.

        With prefetch > 0 a background thread decodes ahead into a bounded queue (order unchanged)."""
        if start % (self.B * self.dp_size):
            raise ValueError(f"start {start} is not a multiple of micro_batch_size * dp = {self.B * self.dp_size}")
        first = start // self.B + self.dp_rank

        def produce() -> Iterator[MicroBatch]:
            m = first
            while True:
                yield self.micro_batch(m)
                m += self.dp_size

        return produce() if prefetch <= 0 else _prefetched(produce(), prefetch)


def _prefetched(it: Iterator[MicroBatch], depth: int) -> Iterator[MicroBatch]:
    """Run `it` in a daemon thread, `depth` items ahead; re-raise its exception in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            q.put(("error", e))

    thread = threading.Thread(target=work, name="scored-loader", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


def benchmark(sources: Sequence[str | Path], *, micro_batch_size: int = 8, seq_length: int = 512,
              epochs: int = 5, seed: int = 0) -> dict:
    """Loader throughput on one core (no prefetch thread): scored shards -> micro-batch tensors, `epochs` epochs
    with the decoded-block LRU emptied before each, so every row is read and decoded every epoch (a small cache
    fits in the LRU, and repeated epochs would otherwise measure batch assembly only). Opening the shards and
    building the sample order are not timed."""
    loader = ScoredLoader(sources, micro_batch_size=micro_batch_size, seq_length=seq_length, seed=seed)
    per_epoch = -(-loader.num_samples // micro_batch_size)
    batches = loader.iter_from(0, prefetch=0)
    tokens = scored = 0
    dt = 0.0
    for _ in range(epochs):
        loader._blocks.clear()
        t0 = time.perf_counter()
        for _ in range(per_epoch):
            mb = next(batches)
            tokens += mb.tokens
            scored += int(mb.loss_mask.sum())
        dt += time.perf_counter() - t0
    return {"k": loader.k, "tokens_per_s": tokens / dt, "scored_tokens_per_s": scored / dt, "seconds": dt,
            "epochs": epochs, "samples": loader.num_samples}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(benchmark(sys.argv[1:]), indent=1))
