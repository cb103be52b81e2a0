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

import json
import mmap
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_clients import Endpoint, downloader, pattern, uploader
from s3_marks import GAP_S, SERVER_PIDS, measured

WARM_BYTES = 1 << 20


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
