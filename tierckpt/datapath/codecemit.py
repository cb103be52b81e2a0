"""The output side of a codec writer (:mod:`~tierckpt.datapath.codecwrite`): each blob's encoded frames
laid out back to back, in frame order, into aligned output chunks of the tier's geometry, and written to
the tier's writer front to back, one blob after another; the copy's frame index built as they go; the
tier's busy time measured for its :class:`~tierckpt.policies.compression.Adaptive`.

**Raw frames go to the tier from where they are.** A frame stored raw whose stored offset is a chunk
boundary (every frame before it in its blob raw, or the chunk just filled) and whose memory is aligned
for the tier (its ``memory_alignment_bytes``) starts a *run*; the raw frames after it that lie right
after it in memory join it. Each whole chunk of a run is written to the tier straight from that memory,
as a plain copy writes it, and the run's end at its blob's end too; a frame's memory is given back once
every write of its bytes completed. What breaks a run (a compressed frame, a raw one elsewhere in
memory) and what the emitter would otherwise wait with (:meth:`Emitter.settle`: the caller may be
waiting for those frames' memory before it writes the next ones) is copied into an output chunk, as
every frame was before. So a copy ``auto`` leaves raw is written as ``none`` writes it, without a copy.

At most ``out_slots`` writes (output chunks or runs' chunks) are in flight to the tier: the next waits
for the oldest. Output chunks are kept for the next writers (a few per size): fresh memory costs a page
fault a page, as much as the copy into it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from time import perf_counter

import numpy as np
import torch

from tierckpt.datapath.cpumeter import meter_for
from tierckpt.format.codec import Encoded
from tierckpt.format.frames import FrameIndex, IndexBuilder
from tierckpt.format.layout import round_up
from tierckpt.io.buffers import aligned_empty, memmove, ptr_mv
from tierckpt.policies.compression import Adaptive
from tierckpt.tiers.base import TierWriter

__all__ = ["OUT_SLOTS", "Emitter", "Stopped"]

#: output chunks of one writer in flight to its tier at most
OUT_SLOTS = 4
_spare_lock = threading.Lock()
#: output chunks of finished writers, by (bytes, alignment), for the next writers (at most OUT_SLOTS each)
_spare: dict[tuple[int, int], list[torch.Tensor]] = {}


def _take_chunk(nbytes: int, align: int) -> torch.Tensor:
    with _spare_lock:
        free = _spare.get((nbytes, align))
        if free:
            return free.pop()
    return aligned_empty(nbytes, align, pin=False)


def _give_chunk(buf: torch.Tensor, align: int) -> None:
    with _spare_lock:
        free = _spare.setdefault((buf.numel(), align), [])
        if len(free) < OUT_SLOTS:
            free.append(buf)


def _address(stream: bytes | memoryview) -> int:
    """The address of a stream's bytes (a zstd frame's, a plane's, the raw frame's): copied from there
    with ``memmove``, which releases the GIL."""
    return int(np.frombuffer(stream, np.uint8).ctypes.data)


class _Hold:
    """A frame's memory in a run: given back (``done``) once its last reference goes (the run's own,
    and one per write in flight that reads it)."""

    __slots__ = ("done", "refs")

    def __init__(self, done: Callable[[], None]) -> None:
        self.done, self.refs = done, 1


class Stopped(Exception):
    """The writer stopped (an error, or abort): nothing more is handed to the tier."""


class _Busy:
    """The tier's busy time: while at least one write is in flight (from its call, or where a budget
    paces the writer from when the budget let it go); each completed write reports its bytes and the
    busy time since the report before. The copy's first completed write reports nothing: it pays for
    what starts a copy (a new file's first blocks, an object's multipart upload), several times a
    later write's time on a fast disk, and the running average would take many writes to forget it
    (``auto`` compressed the frames it decided meanwhile, on a tier faster than its compressor)."""

    def __init__(self, adaptive: Adaptive) -> None:
        self._adaptive, self._meter = adaptive, meter_for(adaptive)
        self._lock = threading.Lock()
        self._inflight, self._mark, self._busy = 0, 0.0, 0.0
        self._first = True

    def _tick(self, now: float) -> None:
        if self._inflight:
            self._busy += now - self._mark
        self._mark = now

    def start(self) -> None:
        self._meter.start()
        with self._lock:
            self._tick(perf_counter())
            self._inflight += 1

    def end(self, nbytes: int) -> None:
        with self._lock:
            self._tick(perf_counter())
            self._inflight -= 1
            busy, self._busy = self._busy, 0.0
            first, self._first = self._first and nbytes > 0, self._first and nbytes <= 0
        self._meter.end(nbytes)
        if nbytes > 0 and not first:
            self._adaptive.observe_tier(nbytes, busy)


class Emitter:
    """One copy's stored streams, written to the tier (see the module docstring). Used by one thread.

    Args:
        inner: the tier's writer, taking stored bytes (an in-order one for a sequential tier).
        end_blob: tells ``inner`` that a blob's stored stream ends at a length (its last write's end).
        sizes: each blob's raw size.
        frame_bytes: ``F``, raw bytes a frame.
        align: the copy's alignment (each blob's stream is zero-padded to it).
        chunk_bytes: bytes of each write to ``inner`` (a multiple of ``align``).
        adaptive: the tier's decisions, told the tier's throughput.
        paced: whether a budget paces the writes (``inner.write`` waits for it before the write goes).
        out_slots: output chunks in flight to ``inner`` at most.
        stopped: whether the writer stopped: checked before each write to the tier, which then raises
            :class:`Stopped` instead.
        failed: told of a write to the tier that failed (from the thread that completed it).
        memory_align: the alignment of memory the tier writes from as it is (its geometry's
            ``memory_alignment_bytes``): raw frames aligned so are written from their memory; None: every
            frame is copied into an output chunk.
    """

    def __init__(
        self,
        inner: TierWriter,
        end_blob: Callable[[int, int], None],
        sizes: Sequence[int],
        frame_bytes: int,
        *,
        align: int,
        chunk_bytes: int,
        adaptive: Adaptive,
        paced: bool,
        out_slots: int,
        stopped: Callable[[], bool],
        failed: Callable[[BaseException], None],
        memory_align: int | None = None,
    ) -> None:
        self._inner, self._end, self._align, self._chunk = inner, end_blob, align, chunk_bytes
        self._memory_align = memory_align
        self._holds_lock = threading.Lock()
        self._run: deque[tuple[int, _Hold]] = deque()  # the run's frames not yet all written: (end address, hold)
        self._run_addr, self._run_len, self._run_blob = 0, 0, 0  # the run's bytes not yet written
        self._last_frame = [-(-s // frame_bytes) - 1 for s in sizes]
        self._builder = IndexBuilder(sizes, frame_bytes)
        self._busy, self._paced, self._adaptive = _Busy(adaptive), paced, adaptive
        self._out_slots, self._stopped, self._failed = out_slots, stopped, failed
        self._free: list[torch.Tensor] = []  # output chunks not in use
        self._inflight: deque[tuple[torch.Tensor | None, Future[int]]] = deque()
        self._slot: torch.Tensor | None = None
        self._start, self._fill = 0, 0  # the current chunk's offset in its blob's stream, and its bytes

    def emit(self, blob: int, k: int, enc: Encoded, done: Callable[[], None] | None = None) -> None:
        """Append frame ``k`` of ``blob`` (its frames come in order) to its blob's stream; at the blob's
        last frame, write its last chunk (zero-padded to the alignment) and tell the tier where the
        stream ended. ``done`` is called once the emitter no longer reads the frame's streams' memory
        (at once where they were copied; for a raw frame written from its memory, once those writes
        completed, from the thread that completed the last; at the latest in :meth:`close`).

        Raises:
            Stopped: the writer stopped.
            BaseException: a write to the tier that failed (the oldest's error, once it is waited for).
        """
        if k == 0:
            self._start, self._fill = 0, 0
        try:
            if self._join_run(blob, enc, done):
                done = None
            else:
                self.settle()
                for stream in enc.streams:
                    if len(stream):
                        self._append(blob, _address(stream), len(stream))
        finally:
            if done is not None:
                done()
        self._builder.add(blob, k, enc.width, enc.planes, enc.lengths if enc.width else ())
        if k == self._last_frame[blob]:
            if self._run_len and self._run_len % self._align == 0:  # the blob's last write, from the run
                self._write_run(blob, self._run_len)
            self.settle()
            held = self._start + self._fill
            if self._fill:
                end = round_up(self._fill, self._align)
                assert self._slot is not None
                ptr_mv(self._slot.data_ptr() + self._fill, end - self._fill)[:] = bytes(end - self._fill)
                self._flush(blob, end)
            self._end(blob, round_up(held, self._align))

    def _append(self, blob: int, addr: int, length: int) -> None:
        """Copy ``length`` bytes at ``addr`` into output chunks, writing each one it fills."""
        chunk, pos = self._chunk, 0
        while pos < length:
            if self._slot is None:
                self._slot = self._acquire()
            n = min(length - pos, chunk - self._fill)
            memmove(self._slot.data_ptr() + self._fill, addr + pos, n)
            self._fill += n
            pos += n
            if self._fill == chunk:
                self._flush(blob, chunk)

    # -- runs of raw frames, written from their memory ----------------------------------------------------
    def _join_run(self, blob: int, enc: Encoded, done: Callable[[], None] | None) -> bool:
        """Take a raw frame into the run (or start one with it) and write the run's whole chunks; whether
        it was taken (its ``done`` is then the run's to call)."""
        if self._memory_align is None or done is None or enc.width or len(enc.streams) != 1:
            return False
        n = len(enc.streams[0])
        addr = _address(enc.streams[0]) if n else 0
        if not n:
            return False
        if self._run_len:
            if addr != self._run_addr + self._run_len:
                return False
        elif self._fill or addr % self._memory_align:
            return False
        else:
            self._run_addr, self._run_blob = addr, blob
        self._run_len += n
        self._run.append((addr + n, _Hold(done)))
        while self._run_len >= self._chunk:
            self._write_run(blob, self._chunk)
        return True

    def _write_run(self, blob: int, nbytes: int) -> None:
        """Write the run's next ``nbytes`` from their memory; the frames whose bytes all went give up the
        run's reference to their memory (the write holds one until it completes)."""
        lo = self._run_addr
        hi = lo + nbytes
        holds = []  # the frames this write reads: up to the first that ends at or after its end
        for end, h in self._run:
            holds.append(h)
            if end >= hi:
                break
        self._send(blob, lo, nbytes, None, holds)
        self._run_addr, self._run_len = hi, self._run_len - nbytes
        gone = []
        while self._run and self._run[0][0] <= hi:
            gone.append(self._run.popleft()[1])
        self._let_go(gone)

    def holding(self) -> bool:
        """Whether a run holds frames' memory not yet written (:meth:`settle` gives it back)."""
        return self._run_len > 0

    def settle(self) -> None:
        """Copy the run's bytes not yet written into an output chunk and give the frames' memory back
        (once their writes in flight complete)."""
        if not self._run_len:
            return
        addr, n = self._run_addr, self._run_len
        self._run_len = 0
        try:
            self._append(self._run_blob, addr, n)  # less than a chunk, into an empty one: no write
        finally:
            gone = [h for _, h in self._run]
            self._run.clear()
            self._let_go(gone)

    def _let_go(self, holds: Sequence[_Hold]) -> None:
        """Drop one reference to each of ``holds``; give back the memory of those left with none."""
        free = []
        with self._holds_lock:
            for h in holds:
                h.refs -= 1
                if h.refs == 0:
                    free.append(h)
        for h in free:
            h.done()

    def drain(self) -> None:
        """Wait for every write in flight (raising the first error)."""
        while self._inflight:
            self._retire()

    def close(self) -> None:
        """Wait for the writes in flight, whatever they end in (they read the output chunks), and keep
        the chunks for the next writers."""
        while self._inflight:
            slot, f = self._inflight.popleft()
            with contextlib.suppress(BaseException):
                f.exception()
            if slot is not None:
                self._free.append(slot)
        gone = [h for _, h in self._run]  # a run the writer stopped in: its frames' memory given back
        self._run.clear()
        self._run_len = 0
        self._let_go(gone)
        if self._slot is not None:
            self._free.append(self._slot)
            self._slot = None
        for buf in self._free:
            _give_chunk(buf, self._align)
        self._free.clear()

    def index(self) -> FrameIndex:
        """The copy's frame index, once every frame was emitted."""
        return self._builder.build()

    def _acquire(self) -> torch.Tensor:
        if len(self._inflight) >= self._out_slots:
            self._retire()
        return self._free.pop() if self._free else _take_chunk(self._chunk, self._align)

    def _flush(self, blob: int, nbytes: int) -> None:
        """Write the output chunk (``nbytes`` of it) at the stream's current chunk."""
        slot, self._slot = self._slot, None
        assert slot is not None
        self._send(blob, slot.data_ptr(), nbytes, slot, ())
        self._fill = 0

    def _send(self, blob: int, addr: int, nbytes: int, slot: torch.Tensor | None, holds: Sequence[_Hold]) -> None:
        """Write ``nbytes`` at ``addr`` (an output chunk ``slot``, or a run's memory, which ``holds`` keep
        until the write completes) at the stream's current offset."""
        if self._stopped():
            if slot is not None:
                self._free.append(slot)
            raise Stopped
        if slot is None and len(self._inflight) >= self._out_slots:
            self._retire()
        paced = self._paced  # the write waits for the budget first: the tier is busy once it goes
        if not paced:
            self._busy.start()
        try:
            fut = self._inner.write(blob, self._start, addr, nbytes)
        except BaseException:
            if not paced:
                self._busy.end(0)
            if slot is not None:
                self._free.append(slot)
            raise
        if paced:
            self._busy.start()
        with self._holds_lock:
            for h in holds:
                h.refs += 1
        counted: Future[int] = Future()  # the write, once it is also counted (what commit waits for)
        self._inflight.append((slot, counted))
        copied = slot is not None
        fut.add_done_callback(lambda f: self._written(f, nbytes, counted, holds, copied))
        self._start += nbytes

    def _written(self, f: Future[int], nbytes: int, counted: Future[int], holds: Sequence[_Hold], copied: bool) -> None:
        error = f.exception()
        try:
            self._busy.end(0 if error is not None else nbytes)
            if error is not None:
                self._failed(error)
            else:
                self._adaptive.observe_written(nbytes, copied=copied)
        finally:
            self._let_go(holds)
            if error is None:
                counted.set_result(f.result())
            else:
                counted.set_exception(error)

    def _retire(self) -> None:
        """Wait for the oldest write to the tier and take its chunk back."""
        slot, f = self._inflight.popleft()
        try:
            f.result()
        finally:
            if slot is not None:
                self._free.append(slot)
