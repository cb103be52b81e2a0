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

Memory: a frame that a single write covers is read where the caller's write put it (the write's future
resolves once it is encoded, or for a frame stored raw once it is copied out); a frame that writes cover
in parts is gathered into a frame buffer of its own first (those writes resolve at once). At most
``window`` frames are being encoded or wait encoded (the one the emitter waits for always gets in),
and at most ``out_slots`` output chunks are in flight: beyond that the writes' futures wait, which is
the caller's backpressure.

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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tierckpt.datapath import codecpool
from tierckpt.datapath.codecemit import OUT_SLOTS, Emitter, Stopped
from tierckpt.errors import TierFullError, TierIOError
from tierckpt.format.codec import Encoded, encode_frame
from tierckpt.format.frameindex import DEFAULT_FRAME_BYTES, MAX_FRAME_BYTES, MIN_FRAME_BYTES
from tierckpt.format.frames import FrameIndex, wrap_manifest
from tierckpt.format.manifest import Manifest, ManifestHead
from tierckpt.io.buffers import memmove, ptr_mv
from tierckpt.policies.compression import Adaptive, FramePlan, Kind, frame_kinds
from tierckpt.tiers.base import Tier, TierWriter

__all__ = ["CodecWriter", "codec_writer", "frame_bytes_for"]

# a frame's states: bytes missing, ready to encode, handed to the pool, encoded, being emitted, emitted
_MISSING, _READY, _QUEUED, _ENCODED, _EMITTING, _EMITTED = range(6)


def frame_bytes_for(manifest: Manifest | ManifestHead) -> int:
    """``F`` for a copy of ``manifest``: its checksum chunk (version 5 on), so that a verified range read
    decodes the frames of the chunks it reads; within the format's 64 KiB to 64 MiB (4 MiB where the
    chunk is no power of two, or for a manifest before version 5)."""
    f = manifest.chunk_bytes if manifest.version >= 5 else DEFAULT_FRAME_BYTES
    if f <= 0 or f & (f - 1):
        return DEFAULT_FRAME_BYTES
    return min(max(f, MIN_FRAME_BYTES), MAX_FRAME_BYTES)


class _Write:
    """One raw write of the caller: its future resolves once no frame needs its memory (and the write
    has been taken in: its own hold)."""

    __slots__ = ("error", "future", "holds", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.future: Future[int] = Future()
        self.nbytes, self.holds = nbytes, 1
        self.error: BaseException | None = None

    def release(self, error: BaseException | None = None) -> None:
        """One frame no longer needs the memory (``error``: the writer stopped before it was used)."""
        self.holds -= 1
        self.error = self.error or error
        if self.holds == 0:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.nbytes)


class _Frame:
    """One frame on its way: its raw bytes (``src``: the caller's memory, whose write is ``owner``, or
    ``buf``), then its encoding."""

    __slots__ = (
        "blob", "buf", "copied", "enc", "k", "owner", "parts", "plan", "raw_len", "src", "state", "t", "task",
    )  # fmt: skip

    def __init__(self, t: int, blob: int, k: int, raw_len: int) -> None:
        self.t, self.blob, self.k, self.raw_len = t, blob, k, raw_len
        self.state = _MISSING
        self.copied = 0  # raw bytes in
        self.parts: list[tuple[int, int]] = []  # the frame's ranges claimed by writes of parts of it
        self.buf: torch.Tensor | None = None
        self.src: memoryview | None = None
        self.owner: _Write | None = None
        self.plan: FramePlan | None = None
        self.enc: Encoded | None = None
        self.task: Future[None] | None = None

    def drop_source(self, error: BaseException | None = None) -> None:
        """The raw bytes are no longer needed: give the caller's memory back (or the frame buffer)."""
        owner, self.owner, self.src, self.buf = self.owner, None, None, None
        if owner is not None:
            owner.release(error)


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
        budget = tier.budget
        #: this writer's bound on the tier's throughput: its budget's rate where that paces the writes
        self.budget = budget.bytes_per_sec if budget is not None and budget.paces(background) else None
        # shared state, under _cv
        self._cv = threading.Condition()
        self._state = bytearray(self._total)  # per frame (blob-major)
        self._frames: dict[int, _Frame] = {}  # the frames on their way
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
            failed=self._failed,
        )  # fmt: skip

    # -- the caller's side ----------------------------------------------------------------------------------
    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        """Take raw bytes ``[offset, offset + nbytes)`` of blob ``blob`` from ``addr``; the future resolves
        once the memory is no longer read (the bytes are encoded, or copied out)."""
        size = self._sizes[blob]
        if offset < 0 or nbytes <= 0 or offset + nbytes > size:
            raise ValueError(f"codec writer: a write of [{offset}, +{nbytes}) is outside blob {blob} of {size} bytes")
        w = _Write(nbytes)
        F, base = self._F, self._first[blob]
        parts: list[tuple[_Frame, int, int, int]] = []  # (frame, frame offset, from addr, bytes) copied in
        with self._cv:
            self._check_going()
            spans = [(k, k * F, min(size, (k + 1) * F)) for k in range(offset // F, -(-(offset + nbytes) // F))]
            for k, lo, hi in spans:  # checked first: a refused write leaves nothing behind
                self._check_fresh(blob, k, max(lo, offset) - lo, min(hi, offset + nbytes) - lo)
            self._start_emitter()
            for k, lo, hi in spans:
                a, z = max(lo, offset), min(hi, offset + nbytes)
                fr = self._frames.get(base + k) or self._frames.setdefault(base + k, _Frame(base + k, blob, k, hi - lo))
                if a == lo and z == hi:  # the whole frame: read where it is
                    fr.copied = hi - lo
                    fr.owner, fr.src = w, ptr_mv(addr + lo - offset, hi - lo, writable=False)
                    w.holds += 1
                    self._arrived(fr)
                    continue
                if fr.buf is None:
                    fr.buf = torch.empty(fr.raw_len, dtype=torch.uint8)
                fr.parts.append((a - lo, z - lo))  # claimed now, counted in once copied
                parts.append((fr, a - lo, addr + a - offset, z - a))
        for fr, at, src, n in parts:  # outside the lock: each part is this write's own bytes of the frame
            assert fr.buf is not None
            memmove(fr.buf.data_ptr() + at, src, n)
        with self._cv:
            for fr, _, _, n in parts:
                fr.copied += n
                if fr.copied == fr.raw_len and self._error is None:
                    self._arrived(fr)
            w.release()  # the write's own hold: it is in
        return w.future

    def _check_fresh(self, blob: int, k: int, lo: int, hi: int) -> None:
        """Refuse a write of bytes ``[lo, hi)`` of frame ``k`` of which some were written before."""
        t = self._first[blob] + k
        fr = self._frames.get(t)
        if self._state[t] != _MISSING or (fr is not None and any(a < hi and lo < z for a, z in fr.parts)):
            raise ValueError(f"codec writer: bytes of blob {blob} frame {k} are written twice")

    def _check_going(self) -> None:
        if self._error is not None:
            raise self._error

    def _check_written(self) -> None:
        """At commit: the first error of the writer; a write the tier refused for room (TierFullError) as
        a plain I/O error, since committing again cannot write that part again (only the tier's own
        commit's TierFullError is retried: making room for it would evict copies for nothing)."""
        err = self._error
        if isinstance(err, TierFullError):
            raise TierIOError(err.errno or errno.ENOSPC, f"a write of this copy failed: {err}") from err
        self._check_going()

    def _start_emitter(self) -> None:
        if self._emitter is None:
            self._emitter = threading.Thread(
                target=self._emit_all, name=f"tierckpt-codec-{self._tier.name}", daemon=True
            )
            self._emitter.start()

    def _arrived(self, fr: _Frame) -> None:
        """Under the lock: the frame's raw bytes are all in: queue it for encoding."""
        if fr.src is None:
            assert fr.buf is not None
            fr.src = ptr_mv(fr.buf.data_ptr(), fr.raw_len, writable=False)
        self._state[fr.t] = fr.state = _READY
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
            self._state[t] = fr.state = _QUEUED
            self._pending += 1
            fr.task = codecpool.submit(self._encode, fr)

    # -- the codec threads -----------------------------------------------------------------------------------
    def _encode(self, fr: _Frame) -> None:
        """On a codec thread: plan the frame and encode it; its caller's memory is given back once the
        stored bytes are the encoder's own (a frame that stays raw is copied out by the emitter first)."""
        with self._cv:
            if self._error is not None:  # stopped while this task was starting
                fr.drop_source(self._error)
                return
            self._running += 1
        kind = self._kinds[fr.blob][fr.k]
        assert fr.src is not None
        enc: Encoded | None = None
        error: BaseException | None = None
        try:  # planned now, not as it arrived: the frames before it were measured meanwhile
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
                self._state[fr.t] = fr.state = _ENCODED
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
            self._out.emit(fr.blob, fr.k, fr.enc)
        except Stopped:
            raise
        except BaseException as e:
            with self._cv:
                self._stop(e)
            raise
        finally:
            with self._cv:
                fr.drop_source(self._error)
                fr.enc = None
                del self._frames[t]
                self._state[t] = fr.state = _EMITTED
                self._pending -= 1
                self._cursor = t + 1
                self._schedule()

    def _next_encoded(self, t: int) -> _Frame:
        with self._cv:
            while True:
                if self._error is not None:
                    raise Stopped
                fr = self._frames.get(t)
                if fr is not None and fr.state == _ENCODED:
                    fr.state = _EMITTING  # its source is the emitter's to give back now
                    return fr
                self._cv.wait()

    def _failed(self, error: BaseException) -> None:
        """A write to the tier failed (on the thread that completed it): the writer stops."""
        with self._cv:
            self._stop(error)

    # -- stopping --------------------------------------------------------------------------------------------
    def _stop(self, error: BaseException) -> None:
        """Under the lock: stop on the first error; give back the caller's memory no codec thread reads."""
        if self._error is None:
            self._error = error
        for fr in self._frames.values():
            if fr.state == _QUEUED:
                if fr.task is not None and fr.task.cancel():  # never ran; one that runs gives it back itself
                    fr.drop_source(self._error)
            elif fr.state in (_READY, _ENCODED):
                fr.drop_source(self._error)
        self._ready.clear()
        self._cv.notify_all()

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
                self._check_written()
                missing = next((t for t in range(self._total) if self._state[t] == _MISSING), None)
                if missing is not None:
                    b = self._blob_of[missing]
                    raise ValueError(
                        f"codec writer: blob {b} frame {missing - self._first[b]} was not written before the commit"
                    )
                self._start_emitter()  # a copy of empty blobs only
            self._wait_quiet()
            self._check_written()
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
