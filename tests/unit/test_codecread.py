"""Reads of compressed tier copies (tierckpt.datapath.codecread, openblobs): raw offsets of any alignment
read through the frames they touch (zstd frames, byte planes compressed or raw, frames stored raw, a
short last frame), the stored bytes read in one aligned read per raw read, edge frames decoded aside and
inner frames straight into place; damage (a flipped stored byte, non-zero padding, a short stored stream,
a stream that declares another size or none) named by tier, step, blob and frame. Then whole compressed
copies made by hand (tierckpt.testing.compressed) on the host, local and S3 (moto) tiers: restore(),
restore(into=), verify(), inspect's stored bytes and ratio, and the range reads of a resharding restore
of a sharded row's checksum chunks."""

from __future__ import annotations

import random
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zstandard

from tierckpt import Hierarchy
from tierckpt.datapath import codecjob
from tierckpt.datapath.codecread import codec_reader
from tierckpt.datapath.openblobs import open_blobs, stored_entries
from tierckpt.datapath.shardread import Copies, Dest, Filler
from tierckpt.datapath.verifier import Where
from tierckpt.errors import CorruptCheckpointError
from tierckpt.facade.describe import describe_stored, stored_lines
from tierckpt.format.frames import FrameIndex, IndexBuilder, unwrap_manifest
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import BlobEntry, decode_head
from tierckpt.io.buffers import memmove
from tierckpt.io.engine import make_engine
from tierckpt.testing.compressed import encode_blobs, recompress
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

KiB, MiB = 1 << 10, 1 << 20
F = 64 * KiB  # the smallest frame the format allows: several frames in a small blob
ALIGN = 4096
WHERE = Where("obj", 7)
KEY = CheckpointKey(1, 0)


# -- the codec reader over blobs in memory --------------------------------------------------------------------
def _floats(n: int, seed: int, dtype: torch.dtype) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n // dtype.itemsize, generator=g) * 0.02).to(dtype)
    return t.view(torch.uint8).numpy().tobytes()


def _raw_blobs() -> list[bytes]:
    """Two blobs: 5 whole frames (bf16, fp32, fp64) and a short one (zeros, fp32); one short frame."""
    a = _floats(2 * F, 1, torch.bfloat16) + _floats(2 * F, 2, torch.float32) + _floats(F, 3, torch.float64)
    a += bytes(F // 2) + _floats(3 * ALIGN, 4, torch.float32)  # a zero-heavy frame, then a short last frame
    b = _floats(ALIGN, 5, torch.float16)
    return [a, b]


#: frame k of blob 0 stored as: zstd whole, planes 2 (all), planes 4 (two raw), raw, planes 8 (zstd high 4), 4
PLANS = {(0, 0): (1, 1), (0, 1): (2, 0b11), (0, 2): (4, 0b1100), (0, 3): (0, 0), (0, 4): (8, 0xF0), (0, 5): (4, 0xF)}


class MemReader(TierReader):
    """A tier's reader of stored bytes in memory, refusing reads the copy's alignment does not allow."""

    def __init__(self, stored: list[bytes], align: int = ALIGN) -> None:
        self.stored, self.align, self.reads = [bytearray(s) for s in stored], align, list[tuple[int, int, int]]()

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        assert offset % self.align == 0 and nbytes % self.align == 0 and addr % self.align == 0, (offset, nbytes)
        self.reads.append((blob, offset, nbytes))
        data = bytes(self.stored[blob][offset : offset + nbytes])
        memmove(addr, data, len(data))
        f: Future[int] = Future()
        f.set_result(len(data))
        return f


def _copy(plans: dict[tuple[int, int], tuple[int, int]] | None = None) -> tuple[list[bytes], FrameIndex, MemReader]:
    raw = _raw_blobs()
    bufs = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    p = PLANS if plans is None else plans
    index, streams = encode_blobs(bufs, F, lambda b, k: p.get((b, k), (4, 0xF)), 1)
    padded = [s + bytes(round_up(len(s), ALIGN) - len(s)) for s in streams]
    return raw, index, MemReader(padded)


def _head(raw: list[bytes]) -> Any:
    return SimpleNamespace(blobs=tuple(BlobEntry(f"blob-{i:05d}.bin", len(r)) for i, r in enumerate(raw)), align=ALIGN)


def _read(r: TierReader, blob: int, lo: int, n: int) -> bytes:
    buf = torch.full((n + 3,), 0xA5, dtype=torch.uint8)
    addr = buf.data_ptr() + 3  # an odd address: reads go anywhere
    got = r.read(blob, lo, addr, n).result()
    assert bytes(buf[:3].tolist()) == b"\xa5" * 3
    return buf[3 : 3 + got].numpy().tobytes()


def test_the_frames_are_stored_as_planned() -> None:
    _, index, _ = _copy()
    assert [index.frame(0, k).width for k in range(index.count(0))] == [1, 2, 4, 0, 8, 4]
    assert index.frame(0, 2).planes & 0b0011 == 0 and index.frame(0, 4).planes & 0x0F == 0  # low planes raw
    assert index.compressed_frames() >= 4 and index.stored_bytes() < sum(len(r) for r in _raw_blobs())


def test_whole_blobs_and_ranges_of_every_alignment() -> None:
    raw, index, inner = _copy()
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    assert r.read_alignment(0) == (1, 1) and r.buffer(0) is None
    for bi, data in enumerate(raw):
        assert _read(r, bi, 0, len(data)) == data
    rng = random.Random(7)
    size = len(raw[0])
    ranges = [(0, 1), (1, 3), (F - 1, 2), (F, F), (F - 5, 2 * F + 11), (3 * F + 7, 1), (size - 1, 1), (size - 3, 50)]
    ranges += [(lo, rng.randrange(1, size - lo + 1)) for lo in (rng.randrange(size) for _ in range(60))]
    for lo, n in ranges:
        assert _read(r, 0, lo, n) == raw[0][lo : lo + n], (lo, n)
    assert r.read(0, size, 0, 10).result() == 0  # past the end: nothing
    r.close()


def test_one_aligned_read_of_the_stored_bytes_per_read() -> None:
    raw, index, inner = _copy()
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    _read(r, 0, F + 100, 3 * F)  # frames 1 to 4, one inner read of their stored bytes back to back
    [(blob, off, n)] = inner.reads
    f1, f4 = index.frame(0, 1), index.frame(0, 4)
    assert blob == 0 and off == f1.stored_offset // ALIGN * ALIGN
    end = f4.stored_offset + f4.stored_len
    assert off + n >= end and n < end - f1.stored_offset + 2 * ALIGN  # widened to the alignment, no more


def test_a_copy_with_every_frame_raw() -> None:
    raw, index, inner = _copy({(b, k): (0, 0) for b in range(2) for k in range(6)})
    assert index.compressed_frames() == 0 and index.stored_bytes() == sum(len(x) for x in raw)
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    assert _read(r, 0, 5, len(raw[0]) - 9) == raw[0][5:-4]


class SlowReader(MemReader):
    """The same, each read landing later on a thread of its own (reads in flight together)."""

    def __init__(self, stored: list[bytes]) -> None:
        super().__init__(stored)
        self.pool = ThreadPoolExecutor(4)

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        def later() -> int:
            time.sleep(random.random() / 500)
            return super(SlowReader, self).read(blob, offset, addr, nbytes).result()

        return self.pool.submit(later)


def test_an_edge_frame_is_decoded_once_for_the_reads_that_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    raw, index, inner = _copy()
    decoded: list[int] = []
    real = codecjob.decode_frame
    monkeypatch.setattr(codecjob, "decode_frame", lambda s, f, o: (decoded.append(f.raw_offset), real(s, f, o)))
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    assert _read(r, 0, 0, F + 100) + _read(r, 0, F + 100, F) == raw[0][: 2 * F + 100]
    assert sorted(decoded) == [0, F, 2 * F]  # frame 1 (the edge of both reads) once, frame 2 for its 100 bytes
    assert len(inner.reads) == 2 and inner.reads[1][1] > index.frame(0, 1).stored_offset  # not read again


def test_pieces_in_flight_together() -> None:
    """Consecutive pieces not on the frame grid, all submitted before any lands: each edge frame is
    decoded by one read and copied out by the other, whichever comes first."""
    raw, index, _ = _copy()
    _, _, mem = _copy()
    inner = SlowReader(mem.stored)
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    size = len(raw[0])
    for piece in (5000, F - 1, F + 4097, 3 * F // 2):
        out = torch.zeros(size, dtype=torch.uint8)
        futs = [(lo, r.read(0, lo, out.data_ptr() + lo, piece)) for lo in range(0, size, piece)]
        assert [f.result(timeout=30) for _, f in futs] == [min(piece, size - lo) for lo, _ in futs]
        assert out.numpy().tobytes() == raw[0], piece
    inner.pool.shutdown()


def _expect(r: TierReader, blob: int, lo: int, n: int, *words: str) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError) as e:
        _read(r, blob, lo, n)
    for w in ("tier=obj", "step=7", *words):
        assert w in str(e.value), (w, str(e.value))
    return e.value


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_a_flipped_stored_byte_is_named(k: int) -> None:
    """A flipped bit in a zstd stream (header, blocks, checksum) is an error naming the frame; one in a
    raw plane gives other bytes, which the checksums over the raw bytes above the reader find."""
    raw, index, inner = _copy()
    f = index.frame(0, k)
    zstd = f.width == 1 or f.planes & 1  # its first stream
    rng = random.Random(k)
    for _ in range(20):
        pos, bit = f.stored_offset + rng.randrange(f.lengths[0]), 1 << rng.randrange(8)
        inner.stored[0][pos] ^= bit
        r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
        try:
            if zstd:
                _expect(r, 0, f.raw_offset, f.raw_len, f"frame {k} of 6", "blob=blob-00000.bin")
                _expect(r, 0, f.raw_offset + 3, 5, f"frame {k} of 6")  # a part of it, decoded aside
            else:
                assert _read(r, 0, f.raw_offset, f.raw_len) != raw[0][f.raw_offset : f.raw_offset + f.raw_len]
        finally:
            inner.stored[0][pos] ^= bit


def test_non_zero_padding_after_the_stream_is_found_where_it_is_read() -> None:
    raw, index, inner = _copy()
    held = index.held[0]
    assert round_up(held, ALIGN) > held  # a padded tail
    inner.stored[0][round_up(held, ALIGN) - 1] = 1
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    assert _read(r, 0, 0, F) == raw[0][:F]  # a read that does not reach it
    _expect(r, 0, len(raw[0]) - 10, 10, "padding bytes", "blob=blob-00000.bin")


def test_a_short_stored_stream_is_a_truncated_copy() -> None:
    raw, index, inner = _copy()
    f3, f4 = index.frame(0, 3), index.frame(0, 4)
    cut = round_up(f3.stored_offset + f3.stored_len, ALIGN)  # frame 3 whole, frame 4 cut short
    assert cut < f4.stored_offset + f4.stored_len
    del inner.stored[0][cut:]
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN)
    assert _read(r, 0, 0, 2 * F) == raw[0][: 2 * F]
    _expect(r, 0, 0, len(raw[0]), "truncated", "frame 4 of 6")


def _rle_frame(declared: int | None, fill: int = 0) -> bytes:
    """A zstd frame of one RLE block of 128 KiB, declaring ``declared`` bytes (None: no size), checksummed."""
    if declared is None:
        fhd, fcs = 0b0000_0100, b"\x58"  # window descriptor: 2^(10+11) bytes
    else:
        fhd, fcs = 0b1110_0100, struct.pack("<Q", declared)  # single segment, 8-byte content size
    block = ((128 * KiB) << 3) | (1 << 1) | 1  # last block, RLE, 128 KiB
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + fcs + block.to_bytes(3, "little") + bytes([fill]) + b"\0\0\0\0"


@pytest.mark.parametrize("declared", [1 << 40, 2 * F, F - 1, None], ids=["1TiB", "twice", "less", "none"])
def test_a_stream_declaring_another_size_is_refused_before_it_is_decoded(declared: int | None) -> None:
    """A decompression bomb: the frame index is sound, the stream's header declares more (or less, or
    nothing) than the frame it stands for: refused from the header, nothing allocated for it."""
    raw = [bytes(F)]
    bomb = _rle_frame(declared)
    b = IndexBuilder([F], F)
    b.add(0, 0, 1, 1, [len(bomb)])
    index = b.build()
    r = codec_reader(MemReader([bomb + bytes(ALIGN - len(bomb))]), _head(raw), index, where=WHERE, mem_align=ALIGN)
    _expect(r, 0, 0, F, "frame 0 of 1", "blob=blob-00000.bin")
    _expect(r, 0, 10, 20, "frame 0 of 1")  # a part of it: decoded aside, refused the same


def test_a_sound_hand_made_stream_decodes() -> None:
    """The hand-made frame above with the right size: the refusals above are of the size alone."""
    data = zstandard.ZstdDecompressor().decompress(_rle_frame(128 * KiB, 7)[:-4].replace(b"\xe4", b"\xe0", 1))
    assert data == bytes([7]) * 128 * KiB


# -- whole compressed copies on the tiers -------------------------------------------------------------------------
def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(300, 257, generator=g) * 0.02).to(torch.bfloat16)  # ~150 KiB: three frames
    return {
        "w": w,
        "tied": w,
        "m": torch.randn(97, 129, generator=g),  # fp32, 49 KiB: a frame shared with its neighbours
        "v": torch.randn(5000, generator=g).abs() * 1e-4,
        "i": torch.arange(3000, dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
        "step": 12,
        "name": "run",
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    moto = pytest.importorskip("moto")
    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="codec")
        yield


def _tier(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    if kind == "host":
        return HostTier("x", 64 * MiB)
    if kind == "local":
        return LocalTier("x", tmp_path / "x", make_engine("threads", 2))
    request.getfixturevalue("s3")
    from tierckpt.tiers._s3client import S3Settings
    from tierckpt.tiers.s3 import S3Tier

    return S3Tier("x", "codec", "run/", S3Settings(attempts=2, deadline_s=5), part_size=5 * MiB)


@pytest.fixture(params=["host", "local", "s3"])
def compressed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Hierarchy, Tier, FrameIndex]]:
    """A hierarchy of one tier of each kind holding step 1 of :func:`state`, its copy recompressed."""
    tier = _tier(request.param, tmp_path, request)
    h = Hierarchy([tier]) if tier.capabilities.persistent else Hierarchy([tier, PfsTier("p", tmp_path / "p")])
    h.save(state(), step=1).wait()
    index = recompress(tier, KEY, plan=lambda b, k: [(4, 0xF), (2, 0b10), (1, 1), (0, 0)][k % 4])
    assert index.compressed_frames() >= 2
    try:
        yield h, tier, index
    finally:
        h.close()


def test_restore_restore_into_and_verify(compressed: tuple[Hierarchy, Tier, FrameIndex]) -> None:
    h = compressed[0]
    got = h.restore(tier="x")
    assert same(state(), got) and got["w"] is got["tied"]
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state().items()}
    target["tied"] = target["w"]
    assert same(state(), h.restore(into=target, tier="x"))
    assert [(s, t, e) for s, t, e in h.verify(1) if t == "x"] == [(1, "x", None)]


def test_range_reads_through_the_tier(compressed: tuple[Hierarchy, Tier, FrameIndex]) -> None:
    _, tier, index = compressed
    with tier.open_copy(KEY) as copy:
        head = decode_head(copy.read_manifest())
        assert head.frames is not None and stored_entries(head)[0].held == round_up(index.held[0], head.align)
        r = open_blobs(tier, copy, head, background=False)
    plain = _read(r, 0, 0, head.blobs[0].size)
    rng = random.Random(5)
    for _ in range(40):
        lo = rng.randrange(len(plain))
        n = rng.randrange(1, min(3 * F, len(plain) - lo) + 1)
        assert _read(r, 0, lo, n) == plain[lo : lo + n]
    r.close()


def test_inspect_shows_stored_bytes_and_ratio(compressed: tuple[Hierarchy, Tier, FrameIndex]) -> None:
    h, _, index = compressed
    [row] = [s for s in describe_stored(h.tiers, KEY) if s["tier"] == "x"]
    assert row["codec"] == "zstd" and row["stored_bytes"] == index.stored_bytes()
    assert row["ratio"] == round(row["raw_bytes"] / row["stored_bytes"], 3) and row["ratio"] > 1
    assert any(line.startswith("  x: ") and "zstd, ratio" in line for line in stored_lines([row]))


def test_a_prefetch_copies_it_decoded(compressed: tuple[Hierarchy, Tier, FrameIndex], tmp_path: Path) -> None:
    """The mover's source side: a copy to a plain tier holds the raw blobs and the inner manifest."""
    tier = compressed[1]
    with tier.open_copy(KEY) as copy:
        manifest = copy.read_manifest()
    top = LocalTier("y", tmp_path / "y", make_engine("threads", 2))
    h2 = Hierarchy([top, tier])
    try:
        assert h2.prefetch(1, to="y").result(timeout=60) == "y"
        inner = top.read_manifest(KEY)
        assert decode_head(inner).frames is None and inner != manifest and unwrap_manifest(manifest)[0] == inner
        assert same(state(), h2.restore(tier="y"))
    finally:
        h2.close()


# -- a resharding restore's range reads of a compressed sharded row ---------------------------------------------
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_range_reads_of_a_sharded_rows_chunks(tmp_path: Path) -> None:
    """The two-rank fixture's ``big`` (18 x 128 fp32, rows 9 + 9, 4 KiB checksum chunks), both ranks'
    copies compressed: a box across both shards reads whole chunks of each (parts of one frame)."""
    sys.path.insert(0, str(GOLDEN))
    import dist_states as ds

    path = Path(shutil.copytree(GOLDEN / "dist-v5" / "pfs", tmp_path / "pfs"))
    tier = PfsTier("pfs", path, make_engine("threads", 2))
    for rank in (0, 1):
        recompress(tier, CheckpointKey(ds.DIST_STEP, rank), plan=lambda b, k: (4, 0xF))
    copies = Copies(tier, ds.DIST_STEP, allow_pickle=False)
    try:
        base = copies.get(0)
        row = base.m.tensors.paths.index("state['model']['big']")
        whole = ds.full("big", ds.DIST_TENSORS["big"])
        out = torch.zeros(10, 100)
        Filler(copies, base).fill([Dest(row, out, ((10, 100), (4, 20)))])
        assert torch.equal(out, whole[4:14, 20:120])
        assert all(c.m.chunk_bytes == 4096 for c in copies.opened.values()) and set(copies.opened) == {0, 1}
    finally:
        copies.close()
        tier.close()
