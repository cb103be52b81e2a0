"""Writing a tier's copy compressed: raw blob bytes in, each blob's stored stream out (docs/format.md,
"Compressed copies (version 6)").

:func:`codec_writer` wraps a tier's :class:`~tierckpt.tiers.base.TierWriter` as the data path wraps it
in a bandwidth throttle: its callers (the packer, :func:`~tierckpt.datapath.blobcopy.copy_blobs`) write
*raw* blob offsets, in the chunks and order they always do. Each blob is cut into frames of ``F`` raw
bytes (the manifest's checksum chunk); a frame whose bytes arrived is planned by the tier's
:class:`~tierckpt.policies.compression.Adaptive` and, unless stored raw, encoded on the process's codec
threads (:mod:`~tierckpt.datapath.codecpool`). One emitter thread per writer then hands each frame, in
order, to its :class:`~tierckpt.datapath.codecemit.Emitter`, which lays each blob's frames out back to
back into aligned chunks of the tier's geometry and writes them to the tier: front to back, one blob
after another, so a tier that takes writes in order only (an S3 multipart upload,
:func:`~tierckpt.datapath.blobcopy.ordered_writer`) works as well as any.

Memory (:mod:`~tierckpt.datapath.codecframes`): a frame that one write covers whole is read where the
caller's write put it (the write's future resolves once the frame is encoded, or for a frame stored
raw once it is copied out or written to the tier from there: the emitter writes runs of raw frames
from the caller's memory where it can, :mod:`~tierckpt.datapath.codecemit`). A write of part of a frame is copied into the frame's buffer (and resolves
at once) while fewer than ``buffers`` frames not yet handed to the codec threads hold one. Beyond that
the write waits for one of them to go, as long as the emitter's next frame has all its bytes (the
writer then moves on without any other write, so the wait ends); else (frames that fill only once
later writes come, which this one may be holding back) the part is held where the caller put it, its
write's future waiting until its frame goes to the codec threads (gathered into a buffer there). At
most ``window`` frames are being encoded or wait encoded (the one the emitter waits for always gets
in), and at most ``out_slots`` output chunks are in flight. So a writer holds at most ``buffers +
window + 1`` frame buffers, as many encoded frames and ``out_slots`` chunks, whatever the order and
size of its writes; beyond that its writes or their futures wait, which is the caller's backpressure.
A caller that waits for a write's future has written every byte of the frames up to the last one that
write touches (a packer, a copy through staging slots): it never waits forever.

The tier's write throughput is measured as stored bytes over its *busy* time (while at least one of
its writes is in flight), so a writer starved by its compressor does not make the tier look slow, and
one paced by the tier's budget does not either (a paced write counts from when the budget lets it go):
it feeds the tier's ``Adaptive``, shared by every writer of the tier. What pays is decided per frame
with this writer's own budget (the tier's where it paces this writer's work, else none), so a paced
background demotion and a blocking save writing to one tier at once each decide with their own.
"""

from __future__ import annotations

import errno
import heapq
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tierckpt.datapath import codecpool
from tierckpt.datapath.codecemit import OUT_SLOTS, Emitter, Stopped
from tierckpt.datapath.codecframes import EMITTED, EMITTING, ENCODED, MISSING, QUEUED, READY, Frame, Piece, Write
from tierckpt.errors import TierFullError, TierIOError
from tierckpt.format.codec import Encoded, encode_frame
from tierckpt.format.frameindex import DEFAULT_FRAME_BYTES, MAX_FRAME_BYTES, MIN_FRAME_BYTES
from tierckpt.format.frames import FrameIndex, wrap_manifest
from tierckpt.format.manifest import Manifest, ManifestHead
from tierckpt.io.buffers import memmove
from tierckpt.policies.compression import Adaptive, Kind, frame_kinds
from tierckpt.tiers.base import Tier, TierWriter

__all__ = ["CodecWriter", "codec_writer", "frame_bytes_for"]

#: how long the emitter waits for the next frame while it holds a run of raw frames' memory before it
#: copies the run out (its caller may be waiting for that memory before it writes the next frame)
SETTLE_SECS = 0.002
#: a part of a write to copy into its frame's buffer: (frame, its buffer, the part)
_Copy = tuple[Frame, torch.Tensor, Piece]


def frame_bytes_for(manifest: Manifest | ManifestHead) -> int:
    """``F`` for a copy of ``manifest``: its checksum chunk (version 5 on), so that a verified range read
    decodes the frames of the chunks it reads; within the format's 64 KiB to 64 MiB (4 MiB where the
    chunk is no power of two, or for a manifest before version 5)."""
    f = manifest.chunk_bytes if manifest.version >= 5 else DEFAULT_FRAME_BYTES
    if f <= 0 or f & (f - 1):
        return DEFAULT_FRAME_BYTES
    return min(max(f, MIN_FRAME_BYTES), MAX_FRAME_BYTES)


class CodecWriter(TierWriter):
    """A tier's writer that stores each blob's frames encoded (see the module docstring).

    Args:
        tier: the tier (its name, for errors; its budget, for the decisions).
        inner: the tier's writer, taking stored bytes (an in-order one for a sequential tier).
        end_blob: tells ``inner`` that a blob's stored stream ends at a length (its last write's end),
            shorter than the blob: :func:`~tierckpt.datapath.blobcopy.ordered_writer`'s.
        manifest: the copy's manifest (or the plan of it: raw blob sizes, ``align``, tensor table).
        adaptive: the tier's decisions.
        chunk_bytes: bytes of each write to ``inner`` (the tier's geometry's chunk, a multiple of
            ``manifest.align``).
        background: whether the writes are paced by the tier's budget (its rate then bounds the
            throughput the decisions assume).
        window: frames being encoded or waiting encoded at most (default: twice the codec threads, plus 2).
        buffers: frames not yet handed to the codec threads that hold a frame buffer at most (default:
            half the window, at least 2).
        out_slots: output chunks in flight to ``inner`` at most.
    """

    def __init__(
        self,
        tier: Tier,
        inner: TierWriter,
        end_blob: Callable[[int, int], None],
        manifest: Manifest | ManifestHead,
        adaptive: Adaptive,
        *,
        chunk_bytes: int,
        background: bool = True,
        window: int | None = None,
        buffers: int | None = None,
        out_slots: int = OUT_SLOTS,
    ) -> None:
        table = manifest.manifest() if isinstance(manifest, ManifestHead) else manifest
        self._tier, self._inner, self._end, self._adaptive = tier, inner, end_blob, adaptive
        self._sizes = [b.size for b in table.blobs]
        self._align, self._chunk = table.align, chunk_bytes
        if chunk_bytes <= 0 or chunk_bytes % table.align:
            raise ValueError(
                f"codec writer: chunk of {chunk_bytes} bytes is no multiple of the alignment {table.align}"
            )
        self._F = frame_bytes_for(table)
        self._kinds: list[list[Kind]] = frame_kinds(self._sizes, table.tensors, self._F)
        self._first = [0]
        for s in self._sizes:
            self._first.append(self._first[-1] + -(-s // self._F))
        self._total = self._first[-1]
        self._blob_of = [b for b, s in enumerate(self._sizes) for _ in range(-(-s // self._F))]
        threads = codecpool.ensure(adaptive.cfg.threads)
        self._window = window if window is not None else 2 * threads + 2
        self._max_buffered = buffers if buffers is not None else max(2, self._window // 2)
        if self._window < 1 or self._max_buffered < 1:
            raise ValueError(f"codec writer: window {self._window} and buffers {self._max_buffered}: at least 1 each")
        budget = tier.budget
        #: this writer's bound on the tier's throughput: its budget's rate where that paces the writes
        self.budget = budget.bytes_per_sec if budget is not None and budget.paces(background) else None
        # shared state, under _cv
        self._cv = threading.Condition()
        self._state = bytearray(self._total)  # per frame (blob-major)
        self._frames: dict[int, Frame] = {}  # the frames on their way
        self._buffered = 0  # frames not yet handed to the pool that hold a buffer
        self._ready: list[int] = []  # heap of frames whose bytes are in, not yet handed to the pool
        self._pending = 0  # frames queued, being encoded, or encoded and not yet emitted
        self._running = 0  # encode tasks of this writer that started and have not finished
        self._cursor = 0  # the next frame the emitter takes
        self._error: BaseException | None = None
        self._emitter: threading.Thread | None = None
        self._index: FrameIndex | None = None
        self._out = Emitter(
            inner, end_blob, self._sizes, self._F, align=table.align, chunk_bytes=chunk_bytes, adaptive=adaptive,
            paced=self.budget is not None, out_slots=out_slots, stopped=lambda: self._error is not None,
            failed=self._failed, memory_align=tier.geometry.memory_alignment_bytes,
        )  # fmt: skip

    # -- the caller's side ----------------------------------------------------------------------------------
    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        """Take raw bytes ``[offset, offset + nbytes)`` of blob ``blob`` from ``addr``; the future resolves
        once the memory is no longer read (the bytes are encoded, copied out, or copied into a frame
        buffer). Waits while the frame buffers are all taken (the module docstring says when)."""
        size = self._sizes[blob]
        if offset < 0 or nbytes <= 0 or offset + nbytes > size:
            raise ValueError(f"codec writer: a write of [{offset}, +{nbytes}) is outside blob {blob} of {size} bytes")
        w = Write(nbytes)
        F, base = self._F, self._first[blob]
        copies: list[_Copy] = []  # parts to copy into their frames' buffers, outside the lock
        later: list[tuple[Frame, Piece]] = []  # parts of frames that have no buffer yet
        with self._cv:
            self._check_going()
            spans = [(k, k * F, min(size, (k + 1) * F)) for k in range(offset // F, -(-(offset + nbytes) // F))]
            for k, lo, hi in spans:  # checked first: a refused write leaves nothing behind
                self._check_fresh(blob, k, max(lo, offset) - lo, min(hi, offset + nbytes) - lo)
            self._start_emitter()
            for k, lo, hi in spans:
                a, z = max(lo, offset), min(hi, offset + nbytes)
                fr = self._frames.get(base + k) or self._frames.setdefault(base + k, Frame(base + k, blob, k, hi - lo))
                fr.claim(a - lo, z - lo)
                piece = Piece(a - lo, addr + a - offset, z - a, w)
                if z - a == fr.raw_len:  # the whole frame: read where it is
                    fr.hold(piece)
                    self._arrived(fr)
                elif (buf := self._buffer(fr, wait=False)) is not None:
                    copies.append((fr, buf, piece))
                else:
                    later.append((fr, piece))
        while True:
            for _, buf, p in copies:  # outside the lock: each part is this write's own bytes of its frame
                memmove(buf.data_ptr() + p.at, p.addr, p.nbytes)
            with self._cv:
                for fr, _, p in copies:
                    fr.copied += p.nbytes
                    if fr.complete() and self._error is None:
                        self._arrived(fr)
                copies = self._place(later)
                if not copies:
                    w.release(self._error if later else None)  # its own hold: it is in (or not all of it)
                    return w.future

    def write_encoded(self, blob: int, k: int, enc: Encoded) -> Future[int]:
        """Take frame ``k`` of blob ``blob`` already encoded (a compressed copy's frame passing through:
        :mod:`~tierckpt.datapath.recode`): stored as it is, neither planned, encoded nor measured. Its
        streams are read where they are; the future resolves once the emitter copied them out. Frames
        handed over so count in the window like encoded ones (:meth:`write`'s frames wait for room).

        Raises:
            ValueError: no such frame, a frame written before, or streams that do not fit its raw length.
        """
        if not (0 <= blob < len(self._sizes) and 0 <= k < self._first[blob + 1] - self._first[blob]):
            raise ValueError(f"codec writer: blob {blob} has no frame {k}")
        fr = Frame(self._first[blob] + k, blob, k, min(self._F, self._sizes[blob] - k * self._F))
        w = Write(fr.raw_len)
        fr.take_encoded(enc, w, f"codec writer: blob {blob} frame {k} handed over encoded")
        with self._cv:
            self._check_going()
            self._check_fresh(blob, k, 0, fr.raw_len)
            self._start_emitter()
            self._frames[fr.t] = fr
            self._state[fr.t] = fr.state = ENCODED
            self._pending += 1
            self._cv.notify_all()
        w.release()
        return w.future

    def _place(self, later: list[tuple[Frame, Piece]]) -> list[_Copy]:
        """Under the lock: hold the parts of ``later`` that get no frame buffer, up to one that does (its
        copy, returned); what the writer stopping left stays in ``later``."""
        while later and self._error is None:
            fr, p = later[0]
            buf = self._buffer(fr, wait=True)
            if buf is not None:
                later.pop(0)
                return [(fr, buf, p)]
            if self._error is None:
                later.pop(0)
                fr.hold(p)
                if fr.complete():
                    self._arrived(fr)
        return []

    def _buffer(self, fr: Frame, *, wait: bool) -> torch.Tensor | None:
        """Under the lock: frame ``fr``'s buffer to copy a part into: its own, or a new one while fewer
        than ``buffers`` frames not yet handed to the pool hold one; with ``wait``, once one of those
        goes, as long as the emitter's next frame has all its bytes. None at once where it has not, or
        the writer stopped: the part is held instead."""
        while self._error is None:
            if fr.buf is not None:
                return fr.buf
            if self._buffered < self._max_buffered:
                self._buffered += 1
                return fr.new_buffer()
            if not wait or self._cursor >= self._total or self._state[self._cursor] == MISSING:
                return None
            self._cv.wait()
        return None

    def _check_fresh(self, blob: int, k: int, lo: int, hi: int) -> None:
        """Refuse a write of bytes ``[lo, hi)`` of frame ``k`` of which some were written before."""
        t = self._first[blob] + k
        fr = self._frames.get(t)
        if self._state[t] != MISSING or (fr is not None and fr.claimed(lo, hi)):
            raise ValueError(f"codec writer: bytes of blob {blob} frame {k} are written twice")

    def _check_going(self) -> None:
        if self._error is not None:
            raise self._error

    def _start_emitter(self) -> None:
        if self._emitter is None:
            self._emitter = threading.Thread(
                target=self._emit_all, name=f"tierckpt-codec-{self._tier.name}", daemon=True
            )
            self._emitter.start()

    def _arrived(self, fr: Frame) -> None:
        """Under the lock: the frame's raw bytes are all in: queue it for encoding."""
        self._state[fr.t] = fr.state = READY
        heapq.heappush(self._ready, fr.t)
        self._schedule()

    def _schedule(self) -> None:
        """Under the lock: hand ready frames to the pool, lowest first, while the window allows (the one
        the emitter waits for always)."""
        while self._ready and self._error is None:
            t = self._ready[0]
            if self._pending >= self._window and t != self._cursor:
                return
            heapq.heappop(self._ready)
            fr = self._frames[t]
            self._state[t] = fr.state = QUEUED
            self._pending += 1
            if fr.buf is not None:  # its buffer is the pool's share now: another frame may have one
                self._buffered -= 1
                self._cv.notify_all()
            fr.task = codecpool.submit(self._encode, fr)

    # -- the codec threads -----------------------------------------------------------------------------------
    def _encode(self, fr: Frame) -> None:
        """On a codec thread: plan the frame and encode it; its caller's memory is given back once the
        stored bytes are the encoder's own (a frame that stays raw is copied out by the emitter first)."""
        with self._cv:
            if self._error is not None:  # stopped while this task was starting
                fr.drop_source(self._error)
                return
            self._running += 1
        kind = self._kinds[fr.blob][fr.k]
        enc: Encoded | None = None
        error: BaseException | None = None
        try:
            gathered = fr.gather()  # the frame is this task's: no one else touches its pieces now
            if gathered:
                with self._cv:
                    for w in gathered:
                        w.release()
            assert fr.src is not None
            # planned now, not as it arrived: the frames before it were measured meanwhile
            plan = fr.plan = self._adaptive.plan(kind, self.budget)
            if plan.sample and plan.measure is not None:  # stored raw; a sample compressed only to measure it
                m = plan.measure
                n = min(len(fr.src), plan.sample) // max(1, m.width) * max(1, m.width)
                if n:
                    sample = encode_frame(fr.src[:n], m.width, m.try_planes, self._adaptive.level)
                    self._adaptive.observe_frame(kind, sample, m)
            enc = encode_frame(fr.src, plan.width, plan.try_planes, self._adaptive.level)
            if plan.width:
                self._adaptive.observe_frame(kind, enc, plan)
        except BaseException as e:
            error = e
        with self._cv:
            self._running -= 1
            if error is not None:
                self._stop(error)
            if self._error is not None:
                fr.drop_source(self._error)
            else:
                assert enc is not None
                fr.enc = enc
                self._state[fr.t] = fr.state = ENCODED
                if enc.width != 0:
                    fr.drop_source()
            self._cv.notify_all()

    # -- the emitter -----------------------------------------------------------------------------------------
    def _emit_all(self) -> None:
        """The emitter thread: every frame in order, into output chunks written to the tier."""
        try:
            for t in range(self._total):
                self._emit_next(t)
            self._out.drain()
        except Stopped:
            pass
        except BaseException as e:
            with self._cv:
                self._stop(e)
        finally:
            self._out.close()  # after an error: once the tier's writes no longer read the output chunks
            with self._cv:
                self._cv.notify_all()

    def _emit_next(self, t: int) -> None:
        """Emit frame ``t`` once it is encoded; then give back its source and let the next ones in."""
        fr = self._next_encoded(t)
        assert fr.enc is not None
        try:
            self._out.emit(fr.blob, fr.k, fr.enc, lambda: self._let_go(fr))
        except Stopped:
            raise
        except BaseException as e:
            with self._cv:
                self._stop(e)
            raise
        finally:
            with self._cv:
                fr.enc = None
                del self._frames[t]
                self._state[t] = fr.state = EMITTED
                self._pending -= 1
                self._cursor = t + 1
                self._schedule()
                self._cv.notify_all()  # a write waiting for a frame buffer looks at the next frame

    def _let_go(self, fr: Frame) -> None:
        """The emitter no longer reads frame ``fr``'s raw bytes: give the caller's memory back."""
        with self._cv:
            fr.drop_source(self._error)
            self._cv.notify_all()

    def _next_encoded(self, t: int) -> Frame:
        """Frame ``t`` once it is encoded. Where the emitter holds raw frames' memory for a run
        (:mod:`~tierckpt.datapath.codecemit`) and some of frame ``t``'s bytes are still to come after
        :data:`SETTLE_SECS`, the run is copied out first: its caller may be waiting for that memory
        before it writes them."""
        while True:
            with self._cv:
                deadline = None
                while True:
                    if self._error is not None:
                        raise Stopped
                    fr = self._frames.get(t)
                    if fr is not None and fr.state == ENCODED:
                        fr.state = EMITTING  # its source is the emitter's to give back now
                        return fr
                    if not self._out.holding() or self._state[t] != MISSING:  # its bytes are in: it comes
                        self._cv.wait()
                        continue
                    now = time.perf_counter()
                    deadline = deadline or now + SETTLE_SECS
                    if now >= deadline:
                        break
                    self._cv.wait(deadline - now)
            self._out.settle()

    def _failed(self, error: BaseException) -> None:
        """A write to the tier failed (on the thread that completed it): the writer stops."""
        with self._cv:
            self._stop(error)

    # -- stopping --------------------------------------------------------------------------------------------
    def _stop(self, error: BaseException) -> None:
        """Under the lock: stop on the first error (:meth:`_refused` says how a tier's refusal is told);
        give back the caller's memory no codec thread reads."""
        if self._error is None:
            self._error = self._refused(error)
        for fr in self._frames.values():
            if fr.state == QUEUED:
                if fr.task is not None and fr.task.cancel():  # never ran; one that runs gives it back itself
                    fr.drop_source(self._error)
            elif fr.state in (READY, ENCODED):
                fr.drop_source(self._error)
            elif fr.state == MISSING:  # its buffer may be written by a write's copy: kept
                fr.release_held(self._error)
        self._ready.clear()
        self._cv.notify_all()

    def _refused(self, error: BaseException) -> BaseException:
        """``error`` as the writer tells it: a write the tier refused for room (a TierFullError: every one
        that stops a writer comes from a write) as a plain I/O error (ENOSPC) caused by it. Committing
        again cannot make that write again, so the mover must not make room and retry (evicting copies
        for nothing; only the tier's own commit's TierFullError is retried); and the copy fails the same
        whether a write's future or the commit tells it."""
        if not isinstance(error, TierFullError):
            return error
        told = TierIOError(
            error.errno or errno.ENOSPC, f"tier {self._tier.name!r}: a write of this copy failed: {error}"
        )
        told.__cause__ = error
        return told

    def _wait_quiet(self) -> None:
        """Wait until no codec thread works for this writer and the emitter has left."""
        with self._cv:
            while self._running:
                self._cv.wait()
        if self._emitter is not None:
            self._emitter.join()

    # -- commit, abort ---------------------------------------------------------------------------------------
    def commit(self, manifest: bytes) -> None:
        """Wait for every frame to be stored, then commit ``manifest`` wrapped with the frame index (or
        ``manifest`` itself when no frame was compressed). The first error of the writer is raised (it
        stays abortable); a :class:`~tierckpt.errors.TierFullError` of the tier's commit leaves it as
        it was, so that committing again retries only that."""
        if self._index is None:
            with self._cv:
                self._check_going()
                missing = next((t for t in range(self._total) if self._state[t] == MISSING), None)
                if missing is not None:
                    b = self._blob_of[missing]
                    raise ValueError(
                        f"codec writer: blob {b} frame {missing - self._first[b]} was not written before the commit"
                    )
                self._start_emitter()  # a copy of empty blobs only
            self._wait_quiet()
            self._check_going()
            self._index = self._out.index()
        index = self._index
        self._inner.commit(wrap_manifest(manifest, index) if index.compressed_frames() else manifest)

    def cancel(self) -> None:
        """Stop: frames not yet encoded are dropped, nothing more goes to the tier, and the tier's writer
        is cancelled, so that its writes in flight fail soon (an S3 part in its retries gives up)."""
        with self._cv:
            self._stop(RuntimeError(f"tier {self._tier.name!r}: the codec writer was aborted"))
        self._inner.cancel()

    def abort(self) -> None:
        """Stop promptly: :meth:`cancel`; then wait for the encodings running and the tier's writes in
        flight (failing soon now: they read this writer's output chunks, and the tier's own abort may
        free what they write to), and abort the tier's writer."""
        self.cancel()
        self._wait_quiet()
        self._inner.abort()


def codec_writer(
    tier: Tier, inner: TierWriter, end_blob: Callable[[int, int], None], manifest: Manifest | ManifestHead,
    adaptive: Adaptive, **options: Any,
) -> CodecWriter:  # fmt: skip
    """``inner`` (of ``tier``) taking raw blob bytes and storing them encoded: a :class:`CodecWriter`
    (``options``: its keyword arguments, ``chunk_bytes`` among them)."""
    return CodecWriter(tier, inner, end_blob, manifest, adaptive, **options)
