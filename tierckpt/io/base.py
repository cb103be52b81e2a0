"""The I/O engine interface every engine implements (:class:`IOEngine`) and the error it raises.

An engine moves bytes between memory (raw addresses) and file descriptors and returns
``concurrent.futures.Future`` objects, like KvikIO's ``pread``/``pwrite``. Rules every engine keeps:

* ``pwrite``/``pread`` transfer exactly ``nbytes`` (short transfers are resubmitted); a read returns
  fewer bytes only at end of file, and the future's result is the byte count.
* The memory at ``addr`` must stay alive and unchanged until the future is done.
* With O_DIRECT file descriptors, ``addr``, ``nbytes`` and ``offset`` must be multiples of the file
  system's alignment (4 KiB always works); the engines do not check.
* A failure is an ``OSError`` with the errno, the path and the operation in the message.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import Future

__all__ = ["IOEngine", "op_error"]


def op_error(err: int, op: str, fd: int, offset: int, nbytes: int, path: str | None) -> OSError:
    """An OSError (of the errno's subclass) that names the operation, offset, length and path."""
    return OSError(err, f"{os.strerror(err)} [{op} fd={fd} offset={offset} len={nbytes}]", path)


class IOEngine(ABC):
    """Asynchronous positional I/O on file descriptors. Thread-safe: any thread may submit."""

    name: str = "abstract"

    @abstractmethod
    def pwrite(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        """Write ``nbytes`` from ``addr`` at ``offset`` of ``fd``."""

    @abstractmethod
    def pread(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        """Read up to ``nbytes`` at ``offset`` of ``fd`` into ``addr``; fewer only at end of file."""

    @abstractmethod
    def fsync(self, fd: int, *, path: str | None = None) -> Future[int]:
        """Flush ``fd``'s data and metadata to stable storage."""

    @abstractmethod
    def close(self) -> None:
        """Finish the operations in flight and stop the engine's threads."""

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
