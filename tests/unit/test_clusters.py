"""tierckpt.testing.clusters without starting anything: why a cluster cannot run, and stop() before or
after a failed start."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from tierckpt.testing import clusters
from tierckpt.testing._daemons import Daemons, is_mounted
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


def test_a_daemon_killed_is_gone_and_forgotten(tmp_path: Path) -> None:
    """``kill`` SIGKILLs a running daemon and forgets it; one that exited by itself is only forgotten."""
    if shutil.which("sleep") is None or shutil.which("true") is None:
        pytest.skip("no `sleep` or `true` program")
    (tmp_path / "log").mkdir()
    d = Daemons(tmp_path)
    p = d.spawn("sleeper", ["sleep", "600"])
    d.spawn("quick", ["true"])
    assert d.running("sleeper")
    d.kill("sleeper")
    assert p.returncode == -signal.SIGKILL and not d.running("sleeper")
    d.procs[0][1].wait(timeout=30)
    assert not d.running("quick")
    d.kill("quick")
    assert d.procs == []
