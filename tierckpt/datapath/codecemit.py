"""The output side of a codec writer (:mod:`~tierckpt.datapath.codecwrite`): each blob's encoded frames
laid out back to back, in frame order, into aligned output chunks of the tier's geometry, and written to
the tier's writer front to back, one blob after another; the copy's frame index built as they go; the
tier's busy time measured for its :class:`~tierckpt.policies.compression.Adaptive`.

At most ``out_slots`` output chunks are in flight to the tier: the next chunk waits for the oldest
write. Output chunks are kept for the next writers (a few per size): fresh memory costs a page fault a
page, as much as the copy into it.
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


class Stopped(Exception):
    """The writer stopped (an error, or abort): nothing more is handed to the tier."""


class _Busy:
    """The tier's busy time: while at least one write is in flight (from its call, or where a budget
    paces the writer from when the budget let it go); each completed write reports its bytes and the
    busy time since the report before."""

    def __init__(self, adaptive: Adaptive) -> None:
        self._adaptive, self._meter = adaptive, meter_for(adaptive)
        self._lock = threading.Lock()
        self._inflight, self._mark, self._busy = 0, 0.0, 0.0

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
        self._meter.end(nbytes)
        if nbytes > 0:
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
    ) -> None:
        self._inner, self._end, self._align, self._chunk = inner, end_blob, align, chunk_bytes
        self._last_frame = [-(-s // frame_bytes) - 1 for s in sizes]
        self._builder = IndexBuilder(sizes, frame_bytes)
        self._busy, self._paced = _Busy(adaptive), paced
        self._out_slots, self._stopped, self._failed = out_slots, stopped, failed
        self._free: list[torch.Tensor] = []  # output chunks not in use
        self._inflight: deque[tuple[torch.Tensor, Future[int]]] = deque()
        self._slot: torch.Tensor | None = None
        self._start, self._fill = 0, 0  # the current chunk's offset in its blob's stream, and its bytes

    def emit(self, blob: int, k: int, enc: Encoded) -> None:
        """Append frame ``k`` of ``blob`` (its frames come in order) to its blob's stream; at the blob's
        last frame, write its last chunk (zero-padded to the alignment) and tell the tier where the
        stream ended.

        Raises:
            Stopped: the writer stopped.
            BaseException: a write to the tier that failed (the oldest's error, once it is waited for).
        """
        chunk = self._chunk
        if k == 0:
            self._start, self._fill = 0, 0
        for stream in enc.streams:
            length, pos = len(stream), 0
            addr = _address(stream) if length else 0
            while pos < length:
                if self._slot is None:
                    self._slot = self._acquire()
                n = min(length - pos, chunk - self._fill)
                memmove(self._slot.data_ptr() + self._fill, addr + pos, n)
                self._fill += n
                pos += n
                if self._fill == chunk:
                    self._flush(blob, chunk)
        self._builder.add(blob, k, enc.width, enc.planes, enc.lengths if enc.width else ())
        if k == self._last_frame[blob]:
            held = self._start + self._fill
            if self._fill:
                end = round_up(self._fill, self._align)
                assert self._slot is not None
                ptr_mv(self._slot.data_ptr() + self._fill, end - self._fill)[:] = bytes(end - self._fill)
                self._flush(blob, end)
            self._end(blob, round_up(held, self._align))

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
            self._free.append(slot)
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
        if self._stopped():
            self._free.append(slot)
            raise Stopped
        paced = self._paced  # the write waits for the budget first: the tier is busy once it goes
        if not paced:
            self._busy.start()
        try:
            fut = self._inner.write(blob, self._start, slot.data_ptr(), nbytes)
        except BaseException:
            if not paced:
                self._busy.end(0)
            self._free.append(slot)
            raise
        if paced:
            self._busy.start()
        counted: Future[int] = Future()  # the write, once it is also counted (what commit waits for)
        self._inflight.append((slot, counted))
        fut.add_done_callback(lambda f: self._written(f, nbytes, counted))
        self._start += nbytes
        self._fill = 0

    def _written(self, f: Future[int], nbytes: int, counted: Future[int]) -> None:
        error = f.exception()
        try:
            self._busy.end(0 if error is not None else nbytes)
            if error is not None:
                self._failed(error)
        finally:
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
            self._free.append(slot)
