"""What tierckpt detects on the real mounts (CephFS over ceph-fuse, GlusterFS over its FUSE client): the
type, family and mount point, the stripes (a CephFS directory's layout, its own, set here, or inherited),
O_DIRECT, and ``tierckpt probe``'s default kind there; the probe leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tierckpt.cli import main
from tierckpt.io.fsutil import probe_fs, probe_fs_explained

pytestmark = [pytest.mark.pfs, pytest.mark.remote]
MiB = 1 << 20


def test_cephfs_is_detected_with_its_layout(cephfs: Path, cephfs_dir: Path) -> None:
    probe = probe_fs_explained(cephfs_dir, writable=True)
    f = probe.facts
    assert (f.fs_type, f.family, f.mount_point) == ("fuse.ceph-fuse", "cephfs", str(cephfs.resolve()))
    assert f.direct and not f.readonly
    # the file system's default layout (4 MiB objects, one stripe), inherited by this new directory
    assert (f.stripe_unit_bytes, f.stripe_count, f.object_bytes) == (4 * MiB, 1, 4 * MiB)
    assert probe.sources["stripe_count"].startswith("ceph.dir.layout")
    assert f.layout_settable and probe.sources["layout_settable"] == "the probe file's layout was set"
    assert dict(probe.details)["statfs_magic"] == "0x65735546 (fuse)"
    assert os.listdir(cephfs_dir) == []


def test_a_cephfs_directorys_own_layout_and_its_childrens(cephfs_dir: Path) -> None:
    wide = cephfs_dir / "wide"
    wide.mkdir()
    os.setxattr(wide, "ceph.dir.layout", b"stripe_unit=1048576 stripe_count=4 object_size=4194304")
    (wide / "child").mkdir()  # no layout of its own: new files there get wide's
    for d in (wide, wide / "child"):
        f = probe_fs(d, writable=True)
        assert (f.stripe_unit_bytes, f.stripe_count, f.object_bytes) == (MiB, 4, 4 * MiB), d
    # read-only, nothing written: the directory's answer alone
    f = probe_fs(wide / "child", writable=False)
    assert (f.stripe_unit_bytes, f.stripe_count, f.direct) == (MiB, 4, False)


def test_glusterfs_is_detected(glusterfs: Path, glusterfs_dir: Path) -> None:
    probe = probe_fs_explained(glusterfs_dir, writable=True)
    f = probe.facts
    assert (f.fs_type, f.family, f.mount_point) == ("fuse.glusterfs", "glusterfs", str(glusterfs.resolve()))
    assert f.direct and f.io_block_bytes == 128 << 10  # the FUSE client's max_read
    assert (f.stripe_unit_bytes, f.stripe_count, f.object_bytes, f.layout_settable) == (None, None, None, False)
    assert dict(probe.details)["bricks"] == "1"
    assert os.listdir(glusterfs_dir) == []


def test_probe_sizes_a_pfs_tier_on_each_mount(pfs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", str(pfs_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "pfs" and out["facts"]["family"] in ("cephfs", "glusterfs")
    assert out["facts"]["direct"] is True  # O_DIRECT works on both mounts
    # ... and is used where it is the faster way to write: GlusterFS, not ceph-fuse (its object cache)
    assert out["geometry"]["one_file"] is True
    assert out["geometry"]["direct"] is (out["facts"]["fs_type"] != "fuse.ceph-fuse")
    assert os.listdir(pfs_dir) == []
