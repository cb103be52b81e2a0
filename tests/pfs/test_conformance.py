"""The shipped tier conformance suite against a ``pfs`` tier on each real mount (CephFS over ceph-fuse,
GlusterFS over its FUSE client), both layouts of its copies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.io.engine import make_engine
from tierckpt.testing.conformance import SMALL_CAPACITY_BYTES, TierConformanceTests
from tierckpt.tiers.base import Tier
from tierckpt.tiers.pfs import PfsTier

pytestmark = [pytest.mark.pfs, pytest.mark.remote]


class TestPfsTierOnMounts(TierConformanceTests):
    @pytest.fixture(params=[True, False], ids=["one-file", "file-a-blob"])
    def tier(self, pfs_dir: Path, request: pytest.FixtureRequest) -> Iterator[Tier]:
        engine = make_engine("threads", 4)
        t = PfsTier("pfs", pfs_dir / "pfs", engine, one_file=request.param)
        yield t
        t.close()
        engine.close()

    @pytest.fixture
    def small_tier(self, pfs_dir: Path) -> Iterator[Tier]:
        engine = make_engine("threads", 4)
        t = PfsTier("pfs", pfs_dir / "small", engine, capacity_bytes=SMALL_CAPACITY_BYTES)
        yield t
        t.close()
        engine.close()
