"""Large frame indexes (tierckpt.format.frameindex): what decoding and checking one costs in memory (about
its own size, however many frames its file says it has), a column longer than the manifest allows refused
before it is unpacked, and stored offsets summed right across the prefix sums kept every 64 frames."""

from __future__ import annotations

import random
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest

from tests.unit.test_frames import F, envelope_dict, frame_file, inner
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frames import IndexBuilder, wrap_manifest
from tierckpt.format.manifest import decode_head


def _large_index_file(frames: int, width: int) -> bytes:
    """A sound version-6 file whose one blob has ``frames`` frames of F, each raw (width 0) or one zstd
    stream of 100 bytes (width 1): an index of 2 or 6 bytes a frame."""
    lengths = np.full(frames if width else 0, 100, "<u4").tobytes()
    held = 100 * frames if width else F * frames
    d = {"manifest": inner(sizes=(F * frames,)), "codec": {
        "name": "zstd", "frame_bytes": F, "held": struct.pack("<Q", held), "width": bytes([width]) * frames,
        "planes": bytes([width]) * frames, "lengths": lengths}}  # fmt: skip
    return frame_file(msgpack.packb(d, use_bin_type=True))


@pytest.mark.parametrize("width", [0, 1])
def test_a_large_index_costs_about_its_own_size(width: int) -> None:
    """An index of a million frames (as large as its file says, so possibly hostile): decoding and
    checking it allocates about twice the file's bytes at the peak (msgpack's copies of the columns),
    and keeps about the columns' bytes (prefix sums every 64 frames, not a Python int a frame)."""
    frames = 1 << 20
    data = _large_index_file(frames, width)
    tracemalloc.start()
    try:
        index = decode_head(data).frames
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index is not None and index.total == frames
    assert peak < 3 * len(data) and kept < 1.3 * len(data), (peak / len(data), kept / len(data))
    stored = 100 if width else F
    for k in (0, 1, 63, 64, 65, 1000, frames - 1):
        fr = index.frame(0, k)
        assert (fr.stored_offset, fr.stored_len) == (k * stored, stored)
    assert index.stored_range(0, 5, frames) == (5 * stored, (frames - 5) * stored)


def test_a_held_column_longer_than_the_blobs_is_refused_before_it_is_unpacked() -> None:
    d = envelope_dict()
    d["codec"]["held"] = (np.arange(1 << 20, dtype="<u8") + 1000).tobytes()  # a million blobs' for the four
    data = frame_file(msgpack.packb(d, use_bin_type=True))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="codec.held: 8388608 bytes for 4 blobs"):
            decode_head(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20  # msgpack's copies of the column (16 MiB); not a Python int an entry (+28 MiB)


def test_offsets_across_many_blocks_and_blobs() -> None:
    """Blobs of many frames (the index keeps prefix sums every 64 frames): every frame's stored offset
    is the sum of the stored lengths before it in its blob, raw and short last frames included."""
    rng = random.Random(3)
    sizes = (70 * F + 8, 3 * F, 0, 130 * F + 4096, 8, 64 * F, 200 * F + 24)
    b = IndexBuilder(sizes, F)
    expect: dict[tuple[int, int], tuple[int, int]] = {}
    for i, size in enumerate(sizes):
        off = 0
        for k in range(b.count(i)):
            raw_len = min(F, size - k * F)
            width = rng.choice([w for w in (0, 0, 1, 2, 4, 8) if w < 2 or raw_len % w == 0])
            planes = rng.randrange(1, 1 << width) if width >= 2 else width
            lengths = [
                max(1, raw_len // max(width, 1) - (planes >> p & 1) * rng.randrange(1, 50)) for p in range(width)
            ]
            b.add(i, k, width, planes, lengths if width else [])
            stored = sum(lengths) if width else raw_len
            expect[i, k] = (off, stored)
            off += stored
    index = b.build()
    assert decode_head(wrap_manifest(inner(sizes=sizes, align=8), index)).frames == index
    for (i, k), (off, stored) in expect.items():
        fr = index.frame(i, k)
        assert (fr.stored_offset, fr.stored_len) == (off, stored), (i, k)
    for i in range(len(sizes)):
        assert index.stored_range(i, 0, index.count(i)) == (0, index.held[i])
    assert index.stored_range(6, 63, 130) == (expect[6, 63][0], expect[6, 130][0] - expect[6, 63][0])
