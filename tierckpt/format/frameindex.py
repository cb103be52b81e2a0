"""The frame index of a compressed tier copy: which frames a blob has and how each is stored.

docs/format.md ("Compressed copies (version 6)") specifies it byte by byte. Compression is a property of
one tier's copy: the copy's ``manifest`` file is then an *envelope* (version 6) holding the unchanged
manifest (versions 1-5) and a :class:`FrameIndex`. Blob ``i`` is cut into frames of ``frame_bytes`` raw
bytes; each frame is stored raw (width 0), as one zstd frame (width 1) or as ``w`` byte planes (width 2,
4 or 8), each plane raw or one zstd frame (:mod:`tierckpt.format.codec`).

This module knows the index and the envelope's payload; :mod:`tierckpt.format.manifest` reads envelopes
with it, and :mod:`tierckpt.format.frames` (the module to import) adds writing and unwrapping whole
files. Pure: no I/O. Everything an index says is checked (:func:`check_index`) against the inner
manifest's blob sizes before a byte of a blob is read; nothing is allocated from a count the file states
before that count is checked against the bytes the file holds.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from tierckpt.errors import CorruptCheckpointError

__all__ = [
    "CODEC_NAME",
    "DEFAULT_FRAME_BYTES",
    "FORMAT_V6",
    "MAX_FRAME_BYTES",
    "MIN_FRAME_BYTES",
    "WIDTHS",
    "Frame",
    "FrameIndex",
    "IndexBuilder",
    "check_index",
    "codec_map",
    "envelope_inner",
    "frame_count",
    "index_from_codec",
    "split_envelope",
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
_ENVELOPE_KEYS = ("manifest", "codec")
_CODEC_KEYS = ("name", "frame_bytes", "held", "width", "planes", "lengths")
_U32 = np.dtype("<u4")
_TRAILER_BYTES = 8
_HEADER_BYTES = 24  # a manifest file's framing (docs/format.md, "Framing"): the payload starts here
#: How wrap_manifest's msgpack starts: a map of 2, the key "manifest", then the inner file as bin.
_ENVELOPE_START = b"\x82\xa8manifest"


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}")


def frame_count(size: int, frame_bytes: int) -> int:
    """How many frames a blob of ``size`` raw bytes has (0 for an empty blob)."""
    return -(-size // frame_bytes)


def _check_frame_bytes(frame_bytes: object) -> None:
    ok = type(frame_bytes) is int and MIN_FRAME_BYTES <= frame_bytes <= MAX_FRAME_BYTES
    if not (ok and frame_bytes & (frame_bytes - 1) == 0):  # type: ignore[operator]
        raise _bad(
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
    naming the column) and keeps prefix sums, so :meth:`frame` is O(1) and :meth:`span` O(1);
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
    _first: list[int] = field(init=False, repr=False)  # blob -> its first frame (B + 1 entries)
    _stream: list[int] = field(init=False, repr=False)  # frame -> its first entry of lengths (T + 1)
    _stored: list[int] = field(init=False, repr=False)  # frame -> stored bytes of all frames before it (T + 1)

    def __post_init__(self) -> None:
        _check_frame_bytes(self.frame_bytes)
        sizes, f = self.sizes, self.frame_bytes
        counts = [frame_count(s, f) for s in sizes]
        total = sum(counts)  # from the inner's sizes: compared with the bytes held before anything is sized by it
        if len(self.held) != len(sizes):
            raise _bad(f"codec.held: {8 * len(self.held)} bytes for {len(sizes)} blobs (8 a blob)")
        for col in ("width", "planes"):
            if len(getattr(self, col)) != total:
                raise _bad(f"codec.{col}: {len(getattr(self, col))} bytes for {total} frames (1 a frame)")
        width = np.frombuffer(self.width, np.uint8)
        if (bad := np.flatnonzero(~np.isin(width, WIDTHS))).size:  # before the lengths a width calls for
            t = int(bad[0])
            b = bisect.bisect_right(np.cumsum(counts).tolist(), t)
            raise _bad(f"codec.width of blob {b} frame {t - sum(counts[:b])}: {width[t]}, not one of {WIDTHS}")
        first = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        stream = np.zeros(total + 1, np.int64)
        np.cumsum(width, out=stream[1:])
        if len(self.lengths) != stream[-1]:
            raise _bad(f"codec.lengths: {4 * len(self.lengths)} bytes, the widths call for {int(stream[-1])} u32")
        lengths = np.asarray(self.lengths, _U32)
        lengths.flags.writeable = False
        summed = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=summed[1:])
        stored = summed[stream[1:]] - summed[stream[:-1]]
        raw = self._raw_lengths(counts)
        stored[width == 0] = raw[width == 0]
        before = np.zeros(total + 1, np.int64)
        np.cumsum(stored, out=before[1:])
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "_first", first.tolist())
        object.__setattr__(self, "_stream", stream.tolist())
        object.__setattr__(self, "_stored", before.tolist())

    def _raw_lengths(self, counts: Sequence[int]) -> npt.NDArray[np.int64]:
        """Each frame's raw length: ``frame_bytes``, less for a blob's last frame."""
        f = self.frame_bytes
        raw = np.full(sum(counts), f, np.int64)
        ends = np.cumsum(counts, dtype=np.int64) - 1
        has = np.asarray(counts, np.int64) > 0
        last = [s - (c - 1) * f for s, c in zip(self.sizes, counts) if c]
        raw[ends[has]] = np.asarray(last, np.int64)
        return raw

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
        return self._first[blob + 1] - self._first[blob]

    def frame(self, blob: int, k: int) -> Frame:
        """Frame ``k`` of blob ``blob``.

        Raises:
            IndexError: the blob has no frame ``k``.
        """
        if not 0 <= k < self.count(blob):
            raise IndexError(f"blob {blob} has {self.count(blob)} frames, not {k + 1}")
        t = self._first[blob] + k
        f, size = self.frame_bytes, self.sizes[blob]
        raw_len = min(f, size - k * f)
        width = self.width[t]
        s0, s1 = self._stream[t], self._stream[t + 1]
        lengths = tuple(self.lengths[s0:s1].tolist()) if width else (raw_len,)
        stored_offset = self._stored[t] - self._stored[self._first[blob]]
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
        base = self._first[blob]
        start = self._stored[base + k0] - self._stored[base]
        return start, self._stored[base + k1] - self._stored[base + k0]

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
            _check_frame_bytes(frame_bytes)
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
        lengths = np.fromiter(chain.from_iterable(x for x in self._lengths if x), _U32)
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


def _where(index: FrameIndex, t: int) -> str:
    b = bisect.bisect_right(index._first, t) - 1
    return f"blob {b} frame {t - index._first[b]}"


def check_index(index: FrameIndex, blob_sizes: Sequence[int]) -> None:
    """Check ``index`` against the inner manifest's blob sizes: every rule of docs/format.md.

    Raises:
        CorruptCheckpointError: naming the column, blob and frame that break a rule.
    """
    if tuple(blob_sizes) != index.sizes:
        raise _bad(f"codec: the index is for {len(index.sizes)} blobs of other sizes than the manifest's")
    if index.name != CODEC_NAME:
        raise _bad(f"codec.name {index.name!r} is not {CODEC_NAME!r}")
    width = np.frombuffer(index.width, np.uint8)
    planes = np.frombuffer(index.planes, np.uint8)
    w = width.astype(np.int64)
    ok = np.where(w <= 1, planes == w, (planes != 0) & (planes.astype(np.int64) >> w == 0))
    if (bad := np.flatnonzero(~ok)).size:
        t = int(bad[0])
        raise _bad(f"codec.planes of {_where(index, t)}: {planes[t]:#x} for width {width[t]}")
    counts = [index.count(b) for b in range(len(index.sizes))]
    raw = index._raw_lengths(counts)
    if (bad := np.flatnonzero((w >= 2) & (raw % np.maximum(w, 1) != 0))).size:
        t = int(bad[0])
        raise _bad(f"codec.width of {_where(index, t)}: {width[t]} byte planes of a {raw[t]}-byte frame")
    _check_lengths(index, w, planes, raw)
    stored = np.asarray(index._stored, np.int64)
    for b, (held, size) in enumerate(zip(index.held, index.sizes)):
        frames = int(stored[index._first[b + 1]] - stored[index._first[b]])
        if held != frames or held > size:
            raise _bad(f"codec.held of blob {b}: {held} bytes; its frames store {frames}, its raw size is {size}")


def _check_lengths(index: FrameIndex, w: npt.NDArray[np.int64], planes: npt.NDArray[np.uint8], raw: Any) -> None:
    """Each stream's length: a zstd stream shorter than the raw bytes it stands for, a raw plane exactly
    ``raw_len / w`` bytes."""
    if not len(index.lengths):
        return
    frame = np.repeat(np.arange(len(w)), w)  # each stream's frame
    plane = np.arange(len(frame)) - np.asarray(index._stream[:-1], np.int64)[frame]
    wf = w[frame]
    stands = np.where(wf == 1, raw[frame], raw[frame] // wf)
    zstd = (wf == 1) | ((planes[frame].astype(np.int64) >> plane) & 1 == 1)
    lengths = index.lengths.astype(np.int64)
    bad = np.flatnonzero(np.where(zstd, lengths >= stands, lengths != stands))
    if bad.size:
        s = int(bad[0])
        kind = "zstd stream" if zstd[s] else "raw plane"
        raise _bad(
            f"codec.lengths of {_where(index, int(frame[s]))} plane {plane[s]}: {kind} of {lengths[s]} bytes "
            f"for {stands[s]} raw bytes"
        )


def codec_map(index: FrameIndex) -> dict[str, Any]:
    """The ``codec`` map of an envelope's payload (what msgpack packs)."""
    return {
        "name": index.name,
        "frame_bytes": index.frame_bytes,
        "held": struct.pack(f"<{len(index.held)}Q", *index.held),
        "width": index.width,
        "planes": index.planes,
        "lengths": index.lengths.astype(_U32).tobytes(),
    }


def _read_map(u: msgpack.Unpacker, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    """The next value of ``u``: a map with exactly ``keys``, in that order."""
    if u.read_map_header() != len(keys):
        raise _bad(f"{what} keys are not {', '.join(keys)}")
    d = {}
    for key in keys:
        if u.unpack() != key:
            raise _bad(f"{what} keys are not {', '.join(keys)}")
        d[key] = _read_map(u, _CODEC_KEYS, "codec") if key == "codec" else u.unpack()
    return d


def split_envelope(payload: memoryview) -> tuple[bytes, dict[str, Any]]:
    """A version-6 file's inner manifest file and its ``codec`` map (keys and types checked; ``payload``:
    the file's payload, its framing checked).

    Raises:
        CorruptCheckpointError: naming the key or field.
    """
    u = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True, max_buffer_size=max(1, len(payload)))
    u.feed(payload)
    try:
        d = _read_map(u, _ENVELOPE_KEYS, "envelope")
        end = u.tell()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # not a map, ends early, bad bytes
        raise _bad(f"envelope is not msgpack: {e}") from e
    if end != len(payload):
        raise _bad(f"envelope is not msgpack: {len(payload) - end} bytes after the map")
    codec = d["codec"]
    if not isinstance(d["manifest"], bytes):
        raise _bad("envelope.manifest is not bytes")
    if not isinstance(codec["name"], str):
        raise _bad(f"codec.name {codec['name']!r} is not a string")
    _check_frame_bytes(codec["frame_bytes"])
    for col in ("held", "width", "planes", "lengths"):
        if not isinstance(codec[col], bytes):
            raise _bad(f"codec.{col} is not bytes")
    for col, size in (("held", 8), ("lengths", 4)):
        if len(codec[col]) % size:
            raise _bad(f"codec.{col}: {len(codec[col])} bytes, not a whole number of {size}-byte entries")
    return d["manifest"], codec


def index_from_codec(codec: dict[str, Any], sizes: tuple[int, ...]) -> FrameIndex:
    """The index a ``codec`` map (from :func:`split_envelope`) stores, for blobs of raw ``sizes``: its
    columns' lengths checked, not its rules (:func:`check_index`)."""
    held = codec["held"]
    return FrameIndex(
        name=codec["name"],
        frame_bytes=codec["frame_bytes"],
        held=struct.unpack(f"<{len(held) // 8}Q", held),
        width=codec["width"],
        planes=codec["planes"],
        lengths=np.frombuffer(codec["lengths"], _U32),
        sizes=sizes,
    )


def envelope_inner(data: bytes) -> memoryview:
    """Where a version-6 file holds its inner manifest file (located, not checked: its commit record's tag
    is the inner's trailer, docs/format.md).

    Raises:
        CorruptCheckpointError: the file is not laid out as a version-6 writer lays it out.
    """
    p = _HEADER_BYTES
    start = p + len(_ENVELOPE_START)
    if bytes(data[p:start]) != _ENVELOPE_START or len(data) < start + 1:
        raise _bad("version-6 file does not start with its inner manifest")
    tag, sizes = data[start], {0xC4: 1, 0xC5: 2, 0xC6: 4}
    if tag not in sizes:
        raise _bad("version-6 file's inner manifest is not bytes")
    body = start + 1 + sizes[tag]
    n = int.from_bytes(data[start + 1 : body], "big")
    if body + n > len(data) - _TRAILER_BYTES:
        raise _bad("version-6 file's inner manifest runs past the file")
    return memoryview(data)[body : body + n]
