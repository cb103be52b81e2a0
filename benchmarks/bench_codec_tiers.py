"""Compression on the slow tiers (issue 30): a demotion and a restart's restore, with and without ``compress``.

Usage::

    python benchmarks/bench_codec_tiers.py --dir /var/tmp/bct                       # throttled + plain local disk
    python benchmarks/bench_codec_tiers.py --dir /var/tmp/bct --targets cephfs,s3   # a loopback Ceph (root)
    python benchmarks/bench_codec_tiers.py --quick                                  # 128 MiB, one repeat
    python benchmarks/bench_codec_tiers.py --copies 8 --targets local,cephfs        # a training job's steady state
    python benchmarks/bench_codec_tiers.py --copies 4 --targets local --measured kept  # a restarted job's first copy

For each target tier and each ``--modes`` setting of its ``compress:`` (``none``, ``auto``, ``zstd``), in
rotated order per repeat: a host → target hierarchy saves the ``llm`` state (tierckpt/bench/workloads.py)
into host memory (waited for: not timed), then the **demotion** is timed from the host copy's commit to
the target's. The hierarchy is closed, the page cache dropped (root; else the figure says so), and a new
process opens the target alone and times ``restore(step)`` (the **restore as a restart**: a fresh process,
cold cache, memory not yet faulted in). Each target first gets one untimed demotion (a fresh radosgw
or MDS is slow at first). Targets:

* ``throttled``: a ``local`` tier under ``--dir`` with ``io: {bandwidth: --budget, throttle: all}``
  (restores are paced too): a deterministic slow tier;
* ``local``: the same directory, unthrottled (``auto`` should decide not to compress);
* ``cephfs``: a ``pfs`` tier on a loopback CephFS (ceph-fuse, memstore OSD) this script starts;
* ``s3``: an ``s3`` tier on the same cluster's radosgw.

With ``--copies N`` (N ≥ 2) the script measures what a training job sees instead: per target, one
hierarchy per mode, each on its own directory or prefix, all open at once; ``N`` saves through each,
the modes interleaved (rotated order per copy), each demotion timed as above (no restores). ``auto``'s
decisions carry from copy to copy as in a job, so the first copy (sampling, learning the tier) and the
later ones (what it then decided) are reported apart: the first copy's time and the median of the
others, each against ``none``. ``--repeats`` repeats the whole series with fresh hierarchies.

What ``auto`` measured is kept across processes (docs/tiers.md, "Compression"). By default
(``--measured fresh``) nothing is kept or read: every hierarchy learns from nothing, and "first copy" is
a new job's first. With ``--measured kept`` the run keeps measurements in a cache directory of its own
(under ``--dir``), each target first gets one untimed ``auto`` demotion (the job's previous run), and
each timed hierarchy starts from what the ones before it kept: "first copy" is a restarted job's first.
Each row says whether its ``auto`` started from kept measurements (``started_from_saved``).

Prints a markdown table (medians over ``--repeats``, ratios against ``none`` of the same target measured
in the same run) and writes JSON lines to ``--out``. See docs/benchmarks.md, "Compression on slow tiers".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy
from tierckpt.bench.system import machine_info
from tierckpt.bench.workloads import llm_dims_for, make_llm_state, state_bytes
from tierckpt.configvalues import parse_rate, parse_size

TARGETS = ("throttled", "local", "cephfs", "s3")
MODES = ("none", "auto", "zstd")
MB = 1e6


def _drop_caches() -> bool:
    """Write back and drop the page cache (root only); whether it was dropped."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def target_tier(target: str, mode: str, where: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The target's tier entry (YAML schema) with ``compress: mode``."""
    entry: dict[str, Any] = {"name": "slow", "compress": mode}
    sub = f"/{mode}" if args.copies > 1 else ""  # one tier per mode when their hierarchies are open at once
    if target in ("throttled", "local"):
        entry.update(kind="local", path=str(where["dir"] / "tier") + sub)
        if target == "throttled":
            entry["io"] = {"bandwidth": args.budget, "throttle": "all"}
    elif target == "cephfs":
        entry.update(kind="pfs", path=str(where["cephfs"] / "tier") + sub)
    else:
        entry.update(
            kind="s3",
            path=f"s3://{where['bucket']}/run{sub}",
            options={"endpoint_url": where["endpoint"], "create_bucket": True, "sweep": False},
        )
    return entry


def config(target: str, mode: str, where: dict[str, Any], args: argparse.Namespace, host: bool) -> dict[str, Any]:
    tiers = [target_tier(target, mode, where, args)]
    if host:
        tiers.insert(0, {"name": "host", "kind": "host", "capacity": f"{2 * args.ckpt_bytes}B"})
    return {
        "tiers": tiers,
        "io": {"engine": args.engine, "chunk": args.chunk},
        "policy": {"keep": {t["name"]: 1 for t in tiers}},
    }


def demote(cfg: dict[str, Any], state: Any, step: int) -> dict[str, Any]:
    """Save into host memory, then time the demotion to the target; the tier's stored/raw bytes."""
    h = Hierarchy.from_config(cfg)
    try:
        return demote_in(h, state, step)
    finally:
        h.close()


def demote_in(h: Hierarchy, state: Any, step: int) -> dict[str, Any]:
    """:func:`demote` through an open hierarchy ``h`` (its ``auto`` keeps what it learnt before)."""
    adaptive = h.tier("slow").adaptive
    before = adaptive.snapshot() if adaptive is not None else {}
    kept = before.get("started_from_saved", False) if before.get("mode") == "auto" else None
    handle = h.save(state, step=step)
    handle.wait("host")
    t0 = time.perf_counter()
    handle.wait("slow")
    seconds = time.perf_counter() - t0
    info = _copy_info(h, step)
    if adaptive is not None:  # what auto's decisions rested on; what its codec writer wrote from where
        snap = adaptive.snapshot()
        info.update(bandwidth=snap["bandwidth_bytes_per_sec"], io_cpu=snap["io_cpu_seconds_per_byte"])
        for key in ("written_from_memory_bytes", "written_copied_bytes"):
            info[key] = snap[key] - before[key]
    return {"demote_s": seconds, "started_from_saved": kept, **info}


def _copy_info(h: Hierarchy, step: int) -> dict[str, Any]:
    """Raw and stored bytes of the step's copy on the target (from its manifest; stored = raw when plain)."""
    from tierckpt.datapath.manifests import load_head
    from tierckpt.tiers.base import CheckpointKey

    tier = h.tier("slow")
    head = load_head(tier, CheckpointKey(step))
    raw = sum(b.size for b in head.blobs)
    frames = getattr(head, "frames", None)
    stored = raw if frames is None else frames.stored_bytes()
    return {
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compressed_frames": 0 if frames is None else frames.compressed_frames(),
    }


def restore_child(cfg: dict[str, Any], step: int) -> dict[str, Any]:
    """``restore(step)`` from the target alone, in a new process: its wall time, as it measures it."""
    code = (
        "import json,sys,time;t=time.perf_counter();"
        "from tierckpt import Hierarchy;"
        "cfg=json.loads(sys.argv[1]);h=Hierarchy.from_config(cfg,readonly=True);"
        "t0=time.perf_counter();s=h.restore(int(sys.argv[2]));t1=time.perf_counter();h.close();"
        "print(json.dumps({'restore_s':t1-t0,'process_s':t1-t}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg), str(step)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def places(targets: list[str], base: Path, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The directories, mounts and endpoint the targets need (a loopback Ceph for cephfs/s3)."""
    where: dict[str, Any] = {"dir": base}
    with contextlib.ExitStack() as stack:
        if "cephfs" in targets or "s3" in targets:
            from tierckpt.testing.clusters import CephCluster, free_port

            held = 3 if args.copies <= 1 else 2 * len(args.modes.split(",")) + 1  # copies held at once
            mem = int(args.ckpt_bytes * held + (1 << 30))
            ceph = CephCluster(Path(tempfile.mkdtemp(prefix="bct-ceph-")), memstore_bytes=mem)
            cluster = stack.enter_context(
                ceph.start(
                    cephfs=base / "cephfs" if "cephfs" in targets else None,
                    rgw_port=free_port() if "s3" in targets else None,
                )
            )
            if "cephfs" in targets:
                where["cephfs"] = Path(cluster.mount)
            if "s3" in targets:
                os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = ceph.access_key, ceph.secret_key
                where.update(endpoint=ceph.s3_endpoint, bucket="tierckpt-codec-bench", ceph=ceph)
        yield where


def _s3_gc(where: dict[str, Any]) -> None:
    """Have radosgw free deleted objects now (a memstore OSD holds them in memory for two hours)."""
    conf = str(where["ceph"].conf)
    subprocess.run(["radosgw-admin", "-c", conf, "gc", "process", "--include-all"], check=False, capture_output=True)


def _clean(target: str, where: dict[str, Any]) -> None:
    """Remove the target's copies between measurements (the next one starts empty)."""
    if target == "s3":
        import boto3

        s3 = boto3.client("s3", endpoint_url=where["endpoint"], region_name="us-east-1")
        with contextlib.suppress(s3.exceptions.NoSuchBucket):
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=where["bucket"]):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    s3.delete_objects(Bucket=where["bucket"], Delete={"Objects": keys})
        _s3_gc(where)
        return
    root = where["cephfs"] if target == "cephfs" else where["dir"]
    shutil.rmtree(root / "tier", ignore_errors=True)


def series(
    target: str, modes: list[str], where: dict[str, Any], args: argparse.Namespace, state: Any, rep: int
) -> list[dict[str, Any]]:
    """``args.copies`` demotions through one hierarchy per mode, all open at once, modes interleaved."""
    _clean(target, where)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        hs = {m: Hierarchy.from_config(config(target, m, where, args, host=True)) for m in modes}
        for h in hs.values():
            stack.callback(h.close)
        for copy in range(args.copies):
            k = (copy + rep) % len(modes)
            for mode in modes[k:] + modes[:k]:
                rec: dict[str, Any] = {"target": target, "mode": mode, "repeat": rep, "copy": copy}
                rec.update(demote_in(hs[mode], state, step=1000 * (rep + 1) + copy))
                rows.append(rec)
                print(json.dumps(rec), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
            if target == "s3":  # the copy the policy dropped: freed before the next
                _s3_gc(where)
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    state = make_llm_state(llm_dims_for(args.ckpt_bytes))
    args.ckpt_bytes = state_bytes(state)[0]
    targets = args.targets.split(",")
    modes = args.modes.split(",")
    rows: list[dict[str, Any]] = []
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    with places(targets, base, args) as where:
        for target in targets:
            if args.warmup:  # a first demotion, untimed: a fresh radosgw or MDS is slow at first
                _clean(target, where)
                demote(config(target, "none", where, args, host=True), state, step=99)
            for mode in modes if args.measured == "kept" and "auto" in modes else ():  # the job's previous run
                if mode == "auto":
                    _clean(target, where)
                    demote(config(target, mode, where, args, host=True), state, step=98)
            for rep in range(args.repeats if args.copies > 1 else 0):
                rows += series(target, modes, where, args, state, rep)
            for rep in range(args.repeats if args.copies <= 1 else 0):
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for mode in order:
                    cfg = config(target, mode, where, args, host=True)
                    _clean(target, where)
                    rec: dict[str, Any] = {"target": target, "mode": mode, "repeat": rep}
                    rec.update(demote(cfg, state, step=100 + rep))
                    rec["cold_cache"] = _drop_caches()
                    rec.update(restore_child(config(target, mode, where, args, host=False), 100 + rep))
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(rec) + "\n")
            _clean(target, where)
    return rows


def table(rows: list[dict[str, Any]], ckpt_bytes: int) -> str:
    lines = [
        f"State: llm, {ckpt_bytes / MB:,.0f} MB. Medians; × none = against `none` on the same target in this run.",
        "",
        "| target | compress | ratio (raw / stored) | demote s | demote × none | restore s | restore × none |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]

        def med(mode: str, key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in mine if r["mode"] == mode)

        for mode in dict.fromkeys(r["mode"] for r in mine):
            ratio = med(mode, "raw_bytes") / max(1.0, med(mode, "stored_bytes"))
            d, rs = med(mode, "demote_s"), med(mode, "restore_s")
            dn = d / med("none", "demote_s") if any(r["mode"] == "none" for r in mine) else float("nan")
            rn = rs / med("none", "restore_s") if any(r["mode"] == "none" for r in mine) else float("nan")
            lines.append(f"| {target} | {mode} | {ratio:.3f} | {d:.2f} | {dn:.2f} | {rs:.2f} | {rn:.2f} |")
    return "\n".join(lines)


def steady_table(rows: list[dict[str, Any]], ckpt_bytes: int, copies: int) -> str:
    """First copy and the later copies' median per target and mode, against ``none``'s in the same run."""
    lines = [
        f"State: llm, {ckpt_bytes / MB:,.0f} MB; {copies} demotions through one hierarchy per mode, modes "
        "interleaved. first = the first copy (median over repeats); later = median of copies 2..N over "
        "repeats; × none = against `none` on the same target in this run.",
        "",
        "| target | compress | first s | first × none | later s | later × none | frames compressed (first / later) "
        "| MB copied (first / later) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]

        def med(mode: str, first: bool, key: str = "demote_s", mine: list[dict[str, Any]] = mine) -> float:
            vals = [r.get(key, 0.0) for r in mine if r["mode"] == mode and (r["copy"] == 0) == first]
            return statistics.median(vals) if vals else float("nan")

        for mode in dict.fromkeys(r["mode"] for r in mine):
            f, later = med(mode, True), med(mode, False)
            fn, ln = f / med("none", True), later / med("none", False)
            cf, cl = med(mode, True, "compressed_frames"), med(mode, False, "compressed_frames")
            mf, ml = (med(mode, first, "written_copied_bytes") / MB for first in (True, False))
            lines.append(
                f"| {target} | {mode} | {f:.2f} | {fn:.2f} | {later:.2f} | {ln:.2f} | {cf:.0f} / {cl:.0f} "
                f"| {mf:.0f} / {ml:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dir", default=None, help="a directory on the local disk (default: a fresh one in /var/tmp)")
    p.add_argument("--targets", default="throttled,local", help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--modes", default="none,auto", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--bytes", dest="ckpt_bytes", type=lambda v: parse_size(v, "--bytes"), default=1 << 30)
    p.add_argument("--budget", default="200MB/s", help="the throttled tier's bandwidth (io.bandwidth)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine", default="auto")
    p.add_argument("--chunk", default="16MiB")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="no untimed first demotion per target")
    p.add_argument("--copies", type=int, default=1, help="N > 1: N demotions through one hierarchy per mode")
    p.add_argument("--quick", action="store_true", help="128 MiB, one repeat")
    p.add_argument(
        "--measured",
        choices=("fresh", "kept"),
        default="fresh",
        help="fresh: auto learns from nothing in each hierarchy; kept: from what earlier ones kept (a restart)",
    )
    args = p.parse_args(argv)
    parse_rate(args.budget, "--budget")  # refused early when malformed
    if args.quick:
        args.ckpt_bytes, args.repeats = 128 << 20, 1
    bad = [t for t in args.targets.split(",") if t not in TARGETS] + [
        m for m in args.modes.split(",") if m not in MODES
    ]
    if args.copies < 1:
        bad.append(f"--copies {args.copies}")
    if bad:
        p.error(f"unknown target or mode: {', '.join(bad)}")
    made = args.dir is None
    if made:
        args.dir = tempfile.mkdtemp(prefix="bct-", dir="/var/tmp")
    if args.measured == "fresh":
        os.environ["TIERCKPT_NO_MEASURE_CACHE"] = "1"
    else:  # a cache of this run's own: nothing from an earlier run or the user's
        cache = Path(args.dir) / "measured-cache"
        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop("TIERCKPT_NO_MEASURE_CACHE", None)
        os.environ["TIERCKPT_CACHE_DIR"] = str(cache)
    try:
        print(json.dumps({"machine": machine_info(Path(args.dir))}), flush=True)
        rows = run(args)
        print(f"auto's measurements: {args.measured} (--measured)")
        print(table(rows, args.ckpt_bytes) if args.copies <= 1 else steady_table(rows, args.ckpt_bytes, args.copies))
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
