"""``host`` tier: checkpoints kept in this process's memory, bounded by ``capacity``.

Blobs live in aligned (pinned where CUDA exists) buffers that the save path packs into directly, so a
save to host memory is one copy. Freed buffers are kept for reuse by the next checkpoint of the same
size, within the capacity. Not persistent: a new process starts empty.

A copy opened for reading (:meth:`HostTier.open_copy`) is a snapshot: it holds the committed version's
manifest and buffers, and buffers that an eviction or a replacing save releases while a copy or reader
still holds them are not reused until the last one is closed (or collected).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tierckpt.config import TierConfig
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, TierFullError
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import aligned_empty, memmove
from tierckpt.io.geometry import PAGE
from tierckpt.tiers.base import (
    CheckpointKey,
    EngineSource,
    Tier,
    TierCapabilities,
    TierCopy,
    TierReader,
    TierWriter,
)
from tierckpt.tiers.options import check_options, refuse_location

__all__ = ["HostTier", "done_future"]


def done_future(value: int) -> Future[int]:
    """A future that is already resolved with ``value``."""
    f: Future[int] = Future()
    f.set_result(value)
    return f


def _default_capacity() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):  # pragma: no cover
        return 8 << 30


@dataclass(eq=False)
class _Held:
    """One committed version; ``readers``: copies and readers holding it open; ``retired``: no longer
    committed (its buffers are reused once ``readers`` is back to 0)."""

    manifest: bytes
    blobs: list[torch.Tensor]
    nbytes: int
    readers: int = 0
    retired: bool = False


class HostTier(Tier):
    """Process-memory tier.

    Args:
        name: tier name.
        capacity_bytes: most bytes held (committed + being written + kept for reuse);
            default a quarter of physical memory.
    """

    kind = "host"
    preferred_blob_bytes = 1 << 30  # declared: an input of the geometry (Tier)

    def __init__(self, name: str = "host", capacity_bytes: int | None = None) -> None:
        super().__init__(name)
        self.capacity_bytes = _default_capacity() if capacity_bytes is None else capacity_bytes
        self.capabilities = TierCapabilities(
            persistent=False, shared=False, device="cpu", alignment_bytes=PAGE, encoded_copies=True
        )
        self._lock = threading.Lock()
        self._held: dict[CheckpointKey, _Held] = {}
        self._reserved = 0
        self._free: list[torch.Tensor] = []
        self._writer_cls: type[_HostWriter] = _HostWriter
        self._reader_cls: type[_HostReader] = _HostReader

    @classmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> HostTier:
        """A host tier takes no location and no options."""
        refuse_location(cfg, "a host tier keeps checkpoints in memory and takes no path")
        check_options(cfg, {})
        tier = cls(cfg.name, cfg.capacity_bytes)
        if cfg.blob_bytes:
            tier.preferred_blob_bytes = cfg.blob_bytes
        return tier

    def used_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    def _alloc(self, size: int) -> torch.Tensor:
        """A new blob buffer of ``size`` bytes (subclasses put it elsewhere, e.g. device memory)."""
        return aligned_empty(size)

    def _reuse(self, size: int) -> torch.Tensor | None:
        """Called with the lock held: a cached buffer of exactly ``size`` bytes (the newest), or None."""
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i].numel() == size:
                return self._free.pop(i)
        return None

    def reserve(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        need = sum(b.size for b in blobs)
        with self._lock:
            used = sum(h.nbytes for h in self._held.values()) + self._reserved
            if used + need > self.capacity_bytes:
                raise TierFullError(
                    f"tier {self.name!r}: checkpoint of step {key.step} needs {need} bytes, "
                    f"{self.capacity_bytes - used} of capacity {self.capacity_bytes} are free"
                )
            reused = [self._reuse(b.size) for b in blobs]  # exact-size cached buffers first
            free_bytes = sum(b.numel() for b in self._free)
            while self._free and used + need + free_bytes > self.capacity_bytes:
                free_bytes -= self._free.pop(0).numel()  # then drop the oldest cached ones that no longer fit
            self._reserved += need
            bufs = [r if r is not None else self._alloc(b.size) for r, b in zip(reused, blobs)]
        return self._writer_cls(self, key, bufs, need)

    def _finish(self, key: CheckpointKey, held: _Held | None, reserved: int, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            self._reserved -= reserved
            if held is not None:
                old = self._held.pop(key, None)
                self._held[key] = held
                if old is not None:
                    self._retire(old)
            else:
                self._free.extend(bufs)

    def _retire(self, held: _Held) -> None:
        """Called with the lock held, for a version no longer committed: its buffers are reused by later
        checkpoints once no copy or reader holds them."""
        held.retired = True
        if not held.readers:
            self._free.extend(held.blobs)

    def _pin(self, key: CheckpointKey) -> _Held:
        """The committed version of ``key``, held for a reader until :meth:`_unpin`."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.readers += 1
                return held
        raise self._not_found(key)

    def _repin(self, held: _Held) -> None:
        with self._lock:
            held.readers += 1

    def _unpin(self, held: _Held) -> None:
        with self._lock:
            held.readers -= 1
            if held.retired and not held.readers:
                self._free.extend(held.blobs)

    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        with self._lock:
            return sorted(k for k in self._held if rank is None or k.rank == rank)

    def holds(self, key: CheckpointKey) -> bool:
        with self._lock:
            return key in self._held

    def _get(self, key: CheckpointKey) -> _Held:
        with self._lock:
            held = self._held.get(key)
        if held is None:
            raise self._not_found(key)
        return held

    def _not_found(self, key: CheckpointKey) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(f"tier {self.name!r} holds no checkpoint for step {key.step} rank {key.rank}")

    def read_manifest(self, key: CheckpointKey) -> bytes:
        return self._get(key).manifest

    def reader(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierReader:
        with self.open_copy(key) as copy:
            return copy.reader(blobs)

    def open_copy(self, key: CheckpointKey) -> TierCopy:
        """A snapshot of ``key``'s committed version (see the module docstring)."""
        return _HostCopy(self, key)

    def evict(self, key: CheckpointKey, *, free: bool = True) -> None:  # freeing memory is cheap: always
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self._retire(held)

    def describe(self) -> str:
        return f"process memory, capacity {self.capacity_bytes} bytes"

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            self._free.clear()


class _HostWriter(TierWriter):
    def __init__(self, tier: HostTier, key: CheckpointKey, bufs: list[torch.Tensor], reserved: int) -> None:
        self._tier, self._key, self._bufs, self._reserved = tier, key, bufs, reserved
        self._open = True

    def buffer(self, blob: int) -> torch.Tensor:
        return self._bufs[blob]

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        dst = self._bufs[blob]
        if offset < 0 or offset + nbytes > dst.numel():
            raise ValueError(f"write [{offset}, {offset + nbytes}) outside blob {blob} of {dst.numel()} bytes")
        target = dst.data_ptr() + offset
        if target != addr and nbytes:
            memmove(target, addr, nbytes)
        return done_future(nbytes)

    def commit(self, manifest: bytes) -> None:
        if not self._open:
            raise RuntimeError("writer already finished")
        self._open = False
        self._tier._finish(self._key, _Held(bytes(manifest), self._bufs, self._reserved), self._reserved, [])

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._tier._finish(self._key, None, self._reserved, self._bufs)


class _HostCopy(TierCopy):
    """One committed version of a checkpoint on a :class:`HostTier`, held from open to close."""

    def __init__(self, tier: HostTier, key: CheckpointKey) -> None:
        super().__init__(tier, key)
        self._tier = tier
        self._held = tier._pin(key)
        self._release = weakref.finalize(self, tier._unpin, self._held)

    def read_manifest(self) -> bytes:
        return self._held.manifest

    def reader(self, blobs: Sequence[BlobEntry]) -> TierReader:
        bufs = self._held.blobs
        for i, b in enumerate(blobs):
            have = bufs[i].numel() if i < len(bufs) else None
            if have is None or have < b.stored:
                declares = "its manifest declares" if b.held is None else "the copy's frame index declares"
                raise CorruptCheckpointError(
                    f"blob {b.name} holds {have or 0} bytes, {declares} {b.stored}",
                    tier=self._tier.name,
                    step=self.key.step,
                    blob=b.name,
                )
        self._tier._repin(self._held)
        return self._tier._reader_cls(self._held, self._tier._unpin)

    def close(self) -> None:
        self._release()


class _HostReader(TierReader):
    def __init__(self, held: _Held, unpin: Callable[[_Held], None]) -> None:
        self._held = held
        self._release = weakref.finalize(self, unpin, held)

    def close(self) -> None:
        self._release()

    def buffer(self, blob: int) -> torch.Tensor:
        return self._held.blobs[blob]

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        src = self._held.blobs[blob]
        n = max(0, min(nbytes, src.numel() - offset))
        if n:
            memmove(addr, src.data_ptr() + offset, n)
        return done_future(n)

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return 1, 1  # a copy out of memory: any address, offset and length
