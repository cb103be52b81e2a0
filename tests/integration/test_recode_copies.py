"""A copy between two tiers that compress with different settings re-encodes only what differs
(docs/tiers.md, "Compression"; :mod:`tierckpt.datapath.recode`): the frames the source stored compressed
pass through byte for byte, the frames it left raw are planned and encoded by the destination; a
destination whose ``auto`` says nothing pays takes the source's copy whole; damage on the source is never
laundered; a hostile index is refused; a failed copy leaves nothing behind."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from test_compressed_copies import same  # tests/integration/

from tierckpt import Hierarchy
from tierckpt.datapath.codecwrite import frame_bytes_for
from tierckpt.datapath.openblobs import stored_entries
from tierckpt.errors import CorruptCheckpointError, TierIOError
from tierckpt.format.frames import FrameIndex, unwrap_manifest
from tierckpt.format.manifest import decode_head
from tierckpt.io.buffers import aligned_empty
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.compression import RAW, Adaptive, FramePlan, Kind
from tierckpt.testing.compressed import recompress
from tierckpt.testing.faulty import FaultyTier
from tierckpt.testing.tamper import rewrite_manifest
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

MiB = 1 << 20
ZSTD = CompressConfig("zstd")


def state(seed: int = 0) -> dict[str, Any]:
    """bf16 weights (compressible: the source leaves them raw), fp32 moments (the source compresses
    them) and random bytes (no tier gains on them)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(5 * MiB // 2, generator=g)
    return {
        "model": {"w": w.to(torch.bfloat16)},
        "optim": {"exp_avg": w * 1e-3},
        "rng": torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8, generator=g),
    }


class _Leaves(Adaptive):
    """A ``zstd`` tier's decisions that leave the frames of ``raw`` kinds raw (as an ``auto`` tier on a fast
    path does): the source of a copy whose frames are part compressed, part raw."""

    def __init__(self, raw: set[str]) -> None:
        super().__init__(ZSTD, 2)
        self.raw = raw

    def plan(self, kind: Kind, budget: float | None = None) -> FramePlan:
        return RAW if kind.name in self.raw else super().plan(kind, budget)


def _leaving(tier: Tier, raw: set[str] | None = None) -> Tier:
    tier.compress = ZSTD
    tier.adaptive = _Leaves(raw if raw is not None else {"bfloat16/weight"})
    return tier


def _with(tier: Tier, cfg: CompressConfig) -> Tier:
    tier.compress = cfg
    return tier


def stored(tier: Tier, step: int) -> tuple[bytes, FrameIndex, list[np.ndarray]]:
    """A copy's manifest file, its frame index and each blob's stored bytes, read through the tier."""
    with tier.open_copy(CheckpointKey(step)) as copy:
        manifest = copy.read_manifest()
        head = decode_head(manifest)
        entries = stored_entries(head)
        reader = copy.reader(entries)
    assert head.frames is not None, f"{tier.name}: step {step} is not stored compressed"
    blobs = []
    try:
        for b, e in enumerate(entries):
            buf = aligned_empty(max(e.stored, 4096), 4096, pin=False)
            assert reader.read(b, 0, buf.data_ptr(), e.stored).result() == e.stored
            blobs.append(buf.numpy()[: e.stored].copy())
    finally:
        reader.close()
    return manifest, head.frames, blobs


def frames(index: FrameIndex) -> Iterator[tuple[int, int]]:
    return ((b, k) for b in range(len(index.sizes)) for k in range(index.count(b)))


def _frame_bytes(index: FrameIndex, blobs: list[np.ndarray], b: int, k: int) -> bytes:
    f = index.frame(b, k)
    return blobs[b][f.stored_offset : f.stored_offset + f.stored_len].tobytes()


def check_recoded(src: Tier, dst: Tier, step: int) -> None:
    """``dst``'s copy: every frame ``src`` stored compressed byte for byte as there, its raw bf16 frames
    compressed now, one inner manifest on both."""
    src_file, src_index, src_blobs = stored(src, step)
    dst_file, dst_index, dst_blobs = stored(dst, step)
    assert unwrap_manifest(src_file)[0] == unwrap_manifest(dst_file)[0]  # the same inner manifest
    assert src_index.frame_bytes == dst_index.frame_bytes and src_index.sizes == dst_index.sizes
    passed = newly = 0
    for b, k in frames(src_index):
        s, d = src_index.frame(b, k), dst_index.frame(b, k)
        if s.width:
            assert (d.width, d.planes, d.lengths) == (s.width, s.planes, s.lengths)
            assert _frame_bytes(dst_index, dst_blobs, b, k) == _frame_bytes(src_index, src_blobs, b, k)
            passed += 1
        elif d.width:
            newly += 1
    assert passed > 0 and newly > 0, (passed, newly)
    assert dst_index.compressed_frames() == passed + newly < dst_index.total  # the random bytes stay raw


@contextmanager
def _moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Tier]]:
    moto = pytest.importorskip("moto")
    from tierckpt.tiers._s3client import S3Settings
    from tierckpt.tiers.s3 import S3Tier

    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="recode")
        yield lambda name: S3Tier(name, "recode", f"{name}/", S3Settings(attempts=2, deadline_s=5), part_size=5 * MiB)


def _source(kind: str, tmp_path: Path) -> Tier:
    if kind == "host":
        return _leaving(HostTier("src", 256 * MiB))
    return _leaving(LocalTier("src", tmp_path / "src"))


def _destination(kind: str, tmp_path: Path, s3: Callable[[str], Tier] | None) -> Tier:
    if kind == "local":
        return _with(LocalTier("dst", tmp_path / "dst"), ZSTD)
    if kind == "local-1MiB":  # reads of a few frames each, several in flight
        return _with(LocalTier("dst", tmp_path / "dst", chunk_bytes=MiB), ZSTD)
    if kind == "pfs":
        return _with(PfsTier("dst", tmp_path / "dst"), ZSTD)
    if kind == "sequential":
        return _with(FaultyTier(LocalTier("dst", tmp_path / "dst"), capabilities={"sequential_writes": True}), ZSTD)
    assert kind == "s3" and s3 is not None
    return _with(s3("dst"), ZSTD)


@pytest.mark.parametrize("dst_kind", ["local", "local-1MiB", "pfs", "sequential", "s3"])
@pytest.mark.parametrize("src_kind", ["host", "local"])
def test_raw_frames_are_encoded_and_compressed_ones_pass_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_kind: str, dst_kind: str
) -> None:
    with _moto_s3(monkeypatch) if dst_kind == "s3" else _nothing() as s3:
        src, dst = _source(src_kind, tmp_path), _destination(dst_kind, tmp_path, s3)
        s = state(1)
        with Hierarchy([src, dst]) as h:
            _leaving(src)  # (the hierarchy kept the tier's Adaptive: the same setting)
            h.save(s, step=1).durable["dst"].result()
            check_recoded(src, dst, 1)
            assert same(h.restore(1, tier="dst"), s)
            assert sorted((t, e) for _, t, e in h.verify(1)) == [("dst", None), ("src", None)]


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def test_a_destination_where_nothing_pays_takes_the_copy_whole(tmp_path: Path) -> None:
    """``auto`` on a tier whose budget (100 GB/s) is far above what the compressor does: the first copy
    measures the raw frames' kinds there (recoded: its ``auto`` samples them and stores them raw); once
    they are measured and nothing pays, the next copy passes the source's file through as it is, planning
    no frame (the CPU term left out: ``cpus`` None)."""
    src = _leaving(LocalTier("src", tmp_path / "src"))
    dst = _with(LocalTier("dst", tmp_path / "dst", bandwidth_bytes_per_sec=100_000_000_000), CompressConfig("auto"))
    with Hierarchy([src, dst], policy={"keep": {"src": 4, "dst": 4}}) as h:
        _leaving(src)
        auto = dst.adaptive = Adaptive(CompressConfig("auto"), 2, None)
        h.save(state(2), step=1).durable["dst"].result()
        planned = {k: v["frames"] for k, v in auto.snapshot()["kinds"].items()}
        assert planned.get("bfloat16/weight", 0) > 0  # the raw frames went through its codec writer
        assert stored(dst, 1)[1].compressed_frames() == stored(src, 1)[1].compressed_frames()  # sampled only
        s = state(3)
        h.save(s, step=2).durable["dst"].result()
        assert {k: v["frames"] for k, v in auto.snapshot()["kinds"].items()} == planned  # nothing planned
        assert stored(dst, 2)[0] == stored(src, 2)[0]  # the source's file, byte for byte
        assert same(h.restore(2, tier="dst"), s)


def _flip(path: Path, pos: int) -> None:
    with path.open("r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_byte_in_a_passed_frame_is_not_laundered(tmp_path: Path) -> None:
    s = state(4)
    src_root = tmp_path / "src"
    with Hierarchy([_leaving(LocalTier("src", src_root))]) as h:
        h.save(s, step=1, blocking=True)
    src = _leaving(LocalTier("src", src_root))
    _, index, _ = stored(src, 1)
    b, k = next((b, k) for b, k in frames(index) if index.frame(b, k).width)
    f = index.frame(b, k)
    name = decode_head(src.read_manifest(CheckpointKey(1))).blobs[b].name
    _flip(src_root / "step-000000000001" / "rank-00000" / name, f.stored_offset + f.stored_len // 2)
    dst = _with(LocalTier("dst", tmp_path / "dst"), ZSTD)
    with Hierarchy([dst, src]) as h:
        _leaving(src)
        h.prefetch(1, to="dst").result()  # a copy verifies nothing: its readers will
        check_recoded(src, dst, 1)  # the damaged frame went through as it was
        with pytest.raises(CorruptCheckpointError):
            h.restore(1, tier="dst")
        report = {t: e for _, t, e in h.verify(1)}
        assert isinstance(report["dst"], CorruptCheckpointError) and isinstance(report["src"], CorruptCheckpointError)


def test_a_hostile_frame_index_on_the_source_is_refused(tmp_path: Path) -> None:
    """The source's index says a frame's zstd stream is longer than a frame: refused with the copy's tier
    and step named, before anything is read or allocated for it; the destination holds nothing."""
    src_root = tmp_path / "src"
    with Hierarchy([_leaving(LocalTier("src", src_root))]) as h:
        h.save(state(5), step=1, blocking=True)
    src = _leaving(LocalTier("src", src_root))
    manifest, index, _ = stored(src, 1)
    first = next(t for t, w in enumerate(index.width) if w)
    (n,) = struct.unpack_from("<Q", manifest, 16)
    payload = msgpack.unpackb(manifest[24 : 24 + n], raw=False)
    lengths = bytearray(payload["codec"]["lengths"])
    struct.pack_into("<I", lengths, 4 * sum(index.width[:first]), index.frame_bytes + 1)  # more than a frame
    payload["codec"]["lengths"] = bytes(lengths)
    packed = msgpack.packb(payload, use_bin_type=True)
    head = struct.pack("<8sHHIQ", b"TIERCKPT", 6, 0, 0, len(packed)) + packed
    path = src_root / "step-000000000001" / "rank-00000" / "manifest"
    rewrite_manifest(path, head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)))
    dst = _with(LocalTier("dst", tmp_path / "dst"), ZSTD)
    with Hierarchy([dst, src]) as h:
        _leaving(src)
        with pytest.raises(CorruptCheckpointError) as e:
            h.prefetch(1, to="dst").result()
        assert "src" in str(e.value) and "1" in str(e.value)
        assert not dst.holds(CheckpointKey(1))


@pytest.mark.parametrize("fail", ["write", "read"])
def test_a_copy_failing_midway_leaves_nothing_and_gives_its_memory_back(tmp_path: Path, fail: str) -> None:
    src_root = tmp_path / "src"
    with Hierarchy([_leaving(LocalTier("src", src_root))]) as h:
        h.save(state(6), step=1, blocking=True)
    err = TierIOError(5, f"injected: a {fail} failed")
    src = FaultyTier(LocalTier("src", src_root), fail={"read": err} if fail == "read" else {}, after=2)
    inner = LocalTier("dst", tmp_path / "dst", chunk_bytes=MiB)
    dst = _with(FaultyTier(inner, fail={"write": err} if fail == "write" else {}, after=2), ZSTD)
    with Hierarchy([dst, src]) as h:
        with pytest.raises(TierIOError):
            h.prefetch(1, to="dst").result()
        assert not dst.inner.holds(CheckpointKey(1))
        left = [p.relative_to(tmp_path / "dst") for p in (tmp_path / "dst").iterdir()]
        assert [str(p) for p in left] == [".tierckpt-lease"]  # no step, no temporary copy
        pool = h._mover.workers["dst"].pool()
        assert pool.allocated_bytes > 0 and len(pool._free) * pool.slot_bytes == pool.allocated_bytes  # all back


@pytest.mark.parametrize("raw", [True, False], ids=["some-raw", "none-raw"])
def test_a_source_of_another_frame_size(tmp_path: Path, raw: bool) -> None:
    """A compressed copy of 64 KiB frames (another grid than the destination's): with frames left raw it
    is decoded and every frame encoded again on the destination's grid, never given an index of two
    grids; with none left raw (no random bytes) it passes through whole, as it is."""
    s = state(7) if raw else {"model": state(7)["model"]}
    src_root = tmp_path / "src"
    with Hierarchy([LocalTier("src", src_root)]) as h:
        h.save(s, step=1, blocking=True)
    src = LocalTier("src", src_root)
    small = recompress(src, CheckpointKey(1), plan=lambda b, k: (0, 0) if raw and k % 3 == 0 else (1, 1))
    assert small.frame_bytes == 64 << 10 and (small.compressed_frames() < small.total) == raw
    dst = _with(LocalTier("dst", tmp_path / "dst"), ZSTD)
    with Hierarchy([dst, src]) as h:
        h.prefetch(1, to="dst").result()
        at_src, at_dst = src.read_manifest(CheckpointKey(1)), dst.read_manifest(CheckpointKey(1))
        index = unwrap_manifest(at_dst)[1]
        assert index is not None and unwrap_manifest(at_dst)[0] == unwrap_manifest(at_src)[0]
        if raw:
            inner = decode_head(unwrap_manifest(at_dst)[0])
            assert index.frame_bytes == frame_bytes_for(inner) != small.frame_bytes
        else:
            assert at_dst == at_src
        assert same(h.restore(1, tier="dst"), s)
