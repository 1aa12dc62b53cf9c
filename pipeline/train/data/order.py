"""The loader's order and packing plan: pure functions of the seed, the shards' row groups and lengths, and a
position, so every rank computes the same ones and a resume is one integer (train/data/loader.py's docstring).

`EpochOrder`: global sample g (counting across epochs) is row order(g // N)[g % N] of the N kept rows. An epoch's
permutation shuffles the row groups ("blocks"), groups them into windows of >= `window_rows` rows and shuffles rows
within each window, so a reader holds about two windows of decoded rows, never the cache (the shuffle of mosaicml
streaming's py1b, simplified).

`StepPlan` (packed layout): the optimizer step starting at a position holds the longest run of samples from there
that `packing.pack` fits into `rows` rows of `seq_length` tokens (lengths only).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from pipeline.train.data.packing import pack, row_offsets


class EpochOrder:
    """Rows [block_starts[b], block_starts[b+1]) form block b; `valid` marks the rows that are samples."""

    def __init__(self, block_starts: np.ndarray, valid: np.ndarray, seed: int, window_rows: int) -> None:
        self.block_starts, self.valid, self.seed, self.window_rows = block_starts, valid, seed, window_rows
        self.num_samples = int(valid.sum())
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    def order(self, epoch: int) -> np.ndarray:
        """Global row ids of one epoch, in training order: a pure function of (seed, epoch) and the shards."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            starts = self.block_starts
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


class StepPlan:
    """Packed steps of `rows` rows of `seq_length` tokens over `order`'s samples, whose full lengths are
    `lengths` (by global row)."""

    def __init__(self, order: EpochOrder, lengths: np.ndarray, rows: int, seq_length: int) -> None:
        self.order, self.lengths, self.G, self.S = order, lengths, rows, seq_length
        self._mean_length = float(np.minimum(lengths[order.valid], seq_length).mean())
        self._plans: OrderedDict[int, tuple[int, np.ndarray, np.ndarray]] = OrderedDict()
        self._bounds = [0]  # start positions of steps 0, 1, ... counted from position 0 (for micro_batch(m))

    def plan(self, start: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The step starting at global sample `start`: (end position, row in [0, G) of each sample in
        [start, end), its first column). A pure function of (seed, shards, start, G, seq_length)."""
        if start in self._plans:
            return self._plans[start]
        budget = self.G * self.S
        count = int(2 * budget / self._mean_length) + self.G
        while True:
            lengths = np.minimum(self.lengths[self.order.sample_rows(start, count)], self.S)
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

    def step_start(self, step: int) -> int:
        """Start position of step `step` counted from position 0."""
        while len(self._bounds) <= step + 1:
            self._bounds.append(self.plan(self._bounds[-1])[0])
        return self._bounds[step]
