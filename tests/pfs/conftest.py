"""The mounts the tests of this directory run on, each in turn: CephFS (``ceph-fuse``) and GlusterFS (its
FUSE client). The clusters and their fixtures (``ceph_cluster``, ``cephfs``, ``cephfs_dir``,
``gluster_volume``, ``glusterfs``, ``glusterfs_dir``) come from :mod:`tierckpt.testing.pytest_clusters`,
which ``tests/conftest.py`` loads: one Ceph per session, shared with the S3 tests of ``tests/s3/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MOUNTS = ("cephfs", "glusterfs")


@pytest.fixture(params=MOUNTS)
def pfs_dir(request: pytest.FixtureRequest) -> Path:
    """A fresh directory on each mount in turn (the test's id names it: ``[cephfs]``, ``[glusterfs]``)."""
    return Path(request.getfixturevalue(f"{request.param}_dir"))
