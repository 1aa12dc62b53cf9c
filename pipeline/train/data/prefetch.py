"""The loader's prefetch thread: micro-batches read, decoded and packed ahead of the training step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def prefetched(it: Iterator[T], depth: int) -> Iterator[T]:
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
        # Stop and join the worker: a daemon thread still inside numpy/torch/numba code when the interpreter
        # shuts down can abort the process ("terminate called without an active exception", seen at exit).
        stop.set()
        while thread.is_alive():
            try:
                q.get_nowait()  # unblock a worker waiting on a full queue
            except queue.Empty:
                pass
            thread.join(timeout=0.05)
