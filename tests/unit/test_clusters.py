"""tierckpt.testing.clusters without starting anything: why a cluster cannot run, and stop() before or
after a failed start."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tierckpt.testing import clusters
from tierckpt.testing._daemons import is_mounted
from tierckpt.testing.clusters import CephCluster, ClusterError, GlusterVolume


def test_not_root_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert clusters.why_ceph_cannot_run() == "needs root (to mount a FUSE file system)"
    assert clusters.why_gluster_cannot_run() == "needs root (to mount a FUSE file system)"


def test_a_missing_program_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/fuse")
    monkeypatch.setattr(shutil, "which", lambda b: None if b in ("ceph-mds", "radosgw") else f"/usr/bin/{b}")
    assert clusters.why_ceph_cannot_run() == "ceph-mds not installed (see docs/testing.md for the Debian packages)"
    assert clusters.why_ceph_cannot_run(rgw=True).startswith("ceph-mds, radosgw not installed")
    assert clusters.why_gluster_cannot_run() is None


def test_no_fuse_device_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    assert clusters.why_gluster_cannot_run() == "no /dev/fuse on this machine"


@pytest.mark.parametrize("cls", [CephCluster, GlusterVolume])
def test_stop_is_safe_unstarted_and_twice(tmp_path: Path, cls: type[CephCluster] | type[GlusterVolume]) -> None:
    c = cls(tmp_path / "base")
    c.stop()
    c.stop()
    assert not (tmp_path / "base").exists()


def test_a_failed_start_names_the_step_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that fails (here: ceph-authtool, replaced by ``false``) fails the start with its command
    line; what had started is stopped and the base directory removed."""
    if shutil.which("false") is None:
        pytest.skip("no `false` program")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ceph-authtool").symlink_to(shutil.which("false"))  # type: ignore[arg-type]
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    c = CephCluster(tmp_path / "ceph")
    with pytest.raises(
        ClusterError, match=r"ceph in .*ceph: ceph-authtool: `ceph-authtool --create-keyring .*` exited 1"
    ):
        c.start()
    assert not (tmp_path / "ceph").exists()
    c.stop()


def test_is_mounted_reads_the_mount_table(tmp_path: Path, mount_tmpfs: Any) -> None:
    """A mount point with a space in its name (escaped in /proc/self/mountinfo), before and after."""
    mnt = tmp_path / "a mount"
    assert not is_mounted(mnt) and is_mounted(Path("/"))
    with mount_tmpfs(mnt, 1 << 20):
        assert is_mounted(mnt) and is_mounted(tmp_path / "." / "a mount")
    assert not is_mounted(mnt)
