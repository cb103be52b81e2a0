"""The portable engine: os.pwrite/os.pread/os.fsync on a thread pool. Always available."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from tierckpt.io.base import IOEngine, op_error
from tierckpt.io.buffers import ptr_mv

__all__ = ["ThreadEngine"]

_MAX_OP = 1 << 30  # Linux transfers at most 0x7ffff000 bytes per call


def _pwrite_all(fd: int, addr: int, nbytes: int, offset: int, path: str | None) -> int:
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _MAX_OP)
        try:
            w = os.pwrite(fd, ptr_mv(addr + done, n, writable=False), offset + done)
        except OSError as e:
            raise op_error(e.errno or 5, "pwrite", fd, offset + done, n, path) from None
        if w == 0:
            raise op_error(5, "pwrite returned 0", fd, offset + done, n, path)
        done += w
    return done


def _pread_all(fd: int, addr: int, nbytes: int, offset: int, path: str | None) -> int:
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _MAX_OP)
        try:
            r = os.preadv(fd, [ptr_mv(addr + done, n)], offset + done)
        except OSError as e:
            raise op_error(e.errno or 5, "pread", fd, offset + done, n, path) from None
        if r == 0:
            break  # end of file
        done += r
    return done


def _fsync(fd: int, path: str | None) -> int:
    try:
        os.fsync(fd)
    except OSError as e:
        raise op_error(e.errno or 5, "fsync", fd, 0, 0, path) from None
    return 0


class ThreadEngine(IOEngine):
    """Runs blocking syscalls on ``queue_depth`` worker threads (the GIL is released in each syscall)."""

    name = "threads"

    def __init__(self, queue_depth: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, queue_depth), thread_name_prefix="tierckpt-io")

    def pwrite(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        return self._pool.submit(_pwrite_all, fd, addr, nbytes, offset, path)

    def pread(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        return self._pool.submit(_pread_all, fd, addr, nbytes, offset, path)

    def fsync(self, fd: int, *, path: str | None = None) -> Future[int]:
        return self._pool.submit(_fsync, fd, path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
