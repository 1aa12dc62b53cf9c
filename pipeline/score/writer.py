"""The score stage's writer threads: the engine scores batch i+1 while batch i is extracted, and a full part is
encoded and committed while the batches of the next part are extracted.

Two of these, chained (score/scorer.py `_score_rows`, score/parts.py `Parts`): a bounded queue (`depth` batches)
between the engine's thread and the batch writer (`Parts.add`: extraction and the finiteness check), and a queue of
one part between that and the part writer (`Parts.write`: codec encoding, the Parquet write, fsync and the commit
under the cache's lock), which runs mostly outside the GIL (numpy, the numba codec kernels, pyarrow, the fsync). The
queues bound the memory held by outputs and parts waiting.

Each writer handles its items in the order they were put, so parts hold the same rows in the same order as in the
engine's thread (depth 0: no threads, both run in the caller): the shards are byte-identical. An error in the
writer (a NaN from the engine, a full disk) is raised in the engine's thread at its next `put` or at the end; a
failing engine lets the writer finish the batches already queued (complete parts only, as the serial path would
have written them) before the error goes on. A kill -9 loses what a serial run loses: the rows of the parts not
yet committed; every commit is atomic (store/cache.py `add_rows`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_STOP = object()


class BatchWriter:
    """Runs `handle(item)` for every `put(item)`, in order, in a thread of its own (depth >= 1) or inline (0)."""

    def __init__(self, handle: Callable[[Any], None], depth: int) -> None:
        self.handle = handle
        self.depth = depth
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None

    def put(self, item: Any) -> None:
        """Hand one batch on (blocks while `depth` batches wait); raises the writer's error, if it had one."""
        self._raise()
        if self._thread is None:
            self.handle(item)
        else:
            self._queue.put(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            if self.error is None:  # after an error, drain without work so that put never blocks forever
                try:
                    self.handle(item)
                except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which raises it
                    self.error = e

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    @contextlib.contextmanager
    def running(self) -> Iterator[BatchWriter]:
        """The writer thread for the duration of the block; on leaving, every queued batch has been handled (also
        when the block raised: those complete parts are kept), then the writer's own error, if any, is raised."""
        if self.depth >= 1:
            self._thread = threading.Thread(target=self._run, name="gkd-score-writer", daemon=True)
            self._thread.start()
        try:
            yield self
        finally:
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None
        self._raise()
