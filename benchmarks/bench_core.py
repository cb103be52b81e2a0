"""Core save/restore benchmark: tierckpt vs torch.save/torch.load vs the raw O_DIRECT limit of the disk.

Usage::

    python benchmarks/bench_core.py [--quick] [--out DIR] [--repeats 3] [--dir SCRATCH]

Two workloads, each measured in the same run (operations interleaved per repeat, order rotated):

* ``llm``: a LLaMA-style training state (embedding, transformer layers, final norm, lm_head; bf16
  params, fp32 master weights, Adam ``exp_avg``/``exp_avg_sq``, step counters, RNG state), ~1.6 GB;
* ``small``: 20,000 tensors of 1-64 KiB (random sizes, mixed dtypes), ~650 MB.

For each: tierckpt save to a hierarchy with only a ``local`` tier (returns after fsync + rename),
tierckpt restore with a cold page cache (into new tensors; ``restore-into``: into a live state made by
``torch.zeros_like``; ``restore-into-aligned``: into one whose tensors are page-aligned, which O_DIRECT
can read straight into), ``torch.save`` + fsync and ``torch.load(weights_only=True)`` cold, and the raw limit: one aligned buffer of the same size written with O_DIRECT + posix_fallocate +
fsync and read back with O_DIRECT. GB/s are state bytes (10^9 B) per second of wall time. fio, when
installed, runs the same sizes as an outside reference. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

import tierckpt
from tierckpt import Hierarchy
from tierckpt.bench.rawio import raw_read_engine, raw_read_pread, raw_write_engine, raw_write_pwrite, run_fio
from tierckpt.bench.system import machine_info, make_cold
from tierckpt.bench.system import read_text as _read
from tierckpt.bench.workloads import (
    LLM_FULL,
    LLM_QUICK,
    like_state,
    make_llm_state,
    make_small_state,
    same_state,
    state_bytes,
)
from tierckpt.io.buffers import aligned_empty
from tierckpt.io.engine import IOEngine, make_engine

GB = 1e9
MiB = 1 << 20
RAW_CHUNK = 64 * MiB
FRESH = "raw-fresh:"  # reference only: a raw read into never-touched memory (pays the page faults)
ALIGN = 4096

# Targets (medians, same run): tierckpt as a fraction of raw, and restore vs torch.load.
TARGET_SAVE = 0.85
TARGET_SAVE_SMALL = 0.75
TARGET_RESTORE = 0.85
TARGET_RESTORE_VS_TORCH = 1.2


def _zeros_page_aligned(t: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor like ``t`` at a page-aligned address (as torch allocates with
    ``THP_MEM_ALLOC_ENABLE=1`` from 2 MiB on), so that O_DIRECT may read straight into it."""
    out = aligned_empty(max(1, t.numel() * t.element_size()), ALIGN, pin=False)[: t.numel() * t.element_size()]
    return out.view(t.dtype).view(t.shape).zero_()


# -- measurement ---------------------------------------------------------------------------------------
@dataclass
class Series:
    workload: str
    op: str  # save | restore
    impl: str  # tierckpt | torch | raw:<variant>
    nbytes: int
    secs: list[float] = field(default_factory=list)

    def gbps(self, which: str = "median") -> float:
        t = statistics.median(self.secs) if which == "median" else min(self.secs)
        return self.nbytes / t / GB


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: Path, out: Path) -> None:
        self.args, self.scratch, self.out = args, scratch, out
        self.series: dict[tuple[str, str, str], Series] = {}
        self.cold_methods: set[str] = set()
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.jsonl = out / f"bench_core-{self.stamp}.jsonl"
        self.fio: dict[tuple[str, str], list[float]] = {}
        self.live: dict[str, Any] = {}  # per workload: the state restore(into=) writes into

    def emit(self, rec: dict[str, Any]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def record(self, workload: str, op: str, impl: str, nbytes: int, rep: int, secs: float, **extra: Any) -> None:
        s = self.series.setdefault((workload, op, impl), Series(workload, op, impl, nbytes))
        s.secs.append(secs)
        rec = {"kind": "sample", "workload": workload, "op": op, "impl": impl, "repeat": rep, "bytes": nbytes}
        rec |= {"secs": round(secs, 6), "gbps": round(nbytes / secs / GB, 4), **extra}
        self.emit(rec)
        print(f"  [{workload} r{rep}] {impl:>14} {op:<7} {secs:7.3f} s  {nbytes / secs / GB:6.3f} GB/s", flush=True)

    def cold(self, paths: list[Path]) -> str:
        m = make_cold(paths)
        self.cold_methods.add(m)
        return m

    def quiet(self) -> None:
        """Settle before a timed write: write back dirty pages, free garbage."""
        gc.collect()
        os.sync()

    # one implementation's save + cold restore -------------------------------------------------------
    def run_tierckpt(self, wl: str, h: Hierarchy, state: Any, nbytes: int, rep: int, check: bool) -> None:
        step = rep
        self.quiet()
        t0 = time.perf_counter()
        h.save(state, step=step).wait()
        t1 = time.perf_counter()
        self.record(wl, "save", "tierckpt", nbytes, rep, t1 - t0)
        cold = self.cold([self.scratch / "tier"])
        t0 = time.perf_counter()
        restored = h.restore(step=step)
        t1 = time.perf_counter()
        self.record(wl, "restore", "tierckpt", nbytes, rep, t1 - t0, cold=cold)
        if check and not same_state(state, restored):
            raise AssertionError(f"{wl}: tierckpt restore differs from the saved state")
        del restored
        # live states to restore into: allocated and written, like a built model's; the second with every
        # tensor at a page-aligned address, which O_DIRECT may read straight into (docs/restore.md)
        for op, make in (("restore-into", torch.zeros_like), ("restore-into-aligned", _zeros_page_aligned)):
            target = self.live.get(f"{wl}:{op}")
            if target is None:
                target = self.live[f"{wl}:{op}"] = like_state(state, make)
            cold = self.cold([self.scratch / "tier"])
            t0 = time.perf_counter()
            h.restore(step=step, into=target)
            t1 = time.perf_counter()
            self.record(wl, op, "tierckpt", nbytes, rep, t1 - t0, cold=cold)
            if check and not same_state(state, target):
                raise AssertionError(f"{wl}: tierckpt {op} differs from the saved state")
        h.tier("local").evict(tierckpt.CheckpointKey(step, h.rank))

    def run_torch(self, wl: str, state: Any, nbytes: int, rep: int, check: bool) -> None:
        path = self.scratch / "torch.pt"
        self.quiet()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        t1 = time.perf_counter()
        self.record(wl, "save", "torch", nbytes, rep, t1 - t0, file_bytes=path.stat().st_size)
        cold = self.cold([path])
        t0 = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        t1 = time.perf_counter()
        self.record(wl, "restore", "torch", nbytes, rep, t1 - t0, cold=cold)
        if check and not same_state(state, loaded):
            raise AssertionError(f"{wl}: torch.load differs from the saved state")
        del loaded
        path.unlink()

    def run_raw(self, wl: str, engine: IOEngine, wbuf: torch.Tensor, rbuf: torch.Tensor, nbytes: int, rep: int) -> None:
        """Both raw variants (os.pwrite/os.preadv, 64 MiB, one at a time; the engine, 64 MiB at its depth),
        reading into a buffer faulted in beforehand; then an engine read into fresh memory (reference)."""
        n = -(-nbytes // ALIGN) * ALIGN
        variants: list[tuple[str, Callable[[Path], None], Callable[[Path], None]]] = [
            ("pwrite", lambda p: raw_write_pwrite(p, wbuf, n), lambda p: raw_read_pread(p, rbuf, n)),
            (
                engine.name,
                lambda p: raw_write_engine(engine, p, wbuf, n),
                lambda p: raw_read_engine(engine, p, rbuf, n),
            ),
        ]
        if rep % 2:
            variants.reverse()
        for name, write, read in variants:
            path = self.scratch / f"raw-{name}.bin"
            self.quiet()
            t0 = time.perf_counter()
            write(path)
            t1 = time.perf_counter()
            self.record(wl, "save", f"raw:{name}", nbytes, rep, t1 - t0)
            cold = self.cold([path])
            t0 = time.perf_counter()
            read(path)
            t1 = time.perf_counter()
            self.record(wl, "restore", f"raw:{name}", nbytes, rep, t1 - t0, cold=cold)
            if name == engine.name:
                cold = self.cold([path])
                t0 = time.perf_counter()
                fresh = aligned_empty(n, ALIGN, pin=False)  # untouched pages: the read faults them in
                raw_read_engine(engine, path, fresh, n)
                t1 = time.perf_counter()
                del fresh
                self.record(wl, "restore", f"{FRESH}{name}", nbytes, rep, t1 - t0, cold=cold)
            path.unlink()

    def workload(self, wl: str, state: Any, h: Hierarchy, engine: IOEngine) -> None:
        nbytes, ntensors = state_bytes(state)
        print(f"\n== workload {wl}: {ntensors} tensors, {nbytes / GB:.3f} GB of tensor bytes", flush=True)
        self.emit({"kind": "workload", "workload": wl, "bytes": nbytes, "tensors": ntensors})
        n = -(-nbytes // ALIGN) * ALIGN
        wbuf = aligned_empty(n, ALIGN, pin=False)
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1), out=wbuf)
        rbuf = aligned_empty(n, ALIGN, pin=False)
        rbuf.fill_(0)  # fault the pages in once: the raw read measures the disk, not the allocator
        runs: list[Callable[[int], None]] = [
            partial(self.run_raw, wl, engine, wbuf, rbuf, nbytes),
            lambda r: self.run_tierckpt(wl, h, state, nbytes, r, check=r == 0),
            lambda r: self.run_torch(wl, state, nbytes, r, check=r == 0 and self.args.quick),
        ]
        for rep in range(self.args.repeats):
            k = rep % len(runs)
            for run in runs[k:] + runs[:k]:  # rotate the order so drift hits every implementation
                run(rep)
        runs.clear()
        del wbuf, rbuf
        if not self.args.no_fio and shutil.which("fio"):
            path = self.scratch / "fio.dat"
            for _ in range(self.args.repeats):
                for rw in ("write", "read"):
                    if rw == "write":
                        path.unlink(missing_ok=True)  # a fresh file, like every other writer here
                    self.quiet()
                    if rw == "read":
                        self.cold([path])
                    g = run_fio(path, n, rw)
                    if g is not None:
                        self.fio.setdefault((wl, rw), []).append(g)
                        self.emit({"kind": "fio", "workload": wl, "rw": rw, "bytes": n, "gbps": round(g, 4)})
                        print(f"  [{wl}] fio 16M QD16 {rw:<5} {g:6.3f} GB/s", flush=True)
            path.unlink(missing_ok=True)

    # reporting ---------------------------------------------------------------------------------------
    def raw_best(self, wl: str, op: str) -> Series | None:
        cands = [s for (w, o, i), s in self.series.items() if w == wl and o == op and i.startswith("raw:")]
        return max(cands, key=lambda s: s.gbps("median"), default=None)

    def table(self, which: str) -> tuple[str, list[dict[str, Any]]]:
        label = "median" if which == "median" else "best (min time)"
        lines = [
            f"| workload | op | tierckpt GB/s | torch GB/s | raw GB/s | tierckpt/raw % | tierckpt/torch × |  ({label})",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        lines[0] = lines[0].rsplit("  (", 1)[0]
        rows: list[dict[str, Any]] = []
        for wl in dict.fromkeys(w for w, _, _ in self.series):
            for op in ("save", "restore", "restore-into", "restore-into-aligned"):
                tc = self.series.get((wl, op, "tierckpt"))
                ref = "restore" if op.startswith("restore") else op  # torch.load has no in-place mode
                tt = self.series.get((wl, ref, "torch"))
                raw = self.raw_best(wl, ref)
                if tc is None or tt is None or raw is None:
                    continue
                a, b, c = tc.gbps(which), tt.gbps(which), raw.gbps(which)
                raw_name = raw.impl.split(":", 1)[1]
                lines.append(
                    f"| {wl} | {op} | {a:.2f} | {b:.2f} | {c:.2f} ({raw_name}) | {100 * a / c:.0f} % | {a / b:.2f} |"
                )
                rows.append(
                    {"workload": wl, "op": op, "stat": which, "tierckpt_gbps": round(a, 4), "torch_gbps": round(b, 4),
                     "raw_gbps": round(c, 4), "raw_variant": raw_name, "tierckpt_over_raw": round(a / c, 4),
                     "tierckpt_over_torch": round(a / b, 4)}
                )  # fmt: skip
        return "\n".join(lines), rows

    def targets(self, rows: list[dict[str, Any]]) -> list[str]:
        out = []
        for r in rows:
            if r["op"] == "save":
                goal = TARGET_SAVE_SMALL if r["workload"] == "small" else TARGET_SAVE
                ok = r["tierckpt_over_raw"] >= goal
                out.append(f"{r['workload']} save >= {goal:.0%} of raw write: {r['tierckpt_over_raw']:.0%} {_ok(ok)}")
            else:
                ok1 = r["tierckpt_over_raw"] >= TARGET_RESTORE
                ok2 = r["tierckpt_over_torch"] >= TARGET_RESTORE_VS_TORCH
                out.append(
                    f"{r['workload']} {r['op']} >= {TARGET_RESTORE:.0%} of raw read: {r['tierckpt_over_raw']:.0%} {_ok(ok1)}; "
                    f">= {TARGET_RESTORE_VS_TORCH}x torch.load: {r['tierckpt_over_torch']:.2f}x {_ok(ok2)}"
                )
        return out

    def report(self, info: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        """The markdown summary (tables, raw variants, fio, targets) and the summary rows for JSON."""
        med, med_rows = self.table("median")
        best, best_rows = self.table("min")
        cold = ", ".join(sorted(self.cold_methods)) or "-"
        lines = [
            f"## Results ({self.args.repeats} repeats, cold reads via {cold})",
            "",
            f"{info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB, Linux {info['kernel']}, {info['fs']} on "
            f"{info['device']} ({info['mount_opts']}); tierckpt engine {info['engine']} (backend {info['backend']}), "
            f"O_DIRECT {info['direct']}, QD {info['queue_depth']}, chunk {info['chunk_bytes'] >> 20} MiB; "
            f"torch {info['torch']}, Python {info['python']}; tierckpt from {info['tierckpt_src']}",
            "",
            "Medians:",
            "",
            med,
            "",
            "Best (min time):",
            "",
            best,
            "",
            "Raw variants (the raw column takes the faster median; raw-fresh is a reference, not a limit):",
            "",
        ]
        lines += [
            f"* {s.workload} {s.op} {s.impl}: median {s.gbps():.2f}, best {s.gbps('min'):.2f} GB/s"
            for s in self.series.values()
            if s.impl.startswith(("raw:", FRESH))
        ]
        if self.fio:
            lines += ["", "fio (16 MiB, QD16, io_uring, O_DIRECT, fallocate, end_fsync), GB/s:", ""]
            lines += [
                f"* {wl} {rw}: median {statistics.median(v):.2f}, best {max(v):.2f}" for (wl, rw), v in self.fio.items()
            ]
        if "fadvise" in self.cold_methods:
            lines += ["", "NOTE: drop_caches was not writable; cold reads used posix_fadvise(DONTNEED) on every file."]
        lines += ["", "Targets (medians):", ""] + [f"* {t}" for t in self.targets(med_rows)]
        return "\n".join(lines), med_rows + best_rows


def _ok(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, well under 2 minutes)")
    ap.add_argument("--out", default="bench-results", help="folder for the JSON lines (default bench-results/)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir under /tmp); removed at the end")
    ap.add_argument("--workloads", default="llm,small", help="comma-separated subset of llm,small")
    ap.add_argument("--no-fio", action="store_true", help="skip the fio reference even if fio is installed")
    ap.add_argument("--queue-depth", type=int, default=None, help="tierckpt io.queue_depth (default: library's)")
    ap.add_argument("--chunk", default=None, help="tierckpt io.chunk, e.g. 64MiB (default: library's)")
    ap.add_argument("--engine", default=None, help="tierckpt io.engine: auto, uring or threads (default: library's)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    bad = set(args.workloads.split(",")) - {"llm", "small"}
    if bad:
        ap.error(f"--workloads: unknown {sorted(bad)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tierckpt-bench-", dir=args.dir or "/tmp"))
    io_cfg: dict[str, Any] = {}
    if args.queue_depth is not None:
        io_cfg["queue_depth"] = args.queue_depth
    if args.chunk is not None:
        io_cfg["chunk"] = args.chunk
    if args.engine is not None:
        io_cfg["engine"] = args.engine
    cfg: dict[str, Any] = {"tiers": [{"name": "local", "kind": "local", "path": str(scratch / "tier")}]}
    if io_cfg:
        cfg["io"] = io_cfg
    t_start = time.perf_counter()
    try:
        h = Hierarchy.from_config(cfg)
        engine = make_engine("auto", h.io.queue_depth)
        bench = Bench(args, scratch, out)
        info = machine_info(scratch, h)
        bench.emit({"kind": "machine", "argv": sys.argv, "quick": args.quick, "repeats": args.repeats, **info})
        print("machine:", json.dumps(info, indent=1), flush=True)
        try:
            wls = args.workloads.split(",")
            if "llm" in wls:
                bench.workload("llm", make_llm_state(LLM_QUICK if args.quick else LLM_FULL), h, engine)
                gc.collect()
            if "small" in wls:
                bench.workload("small", make_small_state(2000 if args.quick else 20_000), h, engine)
                gc.collect()
        finally:
            h.close()
            engine.close()
        text, rows = bench.report(info)
        print("\n" + text)
        bench.jsonl.with_suffix(".md").write_text(text + "\n")
        for r in rows:
            bench.emit({"kind": "summary", **r})
        bench.emit(
            {"kind": "end", "cold": sorted(bench.cold_methods), "wall_secs": round(time.perf_counter() - t_start, 1),
             "loadavg_end": _read("/proc/loadavg"), "fio": {f"{w}:{rw}": v for (w, rw), v in bench.fio.items()}}
        )  # fmt: skip
        print(f"\nJSON lines: {bench.jsonl} (summary: {bench.jsonl.with_suffix('.md')})")
        print(f"wall {time.perf_counter() - t_start:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
