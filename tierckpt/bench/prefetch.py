"""Restore-time prefetch benchmark: how soon after its initialization a restarted job has its state back.

A checkpoint is committed on the ``pfs`` tier only (written through a hierarchy that has only that
tier). A fresh "restart" process opens the whole hierarchy (host → local → pfs, local empty as on a new
node) and either

* ``direct``: initializes for T seconds (a sleep standing in for model construction, NCCL and data
  loader start-up), then restores (from pfs); or
* ``prefetch``: calls ``h.prefetch()`` first (pfs → host, then host → local, in the background), initializes for
  T seconds, then restores (from host once the prefetch is done; ``restore`` waits for it).

Reported per T: the time from the end of initialization to the restored state, and the break-even T
above which prefetching wins. The page cache is emptied before every restart. The parent also restores
from each tier in turn (host, local cold, pfs cold) next to memcpy of the same size.

The child is ``python -m tierckpt.bench.prefetch CONFIG.json MODE T``; it prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tierckpt
from tierckpt.bench.compare import Progress
from tierckpt.bench.metrics import Recorder, Sample
from tierckpt.bench.peers import Memcpy
from tierckpt.bench.system import make_cold, measure, resident_fraction
from tierckpt.bench.workloads import Workload
from tierckpt.hierarchy import Hierarchy

__all__ = ["PrefetchResult", "break_even", "child_main", "default_factors", "run_prefetch"]

STEP = 1
QUICK_FACTORS = (0.0, 1.0, 3.0)
FULL_FACTORS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def default_factors(quick: bool) -> tuple[float, ...]:
    """Init times to try, as multiples of how long ``prefetch()`` (until the host holds the step) takes here."""
    return QUICK_FACTORS if quick else FULL_FACTORS


@dataclass
class PrefetchResult:
    """What the restart sweep measured.

    Attributes:
        direct_secs: per repeat, time from the end of init to the restored state without prefetch.
        prefetch_secs: per init time T, the same with ``prefetch()`` called before init (per repeat).
        prefetch_done_secs: per repeat, how long the prefetch alone took (from the call to its future).
        break_even_secs: smallest T at which prefetching is no slower (interpolated), None if none.
    """

    nbytes: int
    direct_secs: list[float] = field(default_factory=list)
    prefetch_secs: dict[float, list[float]] = field(default_factory=dict)
    prefetch_done_secs: list[float] = field(default_factory=list)
    break_even_secs: float | None = None

    def lines(self) -> list[str]:
        """The markdown table (medians over repeats) and the break-even sentence."""
        d = statistics.median(self.direct_secs)
        out = [
            "| init T s | direct: after init s | prefetch: after init s | prefetch saves s |",
            "|---:|---:|---:|---:|",
        ]
        for t, xs in sorted(self.prefetch_secs.items()):
            p = statistics.median(xs)
            out.append(f"| {t:.2f} | {d:.3f} | {p:.3f} | {d - p:+.3f} |")
        be = "none within the Ts tried" if self.break_even_secs is None else f"T = {self.break_even_secs:.2f} s"
        out += ["", f"Break-even: {be} (prefetching wins for longer initializations). A direct restore from pfs "
                f"took {d:.3f} s after init (median)."]  # fmt: skip
        if self.prefetch_done_secs:
            pd = statistics.median(self.prefetch_done_secs)
            out[-1] += (
                f" In the restart process, prefetch() alone (until the host held the step) took {pd:.3f} s (median)."
            )
        return out


def break_even(direct: float, curve: list[tuple[float, float]]) -> float | None:
    """The smallest init time at which the prefetch curve (sorted (T, secs)) is at or below ``direct``,
    linearly interpolated between the grid points around the crossing; None if it never is."""
    prev: tuple[float, float] | None = None
    for t, p in curve:
        if p <= direct:
            if prev is None:
                return t
            (t0, p0), (t1, p1) = prev, (t, p)
            return t0 + (p0 - direct) * (t1 - t0) / (p0 - p1) if p0 != p1 else t1
        prev = (t, p)
    return None


def _tiers(root: Path, nbytes: int) -> list[dict[str, Any]]:
    cap = max(2 * nbytes + (256 << 20), 1 << 30)
    return [
        {"name": "host", "kind": "host", "capacity": cap},
        {"name": "local", "kind": "local", "path": str(root / "local")},
        {"name": "pfs", "kind": "pfs", "path": str(root / "pfs")},
    ]


def _clear(path: Path) -> None:
    """Empty a tier directory (a new node's local SSD)."""
    if path.is_dir():
        for p in path.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _child(cfg_path: Path, mode: str, init_secs: float, timeout: float) -> dict[str, Any]:
    src = str(Path(tierckpt.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run(
        [sys.executable, "-m", "tierckpt.bench.prefetch", str(cfg_path), mode, repr(init_secs)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"restart process failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _per_tier(rec: Recorder, wl: Workload, cfg: dict[str, Any], root: Path, repeats: int, cold: str) -> float:
    """Restore from host, local (cold) and pfs (cold) in turn, and memcpy of the same size; returns the
    median time of ``prefetch()`` from pfs to host."""
    prefetch_secs: list[float] = []
    memcpy = Memcpy()
    memcpy.open(root, wl)
    with Hierarchy.from_config(cfg) as h:
        for rep in range(repeats):
            make_cold([root / "pfs"], cold)
            with measure() as u:
                h.prefetch(STEP).result()  # the host holds it; the local copy follows, from the host's
            prefetch_secs.append(u.wall_secs)
            h.wait()
            rec.add(Sample("prefetch", "tierckpt:pfs->host", "prefetch", rep, wl.nbytes, u.wall_secs,
                           cpu_secs=u.cpu_secs, peak_extra_rss_bytes=u.peak_extra_rss_bytes))  # fmt: skip
            for tier in ("host", "local", "pfs"):
                paths = [root / tier / f"step-{STEP:012d}"] if tier != "host" else []
                method = make_cold(paths, cold) if paths else None
                resident = resident_fraction(paths) if paths else None
                with measure() as u:
                    state = h.restore(step=STEP, tier=tier)
                rec.add(Sample("prefetch", f"tierckpt:{tier}", "restore", rep, wl.nbytes, u.wall_secs,
                               cache="memory" if tier == "host" else "cold", resident=resident, cold_method=method,
                               cpu_secs=u.cpu_secs, peak_extra_rss_bytes=u.peak_extra_rss_bytes))  # fmt: skip
                del state
            dst = memcpy.prepare_restore(rep, None)
            with measure() as u:
                memcpy.restore(rep, dst, "memory")
            rec.add(Sample("prefetch", "memcpy", "restore", rep, wl.nbytes, u.wall_secs, cache="memory"))
            del dst
            for t in h.tiers[:2]:  # back to pfs only
                t.evict(tierckpt.CheckpointKey(STEP, h.rank))
    memcpy.close()
    return statistics.median(prefetch_secs)


def run_prefetch(
    rec: Recorder,
    wl: Workload,
    scratch: Path,
    *,
    repeats: int,
    cold: str,
    factors: tuple[float, ...],
    init_secs: list[float] | None,
    io: dict[str, Any] | None,
    progress: Progress,
) -> PrefetchResult:
    """Run the per-tier restores and the restart sweep on ``wl``; records samples and ``restart`` records.

    Args:
        rec: recorder.
        wl: the state to checkpoint.
        scratch: folder for the tiers.
        repeats: repeats of every measurement.
        cold: cache-emptying method.
        factors: init times as multiples of the median ``prefetch()`` time measured first (used unless
            ``init_secs`` is given).
        init_secs: explicit init times in seconds.
        io: tierckpt ``io:`` settings.
        progress: console bar (one unit per restart process).
    """
    root = scratch / "prefetch"
    root.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {"tiers": _tiers(root, wl.nbytes), **({"io": io} if io else {})}
    with Hierarchy.from_config({"tiers": [cfg["tiers"][2]], **({"io": io} if io else {})}) as only_pfs:
        only_pfs.save(wl.state, step=STEP, blocking=True).wait()
    (root / "local").mkdir(exist_ok=True)
    cfg_path = root / "hierarchy.json"
    cfg_path.write_text(json.dumps(cfg))
    progress.describe("prefetch: restore from each tier")
    prefetch_median = _per_tier(rec, wl, cfg, root, repeats, cold)
    res = PrefetchResult(wl.nbytes)

    def restart(mode: str, t: float, rep: int) -> dict[str, Any]:
        _clear(root / "local")
        make_cold([root / "pfs"], cold)
        progress.describe(f"prefetch: restart {mode} T={t:.2f}s r{rep}")
        out = _child(cfg_path, mode, t, timeout=600)
        rec.emit({"kind": "restart", "repeat": rep, "bytes": wl.nbytes, **out})
        progress.write(f"  [restart r{rep}] {mode:>8} init {t:6.2f} s  after init {out['after_init_secs']:.3f} s "
                       f"(restored from {out['last_restore'][1]})")  # fmt: skip
        progress.update()
        return out

    grid = init_secs or [round(f * prefetch_median, 3) for f in factors]
    for rep in range(repeats):
        res.direct_secs.append(restart("direct", 0.0, rep)["after_init_secs"])
        for t in grid[rep % len(grid) :] + grid[: rep % len(grid)]:
            out = restart("prefetch", t, rep)
            res.prefetch_secs.setdefault(t, []).append(out["after_init_secs"])
            if out.get("prefetch_done_secs") is not None:
                res.prefetch_done_secs.append(out["prefetch_done_secs"])
    curve = sorted((t, statistics.median(xs)) for t, xs in res.prefetch_secs.items())
    res.break_even_secs = break_even(statistics.median(res.direct_secs), curve)
    rec.emit({"kind": "prefetch_summary", "bytes": wl.nbytes, "direct_median_secs": statistics.median(res.direct_secs),
              "curve": curve, "break_even_secs": res.break_even_secs})  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)
    return res


def child_main(argv: list[str]) -> int:
    """The restart process: ``CONFIG.json MODE T`` → one JSON line on stdout."""
    cfg_path, mode, init = Path(argv[0]), argv[1], float(argv[2])
    h = Hierarchy.from_config(json.loads(cfg_path.read_text()))
    done_at: list[float] = []
    t0 = time.perf_counter()
    fut = None
    if mode == "prefetch":
        fut = h.prefetch()
        fut.add_done_callback(lambda f: done_at.append(time.perf_counter()))
    time.sleep(init)  # model construction, NCCL initialization, data loader workers ...
    t1 = time.perf_counter()
    in_time = fut.done() if fut is not None else None
    state = h.restore()
    t2 = time.perf_counter()
    out = {
        "mode": mode, "init_secs": init, "after_init_secs": t2 - t1, "total_secs": t2 - t0,
        "prefetch_done_secs": (done_at[0] - t0) if done_at else None, "prefetch_done_at_init_end": in_time,
        "last_restore": list(h.last_restore or (None, None)),
    }  # fmt: skip
    del state
    h.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
