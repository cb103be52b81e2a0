"""Copying a compressed copy (version 6) to a tier that compresses with settings of its own: the frames the
source stored compressed pass through as they are (their stored bytes, byte for byte: not decoded, not
encoded again, :meth:`~tierckpt.datapath.codecwrite.CodecWriter.write_encoded`), and the frames it stored
raw go to the destination's codec writer as raw bytes, planned and encoded as a plain copy's are (the
destination's ``Adaptive``, its budget, its level). The destination's writer builds one frame index of
both; checksums stay over the raw bytes, so the inner manifest and its tag do not change.

The source's frame index says where each frame's stored bytes are. A memory tier's copy is read where it
is; any other through the destination's staging buffers: consecutive frames of a blob in one read of up
to a slot (a frame whose stored bytes span more is read alone, into a buffer of its own), in the copy's
alignment, at most the pool's slots of reads in flight, each slot given back once the codec writer no
longer reads its frames. Nothing is verified here (the destination's readers check the raw checksums as
for any copy, and decode the passed frames as they decode any); a blob shorter than its index says is
:class:`~tierckpt.errors.CorruptCheckpointError` naming the tier, step and blob.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.codec import Encoded
from tierckpt.format.frames import Frame, FrameIndex
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import StagingPool, aligned_empty, ptr_mv
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader

__all__ = ["FrameWriter", "recode_blobs"]


class FrameWriter(Protocol):
    """What a recoding copy writes to: a codec writer (:class:`~tierckpt.datapath.codecwrite.CodecWriter`)."""

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]: ...

    def write_encoded(self, blob: int, k: int, enc: Encoded) -> Future[int]: ...

    def cancel(self) -> None: ...


@dataclass
class _Read:
    """One read of stored bytes ``[at, at + nbytes)`` of a blob, holding ``frames``."""

    at: int
    nbytes: int
    frames: list[tuple[int, Frame]]
    slot: torch.Tensor | None = None  # the pool's slot it counts as (and reads into where it fits)
    buf: torch.Tensor | None = None  # where it reads into
    read: Future[int] | None = None
    writes: list[Future[int]] | None = None  # the frames handed to the writer, once the read is in


def recode_blobs(
    src: Tier,
    reader: TierReader,
    writer: FrameWriter,
    key: CheckpointKey,
    blobs: Sequence[BlobEntry],
    index: FrameIndex,
    align: int,
    pool: Callable[[], StagingPool],
) -> None:
    """Hand every frame of the copy to ``writer``: stored compressed, as it is; stored raw, as raw bytes.
    Returns once the writer no longer reads any of them.

    Args:
        src: the source tier (for errors).
        blobs: the copy's blobs (their names, for errors).
        reader: a reader of the source copy's stored bytes (each blob opened at its stored size).
        index: the source copy's frame index (on the destination's frame grid).
        align: the copy's alignment (its stored streams' reads are made in it).
        pool: staging buffers for a source not in memory.

    Raises:
        CorruptCheckpointError: a blob holds fewer bytes than the index says.
        ValueError: the writer refused a frame (a bug: the index was checked when the manifest was read).
    """
    for b, blob in enumerate(blobs):
        if not index.count(b):
            continue

        def truncated(got: int, want: int, at: int, name: str = blob.name) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"blob is truncated: read {got} of {want} stored bytes at offset {at}",
                tier=src.name, step=key.step, blob=name,
            )  # fmt: skip

        buf = reader.buffer(b)
        if buf is not None and buf.is_cpu:
            _from_memory(writer, index, b, buf, truncated)
        else:
            _through_staging(reader, writer, index, b, align, pool(), truncated)


#: a truncated blob's error: (bytes got, bytes wanted, at offset)
_Truncated = Callable[[int, int, int], CorruptCheckpointError]


def _hand(writer: FrameWriter, b: int, k: int, f: Frame, addr: int) -> Future[int]:
    """Frame ``k`` of blob ``b``, whose stored bytes are at ``addr``, to the writer."""
    if not f.width:
        return writer.write(b, f.raw_offset, addr, f.raw_len)
    streams: list[bytes | memoryview] = []
    for n in f.lengths:
        streams.append(ptr_mv(addr, n, writable=False))
        addr += n
    return writer.write_encoded(b, k, Encoded(f.width, f.planes, streams, 0.0, (), ()))


def _wait(futures: list[Future[int]]) -> None:
    """Wait for every one of ``futures`` (raising the first error, once all are done)."""
    error: BaseException | None = None
    for f in futures:
        e = f.exception()
        error = error or e
    if error is not None:
        raise error


def _from_memory(writer: FrameWriter, index: FrameIndex, b: int, buf: torch.Tensor, truncated: _Truncated) -> None:
    """A memory tier's blob: each frame handed over from where it is."""
    if buf.numel() < index.held[b]:
        raise truncated(buf.numel(), index.held[b], 0)
    base, pending = buf.data_ptr(), []
    try:
        for k in range(index.count(b)):
            f = index.frame(b, k)
            pending.append(_hand(writer, b, k, f, base + f.stored_offset))
    except BaseException:
        writer.cancel()
        for fut in pending:  # never leave the writer reading memory the caller may free
            with contextlib.suppress(BaseException):
                fut.exception()
        raise
    _wait(pending)


def _reads(index: FrameIndex, b: int, align: int, slot_bytes: int) -> Iterator[_Read]:
    """Blob ``b``'s frames in reads of the copy's alignment, consecutive ones together up to ``slot_bytes``."""
    end = round_up(index.held[b], align)
    group: list[tuple[int, Frame]] = []
    at = 0
    for k in range(index.count(b)):
        f = index.frame(b, k)
        if group and min(round_up(f.stored_offset + f.stored_len, align), end) - at > slot_bytes:
            last = group[-1][1]
            yield _Read(at, min(round_up(last.stored_offset + last.stored_len, align), end) - at, group)
            group = []
        if not group:
            at = f.stored_offset // align * align
        group.append((k, f))
    if group:
        last = group[-1][1]
        yield _Read(at, min(round_up(last.stored_offset + last.stored_len, align), end) - at, group)


def _through_staging(
    reader: TierReader, writer: FrameWriter, index: FrameIndex, b: int, align: int, pool: StagingPool,
    truncated: _Truncated,
) -> None:  # fmt: skip
    """A blob read into staging slots: each read's frames handed over once it is in; a slot given back once
    the writer no longer reads its frames."""
    inflight: deque[_Read] = deque()

    def hand_over(block: bool) -> None:
        for r in inflight:
            if r.writes is not None:
                continue
            assert r.read is not None and r.buf is not None
            if not (block or r.read.done()):
                return
            got = r.read.result()
            if got != r.nbytes:
                raise truncated(got, r.nbytes, r.at)
            base = r.buf.data_ptr() - r.at
            r.writes = []
            for k, f in r.frames:
                r.writes.append(_hand(writer, b, k, f, base + f.stored_offset))
            block = False

    def retire() -> None:
        hand_over(block=True)
        r = inflight.popleft()
        try:
            _wait(r.writes or [])
        finally:
            assert r.slot is not None
            pool.release(r.slot)

    try:
        for r in _reads(index, b, align, pool.slot_bytes):
            if len(inflight) >= pool.slots:
                retire()
            r.slot = pool.acquire()
            inflight.append(r)
            r.buf = r.slot if r.nbytes <= r.slot.numel() else aligned_empty(r.nbytes, pool.align)
            r.read = reader.read(b, r.at, r.buf.data_ptr(), r.nbytes)
            hand_over(block=False)
        while inflight:
            retire()
    finally:
        if inflight:  # failed: the writer need not go on
            writer.cancel()
        while inflight:  # wait for what was issued before the buffers are given back
            r = inflight.popleft()
            for fut in [r.read, *(r.writes or [])]:
                if fut is not None:
                    with contextlib.suppress(BaseException):
                        fut.exception()
            if r.slot is not None:
                pool.release(r.slot)
