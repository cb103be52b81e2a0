"""Real shared file systems for the tests of this directory: a loopback Ceph with CephFS mounted by
``ceph-fuse`` and a one-brick GlusterFS volume on its FUSE client (:mod:`tierckpt.testing.clusters`).

Each starts at its first use and stops at the end of the session, also when tests fail or the run is
interrupted (SIGINT, SIGTERM, SIGHUP: pytest's teardown; an ``atexit`` hook besides). Without root,
``/dev/fuse`` or the Debian packages, the tests that use them skip and say why. Every test gets a fresh
directory on the mount (``cephfs_dir``, ``glusterfs_dir``, or ``pfs_dir`` for each mount in turn),
removed afterwards so that the cluster's 1 GiB of memstore does not fill up.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from tierckpt.testing.clusters import (
    CephCluster,
    ClusterError,
    GlusterVolume,
    why_ceph_cannot_run,
    why_gluster_cannot_run,
)

MOUNTS = ("cephfs", "glusterfs")


def _stop_on_signals() -> None:
    """Turn SIGTERM and SIGHUP (where nothing else handles them) into SystemExit, so that pytest's teardown
    unmounts and stops the clusters: killed by default, it would leave FUSE mounts whose servers are gone."""

    def leave(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, leave)


def _serve(
    cluster: CephCluster | GlusterVolume, start: Callable[[], object], why_not: str | None
) -> Iterator[CephCluster | GlusterVolume]:
    if why_not is not None:
        pytest.skip(f"{cluster.kind} cannot run here: {why_not}")
    _stop_on_signals()
    atexit.register(cluster.stop)  # a second stop() is harmless
    try:
        try:
            start()
        except ClusterError as e:
            pytest.fail(f"cannot start {cluster.kind}: {e}", pytrace=False)
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)


@pytest.fixture(scope="session")
def ceph_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephCluster]:
    """The session's Ceph: mon, mgr, a 1 GiB memstore OSD, an MDS, CephFS mounted by ``ceph-fuse``."""
    c = CephCluster(tmp_path_factory.mktemp("ceph"))
    mnt = tmp_path_factory.mktemp("cephfs")
    yield from _serve(c, lambda: c.start(cephfs=mnt), why_ceph_cannot_run())  # type: ignore[misc]


@pytest.fixture(scope="session")
def gluster_volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlusterVolume]:
    """The session's GlusterFS volume: one brick, mounted with the FUSE client."""
    g = GlusterVolume(tmp_path_factory.mktemp("gluster"))
    mnt = tmp_path_factory.mktemp("glusterfs")
    yield from _serve(g, lambda: g.start(mnt), why_gluster_cannot_run())  # type: ignore[misc]


@pytest.fixture(scope="session")
def cephfs(ceph_cluster: CephCluster) -> Path:
    """The session's CephFS mount point."""
    assert ceph_cluster.mount is not None
    return ceph_cluster.mount


@pytest.fixture(scope="session")
def glusterfs(gluster_volume: GlusterVolume) -> Path:
    """The session's GlusterFS mount point."""
    assert gluster_volume.mount is not None
    return gluster_volume.mount


def _fresh(mount: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    d = mount / f"{request.node.name[:60].replace('/', '_')}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cephfs_dir(cephfs: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory on the CephFS mount, removed after the test."""
    yield from _fresh(cephfs, request)


@pytest.fixture
def glusterfs_dir(glusterfs: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory on the GlusterFS mount, removed after the test."""
    yield from _fresh(glusterfs, request)


@pytest.fixture(params=MOUNTS)
def pfs_dir(request: pytest.FixtureRequest) -> Path:
    """A fresh directory on each mount in turn (the test's id names it: ``[cephfs]``, ``[glusterfs]``)."""
    return Path(request.getfixturevalue(f"{request.param}_dir"))
