"""Reads of a tier copy whose blobs are stored encoded (a version-6 manifest's frame index): raw blob offsets
in, raw bytes out, decoding only the frames a read touches.

A read of raw bytes ``[lo, hi)`` of a blob is planned by :func:`~tierckpt.datapath.codecplan.plan_read`:
runs of frames stored raw are read straight into the caller's memory where the tier beneath allows it
(every tier but an O_DIRECT one reads into any memory; an O_DIRECT read lands on the run's first aligned
address and its bytes are moved down in place), and the stored bytes of the compressed frames (and of what
cannot be read straight) are read into staging buffers aligned for that tier (at most the tier's
``read_staging_bytes`` of them in flight), then decoded in the
process-wide codec pool (:mod:`tierckpt.datapath.codecpool`): a frame wholly inside the range straight
into the destination, while the tier reads on. A compressed frame at an edge of the range is decoded
whole into a frame buffer shared with the read that wants the rest of it (the next piece of a restore
usually starts in the frame the last one ended in, so it is read and decoded once, not once a piece) and
freed once every byte of it was handed out. An open reader keeps at most :data:`KEEP_BYTES` of staging
buffers for reuse and about as much of such frames (two frames at least): its ``held_bytes()``.

Decoding checks every zstd stream (its declared content size before anything is allocated, its content
checksum: :func:`~tierckpt.format.codec.decode_frame`), and where a read reaches the end of a blob's stored
stream, the zero padding after it. Every problem is a :class:`~tierckpt.errors.CorruptCheckpointError`
naming the tier, the step, the blob and the frame; a stored stream shorter than the frame index says is a
truncated copy. The raw bytes are verified above the reader (checksums over the raw bytes:
:mod:`tierckpt.datapath.verifier`), as a plain copy's are.

A read's future completes once every part of it is in place (or has failed): the caller's memory is never
written after it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Executor, Future
from typing import NamedTuple

import torch

from tierckpt.datapath.codecjob import Edge, Go, Job
from tierckpt.datapath.codecplan import Rules, plan_read
from tierckpt.datapath.codecpool import get_pool
from tierckpt.datapath.verifier import Where
from tierckpt.format.frames import FrameIndex
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import Manifest, ManifestHead
from tierckpt.io.buffers import aligned_empty, populate
from tierckpt.io.geometry import DIRECT_READ_MIN, PAGE, READ_SLOT_BYTES, READ_SLOTS
from tierckpt.tiers.base import TierReader

__all__ = ["KEEP_BYTES", "Held", "codec_reader"]

#: What an open reader keeps between reads, of staging buffers for reuse and, apart, of decoded frames
#: shared by two reads (of these at least two frames, whatever their size)
KEEP_BYTES = 32 << 20
_HUGE = 2 << 20  # staging buffers of this or more are whole multiples of it (reused for reads of other sizes)


def codec_reader(
    inner: TierReader,
    head: ManifestHead | Manifest,
    index: FrameIndex,
    *,
    where: Where,
    mem_align: int,
    pool: Executor | None = None,
    direct_min: int = DIRECT_READ_MIN,
    staging_bytes: int = READ_SLOTS * READ_SLOT_BYTES,
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
        direct_min: the least run of raw frames read straight into the caller's memory, where ``inner``
            allows it (the tier's ``direct_read_min_bytes``); shorter ones are staged with their
            neighbours, in one read.
        staging_bytes: the staging buffers its reads may hold in flight at once (the tier's
            :attr:`~tierckpt.io.geometry.IOGeometry.read_staging_bytes`); a staged read beyond them
            is made once earlier ones give theirs back (a read needing more is made alone).

    Returns:
        A :class:`~tierckpt.tiers.base.TierReader` taking reads of any alignment (``read_alignment`` is
        ``(1, 1)``) at raw offsets; ``buffer()`` is None. Closing it closes ``inner``.
    """
    return _CodecReader(inner, head, index, where, mem_align, pool or get_pool(), direct_min, staging_bytes)


class Held(NamedTuple):
    """What an open codec reader keeps between reads, in bytes."""

    staging: int  #: staging buffers kept for reuse
    frames: int  #: compressed frames decoded whole, kept for the reads that want the rest of them


class _CodecReader(TierReader):
    def __init__(
        self,
        inner: TierReader,
        head: ManifestHead | Manifest,
        index: FrameIndex,
        where: Where,
        mem_align: int,
        pool: Executor,
        direct_min: int,
        staging_bytes: int,
    ) -> None:
        self.inner, self.index, self.where, self.pool = inner, index, where, pool
        self.blobs, self._align, self._mem_align, self._direct_min = head.blobs, head.align, mem_align, direct_min
        self.ends = [round_up(h, head.align) for h in index.held]  # each blob's stored region
        self._rules: dict[int, Rules] = {}  # each blob's, once read
        self._mems: dict[int, int] = {}  # the memory alignment of each blob's staging buffers
        self._spare: list[torch.Tensor] = []  # staging buffers kept for reuse
        self._limit, self._staging = staging_bytes, 0  # bytes of staging buffers in flight: their bound, now
        self._queue: deque[tuple[int, int, Go]] = deque()  # staged reads waiting: (bytes, alignment, go)
        self._edges: OrderedDict[tuple[int, int], Edge] = OrderedDict()
        self._edge_keep = max(KEEP_BYTES, 2 * index.frame_bytes)
        self._lock = threading.Lock()

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return 1, 1

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        n = max(0, min(nbytes, self.blobs[blob].size - offset))
        out: Future[int] = Future()
        if n == 0:
            out.set_result(0)
            return out
        frames = [(k, self.index.frame(blob, k)) for k in self.index.span(blob, offset, offset + n)]
        job = Job(self, blob, offset, n, addr, out, frames)
        elsewhere = set()
        try:
            for k, f in frames:
                if f.width and not (offset <= f.raw_offset and f.raw_offset + f.raw_len <= offset + n):
                    edge, mine = self._edge(blob, k, f.raw_len)
                    job.edges[k] = (edge, mine)
                    if not mine:  # decoded by another read
                        elsewhere.add(k)
            plan = plan_read(frames, offset, n, addr, self._rules_of(blob), elsewhere)
        except BaseException as e:
            job.fail_edges(job.edges, e)
            raise
        job.start(plan)
        return out

    def _rules_of(self, blob: int) -> Rules:
        """How ``blob``'s stored bytes are read: into any memory where the tier beneath allows it (a fact of
        the blob's file: a statx, asked once), then staged reads of that offset alignment (a buffered
        file, an object: no more than the stored bytes wanted), else of the copy's."""
        rules = self._rules.get(blob)
        if rules is None:
            direct = self.inner.read_alignment(blob)
            align = direct[1] if direct is not None and self._align % direct[1] == 0 else self._align
            self._mems[blob] = max(PAGE, direct[0]) if direct is not None else self._mem_align
            held = self.index.held[blob]
            rules = self._rules[blob] = Rules(align, self.ends[blob], held, direct, self._direct_min)
        return rules

    # -- what it keeps between reads ----------------------------------------------------------------------
    def held_bytes(self) -> Held:
        """The bytes it keeps for later reads (not those of reads in flight, freed as they finish)."""
        with self._lock:
            return Held(sum(b.numel() for b in self._spare), sum(e.buf.numel() for e in self._edges.values()))

    def _edge(self, blob: int, k: int, raw_len: int) -> tuple[Edge, bool]:
        """Frame ``k`` of ``blob`` decoded whole: the one kept (False), or a new one to fill (True)."""
        with self._lock:
            e = self._edges.get((blob, k))
            if e is not None:
                self._edges.move_to_end((blob, k))
                return e, False
            e = self._edges[(blob, k)] = Edge(torch.empty(raw_len, dtype=torch.uint8))
            kept = sum(x.buf.numel() for x in self._edges.values())
            while kept > self._edge_keep and len(self._edges) > 2:  # the oldest go (a read using one keeps it)
                kept -= self._edges.popitem(last=False)[1].buf.numel()
            return e, True

    def gave(self, blob: int, k: int, edge: Edge, lo: int, hi: int) -> None:
        """Raw bytes ``[lo, hi)`` of kept frame ``k`` went to a read: once all of it has, it is dropped."""
        with self._lock:
            edge.given = _merged(edge.given, lo, hi)
            if edge.given == [(0, edge.buf.numel())] and self._edges.get((blob, k)) is edge:
                del self._edges[(blob, k)]

    def forget(self, blob: int, k: int, edge: Edge) -> None:
        """Drop a kept frame that failed (an I/O error may not happen again)."""
        with self._lock:
            if self._edges.get((blob, k)) is edge:
                del self._edges[(blob, k)]

    def stage(self, blob: int, nbytes: int, go: Go) -> None:
        """Call ``go(buf, None)`` with a staging buffer for ``nbytes`` of ``blob`` now, or, while the
        staging buffers in flight hold :attr:`_limit` bytes, once enough of them are given back (never
        waiting in this thread: a read may be made from the pool's); ``go(None, error)`` where none can
        be had."""
        align = self._mems.get(blob, self._mem_align)
        with self._lock:
            if self._queue or (self._staging and self._staging + nbytes > self._limit):
                self._queue.append((nbytes, align, go))
                return
            buf, size = self._claim(nbytes, align)
        self._hand(go, buf, size, align)

    def give(self, buf: torch.Tensor, *, reuse: bool = True) -> None:
        """Take a staging buffer back (``reuse``: its bytes are not suspect): to a staged read waiting for
        one, else kept, the largest first, up to :data:`KEEP_BYTES` in all."""
        ready = []
        with self._lock:
            self._staging -= buf.numel()
            if reuse:
                self._spare.append(buf)
            while self._queue and not (self._staging and self._staging + self._queue[0][0] > self._limit):
                nbytes, align, go = self._queue.popleft()
                ready.append((go, *self._claim(nbytes, align), align))
            self._spare.sort(key=lambda b: -b.numel())
            kept = 0
            for i, b in enumerate(self._spare):
                if kept + b.numel() > KEEP_BYTES:
                    del self._spare[i:]
                    break
                kept += b.numel()
        for go, spare, size, align in ready:
            self._hand(go, spare, size, align)

    def _claim(self, nbytes: int, align: int) -> tuple[torch.Tensor | None, int]:
        """(with the lock) A kept buffer for ``nbytes`` (not much larger, aligned to ``align``), else None and
        the size of a new one; its bytes counted in flight."""
        fits = [
            i
            for i, b in enumerate(self._spare)
            if nbytes <= b.numel() <= 2 * nbytes + (1 << 20) and b.data_ptr() % align == 0
        ]
        if fits:
            buf = self._spare.pop(min(fits, key=lambda i: self._spare[i].numel()))
            self._staging += buf.numel()
            return buf, buf.numel()
        size = round_up(nbytes, _HUGE) if nbytes >= _HUGE else max(align, 1 << (nbytes - 1).bit_length())
        self._staging += size
        return None, size

    def _hand(self, go: Go, buf: torch.Tensor | None, size: int, align: int) -> None:
        """``go`` with ``buf``, or a new buffer of ``size`` (its pages faulted in here, not in the tier's read)."""
        if buf is None:
            try:
                buf = aligned_empty(size, align, pin=False)
                populate(buf.data_ptr(), size)
            except BaseException as e:
                with self._lock:
                    self._staging -= size
                go(None, e)
                return
        go(buf, None)

    def close(self) -> None:
        self.inner.close()
        with self._lock:
            self._spare.clear()
            self._edges.clear()


def _merged(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``spans`` (sorted, apart) with ``[lo, hi)`` added."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*spans, (lo, hi)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
