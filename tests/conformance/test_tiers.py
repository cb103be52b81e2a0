"""Every built-in tier passes the shipped conformance suite, with each I/O engine where it matters."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt import ConfigError, CorruptCheckpointError, Hierarchy
from tierckpt.io.buffers import aligned_empty
from tierckpt.testing.conformance import SMALL_CAPACITY_BYTES, TierConformanceTests, _blob, _entries, _read, _write
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.gpu import GpuTier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

GPU_DEVICE = None if torch.cuda.is_available() else "cpu"


class TestHostTier(TierConformanceTests):
    @pytest.fixture
    def tier(self) -> Iterator[Tier]:
        t = HostTier("host", capacity_bytes=64 << 20)
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self) -> Iterator[Tier]:
        t = HostTier("host", capacity_bytes=SMALL_CAPACITY_BYTES)
        yield t
        t.close()


class TestGpuTier(TierConformanceTests):
    """On CUDA when there is a device; else the same code on ``device="cpu"``."""

    @pytest.fixture
    def tier(self) -> Iterator[Tier]:
        t = GpuTier("gpu", capacity_bytes=64 << 20, device=GPU_DEVICE)
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self) -> Iterator[Tier]:
        t = GpuTier("gpu", capacity_bytes=SMALL_CAPACITY_BYTES, device=GPU_DEVICE)
        yield t
        t.close()


class _FileTierChecks:
    """What the contract cannot see on a directory tier: nothing of an evicted step is left on disk."""

    def test_reclaim_leaves_nothing_on_disk(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(1), [_blob(65536, 7)])
        _write(tier, CheckpointKey(2), [_blob(4096, 8)])
        tier.evict(CheckpointKey(1), free=False)
        tier.reclaim()
        root = Path(tier.path)  # type: ignore[attr-defined]
        assert not any("000000000001" in str(p) for p in root.rglob("*")), list(root.rglob("*"))


class TestLocalTier(TierConformanceTests, _FileTierChecks):
    @pytest.fixture(params=[True, False], ids=["direct", "buffered"])
    def tier(self, tmp_path: Path, engine: object, request: pytest.FixtureRequest) -> Iterator[Tier]:
        t = LocalTier("ssd", tmp_path / "ssd", engine, direct=request.param)  # type: ignore[arg-type]
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self, tmp_path: Path, engine: object) -> Iterator[Tier]:
        t = LocalTier("ssd", tmp_path / "small", engine, capacity_bytes=SMALL_CAPACITY_BYTES)  # type: ignore[arg-type]
        yield t
        t.close()


class TestPfsTier(TierConformanceTests, _FileTierChecks):
    @pytest.fixture(params=[True, False], ids=["one-file", "file-a-blob"])
    def tier(self, tmp_path: Path, engine: object, request: pytest.FixtureRequest) -> Iterator[Tier]:
        t = PfsTier("pfs", tmp_path / "pfs", engine, one_file=request.param)  # type: ignore[arg-type]
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self, tmp_path: Path, engine: object) -> Iterator[Tier]:
        t = PfsTier("pfs", tmp_path / "small", engine, capacity_bytes=SMALL_CAPACITY_BYTES)  # type: ignore[arg-type]
        yield t
        t.close()


# -- one data file a copy (pfs's default) ---------------------------------------------------------------
SIZES = [3 * 4096, 4096, 5 * 4096]


def _copy_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}" / "rank-00000"


def test_pfs_writes_one_data_file_a_copy_and_local_a_file_a_blob(tmp_path: Path) -> None:
    blobs = [_blob(n, i) for i, n in enumerate(SIZES)]
    for cls, files in ((PfsTier, ["data.bin"]), (LocalTier, [f"blob-{i:05d}.bin" for i in range(3)])):
        t = cls("t", tmp_path / cls.kind)
        try:
            _write(t, CheckpointKey(1), blobs)
            d = _copy_dir(tmp_path / cls.kind, 1)
            assert sorted(p.name for p in d.iterdir()) == sorted(["manifest", *files])
            assert sum(p.stat().st_size for p in d.iterdir() if p.name != "manifest") == sum(SIZES)
            assert all(torch.equal(a, b) for a, b in zip(_read(t, CheckpointKey(1), SIZES), blobs))
        finally:
            t.close()


@pytest.mark.parametrize("first", [True, False])
def test_copies_of_either_kind_are_read_whatever_the_tier_writes_now(tmp_path: Path, first: bool) -> None:
    blobs = [_blob(n, 10 + i) for i, n in enumerate(SIZES)]
    t = PfsTier("pfs", tmp_path / "pfs", one_file=first)
    _write(t, CheckpointKey(1), blobs)
    t.close()
    t = PfsTier("pfs", tmp_path / "pfs", one_file=not first)
    try:
        _write(t, CheckpointKey(2), blobs[::-1])
        assert all(torch.equal(a, b) for a, b in zip(_read(t, CheckpointKey(1), SIZES), blobs))
        assert all(torch.equal(a, b) for a, b in zip(_read(t, CheckpointKey(2), SIZES[::-1]), blobs[::-1]))
    finally:
        t.close()


def test_a_truncated_data_file_is_damage_naming_it(tmp_path: Path) -> None:
    t = PfsTier("pfs", tmp_path / "pfs")
    try:
        _write(t, CheckpointKey(1), [_blob(n, i) for i, n in enumerate(SIZES)])
        os.truncate(_copy_dir(tmp_path / "pfs", 1) / "data.bin", sum(SIZES) - 4096)
        with pytest.raises(
            CorruptCheckpointError,
            match=r"data file .*data\.bin is truncated: 32768 bytes, its manifest declares 3 blob\(s\) of 36864",
        ):
            t.reader(CheckpointKey(1), _entries(SIZES))
    finally:
        t.close()


def test_a_read_past_a_blobs_end_stops_at_it_in_one_data_file(tmp_path: Path) -> None:
    """Blob 0's last page read with a length past its end returns only its own bytes (a file a blob
    returns the same short count at the file's end), never the next blob's."""
    blobs = [_blob(n, 20 + i) for i, n in enumerate(SIZES)]
    t = PfsTier("pfs", tmp_path / "pfs", direct=False)
    try:
        _write(t, CheckpointKey(1), blobs)
        r = t.reader(CheckpointKey(1), _entries(SIZES))
        buf = aligned_empty(2 * 4096)
        buf.fill_(0)
        assert r.read(0, SIZES[0] - 4096, buf.data_ptr(), 2 * 4096).result() == 4096
        assert torch.equal(buf[:4096], blobs[0][-4096:]) and not buf[4096:].any()
        r.close()
    finally:
        t.close()


def test_one_file_is_an_option_of_the_file_kinds(tmp_path: Path) -> None:
    base = {"name": "p", "kind": "pfs", "path": str(tmp_path / "p")}
    h = Hierarchy.from_config({"tiers": [{**base, "options": {"one_file": False}}]})
    try:
        assert h.tier("p").one_file is False  # type: ignore[attr-defined]
    finally:
        h.close()
    h = Hierarchy.from_config({"tiers": [{**base, "kind": "local"}]})
    try:
        assert h.tier("p").one_file is False  # type: ignore[attr-defined]
    finally:
        h.close()
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.options\.one_file: expected true or false, got 'yes'"):
        Hierarchy.from_config({"tiers": [{**base, "options": {"one_file": "yes"}}]})
