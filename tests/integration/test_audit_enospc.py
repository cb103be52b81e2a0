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

from tierckpt import DeviceFullError, Hierarchy, TierckptError

MiB = 1 << 20
STEP_MIB = 24  # two fit on the 64 MiB tmpfs, three do not


def big_state(step: int) -> dict[str, Any]:
    return {f"t{i}": torch.full((4 * MiB,), (step * 7 + i) % 251, dtype=torch.uint8) for i in range(STEP_MIB // 4)}


def config(tmp_path: Path, ssd: Path, host: bool) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"name": "host", "kind": "host", "capacity": "512MiB"}] if host else []
    tiers += [
        # the shared fixture mounts its tmpfs at tmp_path/pfs: here it is the ssd (messages name that path)
        {"name": "ssd", "kind": "local", "path": str(ssd)},  # no capacity: only the device limits it
        {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "shared"), "compress": "none"},
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


def saves(h: Hierarchy, steps: range) -> dict[int, BaseException]:
    """Each step saved and waited for; the failures by step."""
    errors: dict[int, BaseException] = {}
    for step in steps:
        try:
            h.save(big_state(step), step=step).wait()
        except Exception as e:  # every step's outcome is collected
            errors[step] = e
    return errors


@pytest.mark.root
@pytest.mark.parametrize("host", [False, True], ids=["ssd-on-top", "host-ssd-pfs"])
@pytest.mark.parametrize("pages", [4, 5], ids=["manifest", "record"])
def test_a_device_full_for_the_manifest_or_the_record_makes_room(
    tmp_path: Path, mount_tmpfs: Any, pages: int, host: bool
) -> None:
    """B2 (finding 10 at commit time): an ssd whose device has room for the blobs of two steps and a few
    pages more (the lease, a step's manifest and record take a page each), so that the second step's blobs
    fit and then its manifest (4 pages) or its commit record (5) does not. The full device is found there
    too, and the tier makes room (its older step, which pfs holds, goes) and writes just that again: every
    save commits on the ssd (packed into it on top, or copied from host). On 987543a (and 8c32cc0) each
    later copy failed with a plain TierIOError (ENOSPC), nothing was evicted, and the ssd took no step
    after the first."""
    with mount_tmpfs(tmp_path / "ssd", 2 * STEP_MIB * MiB + pages * 4096) as ssd:
        with Hierarchy.from_config(config(tmp_path, ssd, host)) as h:
            errors = saves(h, range(1, 5))
            listed = {c.step: c.tiers for c in h.checkpoints()}
        assert errors == {}, errors
        assert listed[4] == ("host",) * host + ("ssd", "pfs"), listed
        assert all("pfs" in listed[s] for s in range(1, 5)), listed
        steps = sorted(p.name for p in ssd.glob("step-*"))
        assert steps[-1] == "step-000000000004" and (ssd / steps[-1] / "commit").is_file(), steps
        assert not list(ssd.glob("step-*/.*")), list(ssd.glob("step-*/.*"))  # no scratch left behind


@pytest.mark.root
@pytest.mark.parametrize(("pages", "what"), [(2, "the manifest"), (3, "the commit record")], ids=["manifest", "record"])
def test_a_full_bottom_tier_with_nothing_to_evict_fails_clearly_at_commit(
    tmp_path: Path, mount_tmpfs: Any, pages: int, what: str
) -> None:
    """B2: the bottom tier (pfs) on a device with room for one step's blobs and a page or two more: its
    manifest (2 pages) or its record (3) does not fit, and nothing below holds a step to make room with.
    The copy fails with DeviceFullError naming the tier, its device and what did not fit, and leaves
    nothing listed on pfs and no copy behind; the step stays on host."""
    with mount_tmpfs(tmp_path / "pfs", STEP_MIB * MiB + pages * 4096) as pfs:
        cfg = {
            "tiers": [
                {"name": "host", "kind": "host", "capacity": "512MiB"},
                {"name": "pfs", "kind": "pfs", "path": str(pfs), "compress": "none"},  # its blobs fill the device
            ],
            "io": {"engine": "threads", "chunk": "1MiB"},
            "layout": {"blob_size": "16MiB"},
        }
        with Hierarchy.from_config(cfg) as h:
            errors = saves(h, range(1, 2))
            listed = {c.step: c.tiers for c in h.checkpoints()}
        assert list(errors) == [1] and isinstance(errors[1], DeviceFullError), errors
        assert f"tier 'pfs': the device of {pfs} is full: {what} of step 1 needs" in str(errors[1])
        assert listed == {1: ("host",)}, listed
        assert not list(pfs.glob("step-*/*")), list(pfs.glob("step-*/*"))


def test_a_victim_whose_eviction_fails_is_not_tried_again(tmp_path: Path) -> None:
    """A full ssd makes room by evicting step 1 (pfs holds it), but the step's record cannot be removed
    (EIO): the eviction stops there, step 1 stays. Making room then fails step 2 on the ssd with the full
    device's error, after one try, instead of picking step 1 again without end (which stuck the ssd's
    worker: later saves and close() hung). Step 2, staged into the ssd, fails (its demotion had no copy to
    read), and the next save works on both tiers."""
    import errno

    from tierckpt.io.engine import make_engine
    from tierckpt.tiers.local import LocalTier
    from tierckpt.tiers.pfs import PfsTier

    full = DeviceFullError(errno.ENOSPC, "tier 'ssd': injected: the device is full")
    removes: list[int] = []

    class Stuck(LocalTier):
        def write_record(self, step: int, data: bytes) -> None:
            if step == 2:
                raise full
            super().write_record(step, data)

        def remove_record(self, step: int) -> None:
            removes.append(step)
            raise OSError(errno.EIO, "injected: the record cannot be removed")

    engine = make_engine("threads", 2)
    try:
        with Hierarchy(
            [Stuck("ssd", str(tmp_path / "ssd"), engine), PfsTier("pfs", str(tmp_path / "pfs"), engine)]
        ) as h:
            h.save({"w": torch.ones(8)}, step=1).wait()
            handle = h.save({"w": torch.full((8,), 2.0)}, step=2)
            with pytest.raises(DeviceFullError, match="injected: the device is full"):
                handle.wait(tier="ssd", timeout=30)
            with pytest.raises(TierckptError, match="every tier above 'pfs' failed"):
                handle.wait(tier="pfs", timeout=30)
            h.save({"w": torch.full((8,), 3.0)}, step=3).wait(timeout=30)
            listed = {c.step: c.tiers for c in h.checkpoints()}
            assert torch.equal(h.restore()["w"], torch.full((8,), 3.0))
        assert removes.count(1) == 1, removes  # step 1 was tried once
        assert listed[1] == ("ssd", "pfs") and 2 not in listed and listed[3] == ("ssd", "pfs"), listed
    finally:
        engine.close()
