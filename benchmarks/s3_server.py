"""The S3 server of ``bench_s3.py``: a loopback radosgw it starts (or an endpoint it is given), emptied
between measurements, and what the server did in a window: its requests by operation (from radosgw's log)
and its CPU seconds (radosgw's and the OSD's, from /proc).

radosgw on a memstore OSD keeps every byte in RAM, and a full OSD makes it hang rather than fail: every
object a measurement wrote is deleted after it, radosgw's garbage collector is run at once (deleted
multipart objects otherwise wait two hours for it), and :meth:`Server.make_room` refuses to start a write
that would not fit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from s3_clients import Endpoint, boto3_client

from tierckpt.testing.clusters import CephCluster, free_port, why_ceph_cannot_run
from tierckpt.testing.s3requests import classify as operation

BUCKET = "tierckpt-bench"
_BEAST = re.compile(r'beast: \S+: \S+ - \S* \[([^\]]+)\] "(\w+) (\S+) HTTP/[\d.]+" (\d{3}) (\d+)')
TICK_S = 0.0045  #: how much earlier than it started radosgw may stamp a request (its coarse clock's tick)


def _bucket_of(url: str) -> str:
    return url.lstrip("/").split("?", 1)[0].split("/", 1)[0]


class RequestLog:
    """radosgw's log: each request is one ``beast:`` line with its start time, method, URL and status."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def requests(self, t0: float, t1: float, bucket: str) -> tuple[Counter[str], list[str]]:
        """Requests on ``bucket`` that started in ``[t0, t1]`` (Unix times; windows ``s3_child.GAP_S`` apart are
        told apart, and the warm-up objects ``*.warm`` are left out): their count by operation
        (``GetObject``; a failed one as ``GetObject 404``), and the method and URL of each one other than
        the data's (``UploadPart``, ``GetObject``). Waits until radosgw has logged every request it started."""
        self._settle()
        out: Counter[str] = Counter()
        lines: list[str] = []
        with self.path.open(errors="replace") as f:
            for line in f:
                m = _BEAST.search(line)
                if m is None:
                    continue
                when = datetime.strptime(m.group(1), "%d/%b/%Y:%H:%M:%S.%f %z").timestamp()
                # radosgw stamps a request's start with a coarse clock (4 ms ticks here), rounded down
                if not t0 - TICK_S < when <= t1 + 0.0005 or _bucket_of(m.group(3)) != bucket:
                    continue
                if m.group(3).partition("?")[0].endswith(".warm"):  # the children's warm-ups
                    continue
                op, status = operation(m.group(2), m.group(3)), int(m.group(4))
                out[op if status < 300 else f"{op} {status}"] += 1
                if op not in ("UploadPart", "GetObject") or status >= 300:
                    lines.append(f"{m.group(2)} {re.sub(r'uploadId=[^&]+', 'uploadId=…', m.group(3))} {status}")
        return out, lines

    def _settle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.path.read_text(errors="replace")
            if text.count("starting new request") <= text.count(" beast: "):
                return
            time.sleep(0.2)


class Server:
    """The endpoint, its bucket, and (for a radosgw this process started) its log, conf and daemons."""

    def __init__(self, ep: Endpoint, log: RequestLog | None = None, cluster: CephCluster | None = None) -> None:
        self.ep, self.log, self.cluster = ep, log, cluster

    @classmethod
    def start(cls, base: Path, memstore_bytes: int) -> Server:
        """A one-node Ceph with radosgw under ``base`` (RAM: ``memstore_bytes``), its keys exported to
        this process's environment (the children inherit them), and the bucket made."""
        why = why_ceph_cannot_run(rgw=True)
        if why is not None:
            raise RuntimeError(f"cannot start radosgw here: {why}")
        cluster = CephCluster(base, memstore_bytes=memstore_bytes).start(rgw_port=free_port())
        assert cluster.s3_endpoint is not None
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = cluster.access_key, cluster.secret_key
        server = cls(Endpoint(cluster.s3_endpoint, BUCKET), RequestLog(base / "log" / "client.rgw.a.log"), cluster)
        server.client().create_bucket(Bucket=BUCKET)
        return server

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()

    def client(self) -> Any:
        return boto3_client(self.ep, 16)

    def ensure_bucket(self) -> None:
        c = self.client()
        try:
            c.head_bucket(Bucket=self.ep.bucket)
        except c.exceptions.ClientError:
            c.create_bucket(Bucket=self.ep.bucket)

    # -- emptying -------------------------------------------------------------------------------------
    def clean(self, prefix: str) -> int:
        """Delete every object and abort every multipart upload under ``prefix``; run radosgw's garbage
        collector where this process runs radosgw. Returns how many objects were deleted."""
        c, b, n = self.client(), self.ep.bucket, 0
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=b, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                c.delete_objects(Bucket=b, Delete={"Objects": keys, "Quiet": True})
                n += len(keys)
        for page in c.get_paginator("list_multipart_uploads").paginate(Bucket=b, Prefix=prefix):
            for u in page.get("Uploads", []):
                c.abort_multipart_upload(Bucket=b, Key=u["Key"], UploadId=u["UploadId"])
        if self.cluster is not None:
            self._admin("gc", "process", "--include-all")
        return n

    def _admin(self, *args: str) -> str:
        assert self.cluster is not None
        argv = ["radosgw-admin", "-c", str(self.cluster.conf), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout

    def make_room(self, nbytes: int, timeout_s: float = 60.0) -> None:
        """Wait until the OSD has room for ``nbytes`` more (its usage is reported every few seconds);
        raise naming the sizes if it does not come."""
        if self.cluster is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            stats = json.loads(self.cluster.ceph("df", "-f", "json"))["stats"]
            avail = int(stats["total_avail_bytes"])
            if avail >= nbytes + (128 << 20):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"radosgw's OSD has {avail >> 20} MiB free, {nbytes >> 20} MiB needed: "
                                   "give it more memory (--memstore)")  # fmt: skip
            time.sleep(2)

    # -- what the server spent ------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """radosgw's and the OSD's process ids (none unless this process runs them): the children read
        their CPU time at each mark (``s3_child.Mark``)."""
        if self.cluster is None:
            return []
        conf, out = str(self.cluster.conf).encode(), []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, IndexError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if Path(argv[0].decode()).name in ("radosgw", "ceph-osd") and conf in argv:
                    out.append(int(proc.name))
        return out

    def small_request_ms(self, n: int = 7) -> float:
        """Median milliseconds of a GET of a 1 KiB object, read whole, on a kept-alive connection: a few
        without delays; about 40 where the server writes a response's head and body apart with Nagle's
        algorithm on (radosgw's beast without ``tcp_nodelay=1``) and the client delays its ACKs."""
        c, key = self.client(), "probe/small"
        c.put_object(Bucket=self.ep.bucket, Key=key, Body=b"x" * 1024)
        c.get_object(Bucket=self.ep.bucket, Key=key)["Body"].read()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.get_object(Bucket=self.ep.bucket, Key=key)["Body"].read()
            times.append(time.perf_counter() - t0)
        c.delete_object(Bucket=self.ep.bucket, Key=key)
        return 1000 * sorted(times)[n // 2]

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"endpoint": self.ep.url, "bucket": self.ep.bucket,
                                "small_get_ms": round(self.small_request_ms(), 1)}  # fmt: skip
        if self.cluster is not None:
            info |= {"server": "radosgw (own loopback Ceph, memstore OSD)",
                     "memstore_bytes": self.cluster.memstore_bytes,
                     "ceph_version": subprocess.run(["ceph", "--version"], capture_output=True, text=True).stdout.strip()}  # fmt: skip
        return info
