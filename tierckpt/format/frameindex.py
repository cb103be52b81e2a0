"""The frame index of a compressed tier copy: which frames a blob has and how each is stored.

docs/format.md ("Compressed copies (version 6)") specifies it byte by byte. Compression is a property of
one tier's copy: the copy's ``manifest`` file is then an *envelope* (version 6) holding the unchanged
manifest (versions 1-5) and a :class:`FrameIndex`. Blob ``i`` is cut into frames of ``frame_bytes`` raw
bytes; each frame is stored raw (width 0), as one zstd frame (width 1) or as ``w`` byte planes (width 2,
4 or 8), each plane raw or one zstd frame (:mod:`tierckpt.format.codec`).

This module knows the index; :mod:`tierckpt.format.envelope` the envelope's payload, with which
:mod:`tierckpt.format.manifest` reads envelopes; :mod:`tierckpt.format.frames` (the module to import)
adds writing and unwrapping whole files. Pure: no I/O. Everything an index says is checked (:func:`check_index`) against the inner
manifest's blob sizes before a byte of a blob is read; nothing is allocated from a count the file states
before that count is checked against the bytes the file holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from tierckpt.errors import CorruptCheckpointError

__all__ = [
    "CODEC_NAME",
    "DEFAULT_FRAME_BYTES",
    "FORMAT_V6",
    "MAX_FRAME_BYTES",
    "MIN_FRAME_BYTES",
    "U32",
    "WIDTHS",
    "Frame",
    "FrameIndex",
    "IndexBuilder",
    "check_frame_bytes",
    "check_index",
    "frame_count",
    "held_message",
    "index_error",
]

#: The manifest file version of a compressed tier copy (an envelope; docs/format.md).
FORMAT_V6 = 6
CODEC_NAME = "zstd"
MIN_FRAME_BYTES = 64 << 10
MAX_FRAME_BYTES = 64 << 20
#: The frame size writers use for an inner manifest without ``chunk_bytes`` (versions 1-4).
DEFAULT_FRAME_BYTES = 4 << 20
#: A frame's widths: 0 raw, 1 one zstd frame, 2/4/8 byte planes.
WIDTHS = (0, 1, 2, 4, 8)
U32 = np.dtype("<u4")  #: the lengths column's entries
#: Frames between two of the prefix sums a :class:`FrameIndex` keeps.
_BLOCK = 64
#: Frames :func:`check_index` looks at at once (a multiple of :data:`_BLOCK`).
_CHUNK = 1 << 14
_VALID_WIDTH = np.isin(np.arange(256), WIDTHS)
#: the plane masks each width allows: exactly 0 (raw), exactly 1 (zstd), else not 0 and below bit w
_PLANES_LO = np.array([w if w <= 1 else 1 for w in range(256)], np.uint16)
_PLANES_HI = np.array([w if w <= 1 else (1 << min(w, 8)) - 1 for w in range(256)], np.uint16)


def index_error(msg: str) -> CorruptCheckpointError:
    """A damaged manifest file's error (``msg`` names the field)."""
    return CorruptCheckpointError(f"manifest: {msg}")


def held_message(nbytes: int, blobs: int) -> str:
    """What is wrong with a ``held`` column of ``nbytes`` for ``blobs`` blobs."""
    return f"codec.held: {nbytes} bytes for {blobs} blobs (8 a blob)"


def _runs(total: int) -> Iterator[tuple[int, int]]:
    """Frames 0 to ``total - 1`` in runs of :data:`_CHUNK`: a pass over an index makes temporaries
    sized by a run, not by the index."""
    return ((t0, min(t0 + _CHUNK, total)) for t0 in range(0, total, _CHUNK))


def _per_block(a: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """The sums of ``a``'s runs of :data:`_BLOCK` (the last one shorter), without a widened copy of ``a``."""
    n = len(a) // _BLOCK * _BLOCK
    out = np.empty(-(-len(a) // _BLOCK), np.int64)
    out[: n // _BLOCK] = a[:n].reshape(-1, _BLOCK).sum(axis=1, dtype=np.int64)
    if n < len(a):
        out[-1] = a[n:].sum(dtype=np.int64)
    return out


def frame_count(size: int, frame_bytes: int) -> int:
    """How many frames a blob of ``size`` raw bytes has (0 for an empty blob)."""
    return -(-size // frame_bytes)


def check_frame_bytes(frame_bytes: object) -> None:
    """Refuse a ``frame_bytes`` the format does not allow (:class:`CorruptCheckpointError`)."""
    ok = type(frame_bytes) is int and MIN_FRAME_BYTES <= frame_bytes <= MAX_FRAME_BYTES
    if not (ok and frame_bytes & (frame_bytes - 1) == 0):  # type: ignore[operator]
        raise index_error(
            f"codec.frame_bytes {frame_bytes!r} is not a power of two from {MIN_FRAME_BYTES} to {MAX_FRAME_BYTES}"
        )


@dataclass(frozen=True, slots=True)
class Frame:
    """Where one frame's bytes are and how they are stored.

    Attributes:
        raw_offset: the frame's first raw byte in its blob (``k * frame_bytes``).
        raw_len: its raw bytes (``frame_bytes``, less for a blob's last frame).
        stored_offset: where its stored bytes start in the blob's stored stream.
        width: 0 raw, 1 one zstd frame, 2/4/8 byte planes.
        planes: width 0: 0; width 1: 1; width w: bit p set where plane p is a zstd frame.
        lengths: the stored length of each stream: ``(raw_len,)`` for width 0, one for width 1, ``w`` for
            width ``w`` (one per plane, raw planes too).
    """

    raw_offset: int
    raw_len: int
    stored_offset: int
    width: int
    planes: int
    lengths: tuple[int, ...]

    @property
    def stored_len(self) -> int:
        """The frame's stored bytes."""
        return sum(self.lengths)


@dataclass(frozen=True, eq=False)
class FrameIndex:
    """How every frame of a copy's blobs is stored (docs/format.md, "Compressed copies (version 6)").

    The columns are as stored; ``sizes`` (the raw blob sizes) comes from the inner manifest. Construction
    checks the widths and that the columns have the lengths the sizes and widths call for (:class:`CorruptCheckpointError`
    naming the column) and keeps prefix sums of the streams and stored bytes every :data:`_BLOCK` frames,
    so what it holds beside the columns is a small fraction of their bytes (a hostile index costs about
    its own size), and :meth:`frame` and :meth:`span` are O(1) (a frame sums at most 63 frames' lengths);
    :func:`check_index` checks the rest.

    Attributes:
        name: the codec, ``"zstd"``.
        frame_bytes: raw bytes a frame (F).
        held: each blob's stored stream length.
        width: each frame's width, frames of all blobs blob-major.
        planes: each frame's plane mask.
        lengths: the stored length of every stream (u32, frames in order).
        sizes: each blob's raw size (the inner manifest's; not part of the stored index).
    """

    name: str
    frame_bytes: int
    held: tuple[int, ...]
    width: bytes
    planes: bytes
    lengths: npt.NDArray[np.uint32]
    sizes: tuple[int, ...]
    _first: npt.NDArray[np.int64] = field(init=False, repr=False)  # blob -> its first frame (B + 1)
    _streams: npt.NDArray[np.int64] = field(init=False, repr=False)  # block j -> streams before frame 64 j
    _stored: npt.NDArray[np.int64] = field(init=False, repr=False)  # block j -> stored bytes before frame 64 j
    _last: npt.NDArray[np.int64] = field(init=False, repr=False)  # each non-empty blob's last frame
    _short: npt.NDArray[np.int64] = field(init=False, repr=False)  # its raw length less F (<= 0)

    def __post_init__(self) -> None:
        check_frame_bytes(self.frame_bytes)
        sizes, f = self.sizes, self.frame_bytes
        counts = [frame_count(s, f) for s in sizes]
        total = sum(counts)  # from the inner's sizes: compared with the bytes held before anything is sized by it
        if len(self.held) != len(sizes):
            raise index_error(held_message(8 * len(self.held), len(sizes)))
        for col in ("width", "planes"):
            if len(getattr(self, col)) != total:
                raise index_error(f"codec.{col}: {len(getattr(self, col))} bytes for {total} frames (1 a frame)")
        first = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        width = np.frombuffer(self.width, np.uint8)
        for t0, t1 in _runs(total):  # the widths, before the lengths a width calls for
            if (bad := np.flatnonzero(~_VALID_WIDTH[width[t0:t1]])).size:
                t = t0 + int(bad[0])
                raise index_error(f"codec.width of {_located(first, t)}: {width[t]}, not one of {WIDTHS}")
        streams = np.zeros(-(-total // _BLOCK) + 1, np.int64)
        np.cumsum(_per_block(width), out=streams[1:])
        if len(self.lengths) != streams[-1]:
            raise index_error(
                f"codec.lengths: {4 * len(self.lengths)} bytes, the widths call for {int(streams[-1])} u32"
            )
        lengths = np.asarray(self.lengths, U32)
        lengths.flags.writeable = False
        has = np.asarray(counts, np.int64) > 0
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "_first", first)
        object.__setattr__(self, "_streams", streams)
        object.__setattr__(self, "_last", first[1:][has] - 1)
        object.__setattr__(self, "_short", np.asarray([s - c * f for s, c in zip(sizes, counts) if c], np.int64))
        object.__setattr__(self, "_stored", self._block_sums(width))

    def _block_sums(self, width: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64]:
        """The stored bytes before each block's first frame: its streams' lengths, F for each raw frame,
        less what a blob's short last frame lacks where it is raw."""
        seg = np.zeros(len(self._streams) - 1, np.int64)
        for t0, t1 in _runs(len(width)):
            j0, j1 = t0 // _BLOCK, -(-t1 // _BLOCK)
            lo, hi = self._streams[j0:j1], self._streams[j0 + 1 : j1 + 1]
            some = hi > lo  # blocks with streams (reduceat would give an empty one a length)
            if some.any():
                part = self.lengths[int(lo[0]) : int(hi[-1])].astype(np.int64)
                seg[j0:j1][some] = np.add.reduceat(part, lo[some] - lo[0])
            seg[j0:j1] += _per_block(width[t0:t1] == 0) * self.frame_bytes
        raw = width[self._last] == 0
        np.add.at(seg, self._last[raw] // _BLOCK, self._short[raw])
        stored = np.zeros(len(seg) + 1, np.int64)
        np.cumsum(seg, out=stored[1:])
        return stored

    def _streams_before(self, t: int) -> int:
        """Streams of all frames before frame ``t`` (all blobs, blob-major)."""
        j = t // _BLOCK
        return int(self._streams[j]) + sum(self.width[j * _BLOCK : t])

    def _stored_before(self, t: int) -> int:
        """Stored bytes of all frames before frame ``t`` (all blobs, blob-major)."""
        j = t // _BLOCK
        a = j * _BLOCK
        total = int(self._stored[j])
        if a == t:
            return total
        w = self.width[a:t]
        s0 = int(self._streams[j])
        total += int(self.lengths[s0 : s0 + sum(w)].sum(dtype=np.int64)) + w.count(0) * self.frame_bytes
        i0, i1 = np.searchsorted(self._last, (a, t))
        return total + sum(int(self._short[i]) for i in range(i0, i1) if not self.width[self._last[i]])

    def _raw_len(self, t: int) -> int:
        """Frame ``t``'s raw length (all blobs, blob-major)."""
        i = int(np.searchsorted(self._last, t))
        return self.frame_bytes + (int(self._short[i]) if i < len(self._last) and self._last[i] == t else 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FrameIndex):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.frame_bytes, self.held, self.width, self.planes, self.lengths.tobytes(), self.sizes)

    @property
    def total(self) -> int:
        """Frames of all blobs."""
        return len(self.width)

    def count(self, blob: int) -> int:
        """How many frames blob ``blob`` has."""
        return int(self._first[blob + 1] - self._first[blob])

    def frame(self, blob: int, k: int) -> Frame:
        """Frame ``k`` of blob ``blob``.

        Raises:
            IndexError: the blob has no frame ``k``.
        """
        if not 0 <= k < self.count(blob):
            raise IndexError(f"blob {blob} has {self.count(blob)} frames, not {k + 1}")
        t = int(self._first[blob]) + k
        f, size = self.frame_bytes, self.sizes[blob]
        raw_len = min(f, size - k * f)
        width = self.width[t]
        s0 = self._streams_before(t)
        lengths = tuple(self.lengths[s0 : s0 + width].tolist()) if width else (raw_len,)
        stored_offset = self._stored_before(t) - self._stored_before(t - k)
        return Frame(k * f, raw_len, stored_offset, width, self.planes[t], lengths)

    def span(self, blob: int, lo: int, hi: int) -> range:
        """The frames of blob ``blob`` that hold raw bytes ``[lo, hi)`` (clipped to the blob)."""
        lo, hi = max(lo, 0), min(hi, self.sizes[blob])
        if hi <= lo:
            return range(0)
        return range(lo // self.frame_bytes, frame_count(hi, self.frame_bytes))

    def stored_range(self, blob: int, k0: int, k1: int) -> tuple[int, int]:
        """Offset and length, in blob ``blob``'s stored stream, of its frames ``k0`` to ``k1 - 1``."""
        if not 0 <= k0 <= k1 <= self.count(blob):
            raise IndexError(f"blob {blob} has {self.count(blob)} frames: no frames {k0} to {k1 - 1}")
        base = int(self._first[blob])
        start = self._stored_before(base + k0)
        return start - self._stored_before(base), self._stored_before(base + k1) - start

    def compressed_frames(self) -> int:
        """Frames stored compressed (width other than 0)."""
        return int(np.count_nonzero(np.frombuffer(self.width, np.uint8)))

    def stored_bytes(self) -> int:
        """The stored bytes of all blobs (Σ ``held``)."""
        return sum(self.held)


class IndexBuilder:
    """Collects a writer's frames, in any order, into a :class:`FrameIndex`."""

    def __init__(self, blob_sizes: Sequence[int], frame_bytes: int) -> None:
        try:
            check_frame_bytes(frame_bytes)
        except CorruptCheckpointError as e:
            raise ValueError(str(e)) from None
        self.sizes = tuple(blob_sizes)
        self.frame_bytes = frame_bytes
        self._first = [0]
        for s in self.sizes:
            self._first.append(self._first[-1] + frame_count(s, frame_bytes))
        total = self._first[-1]
        self._width = bytearray(total)
        self._planes = bytearray(total)
        self._lengths: list[tuple[int, ...] | None] = [None] * total

    def count(self, blob: int) -> int:
        """How many frames blob ``blob`` has."""
        return self._first[blob + 1] - self._first[blob]

    def add(self, blob: int, k: int, width: int, planes: int, lengths: Sequence[int]) -> None:
        """Record frame ``k`` of blob ``blob`` (``lengths``: as :attr:`Frame.lengths`; ``()`` too for width 0).

        Raises:
            ValueError: no such frame, added before, or a width or lengths that do not fit.
        """
        if not (0 <= blob < len(self.sizes) and 0 <= k < self.count(blob)):
            raise ValueError(f"frame index: blob {blob} has no frame {k}")
        t = self._first[blob] + k
        if self._lengths[t] is not None:
            raise ValueError(f"frame index: frame {k} of blob {blob} added twice")
        raw_len = min(self.frame_bytes, self.sizes[blob] - k * self.frame_bytes)
        if width not in WIDTHS:
            raise ValueError(f"frame index: width {width} is not one of {WIDTHS}")
        stored = tuple(lengths) if width else ()
        if (width and len(stored) != width) or (not width and tuple(lengths) not in ((), (raw_len,))):
            raise ValueError(f"frame index: frame {k} of blob {blob}: lengths {tuple(lengths)} for width {width}")
        self._width[t], self._planes[t], self._lengths[t] = width, planes, stored

    def build(self) -> FrameIndex:
        """The index, checked (:func:`check_index`).

        Raises:
            ValueError: a frame was not added, or the frames added break a rule of the format.
        """
        if None in self._lengths:
            t = self._lengths.index(None)
            b = bisect.bisect_right(self._first, t) - 1
            raise ValueError(f"frame index: frame {t - self._first[b]} of blob {b} was not added")
        lengths = np.fromiter(chain.from_iterable(x for x in self._lengths if x), U32)
        held = []
        for b, size in enumerate(self.sizes):
            frames = range(self._first[b], self._first[b + 1])
            tail = size - (len(frames) - 1) * self.frame_bytes
            raw = [self.frame_bytes] * (len(frames) - 1) + [tail] if frames else []
            held.append(sum(sum(self._lengths[t] or (r,)) for t, r in zip(frames, raw)))
        try:
            index = FrameIndex(
                CODEC_NAME, self.frame_bytes, tuple(held), bytes(self._width), bytes(self._planes), lengths, self.sizes
            )
            check_index(index, self.sizes)
        except CorruptCheckpointError as e:
            raise ValueError(f"frame index: {e}") from None
        return index


def _located(first: npt.NDArray[np.int64], t: int) -> str:
    """Frame ``t`` (all blobs, blob-major) as "blob b frame k" (``first``: each blob's first frame)."""
    b = int(np.searchsorted(first, t, side="right")) - 1
    return f"blob {b} frame {t - int(first[b])}"


def _where(index: FrameIndex, t: int) -> str:
    return _located(index._first, t)


def check_index(index: FrameIndex, blob_sizes: Sequence[int]) -> None:
    """Check ``index`` against the inner manifest's blob sizes: every rule of docs/format.md.

    Raises:
        CorruptCheckpointError: naming the column, blob and frame that break a rule.
    """
    if tuple(blob_sizes) != index.sizes:
        raise index_error(f"codec: the index is for {len(index.sizes)} blobs of other sizes than the manifest's")
    if index.name != CODEC_NAME:
        raise index_error(f"codec.name {index.name!r} is not {CODEC_NAME!r}")
    width = np.frombuffer(index.width, np.uint8)
    planes = np.frombuffer(index.planes, np.uint8)
    for t0, t1 in _runs(index.total):
        w, p = width[t0:t1], planes[t0:t1]
        if (bad := np.flatnonzero((p < _PLANES_LO[w]) | (p > _PLANES_HI[w]))).size:
            t = t0 + int(bad[0])
            raise index_error(f"codec.planes of {_where(index, t)}: {planes[t]:#x} for width {width[t]}")
    for t in index._last.tolist():  # every frame but a blob's last is F long, a multiple of every width
        raw, w = index._raw_len(t), index.width[t]
        if w >= 2 and raw % w:
            raise index_error(f"codec.width of {_where(index, t)}: {w} byte planes of a {raw}-byte frame")
    for t0, t1 in _runs(index.total):
        _check_lengths(index, t0, t1)
    for b, (held, size) in enumerate(zip(index.held, index.sizes)):
        frames = index._stored_before(int(index._first[b + 1])) - index._stored_before(int(index._first[b]))
        if held != frames or held > size:
            raise index_error(
                f"codec.held of blob {b}: {held} bytes; its frames store {frames}, its raw size is {size}"
            )


def _check_lengths(index: FrameIndex, t0: int, t1: int) -> None:
    """The streams of frames ``t0`` to ``t1 - 1``: a zstd stream shorter than the raw bytes it stands
    for, a raw plane exactly ``raw_len / w`` bytes."""
    w = np.frombuffer(index.width, np.uint8)[t0:t1].astype(np.int64)
    s0 = index._streams_before(t0)
    lengths = index.lengths[s0 : s0 + int(w.sum())].astype(np.int64)
    if not len(lengths):
        return
    raw = np.full(t1 - t0, index.frame_bytes, np.int64)
    i0, i1 = np.searchsorted(index._last, (t0, t1))
    raw[index._last[i0:i1] - t0] += index._short[i0:i1]
    frame = np.repeat(np.arange(t1 - t0), w)  # each stream's frame (in the run)
    plane = np.arange(len(frame)) - (np.cumsum(w) - w)[frame]
    wf = w[frame]
    stands = np.where(wf == 1, raw[frame], raw[frame] // wf)
    planes = np.frombuffer(index.planes, np.uint8)[t0:t1].astype(np.int64)
    zstd = (wf == 1) | ((planes[frame] >> plane) & 1 == 1)
    bad = np.flatnonzero(np.where(zstd, lengths >= stands, lengths != stands))
    if bad.size:
        s = int(bad[0])
        kind = "zstd stream" if zstd[s] else "raw plane"
        raise index_error(
            f"codec.lengths of {_where(index, t0 + int(frame[s]))} plane {plane[s]}: {kind} of {lengths[s]} "
            f"bytes for {stands[s]} raw bytes"
        )
