"""One frame's encoding and decoding (tierckpt.format.codec): round trips, raw fallbacks, bombs, bit flips."""

from __future__ import annotations

import os
import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import codec
from tierckpt.format.codec import (
    LEVELS,
    Encoded,
    decode_frame,
    encode_frame,
    shuffle,
    shuffle_numpy,
    unshuffle,
    unshuffle_numpy,
)
from tierckpt.format.frameindex import WIDTHS, Frame

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def tensor_bytes(dtype: torch.dtype, kind: str, n: int = 12_288) -> bytes:
    g = torch.Generator().manual_seed(3)
    if kind == "random":
        if dtype == torch.bool:
            t = torch.rand(n, generator=g) < 0.5
        elif dtype.is_floating_point:
            t = (torch.randn(n, generator=g) * 0.02).to(dtype)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), (n,), generator=g).to(dtype)
    elif kind == "structured":  # a ramp with runs of zeros: what position ids, masks and sparse rows look like
        t = (torch.arange(n) % 97).to(torch.float32)
        t[n // 3 : n // 2] = 0
        t = t.to(dtype) if dtype != torch.bool else t > 50
    else:
        t = torch.zeros(n, dtype=dtype)
    return t.view(torch.uint8).numpy().tobytes()


def stored_of(e: Encoded) -> bytes:
    return b"".join(bytes(s) for s in e.streams)


def frame_of(e: Encoded, n: int, offset: int = 0) -> Frame:
    return Frame(offset, n, 0, e.width, e.planes, e.lengths)


def decode(e: Encoded, n: int) -> bytes:
    out = bytearray(n)
    decode_frame(memoryview(stored_of(e)), frame_of(e, n), memoryview(out))
    return bytes(out)


def check_encoded(e: Encoded, raw: bytes) -> None:
    """The rules every encoded frame keeps (docs/format.md)."""
    n = len(raw)
    assert e.width in WIDTHS
    if e.width == 0:
        assert e.planes == 0 and e.lengths == (n,) and stored_of(e) == raw
    elif e.width == 1:
        assert e.planes == 1 and len(e.streams) == 1 and e.stored_len < n
    else:
        assert n % e.width == 0 and e.planes and e.planes >> e.width == 0 and len(e.streams) == e.width
        for p, s in enumerate(e.streams):
            if e.planes >> p & 1:
                assert len(s) < n // e.width
                assert zstandard.frame_content_size(bytes(s)) == n // e.width
            else:
                assert bytes(s) == raw[p :: e.width]
    assert e.stored_len <= n and e.seconds >= 0


@pytest.mark.parametrize("kind", ["random", "structured", "zeros"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_round_trip_every_width_and_dtype(width: int, dtype: torch.dtype, kind: str) -> None:
    raw = tensor_bytes(dtype, kind)
    for try_planes in (0xFF, 0x01, 0x80, 0):
        e = encode_frame(memoryview(raw), width, try_planes, 1)
        check_encoded(e, raw)
        assert decode(e, len(raw)) == raw


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 4099, 65_537])
def test_a_length_not_a_multiple_of_the_width_is_tried_whole(width: int, n: int) -> None:
    raw = bytes(n)
    e = encode_frame(memoryview(raw), width, 0xFF, 3)
    assert e.tried == 1 and e.width in (0, 1)
    check_encoded(e, raw)
    assert decode(e, n) == raw


def test_empty_frame_is_raw() -> None:
    e = encode_frame(memoryview(b""), 4, 0xFF, 1)
    assert e.width == 0 and e.lengths == (0,)


def test_planes_that_do_not_compress_stay_raw() -> None:
    raw = tensor_bytes(torch.float32, "random", 1 << 16)
    e = encode_frame(memoryview(raw), 4, 0xF, 1)
    assert e.width == 4
    assert e.planes & 0b1000, "the sign and exponent byte compresses"
    assert not e.planes & 0b0001, "the lowest mantissa byte of random numbers does not"
    assert e.plane_raw == (1 << 16,) * 4 and len(e.plane_stored) == 4
    assert e.plane_stored[0] >= 0.97 * e.plane_raw[0] and e.plane_stored[3] < e.plane_raw[3]
    assert decode(e, len(raw)) == raw


def test_a_frame_that_does_not_gain_is_stored_raw() -> None:
    raw = os.urandom(1 << 16)
    for width in WIDTHS:
        e = encode_frame(memoryview(raw), width, 0xFF, 1)
        assert e.width == 0 and e.planes == 0 and stored_of(e) == raw
        assert e.tried == width
        assert len(e.plane_stored) == max(width, 1)


def test_untried_planes_stay_raw_and_none_tried_is_raw() -> None:
    raw = tensor_bytes(torch.bfloat16, "random", 1 << 15)
    e = encode_frame(memoryview(raw), 2, 0b01, 1)
    assert e.width == 0, "the low byte of random bf16 does not compress, the high one was not tried"
    assert e.plane_stored[1] == e.plane_raw[1]
    assert len(e.plane_seconds) == 2 and e.plane_seconds[1] == 0.0 and e.plane_seconds[0] > 0
    assert sum(e.plane_seconds) <= e.seconds
    assert encode_frame(memoryview(raw), 2, 0, 1).width == 0
    assert encode_frame(memoryview(raw), 2, 0b10, 1).planes == 0b10


@pytest.mark.parametrize("level", [LEVELS.start, 1, 3, LEVELS.stop - 1])
def test_levels(level: int) -> None:
    raw = tensor_bytes(torch.bfloat16, "structured")
    assert decode(encode_frame(memoryview(raw), 2, 0b11, level), len(raw)) == raw


@pytest.mark.parametrize(("width", "level"), [(3, 1), (16, 1), (1, 20), (1, -8)])
def test_bad_width_or_level_is_refused(width: int, level: int) -> None:
    with pytest.raises(ValueError, match="width|level"):
        encode_frame(memoryview(b"x" * 64), width, 1, level)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_shuffle_and_unshuffle_are_inverse(width: int) -> None:
    raw = os.urandom(width * 1001)
    planes = shuffle(raw, width)
    assert planes.shape == (width, 1001)
    for p in range(width):
        assert planes[p].tobytes() == raw[p::width]
    out = bytearray(len(raw))
    unshuffle([memoryview(planes[p]) for p in range(width)], memoryview(out))
    assert bytes(out) == raw


def test_encoding_is_thread_safe() -> None:
    frames = [tensor_bytes(dt, "random", 4096 * (i + 1)) for i, dt in enumerate(DTYPES)] * 4

    def one(i: int) -> bool:
        raw = frames[i]
        e = encode_frame(memoryview(raw), (1, 2, 4, 8)[i % 4], 0xFF, (1, 3, -1)[i % 3])
        return decode(e, len(raw)) == raw

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(len(frames))))


# -- what decode_frame refuses --------------------------------------------------------------------------


def zstd_frame(data: bytes, **kw: bool) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_checksum=True, **kw).compress(data)


def fcs_field(frame: bytes) -> tuple[int, int, int]:
    """(offset, size, bias) of a zstd frame header's content size field (RFC 8878, 3.1.1.1)."""
    fhd = frame[4]
    flag, single = fhd >> 6, fhd >> 5 & 1
    size = (1 if single else 0, 2, 4, 8)[flag]
    offset = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    return offset, size, 256 if size == 2 else 0


def with_content_size(frame: bytes, value: int) -> bytes:
    offset, size, bias = fcs_field(frame)
    patched = bytearray(frame)
    patched[offset : offset + size] = (value - bias).to_bytes(size, "little")
    return bytes(patched)


def zstd_only(n: int, stored: bytes) -> Frame:
    return Frame(0, n, 0, 1, 1, (len(stored),))


def refuse(stored: bytes, frame: Frame, match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        decode_frame(memoryview(stored), frame, memoryview(bytearray(frame.raw_len)))


def test_a_stream_declaring_no_content_size_is_refused() -> None:
    data = bytes(4096)
    stored = zstd_frame(data, write_content_size=False)
    assert zstandard.frame_content_size(stored) == -1
    refuse(stored, zstd_only(4096, stored), "does not declare its content size")


def test_a_stream_declaring_more_than_its_frame_is_refused() -> None:
    data = bytes(5000)
    stored = zstd_frame(data)
    refuse(stored, zstd_only(4096, stored), "declares 5000 bytes, it stands for 4096")


def test_a_bomb_is_refused_before_anything_is_allocated() -> None:
    """A header claiming 2**40 bytes (a zstd frame of 8-byte content size and one RLE block), for a
    4 KiB frame: refused on its header, nothing of that size asked for."""
    header = struct.pack("<IBB", 0xFD2FB528, 0xC0, 0x50) + (1 << 40).to_bytes(8, "little")
    block = ((128 << 10) << 3 | 1 << 1 | 1).to_bytes(3, "little") + b"\x00"  # last block, RLE of 128 KiB
    stored = header + block
    assert zstandard.frame_content_size(stored) == 1 << 40
    tracemalloc.start()
    try:
        refuse(stored, zstd_only(4096, stored), "declares 1099511627776 bytes, it stands for 4096")
        planes = Frame(0, 8192, 0, 2, 0b01, (len(stored), 4096))
        refuse(stored + bytes(4096), planes, "plane 0 of 2: zstd frame declares")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_stream_that_decodes_to_more_than_it_declares_is_refused() -> None:
    data = bytes(range(256)) * 300
    stored = with_content_size(zstd_frame(data), len(data) - 1000)
    assert zstandard.frame_content_size(stored) == len(data) - 1000
    tracemalloc.start()
    try:
        refuse(stored, zstd_only(len(data) - 1000, stored), "zstd data is damaged")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * (len(data) - 1000) + (1 << 16), "the frame's buffer and one output of its size, no more"


def test_data_after_the_zstd_frame_is_refused() -> None:
    data = bytes(4096)
    stored = zstd_frame(data) + zstd_frame(data)
    refuse(stored, zstd_only(4096, stored), "zstd data is damaged")


def test_garbage_and_lengths_are_refused() -> None:
    refuse(b"not zstd at all", zstd_only(4096, b"not zstd at all"), "not a zstd frame")
    stored = zstd_frame(bytes(4096))
    refuse(stored + b"x", zstd_only(4096, stored), "stored bytes, its index says")
    planes = Frame(0, 4096, 0, 2, 0b10, (2000, len(stored)))
    refuse(b"\x00" * 2000 + stored, planes, "plane 0 of 2: raw plane of 2000 bytes, not 2048")
    with pytest.raises(ValueError, match="out is"):
        decode_frame(memoryview(stored), zstd_only(4096, stored), memoryview(bytearray(10)))


@pytest.mark.parametrize(("width", "dtype"), [(1, torch.float32), (2, torch.bfloat16), (4, torch.float32)])
def test_every_bit_flip_in_a_zstd_stream_is_caught(width: int, dtype: torch.dtype) -> None:
    """A flipped bit anywhere in a compressed stream: an error, or (a flag zstd ignores) the same bytes."""
    raw = tensor_bytes(dtype, "structured", 2048)
    e = encode_frame(memoryview(raw), width, 0xFF, 1)
    assert e.width == width
    stored, frame = stored_of(e), frame_of(e, len(raw))
    zstd_bytes, pos = [], 0
    for p, n in enumerate(e.lengths):
        if e.planes >> p & 1:
            zstd_bytes.extend(range(pos, pos + n))
        pos += n
    caught = 0
    for i in zstd_bytes:
        for bit in range(8):
            damaged = bytearray(stored)
            damaged[i] ^= 1 << bit
            out = bytearray(len(raw))
            try:
                decode_frame(memoryview(bytes(damaged)), frame, memoryview(out))
            except CorruptCheckpointError as exc:
                assert "frame at raw offset 0" in str(exc)
                caught += 1
            else:
                assert bytes(out) == raw, f"bit {bit} of byte {i} decoded to other bytes unnoticed"
    assert caught > 0.9 * 8 * len(zstd_bytes)


def test_decoding_stays_within_the_frame() -> None:
    raw = np.arange(4096, dtype=np.float32).tobytes()
    e = encode_frame(memoryview(raw), 4, 0xF, 1)
    buf = bytearray(b"\xee" * (len(raw) + 64))
    decode_frame(memoryview(stored_of(e)), frame_of(e, len(raw)), memoryview(buf)[32 : 32 + len(raw)])
    assert buf[:32] == b"\xee" * 32 and buf[-32:] == b"\xee" * 32 and bytes(buf[32:-32]) == raw


needs_planes = pytest.mark.skipif(
    codec._native is None, reason="the C extension with the plane loops is not built here"
)


@needs_planes
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("elements", [1, 2, 7, 4097, 65_536])
@pytest.mark.parametrize("skew", [0, 1, 3])
def test_native_planes_agree_with_numpy(width: int, elements: int, skew: int) -> None:
    """The C loops against numpy's, on buffers that start off any word boundary."""
    raw = memoryview(os.urandom(width * elements + skew))[skew:]
    planes = shuffle(raw, width)
    assert planes.tobytes() == shuffle_numpy(raw, width).tobytes()
    rows = [memoryview(bytearray(planes[p].tobytes()))[0:] for p in range(width)]
    a, b = bytearray(len(raw) + skew), bytearray(len(raw))
    unshuffle(rows, memoryview(a)[skew:])
    unshuffle_numpy(rows, memoryview(b))
    assert bytes(a[skew:]) == bytes(b) == bytes(raw)


@needs_planes
def test_native_planes_refuse_what_does_not_fit() -> None:
    native = codec._native
    assert native is not None
    with pytest.raises(ValueError, match="width 3"):
        native.shuffle(bytes(12), bytearray(12), 3)
    with pytest.raises(ValueError, match="shuffle: 10 bytes into 12"):
        native.shuffle(bytes(10), bytearray(12), 2)
    with pytest.raises(ValueError, match="width 1 is not"):
        native.unshuffle([bytes(4)], bytearray(4))
    with pytest.raises(ValueError, match="plane 1 is 3 bytes"):
        native.unshuffle([bytes(4), bytes(3)], bytearray(8))
    with pytest.raises(TypeError):
        native.unshuffle([bytes(4), bytes(4)], bytes(8))  # not writable


def test_views_of_any_item_format_count_bytes() -> None:
    """A memoryview of floats (len counts elements) is taken as its bytes."""
    t = torch.arange(4096, dtype=torch.float32)
    raw = memoryview(t.numpy())
    e = encode_frame(raw, 4, 0xF, 1)
    out = torch.empty(4096, dtype=torch.float32)
    decode_frame(memoryview(stored_of(e)), frame_of(e, 4 * 4096), memoryview(out.numpy()))
    assert torch.equal(out, t)
