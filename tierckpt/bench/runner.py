"""``tierckpt bench``: options, the order things run in, and the files written to ``--out``.

Default run: the comparison (every peer on ``llm``, ``small`` and ``mixed``), the prefetch benchmark,
and the training-loop benchmark when ``benchmarks/bench_train.py`` is there. ``--prefetch`` runs only
the prefetch benchmark, ``--sweep`` only the tuning sweep. Writes ``<prefix>-<stamp>.jsonl`` (every
sample), ``.md`` (the tables) and PNGs into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import tierckpt
from tierckpt.bench import plots
from tierckpt.bench.compare import Harness, Progress, all_peers, select_peers, total_units
from tierckpt.bench.metrics import Recorder
from tierckpt.bench.options import SIZES, WORKLOADS, add_arguments
from tierckpt.bench.peers import Peer, RawBuffers
from tierckpt.bench.prefetch import PrefetchResult, default_factors, run_prefetch
from tierckpt.bench.rawio import fio_available
from tierckpt.bench.report import comparison, machine_line
from tierckpt.bench.sweep import KNOBS, QUICK_KNOBS, SweepResult, run_sweep, settings_count
from tierckpt.bench.system import machine_info, read_text
from tierckpt.bench.workloads import Workload, build_workload
from tierckpt.config import parse_size
from tierckpt.errors import ConfigError
from tierckpt.hierarchy import Hierarchy
from tierckpt.io.engine import make_engine

__all__ = ["add_arguments", "find_bench_train", "main", "run"]


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    out = {}
    for name, (full, quick) in SIZES.items():
        raw = getattr(args, name) or (quick if args.quick else full)
        out[name] = int(raw) if name.endswith(("count", "small")) else parse_size(raw, "--" + name.replace("_", "-"))
    return out


def _io(args: argparse.Namespace) -> dict[str, Any]:
    io: dict[str, Any] = {}
    for key, val in (("engine", args.engine), ("queue_depth", args.queue_depth), ("chunk", args.chunk)):
        if val is not None:
            io[key] = val
    return io


def find_bench_train() -> Path | None:
    """``benchmarks/bench_train.py`` of a source checkout (the working directory's, or the one tierckpt
    was imported from), or None."""
    for root in (Path.cwd(), Path(tierckpt.__file__).resolve().parents[1]):
        p = root / "benchmarks" / "bench_train.py"
        if p.is_file():
            return p
    return None


def _run_train(args: argparse.Namespace, out: Path, scratch: Path, rec: Recorder, progress: Progress) -> list[str]:
    """Run the training-loop benchmark as a subprocess; its markdown goes into the report."""
    script = find_bench_train()
    if script is None:
        rec.skip("train", "benchmarks/bench_train.py not found (it ships with a source checkout only)")
        progress.update()
        return []
    cmd = [sys.executable, str(script), "--out", str(out), "--repeats", str(args.repeats), "--dir", str(scratch)]
    cmd += ["--quick"] if args.quick else []
    progress.describe("training loop")
    started = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(tierckpt.__file__).resolve().parents[1]),
                                                                        os.environ.get("PYTHONPATH")]))}  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            progress.write("  [train] " + line.rstrip())
    rec.emit({"kind": "train", "cmd": cmd, "rc": proc.returncode})
    progress.update()
    if proc.returncode != 0:
        rec.skip("train", f"{script.name} exited with status {proc.returncode} (output above)")
        return []
    mds = sorted(p for p in out.glob("train-*.md") if p.stat().st_mtime >= started)
    body = mds[-1].read_text().strip() if mds else "(no markdown found)"
    return ["", "## Training loop (benchmarks/bench_train.py)", "", f"Command: `{' '.join(cmd[1:])}`", "", body]


def _workload(name: str, sizes: dict[str, int], key: str | None = None) -> Workload:
    llm = sizes[key] if key else sizes["llm_size"]
    return build_workload(name, llm_bytes=llm, small_count=sizes["small_count"], mixed_bytes=sizes["mixed_size"],
                          mixed_small=sizes["mixed_small"])  # fmt: skip


def _options(args: argparse.Namespace) -> tuple[dict[str, int], list[str], list[float] | None, int]:
    """The sizes, workloads, prefetch init times and prefetch repeats the options ask for (``args.repeats``
    defaulted: 2 with ``--quick`` for what costs seconds, while the ~0.1 s prefetch restarts keep 3 for
    their median).

    Raises:
        ValueError, ConfigError: a bad option, named.
    """
    pf_repeats = 3 if args.repeats is None else args.repeats
    args.repeats = (2 if args.quick else 3) if args.repeats is None else args.repeats
    sizes = _sizes(args)
    wls = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = set(wls) - set(WORKLOADS)
    if bad or args.repeats < 1:
        raise ValueError(f"--workloads: unknown {sorted(bad)}" if bad else "--repeats must be at least 1")
    init_secs = [float(x) for x in args.prefetch_t.split(",")] if args.prefetch_t else None
    return sizes, wls, init_secs, pf_repeats


def _compare(
    harness: Harness, names: list[str], sizes: dict[str, int], peers: list[Peer], rec: Recorder, progress: Progress
) -> list[Workload]:
    """Build each workload and measure every peer on it; the workloads' descriptions (without the state)."""
    built: list[Workload] = []
    for name in names:
        progress.describe(f"building {name}")
        wl = _workload(name, sizes)
        rec.emit({"kind": "workload", "workload": name, "bytes": wl.nbytes, "tensors": wl.ntensors,
                  "describe": wl.describe})  # fmt: skip
        progress.write(f"== {name}: {wl.ntensors} tensors, {wl.nbytes / 1e9:.3f} GB ({wl.describe})")
        harness.run_workload(wl, peers)
        built.append(Workload(wl.name, None, wl.nbytes, wl.ntensors, wl.describe))
        del wl
        gc.collect()
    return built


def run(args: argparse.Namespace) -> int:
    """Run what the options ask for; returns the exit status (2 on bad options)."""
    t_start = time.perf_counter()
    # DCP warns on every call without a process group, from its own threads too; the report says how it ran.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint")
    try:
        sizes, wls, init_secs, pf_repeats = _options(args)
    except (ValueError, ConfigError) as e:
        print(f"tierckpt bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tierckpt-bench-", dir=args.dir or None))
    io = _io(args)
    rec = Recorder(out, "sweep" if args.sweep else "prefetch" if args.prefetch else "bench")
    progress = Progress(0, enabled=False)
    engine = None
    try:
        with Hierarchy.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(scratch / "probe")}],
                                    **({"io": io} if io else {})}) as probe:  # fmt: skip
            info = machine_info(scratch, probe)
        info["fio"] = fio_available()
        rec.emit({"kind": "machine", "argv": sys.argv, "quick": args.quick, "repeats": args.repeats, "sizes": sizes,
                  "io": io, **info})  # fmt: skip
        print(f"machine: {machine_line(info)}", flush=True)
        engine = make_engine(io.get("engine", "auto"), probe.io.queue_depth)
        compare_wls = [] if (args.sweep or args.prefetch) else [w for w in wls if w != "train"]
        try:
            selected = select_peers(all_peers(engine, RawBuffers(), io), args.peers) if compare_wls else []
        except ValueError as e:
            print(f"tierckpt bench: {e}", file=sys.stderr)
            return 2
        peers = Harness.usable(selected, rec)
        run_pf = args.prefetch or not (args.sweep or args.no_prefetch)
        knobs = QUICK_KNOBS if args.quick else KNOBS
        n_pf = pf_repeats * (1 + (len(init_secs) if init_secs else len(default_factors(args.quick))))
        total = (total_units(len(compare_wls), len(peers), args.repeats) + (n_pf if run_pf else 0)
                 + (settings_count(knobs, args.sweep_grid) if args.sweep else 0)
                 + (1 if compare_wls and "train" in wls else 0))  # fmt: skip
        progress = Progress(total, enabled=not args.no_progress)
        rec.echo = progress.write
        harness = Harness(rec, scratch, args.repeats, args.cold, not args.no_check, progress)
        built = _compare(harness, compare_wls, sizes, peers, rec, progress)
        pf: PrefetchResult | None = None
        if run_pf:
            wl = _workload("llm", sizes, "prefetch_size")
            progress.write(f"== prefetch: {wl.nbytes / 1e9:.3f} GB on pfs only")
            pf = run_prefetch(rec, wl, scratch, repeats=pf_repeats, cold=args.cold, factors=default_factors(args.quick),
                              init_secs=init_secs, io=io, progress=progress)  # fmt: skip
            del wl
            gc.collect()
        sw: SweepResult | None = None
        if args.sweep:
            wl = _workload("llm", sizes, "sweep_size")
            progress.write(f"== sweep: {wl.nbytes / 1e9:.3f} GB")
            sw = run_sweep(rec, wl, scratch, repeats=args.repeats, cold=args.cold, knobs=knobs, grid=args.sweep_grid,
                           progress=progress)  # fmt: skip
            del wl
        train_md = _run_train(args, out, scratch, rec, progress) if compare_wls and "train" in wls else []
        progress.close()
        md = _report(args, info, rec, built, peers, harness.cold_methods, pf, sw, train_md, t_start)
        _finish(md, rec, built, pf, sw, t_start)
    finally:
        progress.close()
        if engine is not None:
            engine.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _finish(
    md: str, rec: Recorder, built: list[Workload], pf: PrefetchResult | None, sw: SweepResult | None, t_start: float
) -> None:
    """Write and print the report ``md``, draw the plots, record the end."""
    md_path = rec.path.with_suffix(".md")
    md_path.write_text(md + "\n")
    print("\n" + md, flush=True)
    _plots(rec, [w.name for w in built], pf, sw, md_path)
    rec.emit({"kind": "end", "wall_secs": round(time.perf_counter() - t_start, 1),
              "loadavg_end": read_text("/proc/loadavg")})  # fmt: skip
    print(f"\nresults: {rec.path}, {md_path}  (wall {time.perf_counter() - t_start:.0f} s)")


def _report(
    args: argparse.Namespace,
    info: dict[str, Any],
    rec: Recorder,
    built: list[Workload],
    peers: list[Peer],
    cold: set[str],
    pf: PrefetchResult | None,
    sw: SweepResult | None,
    train_md: list[str],
    t_start: float,
) -> str:
    cmd = " ".join(["tierckpt", "bench", *getattr(args, "argv", [])])
    lines = [f"## tierckpt bench ({'quick, ' if args.quick else ''}{args.repeats} repeats)", "",
             f"Command: `{cmd}`; wall {time.perf_counter() - t_start:.0f} s.", "", f"Machine: {machine_line(info)}."]  # fmt: skip
    if built:
        lines += comparison(rec, built, peers, cold)
    if pf is not None:
        lines += ["", f"### Restart with prefetch ({pf.nbytes / 1e9:.3f} GB committed on pfs only, "
                      f"{len(pf.direct_secs)} repeats)", ""]  # fmt: skip
        lines += [*_tier_table(rec), "", *pf.lines()]
    if sw is not None:
        lines += ["", f"### io: sweep ({sw.nbytes / 1e9:.3f} GB llm state, local tier)", "", *sw.lines()]
        if rec.skips:
            lines += ["", *[f"* skipped {k.peer}: {k.why}" for k in rec.skips]]
    lines += train_md
    return "\n".join(lines)


def _tier_table(rec: Recorder) -> list[str]:
    g = rec.summary
    ref = g("prefetch", "memcpy", "restore", "memory", "gbps", "median")
    rows = ["| restore from | GB/s median | GB/s best | vs memcpy |", "|---|---:|---:|---:|"]
    for tier, cache in (("host", "memory"), ("local", "cold"), ("pfs", "cold")):
        med = g("prefetch", f"tierckpt:{tier}", "restore", cache, "gbps", "median")
        best = g("prefetch", f"tierckpt:{tier}", "restore", cache, "gbps", "min")
        ratio = f"{100 * med / ref:.0f} %" if med and ref else "-"
        rows.append(f"| {tier} ({cache}) | {med or 0:.2f} | {best or 0:.2f} | {ratio} |")
    pre = g("prefetch", "tierckpt:pfs->host", "prefetch", None, "gbps", "median")
    rows.append(f"| memcpy into new memory | {ref or 0:.2f} | - | 100 % |")
    rows += [
        "",
        f"prefetch() until the host holds the step (pfs → host; local filled from host after) in the same process: {pre or 0:.2f} GB/s (median).",
    ]
    return rows


def _plots(rec: Recorder, wls: list[str], pf: PrefetchResult | None, sw: SweepResult | None, md: Path) -> None:
    why = plots.available()
    if why is not None:
        print(f"no PNG written: matplotlib unavailable ({why}); pip install 'tierckpt[bench]'")
        return
    base = md.with_suffix("")
    made = [plots.plot_comparison(rec, wls, Path(f"{base}-peers.png")) if wls else None]
    if pf is not None:
        made.append(plots.plot_prefetch(pf, Path(f"{base}-prefetch.png")))
    if sw is not None:
        made.append(plots.plot_sweep(sw, Path(f"{base}-sweep.png")))
    for p in made:
        if p is not None:
            rec.emit({"kind": "plot", "path": str(p)})
            print(f"plot: {p}")


def main(argv: list[str] | None = None) -> int:
    """``python -m tierckpt.bench [options]``."""
    p = argparse.ArgumentParser(prog="tierckpt bench", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
