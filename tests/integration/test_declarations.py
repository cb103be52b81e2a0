"""What the hierarchy reads of a tier's declarations: an expensive listing (``cheap_listing=False``)
is listed once and then followed through the hierarchy's own commits and evictions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy
from tierckpt.io.engine import make_engine
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.pfs import PfsTier


class CountedPfs(PfsTier):
    """A pfs whose listing is declared expensive (an object store's LIST), counting its listings."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.capabilities = replace(self.capabilities, cheap_listing=False)
        self.listings = 0

    def list_committed(self, rank: int | None = None) -> list[Any]:
        self.listings += 1
        return super().list_committed(rank)


def test_a_tier_whose_listing_is_expensive_is_listed_once_and_followed_by_the_catalog(tmp_path: Path) -> None:
    pfs = CountedPfs("pfs", tmp_path / "pfs", make_engine("threads", 2))
    with Hierarchy([HostTier("host"), pfs], policy={"keep": {"host": 1, "pfs": 2}}) as h:
        for s in range(1, 7):
            h.save({"s": torch.tensor([s])}, step=s).wait()
        saved_listings = pfs.listings
        assert [c.step for c in h.checkpoints() if "pfs" in c.tiers] == [5, 6]
    assert saved_listings <= 2  # once for the first retention pass (and once at the first save's order check)
    assert sorted(k.step for k in PfsTier("pfs", tmp_path / "pfs", readonly=True).list_committed()) == [5, 6]
