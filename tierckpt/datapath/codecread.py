"""Reads of a tier copy whose blobs are stored encoded (a version-6 manifest's frame index): raw blob offsets
in, raw bytes out, decoding only the frames a read touches.

A read of raw bytes ``[lo, hi)`` of a blob reads the stored bytes of the frames overlapping it, back to back
in one read of the tier beneath (widened to the copy's alignment, into a staging buffer aligned for that
tier), then decodes each frame in the process-wide codec pool (:mod:`tierckpt.datapath.codecpool`): a frame
wholly inside the range straight into the destination, a frame stored raw by a copy of the part wanted.
A compressed frame at an edge of the range is decoded whole into a frame buffer that the reader keeps for
the next few reads (the next piece of a restore usually starts in the frame the last one ended in, so it
is read and decoded once, not once a piece). Decoding checks every zstd stream (its declared content size
before anything is allocated, its content checksum: :func:`~tierckpt.format.codec.decode_frame`), and
where a read reaches the end of a blob's stored stream, the zero padding after it. Every problem is a
:class:`~tierckpt.errors.CorruptCheckpointError` naming the tier, the step, the blob and the frame; a stored
stream shorter than the frame index says is a truncated copy. The raw bytes are verified above the reader
(checksums over the raw bytes: :mod:`tierckpt.datapath.verifier`), as a plain copy's are.

A read's future completes once every frame it touches is in place (or has failed): the caller's memory is
never written after it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial

import torch
import zstandard

from tierckpt.datapath.codecpool import get_pool
from tierckpt.datapath.verifier import Where
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import native as nat
from tierckpt.format.codec import decode_frame
from tierckpt.format.frames import Frame, FrameIndex
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import Manifest, ManifestHead
from tierckpt.io.buffers import aligned_empty, memmove, ptr_mv
from tierckpt.tiers.base import TierReader

__all__ = ["codec_reader"]

#: staging buffers of stored bytes a reader keeps for reuse
_SPARE = 4
#: edge frames a reader keeps decoded (the frames the last few reads ended or started in)
_EDGES = 4


def codec_reader(
    inner: TierReader,
    head: ManifestHead | Manifest,
    index: FrameIndex,
    *,
    where: Where,
    mem_align: int,
    pool: Executor | None = None,
) -> TierReader:
    """A reader of raw blob bytes over ``inner``, a reader of the copy's stored bytes.

    Args:
        inner: the tier's reader of the copy (its blobs opened as
            :func:`~tierckpt.datapath.openblobs.stored_entries` says; a budget's throttle inside it).
        head: the copy's manifest (head): raw blob sizes and names, alignment.
        index: its frame index.
        where: the copy, for errors.
        mem_align: memory alignment of the staging buffers ``inner`` reads into (the tier's
            :meth:`~tierckpt.io.geometry.IOGeometry.buffer_alignment`).
        pool: where frames are decoded (default: the process-wide codec pool).

    Returns:
        A :class:`~tierckpt.tiers.base.TierReader` taking reads of any alignment (``read_alignment`` is
        ``(1, 1)``) at raw offsets; ``buffer()`` is None. Closing it closes ``inner``.
    """
    return _CodecReader(inner, head, index, where, mem_align, pool or get_pool())


@dataclass
class _Edge:
    """A compressed frame decoded whole, for the reads that want part of it."""

    buf: torch.Tensor
    done: Future[None] = field(default_factory=Future)


class _CodecReader(TierReader):
    def __init__(
        self,
        inner: TierReader,
        head: ManifestHead | Manifest,
        index: FrameIndex,
        where: Where,
        mem_align: int,
        pool: Executor,
    ) -> None:
        self._inner, self._index, self._where, self._pool = inner, index, where, pool
        self._blobs, self._align, self._mem_align = head.blobs, head.align, mem_align
        self._ends = [round_up(h, head.align) for h in index.held]  # each blob's stored region
        self._spare: list[torch.Tensor] = []
        self._edges: OrderedDict[tuple[int, int], _Edge] = OrderedDict()
        self._lock = threading.Lock()

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return 1, 1

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        n = max(0, min(nbytes, self._blobs[blob].size - offset))
        out: Future[int] = Future()
        if n == 0:
            out.set_result(0)
            return out
        job = _Read(self, blob, offset, n, addr, out)
        try:
            for k in self._index.span(blob, offset, offset + n):
                f = self._index.frame(blob, k)
                whole = offset <= f.raw_offset and f.raw_offset + f.raw_len <= offset + n
                if whole or f.width == 0:
                    job.stored.append((k, f))
                    continue
                edge, mine = self._edge(blob, k, f.raw_len)
                job.edges.append((k, f, edge, mine))
                if mine:  # frames whose stored bytes this read reads
                    job.stored.append((k, f))
            if not job.stored:  # every frame it touches is being decoded for another read
                job.start_waits()
                return out
            f0, f1 = job.stored[0][1], job.stored[-1][1]
            job.a0 = f0.stored_offset // self._align * self._align
            job.a1 = min(round_up(f1.stored_offset + f1.stored_len, self._align), self._ends[blob])
            job.buf = self._take(job.a1 - job.a0)
            fut = self._inner.read(blob, job.a0, job.buf.data_ptr(), job.a1 - job.a0)
        except BaseException as e:
            job.fail_edges(e)
            job.release()
            raise
        fut.add_done_callback(job.landed)
        return out

    def _edge(self, blob: int, k: int, raw_len: int) -> tuple[_Edge, bool]:
        """Frame ``k`` of ``blob`` decoded whole: the one kept (False), or a new one to fill (True)."""
        with self._lock:
            e = self._edges.get((blob, k))
            if e is not None:
                self._edges.move_to_end((blob, k))
                return e, False
            e = self._edges[(blob, k)] = _Edge(torch.empty(raw_len, dtype=torch.uint8))
            while len(self._edges) > _EDGES:
                self._edges.popitem(last=False)  # a read still using it keeps it alive
            return e, True

    def forget(self, blob: int, k: int, edge: _Edge) -> None:
        """Drop a kept frame that failed (an I/O error may not happen again)."""
        with self._lock:
            if self._edges.get((blob, k)) is edge:
                del self._edges[(blob, k)]

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() >= nbytes:
                    return self._spare.pop(i)
        return aligned_empty(round_up(nbytes, self._mem_align), self._mem_align, pin=False)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._spare.append(buf)
            if len(self._spare) > _SPARE:  # keep the largest
                self._spare.sort(key=lambda b: b.numel())
                del self._spare[0]

    def close(self) -> None:
        self._inner.close()
        with self._lock:
            self._spare.clear()
            self._edges.clear()


class _Read:
    """One read: its stored bytes landed (:meth:`landed`), then its frames decoded in the pool; the
    result is set once every part is in place (or has failed)."""

    def __init__(self, r: _CodecReader, blob: int, lo: int, n: int, addr: int, out: Future[int]) -> None:
        self.r, self.blob, self.lo, self.n, self.addr, self.out = r, blob, lo, n, addr, out
        self.edges: list[tuple[int, Frame, _Edge, bool]] = []  # partly wanted compressed frames (mine: decoded here)
        self.stored: list[tuple[int, Frame]] = []  # frames whose stored bytes it reads
        self.a0 = self.a1 = 0
        self.buf: torch.Tensor | None = None
        self.left = 0  # parts not in place yet
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def _bad(self, message: str, k: int | None = None) -> CorruptCheckpointError:
        if k is not None:
            f = self.r._index.frame(self.blob, k)
            at = f"frame at raw offset {f.raw_offset}"  # decode_frame's words for it: said once
            message = message[len(at) :] if message.startswith(at) else f": {message}"
            count = self.r._index.count(self.blob)
            message = f"frame {k} of {count} (raw bytes [{f.raw_offset}, {f.raw_offset + f.raw_len})){message}"
        return self.r._where.error(message, blob=self.r._blobs[self.blob].name)

    # -- the stored bytes ----------------------------------------------------------------------------------
    def landed(self, fut: Future[int]) -> None:
        """The stored bytes are in (the tier's thread): check them, then decode in the pool."""
        try:
            self._check(fut.result())
        except BaseException as e:
            self.fail_edges(e)
            self.buf = None  # dropped, not kept: the tier may have failed halfway through it
            self.out.set_exception(e)
            return
        with self.lock:
            self.left = len(self.stored) + sum(1 for *_, mine in self.edges if not mine)
        for k, f in self.stored:
            self._submit(self._decode, f, k)
        self.start_waits(counted=True)

    def _check(self, got: int) -> None:
        """Raise if the tier returned fewer bytes than the frames need (a truncated copy), or if the
        padding after the blob's stored stream, where this read holds it, is not zero."""
        index, blob = self.r._index, self.blob
        if got < self.a1 - self.a0:
            end = self.a0 + got
            k = next((k for k, f in self.stored if f.stored_offset + f.stored_len > end), None)
            what = f"its stored stream of {index.held[blob]} bytes (padded to {self.r._ends[blob]})"
            raise self._bad(f"the copy is truncated: {what} ends at byte {end}", k)
        last = self.stored[-1][1]
        s1 = last.stored_offset + last.stored_len
        buf, a1 = self.buf, self.a1
        if buf is not None and s1 == index.held[blob] < a1 and not nat.all_zero(buf.data_ptr() + s1 - self.a0, a1 - s1):
            raise self._bad(f"padding bytes [{s1}, {self.a1}) after the stored stream are not zero")

    def _decode(self, f: Frame, k: int) -> None:
        edge = next((e for kk, _, e, mine in self.edges if kk == k and mine), None)
        try:
            self._place(f, k, edge)
        except BaseException as e:
            err = self._as_damage(e, k)
            if edge is not None:
                self.r.forget(self.blob, k, edge)
                edge.done.set_exception(err)
            self._done(err)
            return
        if edge is not None:
            edge.done.set_result(None)
            self._copy_part(f, edge)
        self._done(None)

    def _place(self, f: Frame, k: int, edge: _Edge | None) -> None:
        """Frame ``k``'s raw bytes: decoded into the destination, or into ``edge``'s buffer."""
        assert self.buf is not None
        at = self.buf.data_ptr() + f.stored_offset - self.a0
        stored = ptr_mv(at, f.stored_len, writable=False)
        if edge is not None:
            decode_frame(stored, f, ptr_mv(edge.buf.data_ptr(), f.raw_len))
            return
        lo, hi = max(self.lo, f.raw_offset), min(self.lo + self.n, f.raw_offset + f.raw_len)
        dst = self.addr + lo - self.lo
        if (lo, hi) == (f.raw_offset, f.raw_offset + f.raw_len):  # wholly inside: straight to the destination
            decode_frame(stored, f, ptr_mv(dst, f.raw_len))
        else:  # stored raw: the wanted part as it is
            memmove(dst, at + lo - f.raw_offset, hi - lo)

    def _as_damage(self, e: BaseException, k: int) -> BaseException:
        if isinstance(e, CorruptCheckpointError):
            return self._bad(str(e) if e.tier is None else str(e.strerror), k)
        if isinstance(e, (zstandard.ZstdError, ValueError)):
            return self._bad(f"{type(e).__name__}: {e}", k)
        return e

    # -- the frames decoded for another read --------------------------------------------------------------
    def start_waits(self, counted: bool = False) -> None:
        """Copy out of the kept frames another read decodes, once each is decoded."""
        waits = [(f, e) for _, f, e, mine in self.edges if not mine]
        if not counted:
            with self.lock:
                self.left = len(waits)
        for f, e in waits:
            e.done.add_done_callback(partial(self._landed_edge, f, e))

    def _landed_edge(self, f: Frame, edge: _Edge, _done: Future[None]) -> None:
        self._submit(self._waited, f, edge)

    def _waited(self, f: Frame, edge: _Edge) -> None:
        err = edge.done.exception()
        if err is None:
            try:
                self._copy_part(f, edge)
            except BaseException as e:
                err = e
        self._done(err)

    def _copy_part(self, f: Frame, edge: _Edge) -> None:
        lo, hi = max(self.lo, f.raw_offset), min(self.lo + self.n, f.raw_offset + f.raw_len)
        memmove(self.addr + lo - self.lo, edge.buf.data_ptr() + lo - f.raw_offset, hi - lo)

    # -- the end ------------------------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self.r._pool.submit(fn, *args)
        except BaseException as e:  # the pool is shut down (the interpreter exits)
            self._done(e)

    def fail_edges(self, e: BaseException) -> None:
        """The stored bytes never came: the frames this read was to decode for others fail with ``e``."""
        for k, _, edge, mine in self.edges:
            if mine:
                self.r.forget(self.blob, k, edge)
                edge.done.set_exception(e)

    def release(self) -> None:
        if self.buf is not None:
            self.r._give(self.buf)
            self.buf = None

    def _done(self, err: BaseException | None) -> None:
        with self.lock:
            if err is not None and self.error is None:
                self.error = err
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        try:
            self.release()
        finally:  # whatever happens, the caller hears of its read
            if self.error is None:
                self.out.set_result(self.n)
            else:
                self.out.set_exception(self.error)
