"""io_uring engine: one ring, one I/O thread, futures for callers.

One dedicated thread owns the ring (created in that thread: docs/io.md) and is the only one that
touches it. Other threads enqueue operations and wake it through an eventfd. The thread waits with
``select.poll`` on the ring fd and the eventfd, which releases the GIL (liburing's own waits keep it), so a training
thread next to it keeps its speed.

Two ring backends implement the same small interface (``prep_rw``, ``prep_fsync``, ``prep_nop``,
``submit``, ``cq_ready``, ``reap``, ``ring_fd``, ``sq_space_left``, ``close``):

* ``liburing``: the PyPI ``liburing`` binding (bundles C liburing), used where its wheel runs; a child
  process checks that first, because on CPUs without AVX-512 the wheel dies with SIGILL;
* ``syscall``: io_uring_setup/io_uring_enter through ctypes with the rings mmap'd, for everywhere else.

``TIERCKPT_URING_BACKEND`` (``auto`` | ``liburing`` | ``syscall``) picks one; ``auto`` prefers liburing.
Short reads/writes are resubmitted for the remainder; negative results become ``OSError(errno, …, path)``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
from concurrent.futures import Future
from typing import Any

from tierckpt.io.base import IOEngine, op_error

__all__ = ["UringEngine", "ring_backend"]

ENV_BACKEND = "TIERCKPT_URING_BACKEND"
_MAX_OP = 1 << 30  # the most one read or write moves (Linux: 0x7ffff000 bytes a call): a limit, not a size
_WRITE, _READ, _FSYNC = 0, 1, 2
_OPNAMES = ("write", "read", "fsync")


def ring_backend(choice: str | None = None) -> str:
    """The backend the engine will use: ``liburing`` or ``syscall``.

    Raises:
        OSError: the backend asked for (argument or ``TIERCKPT_URING_BACKEND``) cannot run here.
    """
    import errno

    choice = choice or os.environ.get(ENV_BACKEND, "auto")
    if choice not in ("auto", "liburing", "syscall"):
        raise ValueError(f"{ENV_BACKEND}: expected auto, liburing or syscall, got {choice!r}")
    if choice == "syscall":
        return choice
    from tierckpt.io._liburing import liburing_runs

    why = liburing_runs()
    if why is None:
        return "liburing"
    if choice == "liburing":
        raise OSError(errno.ENOTSUP, f"liburing backend unavailable: {why}")
    return "syscall"


def _open_ring(backend: str, entries: int) -> Any:
    if backend == "liburing":
        from tierckpt.io._liburing import LiburingRing

        return LiburingRing(entries)
    from tierckpt.io._sysring import SysRing

    return SysRing(entries)


class _Op:
    __slots__ = ("addr", "done", "fd", "future", "kind", "nbytes", "offset", "path", "prep_error")

    def __init__(self, kind: int, fd: int, addr: int, nbytes: int, offset: int, path: str | None) -> None:
        self.kind, self.fd, self.addr, self.nbytes, self.offset, self.path = (
            kind,
            fd,
            addr,
            nbytes,
            offset,
            path,
        )
        self.done = 0
        self.future: Future[int] = Future()
        self.prep_error: Exception | None = None

    def error(self, err: int) -> OSError:
        return op_error(err, _OPNAMES[self.kind], self.fd, self.offset + self.done, self.nbytes - self.done, self.path)


class UringEngine(IOEngine):
    """io_uring engine with one ring and one I/O thread; ``queue_depth`` operations in flight.

    Args:
        queue_depth: operations in flight.
        backend: ``auto``, ``liburing`` or ``syscall`` (default: ``$TIERCKPT_URING_BACKEND`` or auto).

    Raises:
        OSError: io_uring cannot be set up here (disabled by sysctl, seccomp, old kernel).
    """

    name = "uring"

    def __init__(self, queue_depth: int = 8, backend: str | None = None) -> None:
        self.backend = ring_backend(backend)
        self._qd = max(1, queue_depth)
        self._entries = 1 << max(3, (2 * self._qd - 1).bit_length())
        self._pending: collections.deque[_Op] = collections.deque()
        self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._closing = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tierckpt-uring", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            os.close(self._efd)
            raise self._init_error

    # -- submission side (any thread) --------------------------------------------------------------
    def _enqueue(self, op: _Op) -> Future[int]:
        with self._lock:
            if self._closing:
                raise RuntimeError("I/O engine is closed")
            self._pending.append(op)
        os.eventfd_write(self._efd, 1)
        return op.future

    def pwrite(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        return self._enqueue(_Op(_WRITE, fd, addr, nbytes, offset, path))

    def pread(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        return self._enqueue(_Op(_READ, fd, addr, nbytes, offset, path))

    def fsync(self, fd: int, *, path: str | None = None) -> Future[int]:
        return self._enqueue(_Op(_FSYNC, fd, 0, 0, 0, path))

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        os.eventfd_write(self._efd, 1)
        self._thread.join()
        os.close(self._efd)

    # -- the I/O thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            ring = _open_ring(self.backend, self._entries)
        except BaseException as e:
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        poller = select.poll()
        poller.register(ring.ring_fd, select.POLLIN)
        poller.register(self._efd, select.POLLIN)
        inflight: dict[int, _Op] = {}
        tag = 0
        try:
            while True:
                prepped = 0
                while len(inflight) < self._qd and self._pending and ring.sq_space_left() > 0:
                    op = self._pending.popleft()
                    if op.done == 0:
                        if op.kind != _FSYNC and op.nbytes == 0:
                            op.future.set_result(0)
                            continue
                        if not op.future.set_running_or_notify_cancel():
                            continue
                    tag = (tag + 1) & 0xFFFFFFFFFFFF
                    try:
                        if op.kind == _FSYNC:
                            ring.prep_fsync(op.fd, tag)
                        else:
                            n = min(op.nbytes - op.done, _MAX_OP)
                            ring.prep_rw(op.kind == _WRITE, op.fd, op.addr + op.done, n, op.offset + op.done, tag)
                    except Exception as e:  # the backend left a NOP in the SQE's place
                        op.prep_error = e
                    inflight[tag] = op
                    prepped += 1
                if prepped:
                    ring.submit()
                if not inflight and not self._pending and self._closing:
                    break
                if ring.cq_ready() == 0:
                    poller.poll(1000)  # releases the GIL; wakes on a completion or a new request
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._efd)
                self._complete(ring.reap(), inflight)
        finally:
            while inflight:  # only after an unexpected error: never free a buffer the kernel still uses
                if ring.cq_ready() == 0:
                    poller.poll(1000)
                self._complete(ring.reap(), inflight)
            ring.close()
            with self._lock:
                self._closing = True
                left, self._pending = list(self._pending), collections.deque()
            for op in left:
                if not op.future.done():
                    op.future.set_exception(RuntimeError("I/O engine stopped"))

    def _complete(self, results: list[tuple[int, int]], inflight: dict[int, _Op]) -> None:
        for ud, res in results:
            op = inflight.pop(ud)
            if op.prep_error is not None:
                op.future.set_exception(op.prep_error)
            elif res < 0:
                op.future.set_exception(op.error(-res))
            elif op.kind == _FSYNC:
                op.future.set_result(0)
            else:
                op.done += res
                if op.done >= op.nbytes or (res == 0 and op.kind == _READ):
                    op.future.set_result(op.done)  # complete, or end of file on a read
                elif res == 0:
                    op.future.set_exception(op.error(5))
                else:
                    self._pending.appendleft(op)  # short transfer: submit the rest next
