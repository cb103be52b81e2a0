"""Bandwidth-budget benchmark (issue 28, item 5): a background flush held to its budget, and training next to it.

Usage::

    python benchmarks/bench_budget.py --dir /path/on/the/disk    # 300 MB/s, 2 GB llm state, 60 s windows: ~5 minutes
    python benchmarks/bench_budget.py --quick                    # 51 MB state, 50 MB/s, 10 s windows: about a minute

A host → disk hierarchy (``local`` tier under ``--dir``, with ``io.bandwidth`` = ``--budget``) saves the
``llm`` state (tierckpt/bench/workloads.py) over and over from a background thread, ``--in-flight`` saves
at a time (3: one being demoted while the next ones are staged into host memory, so that a slow staging
on a busy machine does not leave the disk idle), so the disk tier's worker demotes back to back for the
whole window; the main thread meanwhile trains the GPT model of ``bench_train.py`` (one torch thread) and
times each step. The window starts when save ``in-flight + 1`` is issued (the pipeline is full and the
host tier's buffers are allocated) and lasts ``--window`` s. The disk tier's I/O engine
is wrapped to time every completed write: the **flush rate** is the bytes whose writes completed in each
1 s of the window, and in the whole window (not the bucket's own count). Modes, in rotated order per
repeat: ``none`` (training alone, no hierarchy), ``budgeted`` (the flush under the budget),
``unbudgeted`` (the same flush at the disk's speed). Results: a markdown table and JSON lines in ``--out``.
See docs/benchmarks.md, "Bandwidth budgets".
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
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy, IOConfig
from tierckpt.bench.system import machine_info
from tierckpt.bench.workloads import LLM_FULL, LLM_QUICK, make_llm_state, state_bytes
from tierckpt.configvalues import parse_rate, parse_size
from tierckpt.io.engine import IOEngine, make_engine
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling modules, when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_workload import FULL, QUICK, Trainer

MODES = ("none", "budgeted", "unbudgeted")
MB = 1e6
TARGET_RATE = 0.05  # the flush's rate over the long window within 5 % of the budget


class MeteredEngine(IOEngine):
    """An engine that notes the time and size of every write that completed without error."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner, self.name = inner, f"metered {inner.name}"
        self.writes: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def _note(self, nbytes: int, f: Future[int]) -> None:
        if not f.cancelled() and f.exception() is None:
            with self._lock:
                self.writes.append((time.monotonic(), nbytes))

    def pwrite(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        f = self.inner.pwrite(fd, addr, nbytes, offset, path=path)
        f.add_done_callback(lambda g: self._note(nbytes, g))
        return f

    def pread(self, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Future[int]:
        return self.inner.pread(fd, addr, nbytes, offset, path=path)

    def fsync(self, fd: int, *, path: str | None = None) -> Future[int]:
        return self.inner.fsync(fd, path=path)

    def close(self) -> None:
        self.inner.close()


class Flusher(threading.Thread):
    """Saves ``state`` again and again, ``in_flight`` saves at a time, until :meth:`stop`; then waits for them."""

    def __init__(self, h: Hierarchy, state: Any, in_flight: int) -> None:
        super().__init__(name="bench-flusher", daemon=True)
        self.h, self.state, self.in_flight = h, state, in_flight
        self.saves = 0
        self.error: BaseException | None = None
        self.steady = threading.Event()  # set as save in_flight + 1 is issued: the pipeline is full
        self._stop_flag = threading.Event()

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        pending: deque[Any] = deque()
        try:
            while not self._stop_flag.is_set():
                while len(pending) >= self.in_flight:
                    pending.popleft().wait()  # the oldest: on the disk (the state never changes: no staged wait)
                self.saves += 1
                pending.append(self.h.save(self.state, step=self.saves))
                if self.saves == self.in_flight + 1:
                    self.steady.set()
            while pending:
                pending.popleft().wait()
        except BaseException as e:  # reported by the main thread
            self.error = e


def rates(writes: list[tuple[float, int]], t0: float, window: float) -> tuple[float, list[float]]:
    """(bytes/s over ``[t0, t0 + window)``, bytes/s in each whole second of it)."""
    bins = [0] * int(window)
    total = 0
    for t, n in writes:
        if t0 <= t < t0 + window:
            total += n
            k = int(t - t0)
            if k < len(bins):
                bins[k] += n
    return total / window, [float(b) for b in bins]


def run_mode(mode: str, rep: int, args: argparse.Namespace, state: Any, scratch: Path) -> dict[str, Any]:
    """One mode: train for the window (next to the flush, unless ``none``); its step times and the flush's rates."""
    gc.collect()
    os.sync()
    trainer = Trainer(QUICK if args.quick else FULL, args.seed)
    for j in range(args.warmup):  # AdamW's state exists, the allocator is warm
        trainer.forward_backward(1_000_000 + j)
        trainer.update()
    h: Hierarchy | None = None
    engine: MeteredEngine | None = None
    flusher: Flusher | None = None
    where = scratch / f"{mode}-r{rep}"
    if mode != "none":
        engine = MeteredEngine(make_engine(args.engine, 16))
        budget = args.budget_bytes if mode == "budgeted" else None
        disk = LocalTier("disk", where, engine, chunk_bytes=args.chunk_bytes, bandwidth_bytes_per_sec=budget)
        host = HostTier("host", int(args.ckpt_bytes * (args.in_flight + 0.5)))  # the saves in flight, slack
        h = Hierarchy([host, disk], policy={"keep": {"host": 1, "disk": 1}}, io=IOConfig(engine=args.engine))
        flusher = Flusher(h, state, args.in_flight)
        flusher.start()
    try:
        if flusher is not None:  # the window starts once the pipeline is full
            while not flusher.steady.wait(0.1):
                if flusher.error is not None or not flusher.is_alive():
                    raise RuntimeError(f"the flush stopped before the window: {flusher.error!r}")
        t0 = time.monotonic()
        proc0, thr0 = time.process_time(), time.thread_time()
        steps: list[float] = []
        i = 0
        while True:
            s0 = time.monotonic()
            trainer.forward_backward(i)
            trainer.update()
            s1 = time.monotonic()
            if s0 >= t0 + args.window:
                break
            if s0 >= t0 and s1 <= t0 + args.window:  # whole steps inside the window only
                steps.append(s1 - s0)
            i += 1
        # CPU seconds per second of this process's other threads (staging, hashing, I/O submission)
        bg_cpu = ((time.process_time() - proc0) - (time.thread_time() - thr0)) / (time.monotonic() - t0)
        rec: dict[str, Any] = {"kind": "mode", "mode": mode, "repeat": rep, "window_secs": args.window,
                               "steps": len(steps), "step_secs": steps, "bg_cpu": bg_cpu}  # fmt: skip
        if flusher is not None and engine is not None and h is not None:
            flusher.stop()
            flusher.join()
            if flusher.error is not None:
                raise flusher.error
            rate, bins = rates(engine.writes, t0, args.window)
            budget_obj = h.tier("disk").budget
            rec.update(rate=rate, bins=bins, saves=flusher.saves,
                       bucket=vars(budget_obj.stats()) if budget_obj is not None else None)  # fmt: skip
    finally:
        if flusher is not None:
            flusher.stop()
            flusher.join()
        if h is not None:
            h.close()
        if engine is not None:
            engine.close()
        shutil.rmtree(where, ignore_errors=True)
    return rec


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(recs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_mode.setdefault(r["mode"], []).append(r)
    steps = {m: [s for r in rs for s in r["step_secs"]] for m, rs in by_mode.items()}
    base = statistics.median(steps["none"]) if steps.get("none") else None
    lines = [
        f"budget {args.budget_bytes / MB:.0f} MB/s, state {args.ckpt_bytes / 1e9:.2f} GB, window {args.window:.0f} s, "
        f"chunk {args.chunk_bytes >> 20} MiB, {args.repeats} repeat(s)",
        "",
        "| mode | flush MB/s over the window | % of budget | 1 s windows MB/s min / median / max | saves | "
        "steps | step median s | step p10 / p90 s | × none | other threads' CPU s/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in MODES:
        if m not in by_mode:
            continue
        rs, st = by_mode[m], steps[m]
        med = statistics.median(st) if st else float("nan")
        cells = [m]
        if "rate" in rs[0]:
            rate = statistics.median(r["rate"] for r in rs)
            bins = [b for r in rs for b in r["bins"]]
            pct = f"{100 * rate / args.budget_bytes:.1f}" if m == "budgeted" else "-"
            cells += [f"{rate / MB:.1f}", pct,
                      f"{min(bins) / MB:.0f} / {statistics.median(bins) / MB:.0f} / {max(bins) / MB:.0f}",
                      str(sum(r["saves"] for r in rs))]  # fmt: skip
        else:
            cells += ["-", "-", "-", "-"]
        cells += [str(len(st)), f"{med:.3f}", f"{_pct(st, 0.1):.3f} / {_pct(st, 0.9):.3f}",
                  f"{med / base:.3f}" if base else "-", f"{statistics.median(r['bg_cpu'] for r in rs):.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if "budgeted" in by_mode:
        rate = statistics.median(r["rate"] for r in by_mode["budgeted"])
        ok = abs(rate / args.budget_bytes - 1) <= TARGET_RATE
        lines += ["", f"* flush rate within {100 * TARGET_RATE:.0f} % of the budget over {args.window:.0f} s: "
                  f"{'PASS' if ok else 'MISS'} ({100 * (rate / args.budget_bytes - 1):+.1f} %)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="51 MB state, tiny model, 50 MB/s, 10 s windows")
    p.add_argument("--budget", default=None, help="the disk tier's io.bandwidth (default 300MB/s; --quick 50MB/s)")
    p.add_argument("--window", type=float, default=None, help="seconds measured per mode (default 60; --quick 10)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of %(default)s")
    p.add_argument("--repeats", type=int, default=1, help="repeats; the order of modes rotates (default 1)")
    p.add_argument("--in-flight", type=int, default=3, help="saves in flight at a time (default 3)")
    p.add_argument("--chunk", default="32MiB", help="the disk tier's chunk, and so its bucket's burst (32MiB)")
    p.add_argument("--engine", default="auto", help="io.engine (auto, uring, threads)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for the training (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps before each mode (3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results", help="directory for the JSON lines and the markdown table")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: under /tmp)")
    args = p.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in args.mode_list if m not in MODES]:
        p.error(f"--modes: unknown {bad} (known: {', '.join(MODES)})")
    args.budget_bytes = parse_rate(args.budget or ("50MB/s" if args.quick else "300MB/s"), "--budget")
    args.window = args.window or (10.0 if args.quick else 60.0)
    args.chunk_bytes = parse_size(args.chunk, "--chunk")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    scratch = Path(tempfile.mkdtemp(prefix="bench-budget-", dir=args.dir or "/tmp"))
    state = make_llm_state(LLM_QUICK if args.quick else LLM_FULL)
    args.ckpt_bytes = state_bytes(state)[0]
    recs: list[dict[str, Any]] = []
    with (out / f"budget-{stamp}.jsonl").open("w") as f:
        info = machine_info(scratch)
        f.write(json.dumps({"kind": "machine", "argv": sys.argv if argv is None else argv, **info}, default=str) + "\n")
        try:
            for rep in range(args.repeats):
                k = rep % len(args.mode_list)
                for mode in args.mode_list[k:] + args.mode_list[:k]:
                    rec = run_mode(mode, rep, args, state, scratch)
                    recs.append(rec)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    extra = f", flush {rec['rate'] / MB:.1f} MB/s" if "rate" in rec else ""
                    med = statistics.median(rec["step_secs"]) if rec["step_secs"] else float("nan")
                    print(f"  [{rep}] {mode:<10} {rec['steps']} steps, median {med:.3f} s{extra}", flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    text = report(recs, args)
    (out / f"budget-{stamp}.md").write_text(text)
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
