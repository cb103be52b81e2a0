"""Host memory copies shared out over a few threads, without a barrier per tensor.

One ``memmove`` runs at what one core's loads and stores reach (4-6 GB/s here); a second core about
doubles it. torch's ``copy_`` splits each tensor over its thread pool, and every split is a barrier: on
a machine whose cores are busy, each tensor waits for a descheduled pool thread (docs/io.md, "Copying
bytes"). :func:`copy_spans` instead cuts a whole list of copies into pieces of :data:`PIECE` bytes that
the calling thread and up to ``threads - 1`` helper threads take in turn from one counter. The caller
takes pieces too, so a helper that is not running leaves it more pieces, not a wait: the one barrier
is at the end, for the pieces a helper is copying at that moment (a few milliseconds at most).
``memmove`` releases the GIL, so the pieces run in parallel; the helpers are daemon threads started on
first use, kept for later calls, and forgotten in a forked child (which starts its own).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Sequence

from tierckpt.io.buffers import memmove

__all__ = ["PIECE", "copy_spans", "copy_threads"]

#: bytes a thread copies at a time: large enough that taking a piece costs nothing beside its copy,
#: small enough that the wait at the end is short
PIECE = 4 << 20
#: below this many bytes in all, one ``memmove`` per span on the caller's thread (waking helpers costs more)
_PARALLEL_MIN = 2 * PIECE


def copy_threads() -> int:
    """Threads a copy uses by default: the CPUs this process may run on, at most 4 (memory bandwidth
    is shared: more threads than that gain nothing on the machines measured)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


class _Job:
    """The pieces of one :func:`copy_spans` call, taken by whichever thread asks next."""

    def __init__(self, pieces: list[tuple[int, int, int]]) -> None:
        self.pieces = pieces
        self._next = itertools.count()  # next() is atomic under the GIL
        self._cv = threading.Condition()
        self._left = len(pieces)  # pieces not yet copied
        self._busy = 0  # threads copying a piece now
        self._stopped = False

    def run(self) -> None:
        """Copy pieces until none is left to take (or the job is stopped)."""
        n = len(self.pieces)
        while True:
            with self._cv:
                if self._stopped or (i := next(self._next)) >= n:
                    return
                self._busy += 1
            dst, src, nbytes = self.pieces[i]
            try:
                memmove(dst, src, nbytes)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._left -= 1
                    self._cv.notify_all()

    def wait(self) -> None:
        """Until every piece is copied."""
        with self._cv:
            while self._left:
                self._cv.wait()

    def stop(self) -> None:
        """No piece is taken any more; returns once none is being copied (the caller may then free the
        memory: an interrupted copy never writes into it later)."""
        with self._cv:
            self._stopped = True
            while self._busy:
                self._cv.wait()


class _Helpers:
    """The helper threads of this process: each runs the jobs it is handed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads = 0

    def forget(self) -> None:
        """In a forked child: the parent's threads (and its lock's state) do not exist here."""
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._threads = 0

    def hand(self, job: _Job, helpers: int) -> None:
        """Let ``helpers`` threads join ``job`` (starting threads up to that many)."""
        with self._lock:
            while self._threads < helpers:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"tierckpt-copy-{self._threads}", daemon=True).start()
        for _ in range(helpers):
            self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get().run()


_helpers = _Helpers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_helpers.forget)


def copy_spans(spans: Sequence[tuple[int, int, int]], threads: int | None = None) -> None:
    """Copy each ``(dst, src, nbytes)`` (addresses of host memory, not overlapping one another's
    destinations), over ``threads`` threads, the caller's among them (default :func:`copy_threads`);
    returns once every byte is copied."""
    threads = copy_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads: expected at least 1, got {threads}")
    total = sum(n for _, _, n in spans)
    if threads == 1 or total < _PARALLEL_MIN:
        for dst, src, nbytes in spans:
            if nbytes:
                memmove(dst, src, nbytes)
        return
    pieces = [(d + o, s + o, min(PIECE, n - o)) for d, s, n in spans for o in range(0, n, PIECE)]
    job = _Job(pieces)
    _helpers.hand(job, min(threads, len(pieces)) - 1)
    try:
        job.run()
        job.wait()
    except BaseException:  # interrupted (KeyboardInterrupt): no helper goes on writing after we return
        job.stop()
        raise
