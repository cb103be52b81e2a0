"""The input side of a codec writer (:mod:`~tierckpt.datapath.codecwrite`): one frame's raw bytes on
their way to the encoder, and the callers' writes whose memory they are.

A frame's bytes arrive in pieces, each a part of one caller's write: a piece is either copied into the
frame's buffer (its write need not wait for the frame) or *held*, read later where the caller's write
put it (the write's future waits until the frame no longer needs it). A frame that one write covers
whole is held, and read in place by the encoder; the held pieces of any other frame are gathered into
its buffer once the frame is handed to the encoder (:meth:`Frame.gather`). Which pieces are copied and
which held, and how many frame buffers may exist, is the writer's decision.

Not thread-safe: the writer calls everything here under its lock, but :meth:`Frame.gather` and the
copies into a frame's buffer (outside it, on the bytes only their caller touches).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch

from tierckpt.format.codec import Encoded
from tierckpt.io.buffers import memmove, ptr_mv
from tierckpt.policies.compression import FramePlan

__all__ = [
    "EMITTED", "EMITTING", "ENCODED", "MISSING", "QUEUED", "READY", "Frame", "Piece", "Write", "check_encoded",
    "frame_buffer",
]  # fmt: skip

# a frame's states: bytes missing, ready to encode, handed to the pool, encoded, being emitted, emitted
MISSING, READY, QUEUED, ENCODED, EMITTING, EMITTED = range(6)


def frame_buffer(nbytes: int) -> torch.Tensor:
    """A frame buffer of ``nbytes`` (the one place they are made: tests count them)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def check_encoded(enc: Encoded, raw_len: int, where: str) -> None:
    """Refuse a frame of ``raw_len`` raw bytes handed over encoded whose streams break a rule of the frame
    index (docs/format.md): compressed (width 1, 2, 4 or 8), its plane mask within the width, a zstd
    stream shorter than the raw bytes it stands for, a raw plane exactly ``raw_len / w`` bytes.

    Raises:
        ValueError: naming ``where`` (the frame) and what is wrong.
    """
    w, planes, lengths = enc.width, enc.planes, enc.lengths
    if w == 1:
        ok = planes == 1 and len(lengths) == 1 and lengths[0] < raw_len
    elif w in (2, 4, 8) and raw_len % w == 0 and 0 < planes < 1 << w and len(lengths) == w:
        plane = raw_len // w
        ok = all(n < plane if planes >> p & 1 else n == plane for p, n in enumerate(lengths))
    else:
        ok = False
    if not ok:
        raise ValueError(f"{where}: width {w}, planes {planes:#x}, streams {lengths} for {raw_len} raw bytes")


class Write:
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


class Piece(NamedTuple):
    """Bytes ``[at, at + nbytes)`` of a frame, at ``addr`` in the memory of ``write``."""

    at: int
    addr: int
    nbytes: int
    write: Write


class Frame:
    """One frame on its way: its raw bytes (held pieces, or its buffer), then its encoding."""

    __slots__ = (
        "blob", "buf", "copied", "enc", "held", "k", "parts", "plan", "raw_len", "src", "state", "t", "task",
    )  # fmt: skip

    def __init__(self, t: int, blob: int, k: int, raw_len: int) -> None:
        self.t, self.blob, self.k, self.raw_len = t, blob, k, raw_len
        self.state = MISSING
        self.copied = 0  # raw bytes in (copied into the buffer, or held)
        self.parts: list[tuple[int, int]] = []  # the frame's ranges claimed by writes
        self.held: list[Piece] = []  # pieces read where their writes put them
        self.buf: torch.Tensor | None = None
        self.src: memoryview | None = None  # the raw bytes, once gathered
        self.plan: FramePlan | None = None
        self.enc: Encoded | None = None
        self.task: Future[None] | None = None

    def claimed(self, lo: int, hi: int) -> bool:
        """Whether a write claimed some of bytes ``[lo, hi)`` before."""
        return any(a < hi and lo < z for a, z in self.parts)

    def claim(self, lo: int, hi: int) -> None:
        """Claim bytes ``[lo, hi)`` for a write (none claimed before)."""
        self.parts.append((lo, hi))

    def hold(self, piece: Piece) -> None:
        """Read ``piece`` where its write put it, later: the write waits for this frame."""
        self.held.append(piece)
        piece.write.holds += 1
        self.copied += piece.nbytes

    def complete(self) -> bool:
        return self.copied == self.raw_len

    def new_buffer(self) -> torch.Tensor:
        """Give the frame a buffer (it has none), to copy its pieces into."""
        self.buf = frame_buffer(self.raw_len)
        return self.buf

    def gather(self) -> list[Write]:
        """Make ``src`` the frame's raw bytes: the caller's memory of a frame that one write covers, else
        the buffer (made if there is none) with the held pieces copied in; the writes of the pieces
        copied, to release (outside the writer's lock: the frame is the encoder's now)."""
        if self.buf is None and len(self.held) == 1 and self.held[0].nbytes == self.raw_len:
            self.src = ptr_mv(self.held[0].addr, self.raw_len, writable=False)
            return []
        base = (self.buf if self.buf is not None else self.new_buffer()).data_ptr()
        for p in self.held:
            memmove(base + p.at, p.addr, p.nbytes)
        done, self.held = [p.write for p in self.held], []
        self.src = ptr_mv(base, self.raw_len, writable=False)
        return done

    def release_held(self, error: BaseException | None = None) -> None:
        """Give the held pieces' memory back to their writes (``error``: unused, the writer stopped)."""
        held, self.held = self.held, []
        for p in held:
            p.write.release(error)

    def take_encoded(self, enc: Encoded, write: Write, where: str) -> None:
        """Make the frame ``enc`` as it is (handed over encoded: nothing is planned or encoded); ``write``
        waits until the emitter no longer reads its streams (:meth:`drop_source`).

        Raises:
            ValueError: streams that do not fit the frame (:func:`check_encoded`), naming ``where``.
        """
        check_encoded(enc, self.raw_len, where)
        self.claim(0, self.raw_len)
        self.hold(Piece(0, 0, self.raw_len, write))
        self.enc = enc

    def drop_source(self, error: BaseException | None = None) -> None:
        """The raw bytes are no longer needed: give the caller's memory back, drop the buffer."""
        self.src, self.buf = None, None
        self.release_held(error)
