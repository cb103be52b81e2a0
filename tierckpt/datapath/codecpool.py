"""The process's compressor threads: one pool, shared by every codec writer and reader of every tier.

Encoding and decoding frames (:mod:`tierckpt.format.codec`) runs here, never in the thread that hands a
writer its bytes (a training thread, a mover worker): zstd and the byte (un)shuffling release the GIL,
so these threads run beside the rest of the process. The pool is made on first use with the largest
``threads`` any tier asked for so far (:func:`ensure`), by default ``min(os.cpu_count(), 8)``; a later,
larger request replaces it with a larger one (the tasks queued on the old one still run). The pool counts
the CPU time its tasks take (:func:`cpu_seconds`), for the CPU its tiers' writes cost beside it
(:mod:`tierckpt.datapath.cpumeter`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

__all__ = ["DEFAULT_MAX_THREADS", "cpu_seconds", "default_threads", "ensure", "get_pool", "size", "submit"]

T = TypeVar("T")

#: the most threads the pool has unless a tier's ``compress: {threads: N}`` asks for more
DEFAULT_MAX_THREADS = 8

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_size = 0
_cpu = 0.0  # CPU seconds the pool's tasks took, all together
_cpu_lock = threading.Lock()


def default_threads() -> int:
    """The pool's size when no tier asks for one: the CPUs this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, DEFAULT_MAX_THREADS))


def ensure(threads: int | None = None) -> int:
    """Make the pool hold at least ``threads`` threads (None: :func:`default_threads`); return its size."""
    global _pool, _size
    want = default_threads() if threads is None else threads
    if want < 1:
        raise ValueError(f"threads: expected at least 1, got {want}")
    with _lock:
        if _pool is None or want > _size:
            old, _pool, _size = _pool, ThreadPoolExecutor(want, thread_name_prefix="tierckpt-codec"), want
            if old is not None:
                old.shutdown(wait=False)  # what it holds queued still runs
        return _size


def size() -> int:
    """The pool's size (0 before its first use)."""
    return _size


def cpu_seconds() -> float:
    """CPU seconds the pool's tasks have taken since the process started, all together."""
    return _cpu


def _timed(fn: Callable[..., T], *args: object) -> T:
    global _cpu
    start = time.thread_time()
    try:
        return fn(*args)
    finally:
        took = time.thread_time() - start
        with _cpu_lock:
            _cpu += took


def submit(fn: Callable[..., T], *args: object) -> Future[T]:
    """Run ``fn(*args)`` on the pool (made with the default size if it is not yet)."""
    if _pool is None:
        ensure()
    with _lock:  # not replaced meanwhile: a replaced pool refuses new tasks
        assert _pool is not None
        return _pool.submit(_timed, fn, *args)


class _Pool(Executor):
    """The pool as an :class:`~concurrent.futures.Executor` that outlives its replacement by a larger one:
    each task goes to the pool of the moment."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if kwargs:
            return submit(partial(fn, *args, **kwargs))
        return submit(fn, *args)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The process's pool is never shut down by one of its users."""


_executor = _Pool()


def get_pool() -> Executor:
    """The pool, as an executor for a caller that submits many tasks (a codec reader): stays valid when a
    later, larger :func:`ensure` replaces the pool (what was queued on the old one still runs)."""
    return _executor
