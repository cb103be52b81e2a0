"""Aligned host buffers, raw-pointer memoryviews and a reusable staging pool.

``torch.empty`` is only 64-byte aligned, which O_DIRECT refuses; :func:`aligned_empty` over-allocates
and slices so ``data_ptr() % align == 0``. Buffers of 2 MiB or more are mapped with transparent huge
pages (see :func:`_anonymous_map`). With CUDA present the memory is pinned (cudaHostAlloc), so
device copies into it run asynchronously. Memory handed to the kernel is always described by
:func:`ptr_mv` (a memoryview of a raw address that owns nothing), and the caller keeps the owning tensor
alive until the I/O completes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from tierckpt.io.geometry import PAGE

__all__ = ["MappedBuffer", "StagingPool", "aligned_empty", "memmove", "populate", "ptr_mv"]

_PyMemoryView_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_PyMemoryView_FromMemory.restype = ctypes.py_object
_PyMemoryView_FromMemory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_from_memory: Callable[[int, int, int], memoryview] = _PyMemoryView_FromMemory  # the same function, typed
_PyBUF_READ, _PyBUF_WRITE = 0x100, 0x200

memmove = ctypes.memmove  # releases the GIL; single-threaded (no OpenMP barrier stalls: docs/io.md)

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
# the machine's memory pages (what is mapped and faulted in), not I/O sizes: those are the tiers' geometries'
_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
_populate_ok = sys.platform.startswith("linux")  # cleared when the kernel says EINVAL
if _populate_ok:
    _madvise = ctypes.CDLL(None, use_errno=True)["madvise"]  # a private function object: argtypes stay here
    _madvise.restype = ctypes.c_int
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(addr: int, nbytes: int) -> None:
    """Fault in the pages of ``[addr, addr + nbytes)`` for writing, without the GIL (a hint; never raises).

    Fresh anonymous memory costs a page fault per 4 KiB page on first touch. Taken inside an O_DIRECT
    read, those faults run in the I/O thread, serially, before the read is issued; on a VM whose host
    backs guest memory lazily (docs/benchmarks.md) that ran at 0.3-1 GB/s, slower than the disk.
    Calling this from helper threads ahead of the reads (``MADV_POPULATE_WRITE``, one call per range)
    takes the faults off the I/O path. Where the kernel lacks it (before 5.14), nothing is done and
    the read faults the pages in as before.
    """
    global _populate_ok
    if not _populate_ok or nbytes <= 0:
        return
    start = addr - addr % _PAGE
    if _madvise(start, addr + nbytes - start, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _populate_ok = False  # unsupported here (or not anonymous memory): stop asking


def ptr_mv(addr: int, nbytes: int, *, writable: bool = True) -> memoryview:
    """A flat byte memoryview of ``nbytes`` at ``addr``. It owns nothing: keep the memory alive."""
    return _from_memory(addr, nbytes, _PyBUF_WRITE if writable else _PyBUF_READ)


def _pin_ok() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken CUDA installs
        return False


def aligned_empty(nbytes: int, align: int = PAGE, *, pin: bool | None = None) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor of ``nbytes`` whose data pointer is a multiple of ``align``.

    Args:
        nbytes: size in bytes.
        align: power of two.
        pin: page-lock the memory (default: when CUDA is available).
    """
    pin = _pin_ok() if pin is None else pin
    if pin or nbytes < _HUGE:
        raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    else:  # see _anonymous_map: big unpinned buffers get transparent huge pages
        raw = torch.frombuffer(_anonymous_map(nbytes + (align if align > _PAGE else 0)), dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off : off + nbytes]


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """Private anonymous memory of ``nbytes``, advised to use transparent huge pages when that large.

    An I/O buffer of 4 KiB pages is physically scattered, so the block layer splits an O_DIRECT request
    at the device's segment limit (254 pages on virtio-blk: ~1 MiB), and each piece costs the device
    (or the VM's host) a request. On this project's VMs, 16 MiB reads into 4 KiB-page buffers ran at
    1.0-1.3 GB/s, into huge-page buffers at 3.5-4.2 GB/s, as fast as the raw read (docs/io.md,
    "Huge-page buffers").
    Huge pages also fault in 512x fewer times. Where THP is off (``never``), the advice is a no-op.
    The kernel maps anonymous regions of 2 MiB or more at a 2 MiB boundary (Linux 6.7+); elsewhere
    only the aligned interior gets huge pages.
    """
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE and _HUGEPAGE is not None:
        with contextlib.suppress(OSError):  # EINVAL: a kernel without THP
            m.madvise(_HUGEPAGE)
    return m


class StagingPool:
    """A fixed set of aligned buffers, reused from save to save so memory does not grow.

    ``acquire()`` blocks while every slot is in use; buffers are allocated on first use.
    """

    def __init__(self, slots: int, slot_bytes: int, align: int = PAGE) -> None:
        if slots < 1 or slot_bytes < align or slot_bytes % align:
            raise ValueError(f"bad staging pool: {slots} slots of {slot_bytes} bytes, align {align}")
        self.slots, self.slot_bytes, self.align = slots, slot_bytes, align
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cv = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slot_bytes

    def acquire(self) -> torch.Tensor:
        with self._cv:
            while not self._free and self._allocated >= self.slots:
                self._cv.wait()
            if self._free:
                return self._free.pop()
            self._allocated += 1
        return aligned_empty(self.slot_bytes, self.align)

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    @contextmanager
    def slot(self) -> Iterator[torch.Tensor]:
        buf = self.acquire()
        try:
            yield buf
        finally:
            self.release(buf)


class MappedBuffer:
    """Page-aligned anonymous memory that restored tensors are carved from without copying.

    Each tensor made by :meth:`tensor` owns a storage that starts at its first byte (storage offset 0,
    storage size = tensor size), as a freshly allocated tensor would; torch APIs that look at the
    storage (``set_rng_state``, ``torch.save``, ``untyped_storage()``) behave as usual. The memory is
    returned to the OS once the last tensor carved from it is gone.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = _anonymous_map(nbytes)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over ``nbytes`` at ``offset`` (which must suit ``dtype``'s alignment)."""
        if offset < 0 or offset + nbytes > self.nbytes or nbytes <= 0:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside a buffer of {self.nbytes} bytes")
        # frombuffer with offset/count makes a storage of exactly these bytes that holds the mapping
        # alive (8 us; a ctypes window type per distinct size cost 28 us, 0.5 s for 20,000 tensors)
        t = torch.frombuffer(self._map, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
        return t if len(shape) == 1 and shape[0] == t.shape[0] else t.view(shape)  # view() costs 2 us

    def populate(self, offset: int, nbytes: int) -> None:
        """Fault in ``[offset, offset + nbytes)`` ahead of a read into it (see :func:`populate`)."""
        populate(self.addr + offset, min(nbytes, self.nbytes - offset))
