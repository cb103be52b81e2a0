"""Every built-in tier passes the shipped conformance suite, with each I/O engine where it matters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt.testing.conformance import SMALL_CAPACITY_BYTES, TierConformanceTests, _blob, _write
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
    @pytest.fixture
    def tier(self, tmp_path: Path, engine: object) -> Iterator[Tier]:
        t = PfsTier("pfs", tmp_path / "pfs", engine)  # type: ignore[arg-type]
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self, tmp_path: Path, engine: object) -> Iterator[Tier]:
        t = PfsTier("pfs", tmp_path / "small", engine, capacity_bytes=SMALL_CAPACITY_BYTES)  # type: ignore[arg-type]
        yield t
        t.close()
