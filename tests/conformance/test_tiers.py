"""Every built-in tier passes the shipped conformance suite, with each I/O engine where it matters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt.testing.conformance import TierConformanceTests
from tierckpt.tiers.base import Tier
from tierckpt.tiers.gpu import GpuTier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier


class TestHostTier(TierConformanceTests):
    @pytest.fixture
    def tier(self) -> Iterator[Tier]:
        t = HostTier("host", capacity_bytes=64 << 20)
        yield t
        t.close()


class TestGpuTier(TierConformanceTests):
    """On CUDA when there is a device; else the same code on ``device="cpu"``."""

    @pytest.fixture
    def tier(self) -> Iterator[Tier]:
        t = GpuTier("gpu", capacity_bytes=64 << 20, device=None if torch.cuda.is_available() else "cpu")
        yield t
        t.close()


class TestLocalTier(TierConformanceTests):
    @pytest.fixture(params=[True, False], ids=["direct", "buffered"])
    def tier(self, tmp_path: Path, engine: object, request: pytest.FixtureRequest) -> Iterator[Tier]:
        t = LocalTier("ssd", tmp_path / "ssd", engine, direct=request.param)  # type: ignore[arg-type]
        yield t
        t.close()


class TestPfsTier(TierConformanceTests):
    @pytest.fixture
    def tier(self, tmp_path: Path, engine: object) -> Iterator[Tier]:
        t = PfsTier("pfs", tmp_path / "pfs", engine)  # type: ignore[arg-type]
        yield t
        t.close()
