"""The I/O study's experiment (arXiv 2512.24511) on each mount: how the write pattern sets a checkpoint's
throughput, with 1 and 4 ranks, saves and cold restores.

On each ``--dir`` (a mount each; ``--start-mounts`` adds a loopback CephFS and GlusterFS), for the ``llm``
and ``small`` workloads (their total size split over the ranks, each rank's tensors its own), every
variant of :mod:`tierckpt.bench.iostudy` (tierckpt sized from the detected geometry and from plain 4 KiB
facts, O_DIRECT and buffered; one write per tensor, buffered and O_DIRECT; a DataStates-LLM-style
stream; ``torch.save``; ``dcp.save`` with 1, 2 and 4 threads; TorchSnapshot) and fio with the same file
count and sizes (16 MiB sequential, QD16, io_uring, O_DIRECT and buffered, end_fsync):

* saves: all in one set of spawned gloo ranks, the variants interleaved (the order rotated every
  repeat), each durable (fsynced) before its time ends; wall time from the first rank's start to the
  last rank's end, after a barrier and a ``sync``;
* restores: every one in fresh processes, the page cache dropped before each (``drop_caches`` as root,
  else ``posix_fadvise(DONTNEED)``), into new tensors (DCP and TorchSnapshot into templates of zeros
  built before the timer), checked byte for byte; fio reads the files its write left.

GB/s are state bytes (10^9 B) over the median time; ratios are to fio's O_DIRECT rate on the same mount
in the same run. Writes ``iostudy.json``, ``iostudy.md`` and a PNG per mount to ``--out``.

    python benchmarks/bench_iostudy.py --dir /var/tmp --out /tmp/iostudy
    python benchmarks/bench_iostudy.py --start-mounts --dir /var/tmp --out /tmp/iostudy
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
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GB = 1e9
FIO = ("fio", "fio:buffered")


# -- one rank's state -----------------------------------------------------------------------------------------
def rank_state(wl: str, total: dict[str, float], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's tensors of workload ``wl``: its share of the total, its own values (seed = rank)."""
    from tierckpt.bench.peers_ext import flat_tensors
    from tierckpt.bench.workloads import llm_dims_for, make_llm_state, make_small_state

    if wl == "llm":
        return flat_tensors(make_llm_state(llm_dims_for(int(total["llm_bytes"] / world)), seed=rank))
    if wl == "small":
        return flat_tensors(make_small_state(int(total["small_count"]) // world, seed=rank))
    raise ValueError(f"unknown workload {wl!r} (llm, small)")


def _skip_reason(name: str, flat: dict[str, torch.Tensor]) -> str | None:
    odd = sum(1 for t in flat.values() if t.dtype == torch.bfloat16 and t.numel() % 2)
    if name == "torchsnapshot" and odd:  # see tierckpt.bench.peers_ext.TorchSnapshot
        return f"torchsnapshot 0.1.0 gets the size of bf16 tensors with an odd element count wrong ({odd} here)"
    return None


def run_fio(d: Path, world: int, per_rank: int, rw: str, direct: bool) -> float:
    """Seconds fio takes (its own rate) to write or read ``world`` files of ``per_rank`` bytes in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    size = -(-per_rank // (1 << 20)) * (1 << 20)
    cmd = ["fio", "--name=raw", f"--directory={d}", f"--rw={rw}", "--ioengine=io_uring", f"--direct={int(direct)}",
           "--iodepth=16", f"--bs={min(size, 16 << 20)}", f"--numjobs={world}", f"--size={size}", "--end_fsync=1",
           "--fallocate=posix", "--group_reporting", "--output-format=json"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
    return world * size / float(job["read" if rw == "read" else "write"]["bw_bytes"])


def save_job(rank: int, world: int, root: str, wl: str, total: dict[str, float], names: list[str],
             repeats: int) -> dict[str, Any]:  # fmt: skip
    """Every variant's saves, interleaved; the last repeat's checkpoints kept for the restores."""
    from bench_dist import _settle

    from tierckpt.bench.iostudy import make_variant
    from tierckpt.bench.system import files_under

    warnings.simplefilter("ignore")  # the peers' deprecation and experimental-feature warnings
    flat = rank_state(wl, total, rank, world)
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(flat), "t": {}, "files": {}, "info": {}, "skipped": {}}
    vs = {}
    for n in names:
        why = _skip_reason(n, flat)
        if why is None:
            try:
                vs[n] = make_variant(n, Path(root), rank, world)
            except (ImportError, RuntimeError) as e:
                why = f"{type(e).__name__}: {e}"
        if why is not None:
            out["skipped"][n] = why
    for n, v in vs.items():  # warm-up: staging buffers, engines, first-call imports
        if n.startswith(("tierckpt", "datastates", "dcp-t1")):
            v.save(flat, -1)
            _settle()
            v.discard(-1)
    order = [*vs, *FIO]
    for rep in range(repeats):
        k = rep % len(order)
        for n in order[k:] + order[:k]:
            _settle()
            if n in FIO:
                secs = 0.0
                if rank == 0:
                    d = Path(root) / n.replace(":", "-")
                    shutil.rmtree(d, ignore_errors=True)
                    secs = run_fio(d, world, nbytes, "write", direct=n == "fio")
                dist.barrier()
                out["t"].setdefault(n, []).append((0.0, secs))
                continue
            dist.barrier()
            t0 = time.time()
            vs[n].save(flat, rep)
            out["t"].setdefault(n, []).append((t0, time.time()))
            dist.barrier()
            if rep == 0 and rank == 0:
                fs = files_under(vs[n].checkpoint_paths(rep))
                out["files"][n] = len(fs)
            dist.barrier()  # counted before any rank deletes its part
            if rep < repeats - 1:
                vs[n].discard(rep)
    for n, v in vs.items():
        out["info"][n] = v.info()
        v.close()
    return out


def restore_job(rank: int, world: int, root: str, wl: str, total: dict[str, float], name: str,
                rep: int) -> dict[str, Any]:  # fmt: skip
    """One cold restore of ``name``'s checkpoint ``rep`` into new tensors, checked."""
    from tierckpt.bench.iostudy import make_variant
    from tierckpt.bench.workloads import same_state

    warnings.simplefilter("ignore")
    like = rank_state(wl, total, rank, world)
    v = make_variant(name, Path(root), rank, world)
    dist.barrier()
    t0 = time.time()
    got = v.restore(rep, like)
    t1 = time.time()
    ok = same_state(like, got)
    v.close()
    return {"t": (t0, t1), "ok": ok}


# -- one mount ---------------------------------------------------------------------------------------------------
def run_case(root: Path, wl: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Saves and cold restores of every variant of ``wl`` on ``world`` ranks below ``root``."""
    from bench_dist import span, spawn

    from tierckpt.bench.system import make_cold

    total = {"llm_bytes": args.llm_gb * GB, "small_count": args.small_count}
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    saves = spawn(world, save_job, str(root), wl, total, args.variants, args.repeats, limit=3600)
    s0 = saves[0]
    res: dict[str, Any] = {"bytes": sum(r["bytes"] for r in saves), "tensors": sum(r["tensors"] for r in saves),
                           "files": s0["files"], "info": s0["info"], "skipped": s0["skipped"], "save": {},
                           "restore": {}, "cold": set()}  # fmt: skip
    for n in s0["t"]:
        runs = [[r["t"][n][i] for r in saves] for i in range(args.repeats)]
        res["save"][n] = [x[0][1] if n in FIO else span(x) for x in runs]
    print(f"  saves ({wl}, {world} ranks): " + ", ".join(f"{n} {statistics.median(t):.2f}s"
          for n, t in res["save"].items()), flush=True)  # fmt: skip
    names = _restore_names(list(s0["t"]), args.restores)
    last = args.repeats - 1
    for rep in range(args.repeats):
        k = rep % (len(names) + 1)
        for n in [*names, "fio"][k:] + [*names, "fio"][:k]:
            res["cold"].add(make_cold([root]))
            if n == "fio":
                secs = run_fio(root / "fio", world, res["bytes"] // world, "read", direct=True)
            else:
                got = spawn(world, restore_job, str(root), wl, total, n, last, limit=1800)
                if not all(g["ok"] for g in got):
                    raise RuntimeError(f"{n}: the restored tensors differ from the saved ones")
                secs = span([g["t"] for g in got])
            res["restore"].setdefault("dcp.load" if n.startswith("dcp-t") else n, []).append(secs)
            print(f"  restore {n} ({wl}, {world} ranks): {secs:.2f}s", flush=True)
    res["cold"] = sorted(res["cold"])
    shutil.rmtree(root, ignore_errors=True)
    return res


def _restore_names(saved: list[str], wanted: list[str] | None) -> list[str]:
    """The variants to restore: ``wanted`` (default: every one saved), with ``dcp.load`` (or any ``dcp-tN``)
    read from one ``dcp-t`` checkpoint (``dcp.load`` has no thread count: the first saved of t1, t2, t4)."""
    dcps = sorted(n for n in saved if n.startswith("dcp-t"))
    out: list[str] = []
    for n in [n for n in saved if n not in FIO] if wanted is None else wanted:
        if n.startswith("dcp-t") or n == "dcp.load":
            if not dcps:
                raise SystemExit(f"--restores {n}: no dcp-t variant was saved (add one to --variants)")
            n = dcps[0]
        elif n not in saved:
            raise SystemExit(f"--restores {n}: not among the variants saved ({', '.join(saved)})")
        if n not in out:
            out.append(n)
    return out


def describe_mount(d: Path) -> dict[str, Any]:
    """The file system under ``d`` as tierckpt detects it."""
    from dataclasses import asdict

    from tierckpt.bench.system import _mount_of
    from tierckpt.io.fsutil import probe_fs

    f = probe_fs(d, writable=True)
    fs = f.fs_type or _mount_of(d)[2]  # a probe that does not name the type yet: /proc/self/mounts's
    return {"path": str(d), "fs_type": fs, "family": f.family, "facts": asdict(f)}


def run_mount(d: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every case on the mount at ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    m = describe_mount(d)
    print(f"{d}: {m['fs_type']} ({m['family']})", flush=True)
    m["cases"] = {}
    for wl in args.workloads:
        for world in args.ranks:
            if f"{m['fs_type']}:{wl}/{world}" in args.skip:
                continue
            m["cases"][f"{wl}/{world}"] = run_case(d / "bench-iostudy", wl, world, args)
    return m


@contextlib.contextmanager
def started_mounts(base: Path, memstore_gb: float, which: list[str]) -> Any:
    """A loopback CephFS (its OSD's memstore of ``memstore_gb``) and GlusterFS (a brick on ``base``'s disk)
    (tierckpt.testing.clusters), unmounted and stopped afterwards."""
    from tierckpt.testing.clusters import CephCluster, GlusterVolume

    with contextlib.ExitStack() as stack:
        mounts = []
        if "ceph" in which:
            ceph = CephCluster(base / "ceph", memstore_bytes=int(memstore_gb * (1 << 30)))
            mounts.append(Path(stack.enter_context(ceph.start(cephfs=base / "cephfs")).mount))
        if "gluster" in which:
            mounts.append(Path(stack.enter_context(GlusterVolume(base / "gluster").start(base / "gfs")).mount))
        yield mounts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tierckpt.bench.iostudy import VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, action="append", default=[], help="a mount to measure on (repeatable)")
    ap.add_argument(
        "--start-mounts",
        nargs="*",
        choices=["ceph", "gluster"],
        help="also start and measure a loopback CephFS and GlusterFS (or the one named)",
    )
    ap.add_argument("--mounts-base", type=Path, default=Path("/var/tmp/bench-iostudy-clusters"))
    ap.add_argument("--memstore-gib", type=float, default=5.0, help="the Ceph OSD's memstore (RAM), GiB")
    ap.add_argument("--workloads", nargs="+", default=["llm", "small"], choices=["llm", "small"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--restores", nargs="+", choices=[*VARIANTS, "dcp.load"],
                    help="restore only these (default: all saved; dcp.load or any dcp-tN: dcp.load once)")  # fmt: skip
    ap.add_argument("--skip", nargs="+", default=[], help="cases to leave out, as FSTYPE:WORKLOAD/RANKS")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llm-gb", type=float, default=1.0, help="the llm state's total size, all ranks (GB)")
    ap.add_argument("--small-count", type=int, default=20000, help="the small workload's tensors, all ranks")
    ap.add_argument("--out", type=Path, default=Path("/tmp/iostudy"), help="folder for the JSON, tables and PNGs")
    args = ap.parse_args(argv)
    if not args.dir and args.start_mounts is None:
        ap.error("give --dir PATH and/or --start-mounts")
    return args


def main(argv: list[str] | None = None) -> int:
    from iostudy_report import plot_mount, report

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    mounts = []
    with contextlib.ExitStack() as stack:
        dirs = list(args.dir)
        if args.start_mounts is not None:
            which = args.start_mounts or ["ceph", "gluster"]
            dirs += stack.enter_context(started_mounts(args.mounts_base, args.memstore_gib, which))
        for d in dirs:
            mounts.append(run_mount(d, args))
    info = {"date": started, "argv": sys.argv[1:], "cpus": os.cpu_count(), "mounts": mounts,
            "repeats": args.repeats}  # fmt: skip
    (args.out / "iostudy.json").write_text(json.dumps(info, indent=1, default=str))
    text = report(info)
    (args.out / "iostudy.md").write_text(text)
    print(text)
    for i, m in enumerate(mounts):
        plot_mount(m, args.out / f"iostudy-{i}-{m['fs_type'].replace('.', '-')}.png")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks import this module as bench_iostudy
    import bench_iostudy

    sys.exit(bench_iostudy.main())
