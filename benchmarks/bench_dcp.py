"""``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through ``tierckpt.dcp`` against the same calls with
DCP's ``FileSystemWriter`` / ``FileSystemReader`` (and its ``DefaultStager``), on one disk, in one run.

One process, one rank (no process group): the ``llm`` state of ``--size``. Each repeat runs every save
once, in turn (so load from other processes on the machine falls on all of them alike):

* ``save``: ``dcp.save`` until it returns (both durable on the disk: DCP fsyncs its files; tierckpt's
  hierarchy is one ``local`` tier, committed);
* ``async``: ``dcp.async_save``, *blocked* = until it returns (training may change the state then),
  *total* = until its future resolves; DCP's own writer with its default staging (a new ``DefaultStager``
  per call, what ``async_save`` does unless given one) and with one ``DefaultStager`` kept across saves,
  tierckpt's writer with ``HierarchyStager`` kept across saves;
* ``load``: a restart: a new process (its interpreter start not counted), the page cache emptied first
  (``drop_caches`` as root, else ``posix_fadvise``), ``dcp.load`` into a state of zeroed tensors (for
  tierckpt: opening the hierarchy, read-only, counted, and reported apart), checked bit-exact; tierckpt's
  ``.pyc`` files are written first, as an install has them (torch's are); where ``fio`` is installed,
  each repeat also times fio reading the step's blobs cold (O_DIRECT, io_uring, QD16): the device's
  limit, so the load speedup DCP's own load leaves room for is ``load:dcp / load:fio-raw``.

``--threads 1`` runs every process with one torch thread: torch's ``copy_`` (DCP's staging and reads)
then does not wait on its thread pool, which on a machine whose cores are busy costs DCP seconds.

Figures are medians over ``--repeats``; ratios are of those medians (``docs/benchmarks.md``, "DCP backend").

    python benchmarks/bench_dcp.py --dir /var/tmp/bench-dcp --size 400MiB --repeats 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import tierckpt
from tierckpt import Hierarchy
from tierckpt.bench.rawio import fio_available, run_fio
from tierckpt.bench.system import make_cold
from tierckpt.bench.workloads import llm_dims_for, make_llm_state, same_state, state_bytes, zeros_like_state
from tierckpt.configvalues import parse_size
from tierckpt.dcp import HierarchyReader, HierarchyStager, HierarchyWriter

warnings.simplefilter("ignore")  # DCP's deprecation and single-process warnings


def _config(root: Path) -> dict[str, Any]:
    return {"tiers": [{"name": "ssd", "kind": "local", "path": str(root / "tierckpt")}], "policy": {"keep": {"ssd": 2}}}


def _state(size: int) -> dict[str, Any]:
    torch.manual_seed(0)  # the state holds the global RNG's state: the same in every process
    return {"model": make_llm_state(llm_dims_for(size))}


def _save(sd: Any, writer: Any) -> float:
    """Seconds of one ``dcp.save``."""
    t = time.perf_counter()
    dcp.save(sd, storage_writer=writer)
    return time.perf_counter() - t


def _async(sd: Any, **kw: Any) -> tuple[float, float]:
    """(blocked, total) seconds of one ``dcp.async_save``."""
    t = time.perf_counter()
    fut = dcp.async_save(sd, **kw)
    blocked = time.perf_counter() - t
    assert isinstance(fut, Future)  # stagers that stage on the caller's thread: the save's future
    fut.result()
    return blocked, time.perf_counter() - t


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def run_saves(root: Path, sd: Any, repeats: int) -> tuple[dict[str, list[float]], int]:
    """Every save, ``repeats`` times in turn; the times, and the last tierckpt step."""
    out: dict[str, list[float]] = {}
    kept_stager = DefaultStager(StagingOptions(False, False, False, False))  # async_save's default options
    stager = HierarchyStager()
    step = 0
    with Hierarchy.from_config(_config(root)) as h:
        for r in range(repeats + 1):  # the first round warms up (buffers, the hierarchy's first save)
            got: dict[str, float] = {}
            got["save:dcp"] = _save(sd, dcp.FileSystemWriter(_fresh(root / "fs")))
            step += 1
            got["save:tierckpt"] = _save(sd, HierarchyWriter(h, step=step))
            w = dcp.FileSystemWriter(_fresh(root / "fs"))
            got["async-blocked:dcp"], got["async-total:dcp"] = _async(sd, storage_writer=w)
            w = dcp.FileSystemWriter(_fresh(root / "fs"))
            kw: dict[str, Any] = {"storage_writer": w, "async_stager": kept_stager}
            got["async-blocked:dcp-kept-stager"], got["async-total:dcp-kept-stager"] = _async(sd, **kw)
            step += 1
            kw = {"storage_writer": HierarchyWriter(h, step=step), "async_stager": stager}
            got["async-blocked:tierckpt"], got["async-total:tierckpt"] = _async(sd, **kw)
            if r:
                for k, v in got.items():
                    out.setdefault(k, []).append(v)
            print(f"round {r}{' (warm-up)' if not r else ''}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()))
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(_fresh(root / "fs")))  # what the loads read
    kept_stager.close()
    stager.close()
    return out, step


def compile_bytecode() -> str:
    """Write tierckpt's ``.pyc`` files, as an installed package has them (torch's are), so that a restart
    does not compile the modules it imports lazily (where ``PYTHONDONTWRITEBYTECODE`` is set, as on the
    project's machines, every process would): what is said of it, for the report."""
    pkg = Path(tierckpt.__file__).parent
    ok = compileall.compile_dir(str(pkg), quiet=2, workers=1)
    return "tierckpt's .pyc written" if ok else "tierckpt's .pyc not all written"


def raw_read_seconds(tier_dir: Path, step: int) -> float | None:
    """Seconds fio (O_DIRECT, io_uring, QD16, 16 MiB reads) takes to read step ``step``'s blob files, one
    after another, cold; None where fio fails or finds none."""
    total = 0.0
    blobs = sorted(tier_dir.glob(f"step-{step:012d}/rank-*/blob-*.bin"))
    if not blobs:
        return None
    for blob in blobs:
        gbps = run_fio(blob, blob.stat().st_size, "read")
        if gbps is None:
            return None
        total += blob.stat().st_size / (gbps * 1e9)
    return total


def run_loads(
    root: Path, size: int, step: int, repeats: int, threads: int | None
) -> tuple[dict[str, list[float]], str]:
    """``repeats`` restarts of each, in turn: a new process after the page cache is emptied."""
    out: dict[str, list[float]] = {}
    method = ""
    print(compile_bytecode())
    for _ in range(repeats):
        if fio_available():  # the device's own limit on these bytes, cold: no load can beat it
            make_cold([root])
            raw = raw_read_seconds(root / "tierckpt", step)
            if raw is not None:
                out.setdefault("load:fio-raw", []).append(raw)
                print(f"fio read of the step's blobs: {raw:.3f} s")
        for who in ("dcp", "tierckpt"):
            method = make_cold([root])
            cmd = [sys.executable, __file__, "--child-load", who, "--dir", str(root), "--size", str(size)]
            cmd += ["--step", str(step)] + (["--threads", str(threads)] if threads else [])
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"the {who} load failed:\n{res.stderr[-3000:]}")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            out.setdefault(f"load:{who}", []).append(got["seconds"])
            if who == "tierckpt":  # of which opening the hierarchy (its first in the process)
                out.setdefault("load-open:tierckpt", []).append(got["open"])
            print(f"load {who}: {got['seconds']:.3f} s, of which open {got['open']:.3f} s ({method})")
    return out, method


def child_load(who: str, root: Path, size: int, step: int) -> None:
    """One restart's load (in its own process): print its seconds as JSON; fail where it is not bit-exact."""
    want = _state(size)
    target = zeros_like_state(want)
    t = time.perf_counter()
    opened = 0.0
    if who == "dcp":
        dcp.load(target, storage_reader=dcp.FileSystemReader(root / "fs"))
    else:
        with Hierarchy.from_config(_config(root), readonly=True) as h:
            opened = time.perf_counter() - t
            dcp.load(target, storage_reader=HierarchyReader(h, step=step))
    seconds = time.perf_counter() - t
    if not same_state(target, want):
        raise SystemExit(f"{who}: the loaded state is not the saved one")
    print(json.dumps({"seconds": seconds, "open": opened}))


def report(times: dict[str, list[float]], nbytes: int, method: str, repeats: int) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "save speedup (dcp / tierckpt), target >= 1.3": med["save:dcp"] / med["save:tierckpt"],
        "staging blocked (tierckpt / dcp default), target <= 0.5": med["async-blocked:tierckpt"]
        / med["async-blocked:dcp"],
        "staging blocked (tierckpt / dcp kept stager)": med["async-blocked:tierckpt"]
        / med["async-blocked:dcp-kept-stager"],
        "async total (dcp / tierckpt)": med["async-total:dcp"] / med["async-total:tierckpt"],
        "load speedup (dcp / tierckpt), target >= 1.5": med["load:dcp"] / med["load:tierckpt"],
        "load bound (dcp / fio's raw read of the blobs): the most any load can reach": med["load:dcp"]
        / med["load:fio-raw"]
        if "load:fio-raw" in med
        else float("nan"),
        "load speedup, the hierarchy's opening left out": med["load:dcp"]
        / statistics.median(a - b for a, b in zip(times["load:tierckpt"], times["load-open:tierckpt"], strict=True)),
    }
    print(f"\nstate {nbytes / 2**20:.0f} MiB, medians of {repeats}, cold loads by {method}, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print("| measure | seconds | GB/s |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {nbytes / v / 1e9:.2f} |")
    print("\n| ratio | value |\n|---|---|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.2f} |")
    return {"bytes": nbytes, "repeats": repeats, "cold": method, "times": times, "medians": med, "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/bench-dcp"), help="scratch directory on the disk")
    p.add_argument("--size", default="400MiB", help="state size (the llm workload)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--threads", type=int, help="torch.set_num_threads in every process (default: torch's)")
    p.add_argument("--child-load", choices=("dcp", "tierckpt"), help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    size = parse_size(a.size, "--size")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.child_load:
        child_load(a.child_load, a.dir, size, a.step)
        return
    root = _fresh(a.dir)
    root.mkdir(parents=True)
    sd = _state(size)
    nbytes = state_bytes(sd)[0]
    try:
        saves, step = run_saves(root, sd, a.repeats)
        loads, method = run_loads(root, size, step, a.repeats, a.threads)
        out = report({**saves, **loads}, nbytes, method, a.repeats)
        out["torch_threads"] = torch.get_num_threads()
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
