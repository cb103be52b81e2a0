"""A minimal io_uring instance driven by raw syscalls through ``ctypes`` (no liburing).

The PyPI ``liburing`` wheel can die with SIGILL on CPUs without the instructions it was built for, so
this module talks to the kernel directly: ``io_uring_setup``/``io_uring_enter`` through libc's
``syscall()``, the rings through ``mmap``. Only what the engine needs is here: non-vectored
READ/WRITE, FSYNC and NOP, submit, reap and a blocking wait.

Memory ordering: the kernel reads the SQ tail with acquire semantics and publishes the CQ tail with
release semantics; user space must pair them (store-release of the SQ tail after writing the SQE,
load-acquire of the CQ tail before reading CQEs, then the CQ head store). Python cannot emit
barriers, so this relies on x86-64's total store order, where plain loads and stores already have
those semantics, and on each ``ctypes`` field access being a separate C-level load/store in program
order. Weaker architectures (aarch64, riscv, ...) would need real barriers (``__sync_synchronize``
is a compiler builtin, not a symbol ``ctypes`` can call), so :class:`SysRing` refuses to start with
``OSError(ENOTSUP)`` on anything but x86_64. The syscall numbers for aarch64 (same generic table
values) are kept so that lifting this restriction needs only barriers.

The SQ index array is filled once with the identity mapping (as liburing does), so publishing SQEs
is just a tail store.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import struct

__all__ = ["SysRing"]

_SYSCALLS = {"x86_64": (425, 426, 427), "aarch64": (425, 426, 427)}  # setup, enter, register
_SUPPORTED = ("x86_64",)  # see module docstring: no barriers from Python

_IORING_OFF_SQ_RING = 0
_IORING_OFF_CQ_RING = 0x8000000
_IORING_OFF_SQES = 0x10000000
_IORING_FEAT_SINGLE_MMAP = 1 << 0
_IORING_ENTER_GETEVENTS = 1 << 0
_IORING_SQ_CQ_OVERFLOW = 1 << 1

_OP_NOP, _OP_FSYNC, _OP_READ, _OP_WRITE = 0, 3, 22, 23
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1

# opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data, 24 zero bytes (buf_index, pad, ...)
_SQE = struct.Struct("<BBHiQQIIQ24x")
_CQE = struct.Struct("<Qi4x")  # user_data, res (flags ignored)
assert _SQE.size == 64 and _CQE.size == 16

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc["syscall"]  # private function object: argtypes here do not leak to other users
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long] * 7


class _SQOffsets(ctypes.Structure):
    _fields_ = [
        ("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
        ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64),
    ]  # fmt: skip


class _CQOffsets(ctypes.Structure):
    _fields_ = [
        ("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32), ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64),
    ]  # fmt: skip


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SQOffsets), ("cq_off", _CQOffsets),
    ]  # fmt: skip


assert ctypes.sizeof(_Params) == 120


def _check(ret: int, what: str) -> int:
    """Turn a ``syscall()`` return value into an int or an ``OSError`` from ``errno``."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


class SysRing:
    """A minimal io_uring instance driven by raw syscalls.

    Single-threaded: only the thread that owns it calls it.

    Attributes:
        ring_fd: The ring file descriptor; it polls readable (POLLIN) while completions are pending.
    """

    ring_fd: int

    def __init__(self, entries: int) -> None:
        """Create the ring and map its SQ ring, CQ ring and SQE array.

        Args:
            entries: Requested SQ depth (the kernel rounds up to a power of two; CQ gets twice that).

        Raises:
            OSError: ``ENOTSUP`` on an unsupported architecture, or the setup/mmap error (``ENOSYS``,
                ``EPERM`` when ``kernel.io_uring_disabled`` forbids it, ...).
        """
        self.ring_fd = -1
        self._maps: list[mmap.mmap] = []
        self._closed = False
        arch = platform.machine()
        if arch not in _SUPPORTED:
            raise OSError(errno.ENOTSUP, f"SysRing: unsupported architecture {arch!r} (no barriers)")
        self._nr_setup, self._nr_enter, _ = _SYSCALLS[arch]
        p = _Params()
        ret = _syscall(self._nr_setup, entries, ctypes.addressof(p), 0, 0, 0, 0)
        self.ring_fd = _check(ret, "io_uring_setup")
        try:
            self._map(p)
        except BaseException:
            self.close()
            raise

    def _mmap(self, length: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(
            self.ring_fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset,
        )  # fmt: skip
        self._maps.append(m)
        return m

    def _map(self, p: _Params) -> None:
        so, co = p.sq_off, p.cq_off
        sq_size = so.array + p.sq_entries * 4
        cq_size = co.cqes + p.cq_entries * _CQE.size
        if p.features & _IORING_FEAT_SINGLE_MMAP:
            sq = cq = self._mmap(max(sq_size, cq_size), _IORING_OFF_SQ_RING)
        else:
            sq = self._mmap(sq_size, _IORING_OFF_SQ_RING)
            cq = self._mmap(cq_size, _IORING_OFF_CQ_RING)
        self._sqes = self._mmap(p.sq_entries * _SQE.size, _IORING_OFF_SQES)
        self._cq = cq
        self._sq_entries: int = p.sq_entries
        self._sq_mask = ctypes.c_uint32.from_buffer(sq, so.ring_mask).value
        self._cq_mask = ctypes.c_uint32.from_buffer(cq, co.ring_mask).value
        self._sq_khead = ctypes.c_uint32.from_buffer(sq, so.head)
        self._sq_ktail = ctypes.c_uint32.from_buffer(sq, so.tail)
        self._sq_kflags = ctypes.c_uint32.from_buffer(sq, so.flags)
        self._cq_khead = ctypes.c_uint32.from_buffer(cq, co.head)
        self._cq_ktail = ctypes.c_uint32.from_buffer(cq, co.tail)
        self._cqes_off = co.cqes
        array = (ctypes.c_uint32 * p.sq_entries).from_buffer(sq, so.array)
        for i in range(p.sq_entries):
            array[i] = i  # identity: SQE slot i is published through array slot i
        del array
        self._sqe_tail = self._sq_ktail.value  # local tail: prepared but maybe not yet published

    def _enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        ret: int = _syscall(self._nr_enter, self.ring_fd, to_submit, min_complete, flags, 0, 0)
        return _check(ret, "io_uring_enter")

    def sq_space_left(self) -> int:
        """Number of SQEs that can still be prepared before the SQ is full."""
        return self._sq_entries - ((self._sqe_tail - self._sq_khead.value) & _U32)

    def _prep(self, opcode: int, fd: int, off: int, addr: int, nbytes: int, user_data: int) -> None:
        tail = self._sqe_tail
        if ((tail - self._sq_khead.value) & _U32) >= self._sq_entries:
            raise RuntimeError("io_uring submission queue is full")
        # One pack_into writes all 64 bytes, so stale fields from an earlier use are zeroed.
        _SQE.pack_into(
            self._sqes,
            (tail & self._sq_mask) * 64,
            opcode,
            0,
            0,
            fd,
            off & _U64,
            addr,
            nbytes,
            0,
            user_data & _U64,
        )
        self._sqe_tail = (tail + 1) & _U32

    def prep_rw(self, write: bool, fd: int, addr: int, nbytes: int, offset: int, user_data: int) -> None:
        """Prepare a non-vectored ``IORING_OP_WRITE``/``IORING_OP_READ`` of ``nbytes`` at ``addr``.

        Args:
            write: Write (True) or read (False).
            fd: File descriptor.
            addr: Buffer address; the memory must stay valid until the CQE is reaped.
            nbytes: Length in bytes (< 2**32).
            offset: File offset (-1: the file position, for stream files).
            user_data: 64-bit tag returned in the CQE.

        Raises:
            RuntimeError: If the SQ is full.
        """
        self._prep(_OP_WRITE if write else _OP_READ, fd, offset, addr, nbytes, user_data)

    def prep_fsync(self, fd: int, user_data: int) -> None:
        """Prepare an ``IORING_OP_FSYNC`` (full fsync, ``fsync_flags`` 0) of ``fd``.

        Raises:
            RuntimeError: If the SQ is full.
        """
        self._prep(_OP_FSYNC, fd, 0, 0, 0, user_data)

    def prep_nop(self, user_data: int) -> None:
        """Prepare an ``IORING_OP_NOP``.

        Raises:
            RuntimeError: If the SQ is full.
        """
        self._prep(_OP_NOP, -1, 0, 0, 0, user_data)

    def submit(self) -> int:
        """Publish the prepared SQEs and hand them to the kernel.

        Returns:
            The number of SQEs the kernel consumed; 0 on ``EAGAIN``/``EBUSY`` (they stay queued).

        Raises:
            OSError: For any other ``io_uring_enter`` error.
        """
        self._sq_ktail.value = self._sqe_tail  # SQE bytes were stored first (x86 TSO: release)
        to_submit = (self._sqe_tail - self._sq_khead.value) & _U32
        if not to_submit:
            return 0
        while True:
            try:
                return self._enter(to_submit, 0, 0)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EBUSY):
                    return 0
                raise

    def cq_ready(self) -> int:
        """Number of CQEs ready to be reaped."""
        return (self._cq_ktail.value - self._cq_khead.value) & _U32

    def reap(self) -> list[tuple[int, int]]:
        """Consume every ready CQE.

        Returns:
            ``(user_data, res)`` pairs in completion order; ``res`` is negative errno on failure.
        """
        out: list[tuple[int, int]] = []
        cq, mask, base, unpack = self._cq, self._cq_mask, self._cqes_off, _CQE.unpack_from
        while True:
            head = self._cq_khead.value
            tail = self._cq_ktail.value  # load-acquire on x86 TSO; CQE loads come after
            while head != tail:
                out.append(unpack(cq, base + (head & mask) * 16))
                head = (head + 1) & _U32
            self._cq_khead.value = head  # frees the slots for the kernel
            if not self._sq_kflags.value & _IORING_SQ_CQ_OVERFLOW:
                return out
            # The CQ overflowed; the kernel kept the CQEs (FEAT_NODROP): flush them into the ring.
            with contextlib.suppress(InterruptedError):
                self._enter(0, 0, _IORING_ENTER_GETEVENTS)

    def wait(self, min_complete: int = 1) -> None:
        """Block (without the GIL) until at least ``min_complete`` CQEs are ready.

        Raises:
            OSError: For an ``io_uring_enter`` error other than ``EINTR``.
        """
        while True:
            try:
                self._enter(0, min_complete, _IORING_ENTER_GETEVENTS)
                return
            except InterruptedError:
                continue

    def close(self) -> None:
        """Unmap the rings and close the fd. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # ctypes views hold buffer exports; drop them before closing the maps.
        for name in ("_sq_khead", "_sq_ktail", "_sq_kflags", "_cq_khead", "_cq_ktail", "_cq", "_sqes"):
            self.__dict__.pop(name, None)
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self.ring_fd >= 0:
            os.close(self.ring_fd)
            self.ring_fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
