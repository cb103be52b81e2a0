"""Copying a checkpoint's blobs from one tier to another, byte for byte (nothing is re-serialized).

Memory → file writes straight from the memory tier's blob buffers; file → memory reads straight into
them; device memory ↔ memory is the device tier's own copy (:meth:`Tier.copy_buffer`); file → file
goes through a few staging buffers, in chunks sized for the destination, reads and writes overlapping.
A worker spends its time in the I/O engine's futures (the engine's thread waits in the kernel without
the GIL: docs/io.md) or in ``memmove`` (which releases the GIL), so a training thread beside it keeps
running.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import StagingPool, memmove
from tierckpt.io.geometry import IOGeometry
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader, TierWriter

__all__ = ["copy_blobs", "ordered_writer", "staging_for", "writer_for"]


def _check_count(got: int, want: int, src: Tier, key: CheckpointKey, blob: BlobEntry, off: int) -> None:
    if got != want:
        raise CorruptCheckpointError(
            f"blob is truncated: read {got} of {want} bytes at offset {off}",
            tier=src.name,
            step=key.step,
            blob=blob.name,
        )


def copy_blobs(
    src: Tier,
    reader: TierReader,
    dst: Tier,
    writer: TierWriter,
    key: CheckpointKey,
    blobs: Sequence[BlobEntry],
    chunk: int,
    pool: Callable[[], StagingPool],
) -> None:
    """Copy every blob from ``reader`` to ``writer``; returns when every write has completed.

    Args:
        src: the source tier (for error messages, and its device copy).
        dst: the destination tier (its device copy).
        chunk: bytes per operation (the destination's geometry's, a multiple of both tiers' alignment).
        pool: staging buffers for file → file copies.

    Raises:
        CorruptCheckpointError: a source blob is shorter than the manifest says.
        OSError: from the engines, with path and errno.

    On a failure the writer is cancelled (:meth:`~tierckpt.tiers.base.TierWriter.cancel`) before the
    writes in flight are waited for: an object store's parts in their retries give up, so the copy fails
    (and its writer is aborted) without waiting them out.
    """
    pending: list[Future[int]] = []
    try:
        for b, blob in enumerate(blobs):
            sbuf, dbuf = reader.buffer(b), writer.buffer(b)
            if sbuf is not None and dbuf is not None and (sbuf.is_cpu and dbuf.is_cpu):  # memory → memory
                memmove(dbuf.data_ptr(), sbuf.data_ptr(), blob.size)
                continue
            if sbuf is not None and dbuf is not None:  # device memory ↔ memory: the device tier's own copy
                (src if not sbuf.is_cpu else dst).copy_buffer(dbuf, sbuf, blob.size)
                continue
            # device memory ↔ file, and memory the other tier's I/O may refuse (O_DIRECT's): through staging
            sbuf = sbuf if sbuf is None or _direct_ok(sbuf, dst.geometry) else None
            dbuf = dbuf if dbuf is None or _direct_ok(dbuf, src.geometry) else None
            if sbuf is not None:  # memory → file: write from the source's own buffer
                if sbuf.numel() < blob.size:
                    _check_count(sbuf.numel(), blob.size, src, key, blob, 0)
                base = sbuf.data_ptr()
                pending += [writer.write(b, o, base + o, min(chunk, blob.size - o)) for o in range(0, blob.size, chunk)]
            elif dbuf is not None:  # file → memory: read into the destination's own buffer
                base = dbuf.data_ptr()
                reads = [
                    (o, n, reader.read(b, o, base + o, n))
                    for o in range(0, blob.size, chunk)
                    for n in [min(chunk, blob.size - o)]
                ]
                pending += [f for _, _, f in reads]
                for o, n, f in reads:
                    _check_count(f.result(), n, src, key, blob, o)
            else:
                _copy_through_staging(src, reader, writer, key, b, blob, pool())
        for f in pending:
            f.result()
        pending = []
    finally:
        if pending:  # failed: the writer's writes need not go on
            writer.cancel()
        for f in pending:  # never leave a read or write running in memory the caller may free
            with contextlib.suppress(BaseException):  # cancelled
                f.exception()


def _direct_ok(buf: torch.Tensor, other: IOGeometry) -> bool:
    """Whether a memory tier's buffer can be handed as it is to the I/O of the tier of geometry ``other``
    that a copy reads from or writes to: CPU memory, aligned as ``other``'s I/O needs (its
    ``memory_alignment_bytes``: a file tier's O_DIRECT alignment, a page at least). A gpu tier on
    ``device="cpu"`` allocates plain tensors."""
    return buf.is_cpu and buf.data_ptr() % other.memory_alignment_bytes == 0


def _copy_through_staging(
    src: Tier, reader: TierReader, writer: TierWriter, key: CheckpointKey, b: int, blob: BlobEntry, pool: StagingPool
) -> None:
    """File → file: read chunks into staging slots and write each as soon as its read is in."""
    chunk = pool.slot_bytes
    inflight: deque[list[Any]] = deque()  # [slot, offset, nbytes, read future, write future | None]

    def start_writes(block: bool) -> None:
        for e in inflight:
            slot, o, n, rf, wf = e
            if wf is not None:
                continue
            if not (block or rf.done()):
                return
            _check_count(rf.result(), n, src, key, blob, o)
            e[4] = writer.write(b, o, slot.data_ptr(), n)
            block = False

    def retire() -> None:
        start_writes(block=True)
        slot, _, _, _, wf = inflight.popleft()
        try:
            wf.result()
        finally:
            pool.release(slot)

    try:
        for o in range(0, blob.size, chunk):
            if len(inflight) >= pool.slots:
                retire()
            slot: torch.Tensor = pool.acquire()
            n = min(chunk, blob.size - o)
            inflight.append([slot, o, n, reader.read(b, o, slot.data_ptr(), n), None])
            start_writes(block=False)
        while inflight:
            retire()
    finally:
        if inflight:  # failed: the writer's writes need not go on
            writer.cancel()
        while inflight:  # after an error: wait for what was issued before giving the buffers back
            slot, _, _, rf, wf = inflight.popleft()
            for f in (rf, wf):
                if f is not None:
                    with contextlib.suppress(BaseException):
                        f.exception()
            pool.release(slot)


def staging_for(geometry: IOGeometry) -> StagingPool:
    """The staging pool of saves and copies to a tier of this geometry (its worker's): its
    ``staging_slots`` buffers of ``staging_slot_bytes``, aligned to its ``alignment_bytes``."""
    return StagingPool(geometry.staging_slots, geometry.staging_slot_bytes, geometry.alignment_bytes)


def writer_for(tier: Tier, writer: TierWriter, blobs: Sequence[BlobEntry]) -> TierWriter:
    """``writer``, or for a tier that takes writes in order only (``capabilities.sequential_writes``) a
    writer that hands it each write once the one before has completed, and refuses a write out of order."""
    return _InOrder(tier, writer, [b.size for b in blobs]) if tier.capabilities.sequential_writes else writer


def _no_end(blob: int, nbytes: int) -> None:
    """A tier that takes writes in any order need not know where a blob's bytes end."""


def ordered_writer(
    tier: Tier, writer: TierWriter, blobs: Sequence[BlobEntry]
) -> tuple[TierWriter, Callable[[int, int], None]]:
    """:func:`writer_for`'s writer, and ``end(blob, nbytes)``, which tells it that a blob's bytes end at
    ``nbytes``, short of its size (a codec writer's stored stream; :mod:`tierckpt.datapath.codecwrite`):
    its next write may then start the next blob. A tier that takes writes in any order needs no telling."""
    if not tier.capabilities.sequential_writes:
        return writer, _no_end
    ordered = _InOrder(tier, writer, [b.size for b in blobs])
    return ordered, ordered.end


class _InOrder(TierWriter):
    """Each blob's writes in increasing offset order, contiguous, one blob after another (empty blobs
    skipped), one write at a time. After a failed write every later one fails with the same error."""

    def __init__(self, tier: Tier, inner: TierWriter, sizes: Sequence[int]) -> None:
        self._tier, self._inner, self._sizes = tier, inner, list(sizes)
        self._at = (0, 0)  # (blob, offset) the next write must start at
        self._last: Future[int] | None = None

    def buffer(self, blob: int) -> torch.Tensor | None:
        return self._inner.buffer(blob)

    def end(self, blob: int, nbytes: int) -> None:
        """Blob ``blob``'s bytes end at ``nbytes`` (at most its size): once written up to there, the next
        blob may start."""
        if not 0 <= nbytes <= self._sizes[blob]:
            raise ValueError(f"blob {blob} of {self._sizes[blob]} bytes cannot end at {nbytes}")
        self._sizes[blob] = nbytes

    def _next(self, blob: int, offset: int) -> bool:
        """Whether a write at (blob, offset) comes next: where the last one ended, or at the start of
        the next non-empty blob once the current one is complete."""
        b, o = self._at
        if (blob, offset) == (b, o):
            return True
        done = o >= self._sizes[b] if b < len(self._sizes) else True
        skipped = all(self._sizes[i] == 0 for i in range(b + 1, min(blob, len(self._sizes))))
        return offset == 0 and blob > b and done and skipped

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        if self._last is not None and self._last.exception() is not None:  # waits for it to be in
            return self._last  # the tier's previous write failed: so does this one, with its error
        if not self._next(blob, offset):
            b, o = self._at
            raise ValueError(
                f"tier {self._tier.name!r} takes writes in order only: got blob {blob} offset {offset}, "
                f"expected blob {b} offset {o} (or the next blob from offset 0 once blob {b} is complete)"
            )
        self._last = self._inner.write(blob, offset, addr, nbytes)
        self._at = (blob, offset + nbytes)
        return self._last

    def commit(self, manifest: bytes) -> None:
        if self._last is not None:
            self._last.result()
        self._inner.commit(manifest)

    def abort(self) -> None:
        self._inner.abort()

    def cancel(self) -> None:
        self._inner.cancel()
