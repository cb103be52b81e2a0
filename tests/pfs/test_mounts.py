"""Save and restore through a ``pfs`` tier on each real mount (CephFS over ceph-fuse, GlusterFS over its
FUSE client): host → pfs demotion, a new process's listing, a prefetch back to host, ``restore(into=)``;
and a full file system (a CephFS directory quota, a GlusterFS brick on a small tmpfs): the save fails with
a clear error, the earlier steps stay listed and restorable, nothing half-written is listed."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pfs.steps import STEP_MIB, MiB, config, same, state
from tierckpt import DeviceFullError, Hierarchy
from tierckpt.testing.clusters import GlusterVolume, why_gluster_cannot_run

pytestmark = [pytest.mark.pfs, pytest.mark.remote]


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_host_to_pfs_round_trip(pfs_dir: Path, compress: str) -> None:
    """Steps demoted from host to the mount (stored raw, or compressed); a new hierarchy (as a restarted
    job) lists them there, prefetches one back to host and restores it from there, and restores another
    into given tensors."""
    with Hierarchy.from_config(config(pfs_dir, compress=compress)) as h:
        for step in (1, 2, 3):
            h.save(state(step), step=step).wait()
        assert h.flush(timeout=60)
        assert {c.step: c.tiers for c in h.checkpoints()}[3] == ("host", "pfs")
    with Hierarchy.from_config(config(pfs_dir, compress=compress)) as h:
        assert {c.step: c.tiers for c in h.checkpoints()} == {s: ("pfs",) for s in (1, 2, 3)}
        assert h.prefetch(2).result(timeout=60) == "host"
        assert same(h.restore(2), state(2)) and h.last_restore == (2, "host")
        into = state(0)
        got = h.restore(3, into=into)
        assert got is into and same(into, state(3)) and h.last_restore == (3, "pfs")
        assert same(h.restore(1, tier="pfs"), state(1))


def save_steps(pfs: Path, steps: range) -> None:
    with Hierarchy.from_config(config(pfs, host=False)) as h:
        for step in steps:
            h.save(state(step), step=step).wait()


def check_full(pfs: Path, full_step: int) -> None:
    """The save of ``full_step`` (after steps 1 to ``full_step - 1``) fails for the full device; then the
    earlier steps are listed and restore (in a new hierarchy too), and nothing of the failed step is
    listed or left on the mount."""
    with Hierarchy.from_config(config(pfs, host=False)) as h:
        with pytest.raises(DeviceFullError) as err:
            h.save(state(full_step), step=full_step).wait()
        assert err.value.errno in (errno.ENOSPC, errno.EDQUOT), err.value
        assert f"tier 'pfs': the device of {pfs} is full" in str(err.value), err.value
        assert [c.step for c in h.checkpoints() if c.tiers] == list(range(1, full_step))
    assert not any(p.name.startswith(".") for p in pfs.glob("step-*/*")), list(pfs.glob("step-*/*"))
    assert not (pfs / f"step-{full_step:012d}").exists()
    with Hierarchy.from_config(config(pfs, host=False)) as h:
        assert [c.step for c in h.checkpoints()] == list(range(1, full_step))
        for step in range(1, full_step):
            assert same(h.restore(step), state(step))


def rbytes(d: Path) -> int:
    return int(os.getxattr(d, "ceph.dir.rbytes"))


def test_a_cephfs_quota_fails_the_save_and_keeps_the_steps_before(cephfs_dir: Path) -> None:
    """The quota (``ceph.quota.max_bytes``) leaves room for two steps: the third's save fails with
    EDQUOT. ceph-fuse enforces a quota from the usage the MDS reports, which follows the writes by a
    moment: the quota is set once the MDS counts the first two steps."""
    pfs = cephfs_dir / "pfs"
    pfs.mkdir()
    save_steps(pfs, range(1, 3))
    deadline = time.monotonic() + 30
    while rbytes(pfs) < 2 * STEP_MIB * MiB and time.monotonic() < deadline:
        time.sleep(0.2)
    os.setxattr(pfs, "ceph.quota.max_bytes", str(rbytes(pfs) + STEP_MIB * MiB // 2).encode())
    check_full(pfs, 3)


@pytest.fixture
def small_glusterfs(tmp_path: Path) -> Iterator[Path]:
    """A second GlusterFS volume whose brick is a tmpfs with room for two steps and a little more."""
    why = why_gluster_cannot_run()
    if why is not None:
        pytest.skip(f"gluster cannot run here: {why}")
    with GlusterVolume(tmp_path / "gluster").start(tmp_path / "mnt", brick_bytes=(2 * STEP_MIB + 4) * MiB) as g:
        assert g.mount is not None
        yield g.mount


def test_a_full_glusterfs_brick_fails_the_save_and_keeps_the_steps_before(small_glusterfs: Path) -> None:
    save_steps(small_glusterfs / "pfs", range(1, 3))
    check_full(small_glusterfs / "pfs", 3)
