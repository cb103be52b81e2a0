"""Restore-time prefetch benchmark: how soon after its initialization a restarted job has its state back.

A checkpoint is committed on the ``pfs`` tier only (written through a hierarchy that has only that
tier). A fresh "restart" process opens the whole hierarchy (host → local → pfs, local empty as on a new
node) and either

* ``direct``: initializes for T seconds (a sleep standing in for model construction, NCCL and data
  loader start-up), then restores (from pfs); or
* ``prefetch``: calls ``h.prefetch()`` first (pfs → host, then host → local, in the background), initializes for
  T seconds, then restores (from host once the prefetch is done; ``restore`` waits for it).

Reported per T: the time from the end of initialization to the restored state, and the break-even T
from which prefetching stays no slower than the direct restore. The Ts span where that lies: 0 to 1.5x
(2x for a full run) the time ``prefetch()`` takes in a restart process, measured by the first restart
(prefetch at T = 0); beyond that time the prefetch is done before the restore is asked for. The page
cache is emptied before every restart. The parent also restores from each tier in turn (host, local
cold, pfs cold) next to memcpy of the same size.

A restart process is forked from a fork server (:mod:`tierckpt.bench._restart`) that has imported
torch and tierckpt and done nothing else (no tensor, no hierarchy, no thread), as a restarted job has
by the time it restores; its restore faults in new memory like any new process's. This costs ~0.1 s
per restart instead of the 3-5 s a new interpreter spends importing torch. ``python -m tierckpt.bench.prefetch
CONFIG.json MODE T`` runs one restart in a new interpreter and prints its JSON line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tierckpt
from tierckpt.bench._restart import restart
from tierckpt.bench.compare import Progress
from tierckpt.bench.metrics import Recorder, Sample
from tierckpt.bench.peers import Memcpy
from tierckpt.bench.system import make_cold, measure, resident_fraction
from tierckpt.bench.workloads import Workload
from tierckpt.hierarchy import Hierarchy

__all__ = ["BreakEven", "PrefetchResult", "Restarts", "break_even", "child_main", "default_factors", "run_prefetch"]

STEP = 1
QUICK_FACTORS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)
FULL_FACTORS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def default_factors(quick: bool) -> tuple[float, ...]:
    """Init times to try, as multiples of how long ``prefetch()`` (until the host holds the step) takes
    in a restart process."""
    return QUICK_FACTORS if quick else FULL_FACTORS


@dataclass(frozen=True)
class BreakEven:
    """Where the prefetch curve meets the direct restore.

    Attributes:
        secs: the init time T from which prefetching stays no slower (interpolated between the Ts
            around the last crossing), or None when that is not inside the Ts tried.
        where: ``found``; ``below`` (no slower already at the smallest T tried: the break-even is at
            or below it); ``above`` (slower at the largest T tried: at or above it, or never).
        lo_secs: the smallest T tried.
        hi_secs: the largest T tried.
    """

    secs: float | None
    where: str
    lo_secs: float
    hi_secs: float

    def sentence(self) -> str:
        """The break-even in words, honest about a range that does not contain it."""
        if self.where == "found":
            return f"T = {self.secs:.2f} s (prefetching is no slower from there on)"
        if self.where == "below":
            return (f"none within the Ts tried: prefetching was no slower at every T, from T = {self.lo_secs:.2f} s "
                    "(the break-even lies at or below it)")  # fmt: skip
        return (f"none within the Ts tried: prefetching was still slower at T = {self.hi_secs:.2f} s (the largest; "
                "the break-even lies above it, if anywhere)")  # fmt: skip


def break_even(direct: float, curve: list[tuple[float, float]]) -> BreakEven:
    """The init time from which the prefetch curve (sorted (T, secs), at least one point) stays at or
    below ``direct``: after the last T where it is above, interpolated linearly up to the next T.
    Taking the last crossing, not the first, keeps one noisy low point at a small T from being
    reported as the break-even."""
    lo, hi = curve[0][0], curve[-1][0]
    above = [i for i, (_, p) in enumerate(curve) if p > direct]
    if not above:
        return BreakEven(None, "below", lo, hi)
    i = above[-1]
    if i == len(curve) - 1:
        return BreakEven(None, "above", lo, hi)
    (t0, p0), (t1, p1) = curve[i], curve[i + 1]
    return BreakEven(t0 + (p0 - direct) * (t1 - t0) / (p0 - p1), "found", lo, hi)


@dataclass
class PrefetchResult:
    """What the restart sweep measured.

    Attributes:
        direct_secs: per repeat, time from the end of init to the restored state without prefetch.
        prefetch_secs: per init time T, the same with ``prefetch()`` called before init (per repeat).
        prefetch_done_secs: per prefetch restart, how long the prefetch alone took (from the call to its future).
        break_even: where prefetching starts to win (see :class:`BreakEven`).
    """

    nbytes: int
    direct_secs: list[float] = field(default_factory=list)
    prefetch_secs: dict[float, list[float]] = field(default_factory=dict)
    prefetch_done_secs: list[float] = field(default_factory=list)
    break_even: BreakEven | None = None

    @property
    def break_even_secs(self) -> float | None:
        """The break-even T in seconds, None when it is not within the Ts tried."""
        return self.break_even.secs if self.break_even else None

    def lines(self) -> list[str]:
        """The markdown table (medians over repeats) and the break-even sentence."""
        d = statistics.median(self.direct_secs)
        out = [
            "| init T s | direct: after init s | prefetch: after init s | prefetch saves s |",
            "|---:|---:|---:|---:|",
        ]
        for t, xs in sorted(self.prefetch_secs.items()):
            p = statistics.median(xs)
            out.append(f"| {t:.3f} | {d:.3f} | {p:.3f} | {d - p:+.3f} |")
        be = self.break_even.sentence() if self.break_even else "not computed"
        out += ["", f"Break-even: {be}. A direct restore from pfs took {d:.3f} s after init (median)."]
        if self.prefetch_done_secs:
            pd = statistics.median(self.prefetch_done_secs)
            out[-1] += (
                f" In the restart process, prefetch() alone (until the host held the step) took {pd:.3f} s (median)."
            )
        return out


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


class Restarts:
    """Restart processes, forked one at a time from a fork server (``python -m tierckpt.bench._restart``)
    that has imported tierckpt's hierarchy and torch and done nothing else. Close it when done."""

    def __init__(self) -> None:
        src = str(Path(tierckpt.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tierckpt.bench._restart"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        self._answer(120.0, "start")

    def _answer(self, timeout: float, what: str) -> list[Any]:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            why = f"gave no answer within {timeout:.0f} s" if not ready else "exited"
            raise RuntimeError(f"restart fork server {why} ({what})")
        got: list[Any] = json.loads(line)  # the server writes one JSON list a line
        return got

    def run(self, cfg_path: Path, mode: str, init_secs: float, timeout: float) -> dict[str, Any]:
        """One restart in a new process; its timings.

        Raises:
            RuntimeError: the restart failed, or gave no result within ``timeout`` seconds.
        """
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps([str(cfg_path), mode, init_secs]) + "\n")
        self._proc.stdin.flush()
        answer = self._answer(timeout, f"{mode} restart, T = {init_secs} s")
        if answer[0] != "ok":
            raise RuntimeError(f"restart process failed: {answer[1]}")
        timings: dict[str, Any] = answer[1]  # an "ok" answer carries the timings dict
        return timings

    def close(self) -> None:
        """Stop the fork server (and a restart still running, on a timeout)."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def _per_tier(rec: Recorder, wl: Workload, cfg: dict[str, Any], root: Path, repeats: int, cold: str) -> None:
    """``prefetch()`` from pfs to host, then restores from host, local (cold) and pfs (cold) in turn,
    and memcpy of the same size, all in this process."""
    memcpy = Memcpy()
    memcpy.open(root, wl)
    with Hierarchy.from_config(cfg) as h:
        for rep in range(repeats):
            make_cold([root / "pfs"], cold)
            with measure() as u:
                h.prefetch(STEP).result()  # the host holds it; the local copy follows, from the host's
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


def _sweep(
    res: PrefetchResult,
    restart: Callable[[str, float, int], dict[str, Any]],
    factors: tuple[float, ...],
    init_secs: list[float] | None,
    repeats: int,
) -> None:
    """Per repeat: a direct restart, then a prefetch restart at every T (in a rotated order). Without
    ``init_secs``, the Ts are ``factors`` times the time prefetch() took in the first prefetch restart
    (T = 0 of repeat 0)."""
    first: dict[str, Any] | None = None
    if init_secs:
        grid = list(init_secs)
    else:
        first = restart("prefetch", 0.0, 0)
        scale = first["prefetch_done_secs"] or first["after_init_secs"]
        grid = sorted({round(f * scale, 3) for f in factors})
    for rep in range(repeats):
        res.direct_secs.append(restart("direct", 0.0, rep)["after_init_secs"])
        for t in grid[rep % len(grid) :] + grid[: rep % len(grid)]:
            out = first if (first is not None and rep == 0 and t == 0.0) else restart("prefetch", t, rep)
            res.prefetch_secs.setdefault(t, []).append(out["after_init_secs"])
            if out.get("prefetch_done_secs") is not None:
                res.prefetch_done_secs.append(out["prefetch_done_secs"])


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
        factors: init times as multiples of the time ``prefetch()`` took in the first restart process
            (a prefetch at T = 0; used unless ``init_secs`` is given).
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
    _per_tier(rec, wl, cfg, root, repeats, cold)
    res = PrefetchResult(wl.nbytes)

    def one(restarts: Restarts, mode: str, t: float, rep: int) -> dict[str, Any]:
        _clear(root / "local")
        make_cold([root / "pfs"], cold)
        progress.describe(f"prefetch: restart {mode} T={t:.2f}s r{rep}")
        out = restarts.run(cfg_path, mode, t, timeout=600)
        rec.emit({"kind": "restart", "repeat": rep, "bytes": wl.nbytes, **out})
        progress.write(f"  [restart r{rep}] {mode:>8} init {t:6.2f} s  after init {out['after_init_secs']:.3f} s "
                       f"(restored from {out['last_restore'][1]})")  # fmt: skip
        progress.update()
        return out

    restarts = Restarts()
    try:
        _sweep(res, functools.partial(one, restarts), factors, init_secs, repeats)
    finally:
        restarts.close()
    curve = sorted((t, statistics.median(xs)) for t, xs in res.prefetch_secs.items())
    res.break_even = break_even(statistics.median(res.direct_secs), curve)
    rec.emit({"kind": "prefetch_summary", "bytes": wl.nbytes, "direct_median_secs": statistics.median(res.direct_secs),
              "curve": curve, "break_even_secs": res.break_even_secs, "break_even_where": res.break_even.where})  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)
    return res


def child_main(argv: list[str]) -> int:
    """``CONFIG.json MODE T``: one restart in this process → one JSON line on stdout."""
    print(json.dumps(restart(argv[0], argv[1], float(argv[2]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
