"""One read of a codec reader (:mod:`tierckpt.datapath.codecread`) carried out: its plan's reads of the tier
beneath submitted at once (:mod:`tierckpt.datapath.codecplan`), each checked as it lands (a short read
is a truncated copy; the padding after a blob's stored stream must be zero), then what it holds moved,
copied out or decoded in the codec pool, while the other reads are still in flight. The caller's future
completes once every part is in place or has failed: never while a part may still write its memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
import zstandard

from tierckpt.datapath.codecplan import Piece, Plan, Staged
from tierckpt.datapath.verifier import Where
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import native as nat
from tierckpt.format.codec import decode_frame
from tierckpt.format.frames import Frame, FrameIndex
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import memmove, ptr_mv
from tierckpt.tiers.base import TierReader

__all__ = ["Edge", "Job", "Reader"]

#: what a staged read is handed: its buffer, or why there is none
Go = Callable[[torch.Tensor | None, BaseException | None], None]


@dataclass
class Edge:
    """A compressed frame decoded whole, for the reads that want part of it.

    Attributes:
        buf: its raw bytes, once ``done``.
        done: set once decoded (or failed).
        given: the parts of it handed to reads so far (raw offsets in the frame, merged).
    """

    buf: torch.Tensor
    done: Future[None] = field(default_factory=Future)
    given: list[tuple[int, int]] = field(default_factory=list)


class Reader(Protocol):
    """What a read uses of its codec reader (:class:`tierckpt.datapath.codecread._CodecReader`)."""

    inner: TierReader
    index: FrameIndex
    where: Where
    pool: Executor
    ends: list[int]

    @property
    def blobs(self) -> Sequence[BlobEntry]: ...

    def stage(self, blob: int, nbytes: int, go: Go) -> None: ...
    def give(self, buf: torch.Tensor, *, reuse: bool = True) -> None: ...
    def gave(self, blob: int, k: int, edge: Edge, lo: int, hi: int) -> None: ...
    def forget(self, blob: int, k: int, edge: Edge) -> None: ...


class _Stage:
    """A staged read's buffer, given back once every piece it holds is out of it."""

    def __init__(self, buf: torch.Tensor, pieces: int) -> None:
        self.buf, self.left, self.lock = buf, pieces, threading.Lock()

    def out(self) -> bool:
        """One piece is out: whether it was the last."""
        with self.lock:
            self.left -= 1
            return self.left == 0


class Job:
    """One read of raw bytes ``[lo, lo + n)`` of ``blob`` to ``addr``; ``out`` gets its result.

    The reader fills :attr:`edges` (the partly wanted compressed frames: the kept frame buffer and
    whether this read decodes it), then calls :meth:`start` with the plan.
    """

    def __init__(
        self, r: Reader, blob: int, lo: int, n: int, addr: int, out: Future[int], frames: list[tuple[int, Frame]]
    ) -> None:
        self.r, self.blob, self.lo, self.n, self.addr, self.out, self.frames = r, blob, lo, n, addr, out, frames
        self.edges: dict[int, tuple[Edge, bool]] = {}
        self.lock = threading.Lock()
        self.left = 1  # parts not finished; 1: start() itself
        self.error: BaseException | None = None
        self.plan = Plan((), ())
        self.placed: list[bool | None] = []  # each direct read: in place, failed, or not yet
        self.after: dict[int, list[Callable[[bool], None]]] = {}  # copies waiting for a direct read

    def start(self, plan: Plan) -> None:
        """Submit every read of ``plan``: straight ones first (staged copies may wait for them)."""
        self.plan, self.placed = plan, [None] * len(plan.directs)
        for j, d in enumerate(plan.directs):
            self._hold()
            self._read(d.at, self.addr + d.land, d.nbytes, partial(self._direct_landed, j))
        for s in plan.staged:
            self._hold()
            self.r.stage(self.blob, s.nbytes, partial(self._staged_go, s))
        for k, (edge, mine) in self.edges.items():
            if not mine:  # another read decodes it: copy out of it once it has
                self._hold()
                edge.done.add_done_callback(partial(self._edge_decoded, k, edge))
        self._release(None)

    def _read(self, at: int, addr: int, nbytes: int, landed: Callable[[Future[int]], None]) -> None:
        try:
            fut = self.r.inner.read(self.blob, at, addr, nbytes)
        except BaseException as e:  # told through the caller's future, once the other parts are done
            fut = Future()
            fut.set_exception(e)
        fut.add_done_callback(landed)

    def _submit(self, failed: Callable[[BaseException], None], fn: Callable[..., None], *args: object) -> None:
        try:
            self.r.pool.submit(fn, *args)
        except BaseException as e:  # the pool is shut down (the interpreter exits)
            failed(e)

    # -- errors -------------------------------------------------------------------------------------------
    def _bad(self, message: str, k: int | None = None) -> CorruptCheckpointError:
        if k is not None:
            f = self.r.index.frame(self.blob, k)
            at = f"frame at raw offset {f.raw_offset}"  # decode_frame's words for it: said once
            message = message[len(at) :] if message.startswith(at) else f": {message}"
            count = self.r.index.count(self.blob)
            message = f"frame {k} of {count} (raw bytes [{f.raw_offset}, {f.raw_offset + f.raw_len})){message}"
        return self.r.where.error(message, blob=self.r.blobs[self.blob].name)

    def _as_damage(self, e: BaseException, k: int) -> BaseException:
        if isinstance(e, CorruptCheckpointError):
            return self._bad(str(e) if e.tier is None else str(e.strerror), k)
        if isinstance(e, (zstandard.ZstdError, ValueError)):
            return self._bad(f"{type(e).__name__}: {e}", k)
        return e

    def _check(self, at: int, nbytes: int, got: int, first: int) -> None:
        """Raise if the tier returned fewer than ``nbytes`` bytes at ``at`` (whose first wanted stored byte
        is ``first``): the copy is truncated."""
        if got < nbytes:
            end = at + got
            ends = (f.stored_offset + f.stored_len for _, f in self.frames)
            k = next((k for (k, _), e in zip(self.frames, ends) if e > max(end, first)), None)
            held, region = self.r.index.held[self.blob], self.r.ends[self.blob]
            what = f"its stored stream of {held} bytes (padded to {region})"
            raise self._bad(f"the copy is truncated: {what} ends at byte {end}", k)

    # -- reads straight into place ------------------------------------------------------------------------
    def _direct_landed(self, j: int, fut: Future[int]) -> None:
        d = self.plan.directs[j]
        try:
            self._check(d.at, d.nbytes, fut.result(), d.at + d.nbytes - d.keep)
        except BaseException as e:
            self._placed(j, e)
            return
        if d.shift:  # its wanted bytes down to where they belong, in the pool
            self._submit(partial(self._placed, j), self._shift, j)
        else:
            self._placed(j, None)

    def _shift(self, j: int) -> None:
        d = self.plan.directs[j]
        memmove(self.addr + d.dst, self.addr + d.dst + d.shift, d.keep)
        self._placed(j, None)

    def _placed(self, j: int, err: BaseException | None) -> None:
        with self.lock:
            self.placed[j] = err is None
            waiting = self.after.pop(j, [])
        for copy in waiting:
            copy(err is None)
        self._release(err)

    # -- staged reads -------------------------------------------------------------------------------------
    def _staged_go(self, s: Staged, buf: torch.Tensor | None, err: BaseException | None) -> None:
        if buf is None:
            self._staged_failed(s, err or MemoryError(f"no staging buffer of {s.nbytes} bytes"))
        else:
            self._read(s.at, buf.data_ptr(), s.nbytes, partial(self._staged_landed, s, buf))

    def _staged_landed(self, s: Staged, buf: torch.Tensor, fut: Future[int]) -> None:
        """The stored bytes are in (the tier's thread): check them, then decode and copy in the pool."""
        try:
            self._check(s.at, s.nbytes, fut.result(), s.pieces[0].src if s.pieces else s.at)
            held = self.r.index.held[self.blob]
            if s.pad and not nat.all_zero(buf.data_ptr() + held - s.at, s.pad):
                raise self._bad(f"padding bytes [{held}, {s.at + s.nbytes}) after the stored stream are not zero")
        except BaseException as e:
            self.r.give(buf, reuse=False)  # the tier may have failed halfway through it
            self._staged_failed(s, e)
            return
        if not s.pieces:  # the padding alone
            self.r.give(buf)
            self._release(None)
            return
        stage = _Stage(buf, len(s.pieces))
        with self.lock:
            self.left += len(s.pieces)
        for p in s.pieces:
            failed = partial(self._piece_done, stage)
            if p.frame.width:
                self._submit(failed, self._decode, s, stage, p)
            elif p.after is None:
                self._submit(failed, self._copy, s, stage, p)
            else:
                with self.lock:
                    placed = self.placed[p.after]
                    if placed is None:  # the direct read lands over its destination: copied after it
                        self.after.setdefault(p.after, []).append(partial(self._copy_after, s, stage, p))
                        continue
                self._copy_after(s, stage, p, placed)
        self._release(None)

    def _staged_failed(self, s: Staged, e: BaseException) -> None:
        """The stored bytes never came: the frames it was to decode for other reads fail with ``e``."""
        self.fail_edges({p.k: self.edges[p.k] for p in s.pieces if p.dst is None and p.frame.width}, e)
        self._release(e)

    def _copy_after(self, s: Staged, stage: _Stage, p: Piece, placed: bool) -> None:
        if placed:
            self._submit(partial(self._piece_done, stage), self._copy, s, stage, p)
        else:  # the direct read failed: its error is the read's
            self._piece_done(stage, None)

    def _copy(self, s: Staged, stage: _Stage, p: Piece) -> None:
        assert p.dst is not None
        memmove(self.addr + p.dst, stage.buf.data_ptr() + p.src - s.at, p.nbytes)
        self._piece_done(stage, None)

    def _decode(self, s: Staged, stage: _Stage, p: Piece) -> None:
        """Frame ``p``'s raw bytes: decoded into the destination, or into its kept frame buffer."""
        edge = None if p.dst is not None else self.edges[p.k][0]
        stored = ptr_mv(stage.buf.data_ptr() + p.src - s.at, p.nbytes, writable=False)
        to = self.addr + p.dst if p.dst is not None else edge.buf.data_ptr()  # type: ignore[union-attr]
        try:
            decode_frame(stored, p.frame, ptr_mv(to, p.frame.raw_len))
        except BaseException as e:
            err = self._as_damage(e, p.k)
            if edge is not None:
                self.fail_edges({p.k: (edge, True)}, err)
            self._piece_done(stage, err)
            return
        if edge is not None:
            edge.done.set_result(None)
            self._copy_part(p.k, p.frame, edge)
        self._piece_done(stage, None)

    def _piece_done(self, stage: _Stage, err: BaseException | None) -> None:
        if stage.out():
            self.r.give(stage.buf)
        self._release(err)

    # -- frames decoded for several reads -----------------------------------------------------------------
    def _edge_decoded(self, k: int, edge: Edge, _done: Future[None]) -> None:
        self._submit(self._release, self._waited, k, edge)

    def _waited(self, k: int, edge: Edge) -> None:
        err = edge.done.exception()
        if err is None:
            try:
                self._copy_part(k, self.r.index.frame(self.blob, k), edge)
            except BaseException as e:
                err = e
        self._release(err)

    def _copy_part(self, k: int, f: Frame, edge: Edge) -> None:
        lo, hi = max(self.lo, f.raw_offset), min(self.lo + self.n, f.raw_offset + f.raw_len)
        memmove(self.addr + lo - self.lo, edge.buf.data_ptr() + lo - f.raw_offset, hi - lo)
        self.r.gave(self.blob, k, edge, lo - f.raw_offset, hi - f.raw_offset)

    def fail_edges(self, edges: dict[int, tuple[Edge, bool]], e: BaseException) -> None:
        """The frames of ``edges`` that this read was to decode for others fail with ``e``."""
        for k, (edge, mine) in edges.items():
            if mine and not edge.done.done():
                self.r.forget(self.blob, k, edge)
                edge.done.set_exception(e)

    # -- the end ------------------------------------------------------------------------------------------
    def _hold(self) -> None:
        with self.lock:
            self.left += 1

    def _release(self, err: BaseException | None) -> None:
        with self.lock:
            if err is not None and self.error is None:
                self.error = err
            self.left -= 1
            last = self.left == 0
        if last:  # whatever happened, the caller hears of its read
            if self.error is None:
                self.out.set_result(self.n)
            else:
                self.out.set_exception(self.error)
