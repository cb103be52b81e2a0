"""pytest fixtures for tests on real servers: one loopback Ceph per test session, whose CephFS and S3
(radosgw) the tests share, a GlusterFS volume, fresh directories and buckets, and a fault-injecting S3
proxy. A pytest plugin: ``pytest_plugins = ["tierckpt.testing.pytest_clusters"]`` in a suite's top
``conftest.py`` (tierckpt's ``tests/conftest.py`` has it), or ``pytest -p tierckpt.testing.pytest_clusters``.

Ceph starts at the first test that needs it, with CephFS (an MDS, a ``ceph-fuse`` mount) at the first test
that needs the mount and radosgw at the first that needs S3, and stops at the end of the session, also
when tests fail or the run is interrupted (SIGINT, SIGTERM, SIGHUP: pytest's teardown; an ``atexit`` hook
besides). Its OSD keeps data in memory, :data:`CEPH_MEMSTORE_BYTES` at most; a full OSD makes radosgw's
requests wait instead of failing, so every directory and bucket given to a test is emptied and removed
after it. Without root, ``/dev/fuse``, the Debian packages or boto3, the tests that need them skip and say
why; a cluster that should start and does not is a failure, with its daemons' log tails.

Fixtures (scope):

* ``ceph_cluster`` (session): the :class:`~tierckpt.testing.clusters.CephCluster` (mon, mgr, one OSD);
  its ``kill_rgw()`` / ``start_rgw()`` crash and restart radosgw in a fault test.
* ``cephfs`` (session), ``cephfs_dir``: the CephFS mount point; a fresh directory on it.
* ``gluster_volume`` (session), ``glusterfs`` (session), ``glusterfs_dir``: the same for GlusterFS.
* ``s3_server`` (session): :class:`~tierckpt.testing.s3bucket.S3Server` (endpoint, access key, secret key).
* ``s3_bucket``: a fresh :class:`~tierckpt.testing.s3bucket.S3Bucket`, the AWS credentials and region in
  the environment.
* ``s3_proxy``: the same, with tiers reaching it through an :class:`~tierckpt.testing.s3proxy.S3Proxy`
  (``s3_proxy.proxy``).
"""

from __future__ import annotations

import atexit
import os
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
from tierckpt.testing.s3bucket import S3Bucket, S3Server, bucket_name
from tierckpt.testing.s3proxy import S3Proxy

__all__ = [
    "CEPH_MEMSTORE_BYTES",
    "ceph_cluster",
    "cephfs",
    "cephfs_dir",
    "gluster_volume",
    "glusterfs",
    "glusterfs_dir",
    "s3_bucket",
    "s3_proxy",
    "s3_server",
]

#: the size of the session's Ceph OSD (in memory); radosgw hangs once it is about 95 % full
CEPH_MEMSTORE_BYTES = 3 << 30
#: the AWS settings of the environment that would point boto3 elsewhere than the test's server
_AWS_ENV_CLEARED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE")


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
    """Start ``cluster``, hand it out, stop it at the end of the run whatever happens (an ``atexit`` hook
    besides: a second ``stop()`` is harmless); skip when it cannot run here, fail when it does not start."""
    if why_not is not None:
        pytest.skip(f"{cluster.kind} cannot run here: {why_not}")
    _stop_on_signals()
    atexit.register(cluster.stop)
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
    """The session's Ceph: a mon, a mgr and a memstore OSD of :data:`CEPH_MEMSTORE_BYTES`; CephFS and
    radosgw are started on it by the ``cephfs`` and ``s3_server`` fixtures, at their first use."""
    c = CephCluster(tmp_path_factory.mktemp("ceph"), memstore_bytes=CEPH_MEMSTORE_BYTES)
    yield from _serve(c, c.start, why_ceph_cannot_run())  # type: ignore[misc]


@pytest.fixture(scope="session")
def cephfs(ceph_cluster: CephCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's CephFS mount point (``ceph-fuse``)."""
    if ceph_cluster.mount is None:
        try:
            ceph_cluster.start_cephfs(tmp_path_factory.mktemp("cephfs"))
        except ClusterError as e:
            pytest.fail(f"cannot start CephFS: {e}", pytrace=False)
    assert ceph_cluster.mount is not None
    return ceph_cluster.mount


@pytest.fixture(scope="session")
def gluster_volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlusterVolume]:
    """The session's GlusterFS volume: one brick, mounted with the FUSE client."""
    g = GlusterVolume(tmp_path_factory.mktemp("gluster"))
    mnt = tmp_path_factory.mktemp("glusterfs")
    yield from _serve(g, lambda: g.start(mnt), why_gluster_cannot_run())  # type: ignore[misc]


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


def _radosgw_up(ceph: CephCluster) -> None:
    """Start radosgw on the session's cluster unless it runs (at the first use, or after a test killed it)."""
    if not ceph.rgw_running:
        try:
            ceph.start_rgw()
        except ClusterError as e:
            pytest.fail(f"cannot start radosgw: {e}", pytrace=False)


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """The session's S3 server: radosgw on the session's Ceph (``ceph_cluster``), started at first use;
    its endpoint (``http://127.0.0.1:PORT``), access key and secret key. Skips where radosgw cannot run."""
    why = why_ceph_cannot_run(rgw=True)
    if why is not None:
        pytest.skip(f"radosgw cannot run here: {why}")
    ceph: CephCluster = request.getfixturevalue("ceph_cluster")
    _radosgw_up(ceph)
    assert ceph.s3_endpoint is not None
    return S3Server(ceph.s3_endpoint, ceph.access_key, ceph.secret_key)


def _bucket(
    server: S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, proxy: S3Proxy | None
) -> Iterator[S3Bucket]:
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'tierckpt[s3]')")
    ceph: CephCluster = request.getfixturevalue("ceph_cluster")
    _radosgw_up(ceph)
    for name in _AWS_ENV_CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", server.region)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # the machine's ~/.aws settings do not apply
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = S3Bucket.create(server, bucket_name(request.node.name), proxy)
    try:
        yield bucket
    finally:
        _radosgw_up(ceph)  # a test that killed radosgw and failed before starting it again
        bucket.remove()


@pytest.fixture
def s3_bucket(
    s3_server: S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[S3Bucket]:
    """A fresh bucket on the session's radosgw, its name unique; ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY`` and ``AWS_DEFAULT_REGION`` set for the test (and the processes it starts),
    the machine's AWS profiles and endpoint settings out of the way. Afterwards every object and every
    multipart upload in progress is removed, then the bucket."""
    yield from _bucket(s3_server, request, monkeypatch, None)


@pytest.fixture
def s3_proxy(
    s3_server: S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[S3Bucket]:
    """A fresh bucket as ``s3_bucket`` gives, whose :attr:`~S3Bucket.endpoint` (and so its
    ``tier_entry``) is that of an :class:`S3Proxy` in front of radosgw: ``s3_proxy.proxy`` counts the
    requests and injects faults. ``s3_proxy.client`` goes straight to radosgw (not counted, not faulted),
    and so does the removal of the bucket after the test."""
    with S3Proxy(s3_server.endpoint) as proxy:
        yield from _bucket(s3_server, request, monkeypatch, proxy)
