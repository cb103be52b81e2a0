"""Training-loop benchmark (issue #3, issue #4 item 5): step time with a checkpoint every k steps.

Usage::

    python benchmarks/bench_train.py                     # ~330 MB state, 10 steps x 8 modes x 3 repeats, ~5 minutes
    python benchmarks/bench_train.py --quick             # tiny model, well under a minute
    python benchmarks/bench_train.py --modes none,tierckpt-lazy,dcp-async-staged --every 2 --steps 20

A small GPT-style model (token + position embedding, transformer blocks, LM head; ~27 M parameters,
~330 MB of fp32 weights and AdamW state) trains on seeded random tokens on the CPU. ``--threads``
(default 1) sets ``torch.set_num_threads``: one core of this 2-core machine trains, the other is left
to the I/O threads. Each mode runs the same ``--steps`` (after ``--warmup`` steps that also save and
are not counted; ``--init-steps`` optimizer steps before those, so that even the first checkpoint holds
the optimizer state) with a checkpoint every ``--every`` steps:

* ``none``: no checkpointing;
* ``tierckpt-lazy``: host → local tiers; ``save()`` before forward/backward, ``handle.staged`` waited
  right before ``optimizer.step()``;
* ``tierckpt-sync``: a local tier only, ``save(blocking=True)`` (the synchronous save to the local tier);
* ``dcp-async``: ``torch.distributed.checkpoint.async_save`` with a ``FileSystemWriter`` (DCP's default
  staging), the previous save waited for first; ``dcp-async-staged``: the same with one ``DefaultStager``
  reused across saves; ``dcp-async-lazy``: that stager with async staging, waited before the update;
* ``dcp-sync``: ``dcp.save``; ``torch-save``: ``torch.save`` + fsync.

Blocking time = time in the save call plus time waiting before the update. A GIL probe measures a
pure-Python loop and a matmul loop while tierckpt stages and demotes a checkpoint in the background,
relative to the same loop alone. Results: a markdown table and JSON lines in ``--out``. See
docs/benchmarks.md, "Training loop".
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
import traceback
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling modules, when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import machine_info
from train_savers import MODES, PEERS, TierckptLazy, make_saver
from train_workload import (
    FULL,
    QUICK,
    GPTDims,
    Trainer,
    matmul_loop,
    poisoned,
    python_loop,
    rate_until,
    same_tensors,
    sched_secs,
    snapshot,
    tensor_bytes,
)

PROBE = "gil-probe"
PROBE_ROWS = (("python", "stage"), ("python", "demote"), ("matmul", "stage"), ("matmul", "demote"))
DCP_ASYNC = ("dcp-async", "dcp-async-staged", "dcp-async-lazy")
# Targets (medians, same run)
TARGET_BLOCK_VS_SYNC = 0.10  # lazy blocking time <= 10 % of a synchronous save to the local tier
TARGET_STEP_RATIO = 1.2  # lazy step time <= 1.2 x step time without checkpointing
TARGET_BLOCK_VS_DCP = 0.4  # lazy blocking time <= 0.4 x the best DCP async_save configuration's


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _ok(ok: bool) -> str:
    return "PASS" if ok else "MISS"


class Bench:
    def __init__(self, args: argparse.Namespace, dims: GPTDims, scratch: Path, out: Path) -> None:
        self.args, self.dims, self.scratch = args, dims, scratch
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.jsonl = out / f"train-{stamp}.jsonl"
        self.md = out / f"train-{stamp}.md"
        self._f = self.jsonl.open("w")
        self.steps: dict[str, list[float]] = {}
        self.blocks: dict[str, list[tuple[float, float, float, float | None]]] = {}  # total, call, wait, prev
        self.drains: dict[str, list[float]] = {}
        self.runq: dict[str, list[tuple[float, float, float]]] = {}  # per step: runq secs, step secs, bg CPU secs
        self.backlogs: dict[str, list[int]] = {}  # per save: earlier saves not yet durable when it started
        self.checks: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}
        self.probe: dict[str, list[dict[str, float]]] = {}
        self.failed = False
        t = Trainer(dims, args.seed)
        t.forward_backward(0)
        t.update()  # AdamW creates its state on the first step
        self.state_bytes, ntensors = tensor_bytes(t.state())
        self.ckpt_bytes = self.state_bytes + (ntensors + 64) * 4096  # + alignment padding and manifest

    def emit(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()

    # -- one mode, one repeat --------------------------------------------------------------------------
    def run_mode(self, mode: str, rep: int) -> None:
        a = self.args
        gc.collect()
        os.sync()  # write back what the previous mode left dirty, outside every timing
        where = self.scratch / f"{mode}-r{rep}"
        trainer = Trainer(self.dims, a.seed)
        for j in range(a.init_steps):  # untimed, unsaved: the checkpoints then all hold the optimizer state
            trainer.forward_backward(1_000_000 + j)
            trainer.update()
        saver = make_saver(mode, where, self.ckpt_bytes)
        total = a.warmup + a.steps
        saving = mode != "none"
        last_save = max(i for i in range(total) if i % a.every == 0)
        check = saving and (rep == 0 or a.quick)
        ref: Any = None
        steps, blocks, runq = [], [], []
        try:
            for i in range(total):
                save_now = saving and i % a.every == 0
                if check and i == last_save:
                    ref = snapshot(trainer.state())  # what step i's checkpoint must restore to (not timed)
                backlog = saver.backlog() if save_now else None
                cpu0, runq0 = sched_secs()
                proc0, thr0 = time.process_time(), time.thread_time()
                t0 = time.perf_counter()
                call = wait = 0.0
                if save_now:
                    saver.begin(i, trainer.state())
                    call = time.perf_counter() - t0
                loss = trainer.forward_backward(i)
                if save_now:
                    b0 = time.perf_counter()
                    saver.before_update()
                    wait = time.perf_counter() - b0
                trainer.update()
                dt = time.perf_counter() - t0
                cpu1, runq1 = sched_secs()
                bg = max(0.0, (time.process_time() - proc0) - (time.thread_time() - thr0))
                if i < a.warmup:
                    continue
                steps.append(dt)
                runq.append((runq1 - runq0, dt, bg))
                rec: dict[str, Any] = {"kind": "sample", "mode": mode, "repeat": rep, "step": i, "step_secs": dt,
                                       "cpu_secs": cpu1 - cpu0, "runq_secs": runq1 - runq0, "bg_cpu_secs": bg}  # fmt: skip
                if save_now:
                    blocks.append((call + wait, call, wait, saver.prev_wait_secs))
                    rec.update(blocking_secs=call + wait, call_secs=call, wait_secs=wait)
                    if saver.prev_wait_secs is not None:
                        rec["prev_wait_secs"] = saver.prev_wait_secs
                    if backlog is not None:
                        rec["backlog"] = backlog
                        self.backlogs.setdefault(mode, []).append(backlog)
                self.emit({**rec, "loss": round(loss, 5)})
            t0 = time.perf_counter()
            saver.drain()
            drain = time.perf_counter() - t0
            results = []
            if check:
                for tier in saver.check_tiers:
                    like = poisoned(ref)  # DCP loads into it in place; the others ignore it
                    diff = same_tensors(ref, saver.load(last_save, like, tier))
                    results.append(f"{tier or 'file'}:{'ok' if diff is None else 'FAILED ' + diff}")
                    self.failed |= diff is not None
        finally:
            saver.close()
            shutil.rmtree(where, ignore_errors=True)
        self.steps.setdefault(mode, []).extend(steps)
        self.runq.setdefault(mode, []).extend(runq)
        self.blocks.setdefault(mode, []).extend(blocks)
        if saving:
            self.drains.setdefault(mode, []).append(drain)
            self.emit({"kind": "drain", "mode": mode, "repeat": rep, "drain_secs": drain})
        if results:
            self.checks.setdefault(mode, []).extend(results)
            self.emit({"kind": "check", "mode": mode, "repeat": rep, "step": last_save, "results": results})
        med_b = _median([b[0] for b in blocks])
        print(
            f"  [{rep}] {mode:<17} step median {statistics.median(steps):.3f} s"
            + (f", blocking median {1e3 * med_b:.1f} ms, drain {drain:.2f} s" if med_b is not None else "")
            + (f", check {' '.join(results)}" if results else ""),
            flush=True,
        )

    # -- GIL probe -------------------------------------------------------------------------------------
    def run_probe(self, rep: int) -> None:
        """A Python loop and a matmul loop while tierckpt stages, then demotes host → local, vs alone."""
        gc.collect()
        os.sync()
        where = self.scratch / f"probe-r{rep}"
        trainer = Trainer(self.dims, self.args.seed)
        trainer.forward_backward(0)
        trainer.update()
        state = trainer.state()
        saver = TierckptLazy(where, self.ckpt_bytes)
        base_secs = 0.05 if self.args.quick else 0.3
        try:
            for step in range(3):  # warm: the host tier's buffers (up to 3 sets) are allocated and faulted in
                saver.h.save(state, step=step).wait()
            step = 3
            for loop, chunk in (("python", python_loop()), ("matmul", matmul_loop())):
                for _ in range(self.args.probe_saves):
                    for phase in ("base", "stage", "demote"):
                        if phase == "base":
                            res = rate_until(chunk, lambda: False, base_secs)
                        elif phase == "stage":
                            handle = saver.h.save(state, step=step)
                            res = rate_until(chunk, handle.staged.done, 60.0)
                        else:
                            res = rate_until(chunk, handle.durable["local"].done, 60.0)
                            handle.wait()
                            step += 1
                        self.probe.setdefault(f"{loop}:{phase}", []).append(res)
                        self.emit({"kind": "probe", "repeat": rep, "loop": loop, "phase": phase, **res})
            saver.drain()
        finally:
            saver.close()
            shutil.rmtree(where, ignore_errors=True)
        ratios = [f"{lp} during {ph} {_fmt(self.probe_ratio(lp, ph), '.2f')}x" for lp, ph in PROBE_ROWS]
        print(f"  [{rep}] {PROBE:<17} " + ", ".join(ratios) + " (all repeats so far)", flush=True)

    def probe_totals(self, key: str) -> dict[str, float]:
        runs = self.probe.get(key, [])
        return {k: sum(r[k] for r in runs) for k in ("chunks", "secs", "cpu_secs", "runq_secs", "bg_cpu_secs")}

    def probe_ratio(self, loop: str, phase: str) -> float | None:
        base, bg = self.probe_totals(f"{loop}:base"), self.probe_totals(f"{loop}:{phase}")
        if not base["secs"] or not bg["secs"] or not base["chunks"]:
            return None
        return (bg["chunks"] / bg["secs"]) / (base["chunks"] / base["secs"])

    def probe_rows(self) -> list[dict[str, Any]]:
        rows = []
        for loop in ("python", "matmul"):
            for phase in ("base", "stage", "demote"):
                t = self.probe_totals(f"{loop}:{phase}")
                if not t["secs"]:
                    continue
                secs = t["secs"]
                rows.append({
                    "kind": "summary", "mode": PROBE, "loop": loop, "background": phase, "secs": secs,
                    "throughput_vs_alone": 1.0 if phase == "base" else self.probe_ratio(loop, phase),
                    "main_on_cpu": t["cpu_secs"] / secs, "main_waiting_for_cpu": t["runq_secs"] / secs,
                    "main_blocked": max(0.0, 1 - (t["cpu_secs"] + t["runq_secs"]) / secs),
                    "other_threads_cpus": max(0.0, t["bg_cpu_secs"] / secs),
                    "windows": len(self.probe[f"{loop}:{phase}"]),
                })  # fmt: skip
        return rows

    def probe_table(self, rows: list[dict[str, Any]]) -> list[str]:
        what = {"base": "nothing (alone)", "stage": "staging (save → host)", "demote": "demotion host → local"}
        lines = [
            "| main-thread loop | in the background | throughput vs alone | main thread on CPU "
            "| main waiting for a CPU | main blocked (GIL) | other threads' CPU | s per window |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['loop']} | {what[r['background']]} | {_fmt(r['throughput_vs_alone'], '.2f')}x "
                f"| {r['main_on_cpu']:.0%} | {r['main_waiting_for_cpu']:.0%} | {r['main_blocked']:.0%} "
                f"| {r['other_threads_cpus']:.2f} | {r['secs'] / r['windows']:.3f} |"
            )
        return lines

    # -- report ----------------------------------------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        none = _median(self.steps.get("none", []))
        sync = _median([b[0] for b in self.blocks.get("tierckpt-sync", [])])
        rows = []
        for mode in MODES:
            if mode not in self.steps:
                continue
            st, bl = self.steps[mode], self.blocks.get(mode, [])
            med, mb = statistics.median(st), _median([b[0] for b in bl])
            prev = [b[3] for b in bl if b[3] is not None]
            rows.append({
                "kind": "summary", "mode": mode, "steps": len(st), "saves": len(bl),
                "step_median_secs": med, "step_min_secs": min(st),
                "step_vs_none": med / none if none else None,
                "blocking_median_secs": mb, "blocking_min_secs": min(b[0] for b in bl) if bl else None,
                "call_median_secs": _median([b[1] for b in bl]), "wait_median_secs": _median([b[2] for b in bl]),
                "prev_wait_median_secs": _median(prev),
                "backlog_mean": statistics.mean(self.backlogs[mode]) if self.backlogs.get(mode) else None,
                "backlog_max": max(self.backlogs[mode]) if self.backlogs.get(mode) else None,
                "blocking_vs_sync_save": mb / sync if mb is not None and sync else None,
                "drain_median_secs": _median(self.drains.get(mode, [])),
                "main_waiting_for_cpu": sum(q for q, _, _ in self.runq[mode]) / sum(d for _, d, _ in self.runq[mode]),
                "bg_cpu_median_secs": statistics.median(b for _, _, b in self.runq[mode]),
                "check": " ".join(sorted(set(self.checks.get(mode, [])))) or None,
            })  # fmt: skip
        return rows

    def targets(self, rows: list[dict[str, Any]]) -> list[str]:
        by = {r["mode"]: r for r in rows}
        lazy = by.get("tierckpt-lazy")
        if lazy is None:
            return ["(tierckpt-lazy did not run: no targets)"]
        out = []
        lb = lazy["blocking_median_secs"]
        if lazy["blocking_vs_sync_save"] is not None:
            r = lazy["blocking_vs_sync_save"]
            sync = by["tierckpt-sync"]["blocking_median_secs"]
            out.append(f"lazy blocking <= {TARGET_BLOCK_VS_SYNC:.0%} of a sync save to local: "
                       f"{1e3 * lb:.1f} ms / {1e3 * sync:.0f} ms = {r:.1%} {_ok(r <= TARGET_BLOCK_VS_SYNC)}")  # fmt: skip
        if lazy["step_vs_none"] is not None:
            r = lazy["step_vs_none"]
            out.append(f"lazy step <= {TARGET_STEP_RATIO}x no checkpointing: {r:.3f}x {_ok(r <= TARGET_STEP_RATIO)}")
        dcp = [by[m] for m in DCP_ASYNC if m in by and by[m]["blocking_median_secs"] is not None]
        if dcp:
            best = min(dcp, key=lambda r: r["blocking_median_secs"])
            # the best DCP configuration measured, and (when it is another) the one issue #4 names
            for what, peer in (
                ("best DCP async_save", best),
                ("DCP with a reused DefaultStager", by.get(DCP_ASYNC[1])),
            ):
                if peer is None or (what != "best DCP async_save" and peer is best):
                    continue
                r = lb / peer["blocking_median_secs"]
                out.append(f"lazy blocking <= {TARGET_BLOCK_VS_DCP}x {what} ({peer['mode']}, "
                           f"{1e3 * peer['blocking_median_secs']:.1f} ms): {1e3 * lb:.1f} ms = {r:.3f}x "
                           f"{_ok(r <= TARGET_BLOCK_VS_DCP)}")  # fmt: skip
        return out

    def report(self, info: dict[str, Any]) -> str:
        a = self.args
        rows = self.summary()
        for r in rows:
            self.emit(r)
        ms = 1e3
        lines = [
            f"## Training loop: {a.steps} steps per mode after {a.warmup} warm-up"
            + (f" and {a.init_steps} unsaved" if a.init_steps else "")
            + f", checkpoint every {a.every}, {a.repeats} repeats, torch threads {a.threads}",
            "",
            f"Model {self.dims.as_dict()} ({self.dims.params() / 1e6:.1f} M params), checkpoint "
            f"{self.state_bytes / 1e6:.0f} MB of tensors; {info.get('cpu', '?')}, {info.get('cores', '?')} cores, "
            f"{info.get('fs', '?')} on {info.get('device', '?')}; torch {torch.__version__}.",
            "",
            "| mode | step median s | step min s | × none | blocking median ms | blocking min ms "
            "| in call / before update ms | % of sync save | drain median s | main waiting for a CPU | other threads' CPU s/step | restore check |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            split = f"{_fmt(r['call_median_secs'], '.1f', ms)} / {_fmt(r['wait_median_secs'], '.1f', ms)}"
            lines.append(
                f"| {r['mode']} | {r['step_median_secs']:.3f} | {r['step_min_secs']:.3f} "
                f"| {_fmt(r['step_vs_none'], '.3f')} | {_fmt(r['blocking_median_secs'], '.1f', ms)} "
                f"| {_fmt(r['blocking_min_secs'], '.1f', ms)} | {split if r['saves'] else '-'} "
                f"| {_fmt(r['blocking_vs_sync_save'], '.1f', 100)} "
                f"| {_fmt(r['drain_median_secs'], '.2f')} | {r['main_waiting_for_cpu']:.0%} "
                f"| {r['bg_cpu_median_secs']:.3f} | {r['check'] or '-'} |"
            )
        prev = [f"{r['mode']} {_fmt(r['prev_wait_median_secs'], '.1f', ms)} ms" for r in rows
                if r["prev_wait_median_secs"] is not None]  # fmt: skip
        if prev:
            lines += ["", "Of the time in the call, waiting for the previous save (median): " + ", ".join(prev) + "."]
        backlog = [f"{r['mode']} {r['backlog_mean']:.2f} / {r['backlog_max']}" for r in rows
                   if r["backlog_max"] is not None]  # fmt: skip
        if backlog:
            lines += ["", "Earlier saves not yet durable when a save starts (mean / max): " + ", ".join(backlog) + "."]
        for mode, why in self.skipped.items():
            lines += ["", f"{mode}: skipped ({why})"]
        if self.probe:
            probe_rows = self.probe_rows()
            for r in probe_rows:
                self.emit(r)
            lines += ["", "GIL probe: a main-thread loop while tierckpt works in the background, vs the same loop "
                      "alone (main-thread time split with /proc/thread-self/schedstat):", ""]  # fmt: skip
            lines += self.probe_table(probe_rows)
        lines += ["", "Targets (medians, same run):", ""] + [f"* {t}" for t in self.targets(rows)]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._f.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, for a smoke test (well under a minute)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode and repeat (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, saving like the timed ones (3)")
    p.add_argument("--every", type=int, default=1, help="checkpoint every K steps (default 1)")
    p.add_argument("--init-steps", type=int, default=0,
                   help="optimizer steps before the warm-up, not timed, not saved (default 0: the first save,\n"
                        "before any optimizer step, holds no optimizer state and is smaller than the others)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="repeats; the order of modes rotates (default 3)")
    p.add_argument("--modes", default=",".join((*MODES, PROBE)), help="comma-separated subset of: %(default)s")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: one core trains, one is left for the I/O threads)")  # fmt: skip
    p.add_argument("--dim", type=int, help="model width (default 512; --quick 64)")
    p.add_argument("--layers", type=int, help="transformer blocks (default 6; --quick 2)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 8192; --quick 512)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4; --quick 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 64; --quick 16)")
    p.add_argument("--probe-saves", type=int, default=3, help="background saves per GIL probe loop (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results", help="directory for the JSON lines and the markdown table")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp); removed at the end")
    args = p.parse_args(argv)
    known = (*MODES, PROBE)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in known]
    if bad:
        p.error(f"--modes: unknown {bad} (known: {', '.join(known)})")
    if args.steps < 1 or args.every < 1 or args.repeats < 1 or args.warmup < 0 or args.init_steps < 0:
        p.error("--steps, --every and --repeats must be >= 1, --warmup and --init-steps >= 0")
    return args


def dims_from(args: argparse.Namespace) -> GPTDims:
    base = QUICK if args.quick else FULL
    pick = {k: getattr(args, k) for k in ("dim", "layers", "vocab", "batch", "seq") if getattr(args, k) is not None}
    d = GPTDims(**{**base.as_dict(), **pick})
    heads = base.heads if d.dim % base.heads == 0 else 1
    return GPTDims(**{**d.as_dict(), "heads": heads})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dims = dims_from(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-train-", dir=args.dir or "/tmp"))
    bench = Bench(args, dims, scratch, out)
    t_start = time.perf_counter()
    try:
        probe_h = Hierarchy.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(scratch / "m")}]})
        try:
            info = machine_info(scratch, probe_h)
        finally:
            probe_h.close()
        info.update(threads=args.threads, dims=dims.as_dict(), params=dims.params())
        bench.emit({"kind": "machine", "argv": sys.argv if argv is None else argv, "quick": args.quick,
                    "steps": args.steps, "warmup": args.warmup, "every": args.every, "repeats": args.repeats,
                    "init_steps": args.init_steps,
                    "modes": args.mode_list, **info})  # fmt: skip
        print(f"model {dims.as_dict()}: {dims.params() / 1e6:.1f} M params, torch threads {args.threads}, "
              f"scratch {scratch}", flush=True)  # fmt: skip
        items = list(args.mode_list)
        for rep in range(args.repeats):
            k = rep % len(items)
            for item in items[k:] + items[:k]:  # rotate the order so drift hits every mode
                if item in bench.skipped:
                    continue
                try:
                    bench.run_probe(rep) if item == PROBE else bench.run_mode(item, rep)
                except Exception as e:
                    if item not in PEERS:
                        raise
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    print(f"  [{rep}] {item}: skipped ({why})", flush=True)
                    traceback.print_exc(limit=3)
                    bench.skipped[item] = why
                    bench.emit({"kind": "skip", "mode": item, "repeat": rep, "error": why})
        text = bench.report(info)
        bench.md.write_text(text)
        print("\n" + text, flush=True)
        bench.emit({"kind": "end", "wall_secs": time.perf_counter() - t_start, "check_failed": bench.failed})
        print(f"results: {bench.jsonl} and {bench.md}")
    finally:
        bench.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
