"""A background thread that prepares the next micro-batches while the device computes the current one.

Reading windows from memory-mapped shards, building document masks and pinning host memory all happen off
the training thread; the training thread only issues the non-blocking host-to-device copy. numpy slicing and
`pin_memory` release the GIL, so one thread is enough to stay far ahead of a GPU (bench/data.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class Prefetcher(Generic[T]):
    """Calls `produce()` in a daemon thread, keeping up to `depth` results ready; `get()` returns them in order.
    An exception in `produce` is raised again by the `get()` that would have returned its result."""

    def __init__(self, produce: Callable[[], T], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(produce,), name="hopperlm-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, produce: Callable[[], T]) -> None:
        while not self._stop.is_set():
            try:
                item = (True, produce())
            except (
                BaseException
            ) as e:  # handed to the consumer, which raises it where it would have used the item
                item = (False, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    def get(self) -> T:
        ok, value = self._queue.get()
        if not ok:
            self.close()
            raise value
        return value

    def close(self) -> None:
        """Stop the thread and drop what it had prepared."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
