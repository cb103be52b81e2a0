"""S3 benchmark (issue 29): the S3 tier against the raw limits of its client libraries and against peers.

Usage::

    python benchmarks/bench_s3.py                     # 1 GiB, 3 repeats, its own loopback radosgw: ~30 min
    python benchmarks/bench_s3.py --quick             # 64 MiB, 1 repeat, a small sweep: a few minutes
    python benchmarks/bench_s3.py --endpoint http://HOST:PORT --bucket B   # another server (keys from
                                                      # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)

Every measurement runs in a fresh process (``s3_child.py``) that moves ``--bytes`` of one byte pattern, so
every path moves the same bytes. Phases (``--phases``, in this order):

1. ``sweep``: raw multipart uploads and raw parallel ranged GETs of each client library over part sizes
   ``--parts`` × concurrency ``--concs`` (s3_clients.py says what each client does); each library's best
   (highest median rate) is what the later phases compare against.
2. ``clients``: every client variant at its library's best settings (memoryview vs bytes bodies, default
   configs, s3transfer, obstore's ``get_ranges`` and a thread pool of ``get_range``);
3. ``tier``: tierckpt's S3 tier (``kind: s3``, its ``part_size`` and ``concurrency`` the raw boto3 best
   unless ``--tier-options`` sets them): the demotions host → s3 of two saves (the first after opening the
   hierarchy, then one that evicts it: the figures are the second's), each timed from the host copy's
   commit to the S3 copy's, and a restart's restore s3 → memory in a new process with no host copy;
4. ``peers``: ``dcp.save``/``dcp.load`` through fsspec + s3fs, and s3torchconnector's DCP writer/reader.

Phases 2–4 run ``--repeats`` rounds, the order of the items rotating each round, so that a slow spell of a
busy machine does not fall on one item; the tables give medians. Besides MB/s each row has the client
process's CPU seconds per GB (``getrusage``: every thread), its peak extra RSS during the transfer (VmHWM,
reset just before), and, where this script runs radosgw, the server's CPU seconds per GB (radosgw + OSD)
and its requests by operation (from radosgw's log). Peers import from ``--peer-path`` (a ``pip install
--target`` folder) when given, so that s3fs's pinned botocore need not replace the environment's.

First the server's latency for a small GET is measured and reported: radosgw's beast frontend without
``tcp_nodelay=1`` adds about 40 ms to every response with a body (Nagle against delayed ACKs).

Results: JSON lines and a markdown report in ``--out``. See docs/benchmarks.md, "S3".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_clients import DOWNLOADS, SWEPT_DOWNLOADS, SWEPT_UPLOADS, UPLOADS, Endpoint
from s3_report import report
from s3_server import BUCKET, Server

from tierckpt.configvalues import parse_size

HERE = Path(__file__).resolve().parent
PHASES = ("sweep", "clients", "tier", "peers")
PEERS = ("dcp-fsspec", "s3torch")
#: the client variants that run at another's best settings (upload, download)
BEST_OF = {"boto3-signed": "boto3", "boto3-bytes": "boto3", "boto3-defaults": "boto3", "obstore-signed": "obstore"}
BEST_OF_GET = {"boto3-urllib3": "boto3", "s3transfer": "boto3"}
OBSTORE_RANGES_CONC = 10  # obstore.get_ranges runs at most 10 requests at a time, whatever one asks


class Bench:
    """One run: the server, the records so far (also appended to the JSON-lines file) and the settings."""

    def __init__(self, args: argparse.Namespace, server: Server, out: Path) -> None:
        self.args, self.server = args, server
        self.server_pids = server.pids()
        self.unavailable = unavailable_clients()
        self.recs: list[dict[str, Any]] = []
        out.mkdir(parents=True, exist_ok=True)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = out / f"s3-{self.stamp}.jsonl"

    def emit(self, rec: dict[str, Any]) -> None:
        self.recs.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    # -- one measurement ------------------------------------------------------------------------------
    def child(self, spec: dict[str, Any], peer: bool = False) -> dict[str, Any]:
        """Run one operation in a fresh process; its result with the server's requests added."""
        spec = {"endpoint": self.server.ep.url, "bucket": self.server.ep.bucket, "nbytes": self.args.nbytes,
                "seed": self.args.seed, "tensor_bytes": self.args.tensor_bytes, "server_pids": self.server_pids,
                **spec}  # fmt: skip
        if spec["op"] != "get" and not spec["op"].endswith(("load", "restore")):
            self.server.make_room(self.args.nbytes * (2 if spec["op"] == "tier-save" else 1))
        env = dict(os.environ)
        if peer and self.args.peer_path:
            env["PYTHONPATH"] = os.pathsep.join([self.args.peer_path, env.get("PYTHONPATH", "")])
        try:
            p = subprocess.run([sys.executable, str(HERE / "s3_child.py"), json.dumps(spec)], env=env,
                               capture_output=True, text=True, timeout=self.args.child_timeout)  # fmt: skip
            lines = p.stdout.strip().splitlines()
            out = json.loads(lines[-1]) if lines else {"ok": False, "error": f"exit {p.returncode}"}
            if not out.get("ok"):
                out["stderr_tail"] = p.stderr[-3000:]
        except subprocess.TimeoutExpired:
            out = {"ok": False, "error": f"no answer in {self.args.child_timeout:.0f} s"}
        if out.get("ok") and self.server.log is not None:
            first = out.get("first") or {}
            for part in (out, out.get("save"), out.get("open"), first, first.get("save")):
                if part:  # the requests in the measured window (and the whole save's, and the opening's)
                    counts, lines = self.server.log.requests(part["t0"], part["t1"], self.server.ep.bucket)
                    part["requests"], part["request_lines"] = dict(counts), lines
        return out

    def sample(self, phase: str, spec: dict[str, Any], rep: int, peer: bool = False) -> dict[str, Any]:
        res = self.child(spec, peer)
        rec = {"kind": "sample", "phase": phase, "repeat": rep, "nbytes": self.args.nbytes,
               **{k: v for k, v in spec.items() if k in ("op", "client", "part", "conc")}, **res}  # fmt: skip
        self.emit(rec)
        rate = f"{self.args.nbytes / res['secs'] / 1e6:7.1f} MB/s" if res.get("ok") else f"FAILED: {res['error']}"
        what = f"{spec['op']} {spec.get('client', '')}".strip()
        print(f"  [{phase} r{rep}] {what:<26} part {spec.get('part', 0) >> 20:>3} MiB × {spec.get('conc', 0):>2}  {rate}",
              flush=True)  # fmt: skip
        return rec

    # -- phases ---------------------------------------------------------------------------------------
    def put_source(self) -> None:
        """The object the GETs read (``src/obj``, and ``src/obj.warm`` for the warm-ups)."""
        res = self.child({"op": "put", "client": "boto3", "key": "src/obj", "part": 16 << 20, "conc": 8})
        if not res.get("ok"):
            raise RuntimeError(f"could not upload the source object: {res['error']}\n{res.get('stderr_tail', '')}")

    def put(self, phase: str, client: str, part: int, conc: int, rep: int) -> None:
        spec = {"op": "put", "client": client, "key": f"up/{client}", "part": part, "conc": conc}
        self.sample(phase, spec, rep)
        self.server.clean("up/")

    def get(self, phase: str, client: str, part: int, conc: int, rep: int) -> None:
        self.sample(phase, {"op": "get", "client": client, "key": "src/obj", "part": part, "conc": conc}, rep)

    def sweep(self) -> None:
        a = self.args
        for rep in range(a.sweep_repeats):
            for part in a.part_list:
                nparts = -(-a.nbytes // part)
                concs = [c for c in a.conc_list if c <= nparts] or a.conc_list[:1]
                for conc in concs:
                    for client in self.available(SWEPT_UPLOADS):
                        self.put("sweep", client, part, conc, rep)
                    for client in self.available(SWEPT_DOWNLOADS):
                        if client != "obstore" or conc == concs[0]:  # get_ranges: its own concurrency
                            self.get("sweep", client, part, OBSTORE_RANGES_CONC if client == "obstore" else conc, rep)

    def best(self, op: str, client: str) -> tuple[int, int]:
        """(part, conc) of the highest median rate of ``client``'s sweep; ``--part``/``--conc`` without one."""
        rows: dict[tuple[int, int], list[float]] = {}
        for r in self.recs:
            if r["kind"] == "sample" and r["phase"] == "sweep" and r["op"] == op and r["client"] == client and r["ok"]:
                rows.setdefault((r["part"], r["conc"]), []).append(r["secs"])
        if not rows:
            return self.args.part_bytes, self.args.conc
        return min(rows, key=lambda k: statistics.median(rows[k]))

    def available(self, clients: tuple[str, ...]) -> list[str]:
        return [c for c in clients if c not in self.unavailable]

    def items(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if "clients" in self.args.phase_list:
            out += [("put", c) for c in self.available(UPLOADS)] + [("get", c) for c in self.available(DOWNLOADS)]
        if "tier" in self.args.phase_list:
            out.append(("tier", "tierckpt"))
        if "peers" in self.args.phase_list:
            out += [("peer", p) for p in PEERS]
        return out

    def compare(self) -> None:
        """Phases 2–4, ``--repeats`` rounds in rotated order."""
        items = self.items()
        for rep in range(self.args.repeats):
            k = rep % max(1, len(items))
            for kind, name in items[k:] + items[:k]:
                if kind == "put":
                    self.put("clients", name, *self.best("put", BEST_OF.get(name, name)), rep)
                elif kind == "get":
                    self.get("clients", name, *self.best("get", BEST_OF_GET.get(name, name)), rep)
                else:
                    self.save_and_load(kind, name, rep)

    def save_and_load(self, kind: str, name: str, rep: int) -> None:
        """The tier's save then a restart's restore, or a peer's save then load; both deleted after."""
        prefix = f"{kind}/{name}/r{rep}"
        part, conc = self.best("put", "boto3")
        ops = ("tier-save", "tier-restore") if kind == "tier" else (f"{name}-save", f"{name}-load")
        opts = {"part_size": part, "concurrency": conc, **self.args.tier_opts}  # the raw client's best unless set
        base = {"prefix": prefix, "client": name, "part": part, "conc": conc, "tier_options": opts}
        try:
            saved = self.sample(kind, {**base, "op": ops[0]}, rep, peer=kind == "peer")
            if saved["ok"]:
                self.sample(kind, {**base, "op": ops[1]}, rep, peer=kind == "peer")
        finally:
            self.server.clean(f"{kind}/")


def unavailable_clients() -> dict[str, str]:
    """The client variants whose library is not installed here, and why (they are left out)."""
    if importlib.util.find_spec("obstore") is None:
        why = "obstore is not installed (pip install obstore)"
        return {c: why for c in (*UPLOADS, *DOWNLOADS) if c.startswith("obstore")}
    return {}


def tier_available() -> str | None:
    """Why tierckpt's ``kind: s3`` cannot be used here, or None."""
    from tierckpt.registry import get_tier_class

    try:
        get_tier_class("s3")
    except Exception as e:
        return f"kind s3 is not available in this tree ({type(e).__name__}: {e})"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat, parts 8,16 MiB × 4,8 threads")
    p.add_argument("--bytes", default=None, help="bytes each transfer moves (default 1GiB; --quick 64MiB)")
    p.add_argument("--repeats", type=int, default=None, help="rounds of the compared phases (default 3; --quick 1)")
    p.add_argument("--sweep-repeats", type=int, default=1, help="repeats of each sweep point (default 1)")
    p.add_argument("--parts", default=None, help="part sizes swept (default 8MiB,16MiB,32MiB,64MiB)")
    p.add_argument("--concs", default=None, help="concurrencies swept (default 4,8,16)")
    p.add_argument("--part", default="16MiB", help="part size where no sweep ran (16MiB)")
    p.add_argument("--conc", type=int, default=8, help="concurrency where no sweep ran (8)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of %(default)s")
    p.add_argument("--tensor-bytes", default="64MiB", help="size of each tensor of the tier's and peers' state")
    p.add_argument(
        "--tier-options",
        default="{}",
        help="JSON merged into the S3 tier's options (default: part_size and\nconcurrency of the raw boto3 best)",
    )
    p.add_argument("--tier-client", default="boto3", help="the client library the S3 tier uses (its raw limit)")
    p.add_argument(
        "--peer-path", default=None, help="a folder put first on the peers' PYTHONPATH (s3fs, s3torchconnector)"
    )
    p.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting radosgw")
    p.add_argument("--bucket", default=BUCKET, help=f"its bucket (made if missing; default {BUCKET})")
    p.add_argument("--rgw-log", default=None, help="with --endpoint: radosgw's log, to count requests")
    p.add_argument("--memstore", default=None, help="RAM of the own radosgw's OSD (default 3 × bytes + 1GiB)")
    p.add_argument("--child-timeout", type=float, default=None, help="seconds one measurement may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results", help="directory for the JSON lines and the markdown report")
    p.add_argument("--dir", default=None, help="where the own radosgw keeps its files and logs (default /tmp)")
    a = p.parse_args(argv)
    a.nbytes = parse_size(a.bytes or ("64MiB" if a.quick else "1GiB"), "--bytes")
    a.repeats = a.repeats or (1 if a.quick else 3)
    parts = a.parts or ("8MiB,16MiB" if a.quick else "8MiB,16MiB,32MiB,64MiB")
    a.part_list = [parse_size(s.strip(), "--parts") for s in parts.split(",") if s.strip()]
    a.conc_list = [int(s) for s in (a.concs or ("4,8" if a.quick else "4,8,16")).split(",") if s.strip()]
    a.part_bytes, a.tensor_bytes = parse_size(a.part, "--part"), parse_size(a.tensor_bytes, "--tensor-bytes")
    a.phase_list = [s.strip() for s in a.phases.split(",") if s.strip()]
    if bad := [s for s in a.phase_list if s not in PHASES]:
        p.error(f"--phases: unknown {bad} (known: {', '.join(PHASES)})")
    if a.tensor_bytes % 4:
        p.error("--tensor-bytes: a multiple of 4 (the tensors are float32)")
    a.tier_opts = json.loads(a.tier_options)
    a.memstore_bytes = parse_size(a.memstore, "--memstore") if a.memstore else 3 * a.nbytes + (1 << 30)
    a.child_timeout = a.child_timeout or 120 + a.nbytes / 5e6  # 5 MB/s would be a broken server
    return a


def open_server(a: argparse.Namespace, base: Path) -> Server:
    if a.endpoint is None:
        return Server.start(base, a.memstore_bytes)
    from s3_server import RequestLog

    server = Server(Endpoint(a.endpoint, a.bucket), RequestLog(Path(a.rgw_log)) if a.rgw_log else None)
    server.ensure_bucket()
    return server


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through main's finally: the own radosgw is stopped


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from tierckpt.bench.system import machine_info

    base = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=a.dir or "/tmp"))
    server = open_server(a, base / "ceph")
    try:
        bench = Bench(a, server, Path(a.out))
        why_tier = tier_available()
        bench.emit({"kind": "machine", "argv": sys.argv if argv is None else argv, **machine_info(base),
                    **server.describe(), "nbytes": a.nbytes, "tier": why_tier or "kind s3"})  # fmt: skip
        for client, why in sorted(bench.unavailable.items()):
            bench.emit({"kind": "skip", "what": f"client {client}", "why": why})
        if why_tier and "tier" in a.phase_list:
            a.phase_list.remove("tier")
            bench.emit({"kind": "skip", "what": "tier", "why": why_tier})
            print(f"  skipped the tier: {why_tier}", flush=True)
        bench.put_source()
        if "sweep" in a.phase_list:
            bench.sweep()
        bench.compare()
        server.clean("")
        text = report(bench.recs, a)
        md = bench.path.with_suffix(".md")
        md.write_text(text)
        bench.emit({"kind": "end", "md": str(md)})
        print("\n" + text, flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    sys.exit(main())
