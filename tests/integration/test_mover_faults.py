"""Failure isolation of the background mover: a failing lower tier (EIO, ENOSPC, a directory gone mid-run)
never blocks or damages the tiers above it; the error is recorded per step and tier, raised where
promised (``handle.wait``, ``h.wait``), and later saves go on."""

from __future__ import annotations

import errno
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy, TierIOError
from tierckpt.io.engine import make_engine
from tierckpt.testing import FaultyTier
from tierckpt.tiers._lease import LEASE_DIR
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

MiB = 1 << 20


def state(step: int, mib: int = 1) -> dict[str, Any]:
    return {"w": torch.full((mib * MiB // 4,), float(step)), "b": torch.arange(100) + step, "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def chain(tmp_path: Path, ssd_path: Path | None = None, ssd_wrap: Any = None, **policy: Any) -> Hierarchy:
    engine = make_engine("threads", 4)
    ssd: Any = LocalTier("ssd", ssd_path or tmp_path / "ssd", engine)
    if ssd_wrap is not None:
        ssd = ssd_wrap(ssd)
    pfs = PfsTier("pfs", tmp_path / "pfs2", engine)
    return Hierarchy([HostTier("host", capacity_bytes=512 * MiB), ssd, pfs], policy=policy)


def test_eio_on_the_middle_tier(tmp_path: Path) -> None:
    """EIO on the ssd for steps 2 and 3: the host commits every step at once, the pfs gets 2 and 3 from
    the host instead, the errors come out of the handles with their cause, and step 4 uses the ssd again."""
    faulty: list[FaultyTier] = []

    def wrap(t: LocalTier) -> FaultyTier:
        faulty.append(FaultyTier(t))
        return faulty[0]

    with chain(tmp_path, ssd_wrap=wrap, keep={"host": 1}) as h:
        ssd = faulty[0]
        saved = {1: state(1)}
        h.save(saved[1], step=1).wait()
        ssd.fail = {"write": OSError(errno.EIO, "injected EIO")}
        handles = {}
        for s in (2, 3):
            saved[s] = state(s)
            handles[s] = h.save(saved[s], step=s)
            handles[s].wait(tier="host")  # never held up by the failing tier
        for s in (2, 3):
            with pytest.raises(OSError) as ei:
                handles[s].wait(tier="ssd")
            assert ei.value.errno == errno.EIO
            handles[s].wait(tier="pfs")  # copied from the host
            with pytest.raises(OSError):
                handles[s].wait()
            assert set(handles[s].errors()) == {"ssd"}
        ssd.fail = {}
        saved[4] = state(4)
        h.save(saved[4], step=4).wait()

        infos = {c.step: c for c in h.checkpoints()}
        assert {s: i.tiers for s, i in infos.items()} == {
            1: ("ssd", "pfs"), 2: ("pfs",), 3: ("pfs",), 4: ("host", "ssd", "pfs"),
        }  # fmt: skip
        assert infos[2].states == {"host": "absent", "ssd": "failed", "pfs": "committed"}
        assert isinstance(infos[2].errors["ssd"], OSError)
        assert not list((tmp_path / "ssd").glob("step-*2/**/blob-*"))  # nothing half-written left
        assert all(err is None for _, _, err in h.verify())
        for s, st in saved.items():
            assert same(h.restore(step=s), st)
    # every failure above was observed through its handle, so close() raised nothing


def test_unobserved_failure_surfaces_from_wait(tmp_path: Path) -> None:
    with chain(tmp_path, ssd_wrap=lambda t: FaultyTier(t, fail={"commit": OSError(errno.EIO, "injected")})) as h:
        h.save(state(1), step=1)  # handle dropped
        with pytest.raises(OSError) as ei:
            h.wait()
        assert ei.value.errno == errno.EIO
        h.wait()  # raised once; nothing left to raise
        assert h.checkpoints()[0].tiers == ("host", "pfs")


@pytest.mark.root
def test_enospc_on_the_middle_tier(tmp_path: Path, tmpfs: Path) -> None:
    """A 64 MiB tmpfs as the ssd: a 96 MiB checkpoint does not fit. The host and the pfs hold it, nothing
    half-written stays on the tmpfs, the earlier checkpoint there is untouched, a smaller one fits later."""
    with chain(tmp_path, ssd_path=tmpfs) as h:
        small1 = state(1, mib=8)
        h.save(small1, step=1).wait()
        big = state(2, mib=96)
        handle = h.save(big, step=2)
        handle.staged.result(timeout=60)
        err = handle.durable["ssd"].exception(timeout=60)  # looked at, but not through handle.wait()
        assert isinstance(err, TierIOError) and err.errno == errno.ENOSPC and "ssd" in str(err)
        handle.wait(tier="host")
        handle.wait(tier="pfs")
        assert [p.name for p in tmpfs.iterdir() if p.name != LEASE_DIR] == ["step-000000000001"]
        assert not [p for p in tmpfs.rglob("*") if p.name.startswith(".") and LEASE_DIR not in p.parts]
        small3 = state(3, mib=8)
        h.save(small3, step=3).wait()
        assert {c.step: c.tiers for c in h.checkpoints()} == {
            1: ("host", "ssd", "pfs"), 2: ("host", "pfs"), 3: ("host", "ssd", "pfs"),
        }  # fmt: skip
        assert same(h.restore(step=1, tier="ssd"), small1)
        assert same(h.restore(step=2), big)
        assert all(err is None for _, _, err in h.verify())
        with pytest.raises(TierIOError):
            h.wait()  # nobody waited for step 2's ssd copy through its handle


def test_tier_directory_removed_while_a_copy_is_in_flight(tmp_path: Path) -> None:
    """The ssd directory vanishes (an unmounted disk) while step 2 is being copied there: the copy fails
    with ENOENT, the directory is not recreated, the host and the pfs go on, later saves reach every tier
    that is there, and once the directory is back the ssd takes saves again."""
    gate = threading.Event()
    with chain(tmp_path, ssd_wrap=lambda t: FaultyTier(t, gates={"commit": gate})) as h:
        gate.set()
        s1 = state(1)
        h.save(s1, step=1).wait()
        gate.clear()
        try:
            handle = h.save(state(2), step=2)
            handle.wait(tier="host")
            for _ in range(100):  # the ssd may still be writing blobs (only its commit is held)
                try:
                    shutil.rmtree(tmp_path / "ssd")
                    break
                except OSError as e:
                    if e.errno != errno.ENOTEMPTY:
                        raise
                    time.sleep(0.05)
        finally:
            gate.set()
        with pytest.raises(TierIOError) as ei:
            handle.wait(tier="ssd")
        assert ei.value.errno == errno.ENOENT
        handle.wait(tier="pfs")
        assert not (tmp_path / "ssd").exists()
        h3 = h.save(state(3), step=3)
        with pytest.raises(TierIOError):
            h3.wait(tier="ssd")
        h3.wait(tier="pfs")
        assert same(h.restore(step=1), s1)  # step 1 is still on the pfs
        (tmp_path / "ssd").mkdir()
        h.save(state(4), step=4).wait()
        assert h.checkpoints()[-1].tiers == ("host", "ssd", "pfs")
        h.wait()  # both failures were seen through handle.wait(tier="ssd")
