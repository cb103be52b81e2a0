"""Loopback shared file systems for tests and benchmarks: a one-node Ceph (CephFS over ``ceph-fuse``,
optionally S3 through radosgw) and a one-brick GlusterFS volume over its FUSE client.

Both need root, ``/dev/fuse`` and the Debian packages (``ceph-mon ceph-osd ceph-mgr ceph-mds ceph-fuse
ceph-common radosgw glusterfs-server glusterfs-client fuse3``); :func:`why_ceph_cannot_run` and
:func:`why_gluster_cannot_run` say what is missing (``None`` when nothing is)::

    with CephCluster(tmp / "ceph").start(cephfs=tmp / "cephfs", rgw_port=free_port()) as ceph:
        ...  # a CephFS mount at ceph.mount, S3 at ceph.s3_endpoint (ceph.access_key / ceph.secret_key)
    with GlusterVolume(tmp / "gluster").start(tmp / "gfs") as gv:
        ...  # a GlusterFS mount at gv.mount

Ceph's daemons listen on 127.0.0.1 at ports chosen free; Gluster's on glusterd's fixed port 24007 and the
ports it gives its bricks, under this machine's name (see :class:`GlusterVolume`). Each cluster keeps its
files and logs under its private base directory, and its daemons run in the foreground as children of this
process (Gluster's brick is glusterd's child). ``start()`` waits for each step with a bounded timeout and, when one fails, raises
:class:`ClusterError` with the tails of the daemons' logs, after stopping what it started. ``stop()``
unmounts first (a FUSE client left without its servers makes every access to its mount point hang), then
stops the daemons in order (SIGTERM, SIGKILL after a bounded wait) and removes the base directory; it may
be called twice and after a failed start.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

from tierckpt.testing._daemons import (
    STEP_TIMEOUT_S,
    Cluster,
    ClusterError,
    free_port,
    http_answers,
    is_mounted,
    port_open,
    why_not,
)

__all__ = [
    "CEPH_BINARIES",
    "GLUSTER_BINARIES",
    "CephCluster",
    "ClusterError",
    "GlusterVolume",
    "free_port",
    "why_ceph_cannot_run",
    "why_gluster_cannot_run",
]

#: the programs :class:`CephCluster` runs (radosgw only with ``rgw_port``)
CEPH_BINARIES = ("ceph", "ceph-authtool", "monmaptool", "ceph-mon", "ceph-osd", "ceph-mgr", "ceph-mds", "ceph-fuse")
#: the programs :class:`GlusterVolume` runs
GLUSTER_BINARIES = ("glusterd", "gluster", "mount.glusterfs")


def why_ceph_cannot_run(rgw: bool = False) -> str | None:
    """Why a :class:`CephCluster` cannot start here (not root, no FUSE, a program missing), else ``None``."""
    return why_not(CEPH_BINARIES + (("radosgw", "radosgw-admin") if rgw else ()))


def why_gluster_cannot_run() -> str | None:
    """Why a :class:`GlusterVolume` cannot start here (not root, no FUSE, a program missing), else ``None``."""
    return why_not(GLUSTER_BINARIES)


_CEPH_CONF = """[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
ms bind ipv6 = false
# auth none needs the crc messenger mode, or daemons fail with -13 (EACCES)
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
ms client mode = crc secure
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 5
# a killed radosgw's watches on its control objects outlive it this long (default 30 s), and every change
# radosgw announces to its peers (a bucket made or deleted) waits for the dead one's answer until then;
# a live radosgw pings its watches every tick (objecter tick interval: 1 s below, default 5 s)
osd client watch timeout = 5
osd crush chooseleaf type = 0
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
run dir = {base}/run
pid file = {base}/run/$name.pid
admin socket = {base}/run/$name.asok
log file = {base}/log/$name.log
mon data = {base}/$name
osd data = {base}/$name
mgr data = {base}/$name
mds data = {base}/$name
keyring = {base}/keyring
[client.rgw.a]
rgw data = {base}/rgw
# radosgw frees a deleted object's tail and an aborted upload's parts by garbage collection, by default
# two hours after the delete and once an hour: here at once and every few seconds, or the memstore fills up
rgw gc obj min wait = 0
rgw gc processor period = 5
objecter tick interval = 1
"""
#: the name radosgw runs under (its section of the configuration, its log file)
RGW = "client.rgw.a"


class CephCluster(Cluster):
    """A one-node Ceph on loopback: a mon (v2 port chosen free), a mgr, one memstore OSD (RAM-backed, its
    size ``memstore_bytes``: 1 GiB by default, which bounds what the cluster can hold), and on request an
    MDS with CephFS mounted by ``ceph-fuse`` and a radosgw serving S3 on 127.0.0.1.

    Auth is off (``auth_*_required = none``); the S3 user has :attr:`access_key` / :attr:`secret_key`.
    CephFS and radosgw may be started with :meth:`start` or later, on the running cluster
    (:meth:`start_cephfs`, :meth:`start_rgw`); :meth:`kill_rgw` crashes radosgw for fault tests, and
    :meth:`start_rgw` brings it back on the same port with the same user and buckets (they live in RADOS).

    A full OSD (about 95 % of ``memstore_bytes``) does not fail radosgw's requests: they wait until room is
    made, so a client without a timeout hangs. Size the memstore for what the tests keep at once.
    """

    kind = "ceph"
    access_key = "TIERCKPTACCESS"
    secret_key = "TIERCKPTSECRET"

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        memstore_bytes: int = 1 << 30,
        timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        super().__init__(base_dir, timeout_s)
        self.memstore_bytes = memstore_bytes
        self.conf = self.base / "ceph.conf"
        self.mon_port = 0
        self.rgw_port: int | None = None
        self._s3_user = False

    @property
    def s3_endpoint(self) -> str | None:
        """``http://127.0.0.1:PORT`` once radosgw was started (also while it is killed), else ``None``."""
        return None if self.rgw_port is None else f"http://127.0.0.1:{self.rgw_port}"

    @property
    def rgw_running(self) -> bool:
        """Whether radosgw was started and has not exited (nor been killed) since."""
        return self._daemons.running(RGW)

    def ceph(self, *args: str, timeout_s: float | None = None) -> str:
        """Run the ``ceph`` command line against this cluster; its standard output."""
        return self._run(["ceph", "-c", str(self.conf), *args], f"ceph {args[0]}", timeout_s)

    def start(self, cephfs: str | os.PathLike[str] | None = None, rgw_port: int | None = None) -> CephCluster:
        """Start the mon, mgr and OSD; with ``cephfs`` an MDS and a ``ceph-fuse`` mount there (made if
        missing); with ``rgw_port`` radosgw on 127.0.0.1:``rgw_port`` and an S3 user. Returns ``self``."""
        self._prepare(["mon.a", "osd.0", "mgr.x", "mds.a", "run", "rgw"])
        self.mon_port = free_port()
        self.conf.write_text(
            _CEPH_CONF.format(
                fsid=uuid.uuid4(), mon_port=self.mon_port, memstore_bytes=self.memstore_bytes, base=self.base
            )
        )
        with self._all_or_nothing():
            self._start_core()
            if cephfs is not None:
                self.start_cephfs(cephfs)
            if rgw_port is not None:
                self.start_rgw(rgw_port)
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        self._daemons.spawn(name, [*argv, "-f", "-c", str(self.conf)])

    def _start_core(self) -> None:
        b, c = self.base, ["-c", str(self.conf)]
        keyring, monmap = str(b / "keyring"), str(b / "monmap")
        self._run(["ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *"])
        self._run(["monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]", monmap])
        self._run(["ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring])
        self._daemon("mon.a", ["ceph-mon", "-i", "a"])
        self._wait("ceph-mon listening", lambda: port_open("127.0.0.1", self.mon_port))
        self.ceph("osd", "create")
        self._run(["ceph-osd", *c, "-i", "0", "--mkfs"])
        self._daemon("osd.0", ["ceph-osd", "-i", "0"])
        self._daemon("mgr.x", ["ceph-mgr", "-i", "x"])
        self._wait("osd.0 up", lambda: '"num_up_osds":1' in self.ceph("osd", "stat", "-f", "json").replace(" ", ""))

    def start_cephfs(self, mount: str | os.PathLike[str]) -> Path:
        """On the running cluster: create CephFS, start an MDS, mount it at ``mount`` (made if missing)
        with ``ceph-fuse``; returns the mount point. A failure raises :class:`ClusterError` and leaves
        the cluster running (:meth:`stop` stops what this started)."""
        if self.mount is not None:
            raise ClusterError(f"{self.kind} in {self.base}: CephFS is mounted already, at {self.mount}")
        mnt = Path(mount).absolute()
        self.ceph("osd", "pool", "create", "cephfs_data", "8")
        self.ceph("osd", "pool", "create", "cephfs_metadata", "8")
        self.ceph("fs", "new", "cephfs", "cephfs_metadata", "cephfs_data")
        self._daemon("mds.a", ["ceph-mds", "-i", "a"])
        self._wait("mds.a up:active", lambda: "up:active" in self.ceph("mds", "stat"))
        mnt.mkdir(parents=True, exist_ok=True)
        if is_mounted(mnt):
            self._fail(f"{mnt} is already a mount point")
        self.mount = mnt
        self._daemon("client.admin", ["ceph-fuse", str(mnt)])
        self._wait(f"ceph-fuse mount at {mnt}", lambda: is_mounted(mnt))
        return mnt

    def start_rgw(self, port: int | None = None) -> str:
        """On the running cluster: start radosgw on 127.0.0.1:``port`` (by default the port it had, else
        one chosen free), wait until it answers HTTP (about 13 s on a loaded 2-core machine), and create
        the S3 user at the first start; returns :attr:`s3_endpoint`. A failure raises
        :class:`ClusterError` with the logs' tails and leaves the cluster running."""
        if self.rgw_running:
            raise ClusterError(f"{self.kind} in {self.base}: radosgw runs already, on port {self.rgw_port}")
        self._daemons.kill(RGW)  # forget one that exited by itself: it would fail the wait below
        port = port or self.rgw_port or free_port()
        self.rgw_port = port
        self._daemon(RGW, ["radosgw", "-n", RGW, f"--rgw_frontends=beast endpoint=127.0.0.1:{port} tcp_nodelay=1"])
        self._wait(f"radosgw answering on 127.0.0.1:{port}", lambda: http_answers("127.0.0.1", port))
        if not self._s3_user:
            self._run(
                [
                    *("radosgw-admin", "-c", str(self.conf), "user", "create", "--uid=tierckpt"),
                    *("--display-name=tierckpt", f"--access-key={self.access_key}", f"--secret-key={self.secret_key}"),
                ]
            )
            self._s3_user = True
        return f"http://127.0.0.1:{port}"

    def kill_rgw(self) -> None:
        """SIGKILL radosgw, as a crash would, and wait until it is gone (at most 15 s, else
        :class:`ClusterError`). Requests in flight fail with a reset connection, new ones are refused,
        until :meth:`start_rgw` starts it again on the same port."""
        self._daemons.kill(RGW)

    def _stop_servers(self) -> None:
        # radosgw keeps nothing of its own (its data is in RADOS), and on SIGTERM it takes 5 to 10 s and
        # more, waiting for its clients' idle connections: killed at once
        self._daemons.kill(RGW)
        super()._stop_servers()

    def set_quota(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        """Set the CephFS quota ``ceph.quota.max_bytes`` on a directory of the mount (0 lifts it); ceph-fuse
        enforces it (a write past it fails with ``EDQUOT``), a little after the fact: the client learns the
        usage from the MDS."""
        os.setxattr(directory, "ceph.quota.max_bytes", str(max_bytes).encode())


#: the port of glusterd: its bricks and clients ask it for their volume files there, whatever port it listens on
GLUSTERD_PORT = 24007
#: the unix socket the ``gluster`` command talks to glusterd on (its default)
GLUSTERD_SOCK = "/var/run/glusterd.socket"
_GLUSTERD_VOL = """volume management
    type mgmt/glusterd
    option working-directory {workdir}
    option transport-type socket
    option transport.socket.listen-port {port}
    option glusterd-sockfile {sock}
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
end-volume
"""


def brick_host() -> str:
    """The host name Gluster's brick is declared on: this machine's name when it resolves to one of its own
    addresses. Gluster refuses ``localhost`` and ``127.0.0.1`` in a brick's name (it wants a name other
    peers could reach) yet needs the name to be local; on a machine whose name resolves to a loopback
    address (``/etc/hosts``: ``127.0.0.1 vm``) or to its own interface either works."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))  # fails unless the address is this machine's
    except OSError as e:
        raise ClusterError(f"this machine's name {name!r} does not resolve to one of its addresses: {e}") from e
    return name


def _glusterd_sockets() -> list[str]:
    """Where running glusterds listen for the ``gluster`` command: the default socket, and the
    ``glusterd-sockfile`` of each one started with a volume file of its own (``-f FILE``)."""
    socks = [GLUSTERD_SOCK]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
            if Path(argv[0]).name != "glusterd" or "-f" not in argv:
                continue
            for line in Path(argv[argv.index("-f") + 1]).read_text().splitlines():
                words = line.split()
                if words[:2] == ["option", "glusterd-sockfile"] and len(words) == 3 and words[2] not in socks:
                    socks.append(words[2])
        except (OSError, IndexError):
            continue
    return socks


class GlusterVolume(Cluster):
    """A one-brick GlusterFS volume mounted with the FUSE client.

    Gluster's bricks and clients fetch their volume files from glusterd on port 24007, whatever port it
    listens on, so a machine has one glusterd: when one answers there already (the system's, or another
    instance's) the volume is created in it and only the volume is removed at :meth:`stop`; else this
    instance starts its own (its working directory under the base directory, its unix socket where the
    ``gluster`` command looks by default, :data:`GLUSTERD_SOCK`) and stops it: stop the instances
    started later first.
    The volume's name is unique per instance; glusterd keeps the bricks' pid files in the system's run
    directory (``/var/run/gluster/vols/NAME``), which :meth:`stop` removes.

    With ``brick_bytes`` the brick lives on a tmpfs of that size, so that the volume fills up (the brick's
    ``storage.reserve`` is set to 0: by default Gluster refuses writes once 1 % of the brick is left).
    """

    kind = "gluster"

    def __init__(self, base_dir: str | os.PathLike[str], timeout_s: float = STEP_TIMEOUT_S) -> None:
        super().__init__(base_dir, timeout_s)
        self.volume = f"tck{uuid.uuid4().hex[:10]}"
        # the gluster command's default socket: where a glusterd another instance started listens too
        self._cli = (f"--glusterd-sock={GLUSTERD_SOCK}", "--mode=script")
        self._brick_mount: Path | None = None

    def _start_glusterd(self) -> None:
        vol = self.base / "glusterd.vol"
        vol.write_text(_GLUSTERD_VOL.format(workdir=self.base / "glusterd", port=GLUSTERD_PORT, sock=GLUSTERD_SOCK))
        log = self._daemons.log_path("glusterd")
        self._daemons.spawn("glusterd", ["glusterd", "-N", "-f", str(vol), "-l", str(log)])
        self._wait("glusterd answering", self._answers)

    def gluster(self, *args: str) -> str:
        """Run the ``gluster`` command line against this volume's glusterd; its standard output."""
        return self._run(["gluster", *self._cli, *args], f"gluster {args[0]}")

    def _answers(self, sock: str = GLUSTERD_SOCK) -> bool:
        """Whether glusterd answers on ``sock``; if so, the ``gluster`` commands go there."""
        argv = ["gluster", f"--glusterd-sock={sock}", "--mode=script", "pool", "list"]
        try:
            if subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode != 0:
                return False
        except subprocess.TimeoutExpired:
            return False
        self._cli = (f"--glusterd-sock={sock}", "--mode=script")
        return True

    def start(self, mount: str | os.PathLike[str], brick_bytes: int | None = None) -> GlusterVolume:
        """Start glusterd (unless one serves this machine already), create and start the volume, mount it
        at ``mount`` (made if missing); returns ``self``."""
        self._prepare(["glusterd", "brick"])
        with self._all_or_nothing():
            self._start_volume(Path(mount).absolute(), brick_bytes)
        return self

    def _start_volume(self, mnt: Path, brick_bytes: int | None) -> None:
        host = brick_host()
        brick = self.base / "brick"
        if brick_bytes is not None:
            self._run(["mount", "-t", "tmpfs", "-o", f"size={brick_bytes}", "tmpfs", str(brick)], "brick tmpfs")
            self._brick_mount = brick
            brick = brick / "b"
            brick.mkdir()
        if not port_open("127.0.0.1", GLUSTERD_PORT):
            self._start_glusterd()
        elif not any(self._answers(sock) for sock in _glusterd_sockets()):
            self._fail(f"a glusterd listens on port {GLUSTERD_PORT} but answers on none of {_glusterd_sockets()}")
        self.gluster("volume", "create", self.volume, f"{host}:{brick}", "force")
        if brick_bytes is not None:
            self.gluster("volume", "set", self.volume, "storage.reserve", "0")
        self.gluster("volume", "start", self.volume)
        self._daemons.extra_pids.extend(self._brick_pids())
        mnt.mkdir(parents=True, exist_ok=True)
        if is_mounted(mnt):
            self._fail(f"{mnt} is already a mount point")
        self.mount = mnt
        opts = f"log-file={self.base / 'log' / 'mount.log'}"
        self._run(["mount", "-t", "glusterfs", "-o", opts, f"{host}:/{self.volume}", str(mnt)], "mount -t glusterfs")
        self._wait(f"glusterfs mount at {mnt}", lambda: is_mounted(mnt))

    def _brick_pids(self) -> list[int]:
        pids = []
        for f in Path("/var/run/gluster/vols", self.volume).glob("*.pid"):
            try:
                pids.append(int(f.read_text().strip()))
            except (OSError, ValueError):
                continue
        return pids

    def _stop_servers(self) -> None:
        own = bool(self._daemons.procs)
        if self._started and (not own or self._daemons.procs[0][1].poll() is None):
            for args in (["volume", "stop", self.volume, "force"], ["volume", "delete", self.volume]):
                try:  # best effort: what this leaves running is killed below
                    subprocess.run(["gluster", *self._cli, *args], capture_output=True, timeout=60)
                except subprocess.TimeoutExpired:
                    break
        self._daemons.extra_pids.extend(p for p in self._brick_pids() if p not in self._daemons.extra_pids)
        super()._stop_servers()
        shutil.rmtree(Path("/var/run/gluster/vols", self.volume), ignore_errors=True)
        if self._brick_mount is not None:
            subprocess.run(["umount", "-l", str(self._brick_mount)], capture_output=True, timeout=30, check=False)
            self._brick_mount = None
