"""The frame index and the version-6 manifest file (tierckpt.format.frames, docs/format.md "Compressed copies")."""

from __future__ import annotations

import dataclasses
import random
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from tierckpt.format.codec import decode_frame, encode_frame
from tierckpt.format.frames import (
    FORMAT_V6,
    FrameIndex,
    IndexBuilder,
    check_index,
    envelope_inner,
    held_sizes,
    unwrap_manifest,
    wrap_manifest,
)
from tierckpt.format.manifest import (
    BlobEntry,
    Manifest,
    TensorEntry,
    decode_head,
    decode_manifest,
    encode_manifest,
    manifest_version,
)
from tierckpt.format.record import CommitRecord, manifest_tag

F = 64 << 10
SIZES = (3 * F + 4096, 0, F, 8192)  # blob 0: 4 frames (the last 4 KiB), blob 1 none, 2: one, 3: one of 8 KiB


def inner(sizes: tuple[int, ...] = SIZES, align: int = 4096, **kw: Any) -> bytes:
    blobs = tuple(BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes))
    tensors = (TensorEntry("state['w']", "bfloat16", (sizes[0] // 2,), 0, 0, sizes[0], 7),) if sizes[0] else ()
    m = Manifest(step=3, rank=0, world_size=1, align=align, blobs=blobs, tensors=tensors, tree=b"\x80",
                 has_pickle=False, **kw)  # fmt: skip
    return encode_manifest(m)


def blob_bytes(size: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def encode_blobs(
    sizes: tuple[int, ...] = SIZES, widths: tuple[int, ...] = (2, 1, 4, 0, 8), order_seed: int = 0
) -> tuple[FrameIndex, list[bytes], list[bytes]]:
    """Every blob's raw bytes and stored stream, encoded with the given widths in turn, frames added in
    a shuffled order."""
    raws = [blob_bytes(s, i) for i, s in enumerate(sizes)]
    b = IndexBuilder(sizes, F)
    jobs = [(i, k) for i, s in enumerate(sizes) for k in range(b.count(i))]
    random.Random(order_seed).shuffle(jobs)
    enc = {}
    for n, (i, k) in enumerate(jobs):
        e = encode_frame(memoryview(raws[i])[k * F : (k + 1) * F], widths[n % len(widths)], 0xFF, 1)
        b.add(i, k, e.width, e.planes, e.lengths)
        enc[i, k] = b"".join(bytes(s) for s in e.streams)
    streams = [b"".join(enc[i, k] for k in range(b.count(i))) for i in range(len(sizes))]
    return b.build(), raws, streams


def read_range(index: FrameIndex, stream: bytes, blob: int, lo: int, hi: int) -> bytes:
    """Raw bytes [lo, hi) of a blob, decoding only the frames that hold them (what a reader does)."""
    out = bytearray()
    ks = index.span(blob, lo, hi)
    for k in ks:
        fr = index.frame(blob, k)
        buf = bytearray(fr.raw_len)
        decode_frame(memoryview(stream)[fr.stored_offset : fr.stored_offset + fr.stored_len], fr, memoryview(buf))
        out += buf
    start = ks.start * index.frame_bytes if ks else lo
    return bytes(out[lo - start : hi - start])


def test_index_round_trip_and_frames() -> None:
    index, raws, streams = encode_blobs()
    assert [index.count(i) for i in range(4)] == [4, 0, 1, 1]
    assert index.total == 6
    assert index.held == tuple(len(s) for s in streams)
    assert index.stored_bytes() == sum(index.held) < sum(SIZES)
    assert 0 < index.compressed_frames() < index.total
    last = index.frame(0, 3)
    assert (last.raw_offset, last.raw_len) == (3 * F, 4096)
    assert index.frame(3, 0).raw_len == 8192
    off = 0
    for k in range(4):
        fr = index.frame(0, k)
        assert fr.stored_offset == off
        off += fr.stored_len
    assert off == index.held[0]
    assert index.stored_range(0, 1, 3) == (
        index.frame(0, 1).stored_offset,
        sum(index.frame(0, k).stored_len for k in (1, 2)),
    )
    for i, raw in enumerate(raws):
        assert read_range(index, streams[i], i, 0, len(raw)) == raw
    with pytest.raises(IndexError):
        index.frame(0, 4)
    with pytest.raises(IndexError):
        index.frame(1, 0)


@pytest.mark.parametrize(
    ("lo", "hi", "frames"),
    [(0, 1, range(0, 1)), (F - 1, F + 1, range(0, 2)), (F, 2 * F, range(1, 2)), (10, 10, range(0)),
     (3 * F, 10**9, range(3, 4)), (-5, 3, range(0, 1)), (5, 2, range(0))],
)  # fmt: skip
def test_span(lo: int, hi: int, frames: range) -> None:
    index, raws, streams = encode_blobs()
    assert index.span(0, lo, hi) == frames
    lo, hi = max(lo, 0), min(hi, SIZES[0])
    assert read_range(index, streams[0], 0, lo, hi) == raws[0][lo:hi]


def test_builder_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="frame_bytes"):
        IndexBuilder(SIZES, 4096)
    b = IndexBuilder(SIZES, F)
    with pytest.raises(ValueError, match="blob 1 has no frame 0"):
        b.add(1, 0, 0, 0, ())
    with pytest.raises(ValueError, match="width 3"):
        b.add(0, 0, 3, 0, (1, 2, 3))
    with pytest.raises(ValueError, match="lengths"):
        b.add(0, 0, 2, 1, (5,))
    with pytest.raises(ValueError, match="lengths"):
        b.add(0, 0, 0, 0, (5,))
    b.add(0, 0, 0, 0, (F,))
    with pytest.raises(ValueError, match="added twice"):
        b.add(0, 0, 0, 0, ())
    with pytest.raises(ValueError, match="frame 1 of blob 0 was not added"):
        b.build()
    b = IndexBuilder((F,), F)
    b.add(0, 0, 1, 1, (F,))  # a zstd stream as long as the raw frame: not allowed
    with pytest.raises(ValueError, match="codec.lengths of blob 0 frame 0"):
        b.build()


def test_an_index_of_no_blobs_or_no_frames() -> None:
    for sizes in ((), (0, 0)):
        index = IndexBuilder(sizes, F).build()
        assert index.total == 0 and index.held == (0,) * len(sizes)


def test_envelope_round_trip() -> None:
    index, _, _ = encode_blobs()
    plain = inner()
    env = wrap_manifest(plain, index)
    assert env == wrap_manifest(plain, index), "deterministic"
    assert env[:8] == b"TIERCKPT" and manifest_version(env[:24]) == FORMAT_V6
    assert unwrap_manifest(env) == (plain, index)
    assert unwrap_manifest(plain) == (plain, None)
    assert bytes(envelope_inner(env)) == plain
    head = decode_head(env)
    assert head.version == 5 and head.frames == index
    assert decode_head(plain).frames is None
    m = decode_manifest(env)
    assert m == decode_manifest(plain) and m.frames == index
    assert encode_manifest(m) == plain, "the index is no part of the manifest's bytes"


def test_tag_is_the_inner_manifests() -> None:
    index, _, _ = encode_blobs()
    plain = inner()
    env = wrap_manifest(plain, index)
    assert manifest_tag(env) == manifest_tag(plain) != struct.unpack("<Q", env[-8:])[0]
    assert CommitRecord(3, 1, (manifest_tag(plain),)).matches(0, env)
    large = inner(sizes=(F,) * 20_000)  # an inner file of more than 64 KiB: a bin32 in the envelope
    b = IndexBuilder((F,) * 20_000, F)
    for i in range(20_000):
        b.add(i, 0, 0, 0, ())
    assert manifest_tag(wrap_manifest(large, b.build())) == manifest_tag(large)


def test_held_sizes() -> None:
    index, _, streams = encode_blobs()
    held = held_sizes(wrap_manifest(inner(), index))
    assert held == [-(-len(s) // 4096) * 4096 for s in streams]
    assert all(h <= s for h, s in zip(held, SIZES))
    assert held_sizes(inner()) is None


def test_wrap_refuses_what_is_not_a_plain_manifest_or_does_not_fit() -> None:
    index, _, _ = encode_blobs()
    env = wrap_manifest(inner(), index)
    with pytest.raises(ValueError, match="version is 6"):
        wrap_manifest(env, index)
    with pytest.raises(ValueError, match="version is None"):
        wrap_manifest(b"not a manifest at all, no.", index)
    with pytest.raises(ValueError, match="does not fit"):
        wrap_manifest(inner(sizes=(F, 0, F, 8192)), index)


def test_inner_of_every_version() -> None:
    index, _, _ = encode_blobs()
    for version in (1, 2, 3, 4, 5):
        plain = inner(version=version)
        head = decode_head(wrap_manifest(plain, index))
        assert head.version == version and head.frames == index


# -- validation: one test a rule ------------------------------------------------------------------------


def frame_file(payload: bytes, version: int = FORMAT_V6) -> bytes:
    framed = struct.pack("<8sHHIQ", b"TIERCKPT", version, 0, 0, len(payload)) + payload
    return framed + struct.pack("<Q", xxhash.xxh3_64_intdigest(framed))


def envelope_dict() -> dict[str, Any]:
    index, _, _ = encode_blobs()
    env = wrap_manifest(inner(), index)
    n = struct.unpack_from("<Q", env, 16)[0]
    d: dict[str, Any] = msgpack.unpackb(env[24 : 24 + n], raw=False)
    return d


def first(index_col: str, d: dict[str, Any], value: int, frame: int = 0) -> None:
    col = bytearray(d["codec"][index_col])
    col[frame] = value
    d["codec"][index_col] = bytes(col)


def lengths_of(d: dict[str, Any]) -> list[int]:
    return [int(x) for x in np.frombuffer(d["codec"]["lengths"], "<u4")]


def set_lengths(d: dict[str, Any], values: list[int]) -> None:
    d["codec"]["lengths"] = np.asarray(values, "<u4").tobytes()


def first_frame_of_width(d: dict[str, Any], width: int) -> tuple[int, int]:
    """(frame number, index of its first stream) of the first frame of that width."""
    widths = d["codec"]["width"]
    t = widths.index(bytes([width]))
    return t, sum(widths[:t])


def grow_stream(d: dict[str, Any], width: int, zstd: bool, delta: int) -> None:
    """Change the length of the first zstd (or raw) stream of the first frame of ``width``, and ``held``."""
    t, s = first_frame_of_width(d, width)
    planes = d["codec"]["planes"][t]
    p = next(p for p in range(width) if bool(planes >> p & 1) == zstd)
    lengths = lengths_of(d)
    lengths[s + p] += delta
    set_lengths(d, lengths)


def set_held(d: dict[str, Any], blob: int, delta: int) -> None:
    held = list(struct.unpack(f"<{len(d['codec']['held']) // 8}Q", d["codec"]["held"]))
    held[blob] += delta
    d["codec"]["held"] = struct.pack(f"<{len(held)}Q", *held)


def zstd_len_to_raw(d: dict[str, Any]) -> None:
    t, s = first_frame_of_width(d, 1)
    lengths = lengths_of(d)
    lengths[s] = F if t != 3 else 4096
    set_lengths(d, lengths)


Mutation = Callable[[dict[str, Any]], Any]


def cut(col: str, n: int) -> Mutation:
    return lambda d: d["codec"].__setitem__(col, d["codec"][col][:-n])


def put(key: str, value: Any) -> Mutation:
    return lambda d: d["codec"].__setitem__(key, value)


def grow(col: str, tail: bytes) -> Mutation:
    return lambda d: d["codec"].__setitem__(col, d["codec"][col] + tail)


def at_width(col: str, value: int, width: int) -> Mutation:
    """Set column ``col`` of the first frame of ``width`` to ``value``."""
    return lambda d: first(col, d, value, first_frame_of_width(d, width)[0])


ENVELOPE = "envelope keys are not manifest, codec"
NOT_SHORTER = "codec.lengths of blob . frame . plane 0: zstd stream of \\d+ bytes for \\d+ raw"
RULES: list[tuple[str, Mutation, str]] = [
    ("key missing", lambda d: d.pop("codec"), ENVELOPE),
    ("key added", lambda d: d.__setitem__("extra", 1), ENVELOPE),
    ("keys reordered", lambda d: d.update(manifest=d.pop("manifest")), ENVELOPE),
    ("manifest not bin", lambda d: d.__setitem__("manifest", "text"), "envelope.manifest is not bytes"),
    ("manifest not a manifest", lambda d: d.__setitem__("manifest", b"x" * 40), "envelope.manifest is not a manifest"),
    ("manifest damaged", lambda d: d.__setitem__("manifest", d["manifest"][:-1] + b"\x00"), "checksum mismatch"),
    ("codec key missing", lambda d: d["codec"].pop("planes"), "codec keys are not name"),
    ("codec keys reordered", lambda d: d["codec"].update(name=d["codec"].pop("name")), "codec keys are not name"),
    ("codec not a map", lambda d: d.__setitem__("codec", [1, 2]), "is not msgpack"),
    ("name", put("name", "lz4"), "codec.name 'lz4' is not 'zstd'"),
    ("name type", put("name", 7), "codec.name 7 is not a string"),
    ("frame_bytes small", put("frame_bytes", 32 << 10), "codec.frame_bytes 32768"),
    ("frame_bytes large", put("frame_bytes", 128 << 20), "codec.frame_bytes 134217728"),
    ("frame_bytes odd", put("frame_bytes", (64 << 10) + 1), "codec.frame_bytes 65537"),
    ("frame_bytes type", put("frame_bytes", "4MiB"), "codec.frame_bytes '4MiB'"),
    ("frame_bytes other", put("frame_bytes", 128 << 10), "codec.width: 6 bytes for 4 frames"),
    ("held type", put("held", [1]), "codec.held is not bytes"),
    ("held partial", cut("held", 1), "codec.held: 31 bytes, not a whole"),
    ("held short", cut("held", 8), "codec.held: 24 bytes for 4 blobs"),
    ("width short", cut("width", 1), "codec.width: 5 bytes for 6 frames"),
    ("planes long", grow("planes", b"\x00"), "codec.planes: 7 bytes for 6"),
    ("lengths partial", cut("lengths", 2), "codec.lengths: \\d+ bytes, not a whole"),
    ("lengths short", cut("lengths", 4), "codec.lengths: \\d+ bytes, the widths call for"),
    ("width value", lambda d: first("width", d, 3, 1), "codec.width of blob 0 frame 1: 3, not one of"),
    ("planes of width 0", at_width("planes", 1, 0), "codec.planes of blob . frame .: 0x1 for width 0"),
    ("planes of width 1", at_width("planes", 3, 1), "codec.planes of blob . frame .: 0x3 for width 1"),
    ("planes none", at_width("planes", 0, 2), "codec.planes of blob . frame .: 0x0 for width 2"),
    ("planes high bit", at_width("planes", 0x12, 2), "codec.planes of blob . frame .: 0x12 for width 2"),
    ("zstd not shorter", zstd_len_to_raw, NOT_SHORTER),
    ("raw plane length", lambda d: grow_stream(d, 4, False, -1), "codec.lengths of blob . frame . plane .: raw plane"),
    ("held other", lambda d: set_held(d, 2, -1), "codec.held of blob 2: \\d+ bytes; its frames store"),
    ("held of empty blob", lambda d: set_held(d, 1, 1), "codec.held of blob 1: 1 bytes; its frames store 0"),
]


@pytest.mark.parametrize(("name", "mutate", "message"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_is_refused_naming_the_field(name: str, mutate: Mutation, message: str) -> None:
    d = envelope_dict()
    mutate(d)
    data = frame_file(msgpack.packb(d, use_bin_type=True))
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_head(data)
    with pytest.raises(CorruptCheckpointError, match=message):
        held_sizes(data)


def test_planes_only_where_the_frame_is_a_multiple_of_the_width() -> None:
    """A blob of 2F + 4 bytes (align 4): frames of F, F and 4 bytes; 8 planes of the 4-byte one."""
    d = {"manifest": inner(sizes=(2 * F + 4,), align=4), "codec": {
        "name": "zstd", "frame_bytes": F, "held": struct.pack("<Q", 2 * F + 4), "width": b"\x00\x00\x08",
        "planes": b"\x00\x00\x01", "lengths": np.zeros(8, "<u4").tobytes()}}  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="codec.width of blob 0 frame 2: 8 byte planes of a 4-byte frame"):
        decode_head(frame_file(msgpack.packb(d, use_bin_type=True)))


def test_an_envelope_in_an_envelope_is_refused() -> None:
    d = envelope_dict()
    d["manifest"] = frame_file(msgpack.packb(envelope_dict(), use_bin_type=True))
    with pytest.raises(CorruptCheckpointError, match="envelope.manifest is of version 6"):
        decode_head(frame_file(msgpack.packb(d, use_bin_type=True)))


def test_bytes_after_the_map_are_refused() -> None:
    data = frame_file(msgpack.packb(envelope_dict(), use_bin_type=True) + b"\xc0")
    with pytest.raises(CorruptCheckpointError, match="1 bytes after the map"):
        decode_head(data)


def test_check_index_against_other_sizes() -> None:
    index, _, _ = encode_blobs()
    check_index(index, SIZES)
    with pytest.raises(CorruptCheckpointError, match="other sizes"):
        check_index(index, (*SIZES[:-1], 4096))


def test_a_huge_frame_count_is_refused_before_anything_is_sized_by_it() -> None:
    """A blob of 2**62 bytes is 2**46 frames: the 1-byte width column is refused without allocating them."""
    d = envelope_dict()
    d["manifest"] = inner(sizes=(1 << 62, *SIZES[1:]))
    data = frame_file(msgpack.packb(d, use_bin_type=True))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="codec.width: 6 bytes for 70368744177666 frames"):
            decode_head(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_every_bit_flip_in_an_envelope_is_caught() -> None:
    index, _, _ = encode_blobs()
    env = wrap_manifest(inner(), index)
    for i in range(len(env)):
        for bit in range(8):
            damaged = bytearray(env)
            damaged[i] ^= 1 << bit
            with pytest.raises(CorruptCheckpointError):
                decode_head(bytes(damaged))


def test_a_newer_version_after_6_is_unsupported() -> None:
    d = envelope_dict()
    with pytest.raises(UnsupportedFormatError, match="this reader knows versions 1, 2, 3, 4, 5, 6"):
        decode_head(frame_file(msgpack.packb(d, use_bin_type=True), version=7))


def test_envelope_inner_refuses_other_layouts() -> None:
    good = envelope_dict()
    for bad in ({"codec": good["codec"], "manifest": good["manifest"]}, {"manifest": "text", "codec": 1}):
        with pytest.raises(CorruptCheckpointError, match="version-6 file"):
            manifest_tag(frame_file(msgpack.packb(bad, use_bin_type=True)))
    truncated = frame_file(msgpack.packb(good, use_bin_type=True))[:300]
    with pytest.raises(CorruptCheckpointError, match="runs past the file"):
        envelope_inner(truncated)


# -- random indexes --------------------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    sizes = tuple(draw(st.lists(st.integers(0, 5 * F // 8).map(lambda n: 8 * n), max_size=5)))
    frames = []
    for s in sizes:
        for k in range(-(-s // F)):
            raw_len = min(F, s - k * F)
            width = draw(st.sampled_from([w for w in (0, 1, 2, 4, 8) if w < 2 or raw_len % w == 0]))
            planes = draw(st.integers(1, (1 << width) - 1)) if width >= 2 else width
            frames.append((width, planes))
    return sizes, frames


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_random_indexes_round_trip(layout: tuple[tuple[int, ...], list[tuple[int, int]]]) -> None:
    sizes, frames = layout
    b = IndexBuilder(sizes, F)
    it = iter(frames)
    expect = {}
    for i, s in enumerate(sizes):
        for k in range(b.count(i)):
            width, planes = next(it)
            raw_len = min(F, s - k * F)
            if width == 0:
                lengths: tuple[int, ...] = (raw_len,)
            elif width == 1:
                lengths = (raw_len - 1 - k,)
            else:
                lengths = tuple(raw_len // width - (1 if planes >> p & 1 else 0) for p in range(width))
            b.add(i, k, width, planes, lengths)
            expect[i, k] = (width, planes, lengths)
    index = b.build()
    align = 8
    plain = inner(sizes=sizes or (0,), align=align) if sizes else None
    if plain is not None:
        got = decode_head(wrap_manifest(plain, index)).frames
        assert got == index
    for (i, k), (width, planes, lengths) in expect.items():
        fr = index.frame(i, k)
        assert (fr.width, fr.planes, fr.lengths, fr.raw_offset) == (width, planes, lengths, k * F)
        assert fr.stored_offset + fr.stored_len <= index.held[i]
    for i in range(len(sizes)):
        assert index.stored_range(i, 0, index.count(i)) == (0, index.held[i])
        assert index.held[i] <= sizes[i]


def test_frames_is_no_part_of_manifest_equality() -> None:
    index, _, _ = encode_blobs()
    m = decode_manifest(inner())
    assert dataclasses.replace(m, frames=index) == m


def test_the_example_of_docs_format_md() -> None:
    """docs/format.md, "Compressed copies (version 6)": the example's columns and offsets."""
    mib = 1 << 20
    b = IndexBuilder((9 * mib, 64 << 10), 4 * mib)
    b.add(0, 2, 0, 0, ())
    b.add(1, 0, 1, 1, (1234,))
    b.add(0, 1, 2, 0b10, (2 * mib, 771_234))
    b.add(0, 0, 2, 0b10, (2 * mib, 770_000))
    index = b.build()
    assert (index.width, index.planes) == (b"\x02\x02\x00\x01", b"\x02\x02\x00\x01")
    assert index.lengths.tolist() == [2_097_152, 770_000, 2_097_152, 771_234, 1_234]
    assert index.held == (6_784_114, 1_234)
    assert [index.frame(0, k).stored_offset for k in range(3)] == [0, 2_867_152, 5_735_538]
    plain = inner(sizes=(9 * mib, 64 << 10))
    assert held_sizes(wrap_manifest(plain, index)) == [6_787_072, 4096]
