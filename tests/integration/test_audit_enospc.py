"""Audit finding 10: a node-local tier whose device is full (a real ENOSPC, no ``capacity`` configured) must
make room as a full ``capacity`` does (docs/policies.md, the ``MakeRoom`` plan): evict its oldest copy that
a lower tier holds, then write the new one. The ssd here is a 64 MiB tmpfs (the shared ``tmpfs`` fixture:
root only, skipped otherwise); each step is 24 MiB, so the third does not fit beside the first two.

On 8c32cc0 the file tier raises ``TierIOError(ENOSPC)`` from ``posix_fallocate`` when the writer starts,
the mover makes room only for ``TierFullError``, so the copy fails, nothing is evicted, and every later
save fails on that tier the same way; ``handle.wait()`` raises although each step is safe on pfs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy

MiB = 1 << 20
STEP_MIB = 24  # two fit on the 64 MiB tmpfs, three do not


def big_state(step: int) -> dict[str, Any]:
    return {f"t{i}": torch.full((4 * MiB,), (step * 7 + i) % 251, dtype=torch.uint8) for i in range(STEP_MIB // 4)}


def config(tmp_path: Path, ssd: Path, host: bool) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "host", "kind": "host", "capacity": "512MiB"}] if host else []
    tiers += [
        # the shared fixture mounts its tmpfs at tmp_path/pfs: here it is the ssd (messages name that path)
        {"name": "ssd", "kind": "local", "path": str(ssd)},  # no capacity: only the device limits it
        {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "shared")},
    ]
    return {"tiers": tiers, "io": {"engine": "threads", "chunk": "1MiB"}, "layout": {"blob_size": "16MiB"}}


@pytest.mark.root
@pytest.mark.parametrize("host", [False, True], ids=["ssd-on-top", "host-ssd-pfs"])
def test_a_full_device_evicts_the_older_steps_a_lower_tier_holds(tmp_path: Path, tmpfs: Path, host: bool) -> None:
    """ssd on top (the save packs into it) and below a host tier (the copy comes from host): either way each
    save's ssd copy commits, once the oldest steps pfs holds have left the ssd."""
    errors: dict[int, str] = {}
    with Hierarchy.from_config(config(tmp_path, tmpfs, host)) as h:
        for step in range(1, 6):
            handle = h.save(big_state(step), step=step)
            try:
                handle.wait()
            except Exception as e:  # every step's outcome is collected: the failures go on after the first
                errors[step] = f"{type(e).__name__}: {e}"
        listed = {c.step: c.tiers for c in h.checkpoints()}
        got = h.restore()
        last = h.last_restore
    assert errors == {}, errors
    assert all("pfs" in listed[s] for s in range(1, 6)), listed  # every step is safe on pfs
    on_ssd = sorted(s for s, tiers in listed.items() if "ssd" in tiers)
    assert on_ssd[-1] == 5 and len(on_ssd) <= 2, listed  # the newest steps, as many as fit
    assert got["t0"][0].item() == (5 * 7) % 251 and last == (5, "host" if host else "ssd")
