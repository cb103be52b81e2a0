"""One measured S3 operation of ``bench_s3.py`` in a fresh process.

Run as ``python s3_child.py '<json spec>'``; prints one JSON line (the last line of stdout): the wall time
of the operation, this process's CPU seconds during it (``getrusage``: every thread, Rust's included), its
peak extra RSS (the kernel's VmHWM, reset just before, minus VmRSS then), the server's CPU seconds during it
(where the parent passed the server's process ids), the wall-clock start and end (the parent counts the
server's requests between them), and for a download whether the bytes are the source's.
A fresh process per measurement: freed memory of an earlier one cannot hide this one's peak, and every
client opens its connections anew.

Spec keys: ``op`` (``put``, ``get``, or an operation of ``s3_peers.py``), ``client``, ``endpoint``,
``bucket``, ``key``, ``nbytes``, ``part``, ``conc``, ``seed``, ``server_pids``, and what ``s3_peers.py``
reads.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_clients import Endpoint, downloader, pattern, uploader

WARM_BYTES = 1 << 20
GAP_S = 0.02  # between two windows whose requests the parent counts apart (radosgw's clock: 4 ms ticks)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith(field + ":")), 0)


def cpu_secs() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


SERVER_PIDS: list[int] = []  # radosgw's and the OSD's, where the parent runs them (spec["server_pids"])
_TICK = os.sysconf("SC_CLK_TCK")


def server_cpu_secs() -> float | None:
    """CPU seconds so far of the server's processes (None when they are not known or gone)."""
    if not SERVER_PIDS:
        return None
    total = 0.0
    for pid in SERVER_PIDS:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


class Mark:
    """A point in time: wall clock, monotonic clock, process CPU, RSS; with ``reset`` the peak-RSS mark
    (VmHWM) is set to the RSS now."""

    def __init__(self, reset: bool = False) -> None:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self.wall, self.mono, self.cpu, self.rss_kib = (
            time.time(),
            time.perf_counter(),
            cpu_secs(),
            _status_kib("VmRSS"),
        )
        self.server_cpu = server_cpu_secs()

    def until(self, end: Mark) -> dict[str, Any]:
        """The interval from this mark to ``end`` as the parent reads it."""
        srv = None if self.server_cpu is None or end.server_cpu is None else end.server_cpu - self.server_cpu
        return {"secs": end.mono - self.mono, "cpu": end.cpu - self.cpu, "t0": self.wall, "t1": end.wall,
                "extra_rss": max(0, _status_kib("VmHWM") - self.rss_kib) * 1024, "server_cpu": srv}  # fmt: skip


@contextlib.contextmanager
def measured(out: dict[str, Any]) -> Iterator[None]:
    """Measure the block into ``out`` (see :meth:`Mark.until`)."""
    start = Mark(reset=True)
    yield
    out.update(start.until(Mark()))


def digest(buf: Any) -> str:
    import xxhash

    return str(xxhash.xxh3_64_hexdigest(buf))


def endpoint(spec: dict[str, Any]) -> Endpoint:
    return Endpoint(spec["endpoint"], spec["bucket"])


def put(spec: dict[str, Any]) -> dict[str, Any]:
    """Upload ``nbytes`` of the pattern as ``key``, after a small warm-up upload by the same client."""
    src = pattern(spec["nbytes"], spec["seed"])
    up = uploader(spec["client"], endpoint(spec), spec["conc"])
    up(spec["key"] + ".warm", src[:WARM_BYTES], spec["part"])
    time.sleep(GAP_S)
    out: dict[str, Any] = {}
    with measured(out):
        up(spec["key"], src, spec["part"])
    return out


def get(spec: dict[str, Any]) -> dict[str, Any]:
    """Download ``key`` with ranged GETs into fresh anonymous memory (its pages first touched by the
    download, as a restore's new tensors are); whether it holds the pattern. The warm-up reads ``key.warm``, an
    object of :data:`WARM_BYTES`, into a scratch buffer."""
    down = downloader(spec["client"], endpoint(spec), spec["conc"])
    down(spec["key"] + ".warm", memoryview(bytearray(WARM_BYTES)), WARM_BYTES)
    dst = mmap.mmap(-1, spec["nbytes"])
    time.sleep(GAP_S)
    out: dict[str, Any] = {}
    with measured(out):
        down(spec["key"], memoryview(dst), spec["part"])
    out["intact"] = digest(dst) == digest(pattern(spec["nbytes"], spec["seed"]))
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    SERVER_PIDS[:] = spec.get("server_pids", [])
    try:
        if spec["op"] in ("put", "get"):
            out = put(spec) if spec["op"] == "put" else get(spec)
        else:
            import s3_peers  # torch: only where needed

            out = s3_peers.run(spec)
        out["ok"] = True
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        traceback.print_exc()
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    out["pid"] = os.getpid()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
