"""One worker thread per tier: every job that ends in a commit on a tier runs on that tier's worker, in
submission order, so saves reach each tier in the order they were made."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tierckpt.io.buffers import StagingPool

__all__ = ["Worker"]

T = TypeVar("T")
_STOP = object()


class Worker:
    """A thread that runs one tier's jobs in FIFO order. Started on first use.

    Args:
        name: thread name suffix (the tier's name).
        staging: factory of this worker's staging pool (created on first use, one per worker so two
            workers never wait on each other's buffers); None for a worker whose jobs move no bytes.
    """

    def __init__(self, name: str, staging: Callable[[], StagingPool] | None = None) -> None:
        self.name = name
        self._make_pool = staging
        self._pool: StagingPool | None = None
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def pool(self) -> StagingPool:
        """This worker's staging buffers (only its own thread uses them)."""
        if self._pool is None:
            if self._make_pool is None:
                raise RuntimeError(f"worker {self.name!r} has no staging buffers")
            self._pool = self._make_pool()
        return self._pool

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn``; the future holds its result or exception."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"worker {self.name!r} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"tierckpt-{self.name}", daemon=True)
                self._thread.start()
            self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the queued jobs; join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._q.put(_STOP)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._pool = None
