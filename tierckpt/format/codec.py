"""Encoding and decoding one frame of a compressed tier copy (docs/format.md, "Compressed copies (version 6)").

A frame is stored raw (width 0), as one zstd frame (width 1), or as ``w`` byte planes (width 2, 4 or 8:
plane ``p`` holds bytes ``p, p + w, p + 2w, …`` of the frame, so the exponent bytes of floating-point
numbers sit together and compress, while the mantissa bytes, which mostly do not, can stay raw).

Thread-safe: each thread keeps its own zstd compressors (one per level) and decompressor, and zstd runs
without the GIL. The decoder trusts nothing it reads: a zstd stream must declare exactly the raw length
it stands for before anything is allocated for it (a decompression bomb is refused), and every failure
is a :class:`~tierckpt.errors.CorruptCheckpointError` naming the frame and plane.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import numpy.typing as npt
import zstandard

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frameindex import WIDTHS, Frame
from tierckpt.format.native import native

__all__ = [
    "LEVELS",
    "PLANE_GAIN",
    "Encoded",
    "decode_frame",
    "encode_frame",
    "shuffle",
    "shuffle_numpy",
    "unshuffle",
    "unshuffle_numpy",
]

LEVELS = range(-7, 20)
#: A plane is stored compressed only when its zstd stream is below this fraction of its raw bytes: a
#: plane that gains less costs a decompression on every read for almost nothing.
PLANE_GAIN = 0.97


@dataclass
class Encoded:
    """One frame, encoded.

    Attributes:
        width: 0 raw, 1 one zstd frame, 2/4/8 byte planes.
        planes: the plane mask (:attr:`~tierckpt.format.frames.Frame.planes`).
        streams: the stored streams, in order; their lengths are :attr:`lengths`.
        seconds: wall time the encoding took.
        plane_raw: per plane tried, its raw bytes (one entry where the frame was tried whole).
        plane_stored: per plane tried, its zstd stream's length where it was compressed (kept or not),
            else its raw bytes: what the data gives, for statistics.
        tried: the width tried (``width`` asked for, 1 where the frame's length is not a multiple of it);
            ``width`` is 0 where nothing gained.
        plane_seconds: per plane tried, the seconds its zstd compression took (0 for a plane not tried);
            the rest of :attr:`seconds` is the frame's own (the split into planes): what a plane costs
            differs (an exponent plane takes longer than a noisy mantissa plane, which zstd gives up on).
    """

    width: int
    planes: int
    streams: list[bytes | memoryview]
    seconds: float
    plane_raw: tuple[int, ...]
    plane_stored: tuple[int, ...]
    tried: int = field(default=0)
    plane_seconds: tuple[float, ...] = field(default=())

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each stream's length (width 0: the frame's raw length)."""
        return tuple(len(s) for s in self.streams)

    @property
    def stored_len(self) -> int:
        """The frame's stored bytes."""
        return sum(len(s) for s in self.streams)


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()


_local = _PerThread()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    c = _local.compressors.get(level)
    if c is None:
        c = _local.compressors[level] = zstandard.ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
    return c


def _native_planes() -> ModuleType | None:
    """The C extension where it has the plane loops (it loads bytes as little-endian words)."""
    has = native is not None and hasattr(native, "shuffle") and hasattr(native, "unshuffle")
    return native if has and sys.byteorder == "little" else None


_native = _native_planes()


def shuffle_numpy(raw: memoryview | bytes, width: int) -> npt.NDArray[np.uint8]:
    """:func:`shuffle` with numpy: a transposed copy."""
    return np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(-1, width).T)


def unshuffle_numpy(planes: Sequence[bytes | memoryview], out: memoryview) -> None:
    """:func:`unshuffle` with numpy: one strided assignment a plane."""
    o = np.frombuffer(out, np.uint8).reshape(-1, len(planes))
    for p, plane in enumerate(planes):
        o[:, p] = np.frombuffer(plane, np.uint8)


def shuffle(raw: memoryview | bytes, width: int) -> npt.NDArray[np.uint8]:
    """The ``(width, len(raw) // width)`` byte planes of ``raw`` (a copy; ``len(raw)`` a multiple of
    ``width``): in the C extension where it is built (without the GIL), else with numpy."""
    if _native is None:
        return shuffle_numpy(raw, width)
    planes = np.empty((width, len(raw) // width), np.uint8)
    _native.shuffle(raw, planes, width)
    return planes


def unshuffle(planes: Sequence[bytes | memoryview], out: memoryview) -> None:
    """Interleave ``planes`` (equal lengths) back into ``out``: the inverse of :func:`shuffle`."""
    if _native is None:
        unshuffle_numpy(planes, out)
    else:
        _native.unshuffle(planes, out)


def _as_bytes(view: memoryview) -> memoryview:
    """``view`` as unsigned bytes (``len`` counts bytes), whatever its item format."""
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_frame(raw: memoryview, width: int, try_planes: int, level: int) -> Encoded:
    """Encode one frame's raw bytes.

    Width 0 stores ``raw`` as it is. Width 1 stores one zstd frame of it if that is shorter, else ``raw``.
    Width 2, 4 or 8 (``len(raw)`` a multiple of it, else width 1 is tried) splits it into byte planes and
    compresses plane ``p`` where bit ``p`` of ``try_planes`` is set and zstd makes it shorter than
    :data:`PLANE_GAIN` of its raw bytes; the other planes stay raw. A frame in which nothing gained is
    stored raw (width 0, ``raw`` unshuffled).

    Raises:
        ValueError: a width or level this format does not have.
    """
    if width not in WIDTHS:
        raise ValueError(f"encode_frame: width {width} is not one of {WIDTHS}")
    if level not in LEVELS:
        raise ValueError(f"encode_frame: zstd level {level} is not in {LEVELS.start} to {LEVELS.stop - 1}")
    start = time.perf_counter()
    raw = _as_bytes(raw)
    n = len(raw)
    if width >= 2 and n % width:
        width, try_planes = 1, 1
    if width == 0 or n == 0:
        return Encoded(0, 0, [raw], time.perf_counter() - start, (n,), (n,), tried=0)
    zstd = _compressor(level)
    if width == 1:
        packed = zstd.compress(raw)
        took = time.perf_counter() - start
        if len(packed) < n:
            return Encoded(1, 1, [packed], took, (n,), (len(packed),), tried=1, plane_seconds=(took,))
        return Encoded(0, 0, [raw], took, (n,), (len(packed),), tried=1, plane_seconds=(took,))
    planes = shuffle(raw, width)
    streams: list[bytes | memoryview] = []
    stored, mask, spent = [], 0, []
    for p in range(width):
        plane = memoryview(planes[p])
        t0 = time.perf_counter()
        squeezed = zstd.compress(plane) if try_planes >> p & 1 else None
        spent.append(time.perf_counter() - t0 if squeezed is not None else 0.0)
        stored.append(len(plane) if squeezed is None else len(squeezed))
        if squeezed is not None and len(squeezed) < PLANE_GAIN * len(plane):
            streams.append(squeezed)
            mask |= 1 << p
        else:
            streams.append(plane)
    raw_planes = (n // width,) * width
    took = time.perf_counter() - start
    if not mask:
        return Encoded(0, 0, [raw], took, raw_planes, tuple(stored), tried=width, plane_seconds=tuple(spent))
    return Encoded(width, mask, streams, took, raw_planes, tuple(stored), tried=width, plane_seconds=tuple(spent))


def _decompress(stream: memoryview, expected: int, what: str) -> bytes:
    """One zstd frame that must decode to exactly ``expected`` bytes: its declared content size is checked
    before anything is allocated, and the decoder is given no room for more."""
    try:
        declared = zstandard.frame_content_size(stream)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"{what}: not a zstd frame ({e})") from None
    if declared < 0:
        raise CorruptCheckpointError(f"{what}: zstd frame does not declare its content size")
    if declared != expected:
        raise CorruptCheckpointError(f"{what}: zstd frame declares {declared} bytes, it stands for {expected}")
    try:
        data = _local.decompressor.decompress(stream, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"{what}: zstd data is damaged ({e})") from None
    if len(data) != expected:
        raise CorruptCheckpointError(f"{what}: zstd frame decodes to {len(data)} bytes, not {expected}")
    return data


def decode_frame(stored: memoryview, frame: Frame, out: memoryview) -> None:
    """Decode one frame's stored bytes into ``out`` (exactly ``frame.raw_len`` bytes).

    Raises:
        CorruptCheckpointError: ``"frame at raw offset …: …"``: the stored bytes do not decode to the frame
            (a zstd error, a declared size that is not the frame's, a stream of the wrong length). The
            caller adds tier, step and blob.
    """
    name = f"frame at raw offset {frame.raw_offset}"
    stored, out = _as_bytes(stored), _as_bytes(out)
    if len(out) != frame.raw_len:
        raise ValueError(f"decode_frame: {name}: out is {len(out)} bytes, the frame {frame.raw_len}")
    if len(stored) != frame.stored_len:
        raise CorruptCheckpointError(f"{name}: {len(stored)} stored bytes, its index says {frame.stored_len}")
    if frame.width == 0:
        out[:] = stored
        return
    if frame.width == 1:
        out[:] = _decompress(stored, frame.raw_len, f"{name} (width 1)")
        return
    w, plane_len = frame.width, frame.raw_len // frame.width
    planes: list[bytes | memoryview] = []
    pos = 0
    for p, n in enumerate(frame.lengths):
        stream = stored[pos : pos + n]
        pos += n
        if frame.planes >> p & 1:
            planes.append(_decompress(stream, plane_len, f"{name} plane {p} of {w}"))
        elif n != plane_len:
            raise CorruptCheckpointError(f"{name} plane {p} of {w}: raw plane of {n} bytes, not {plane_len}")
        else:
            planes.append(stream)
    unshuffle(planes, out)
