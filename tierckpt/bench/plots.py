"""matplotlib PNGs: grouped bars per peer and workload, the prefetch curve, the tuning sweep.

matplotlib is optional (``pip install 'tierckpt[bench]'``): :func:`available` says whether it imports,
and without it the harness writes no PNG and says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierckpt.bench.metrics import Recorder
from tierckpt.bench.prefetch import PrefetchResult
from tierckpt.bench.sweep import SweepResult

__all__ = ["available", "plot_comparison", "plot_prefetch", "plot_sweep"]


def available() -> str | None:
    """None when matplotlib imports (with the non-interactive Agg backend), else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except Exception as e:  # ImportError, or a broken install
        return f"{type(e).__name__}: {e}"
    return None


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt: Any, fig: Any, ax: Any, path: Path, ylabel: str, title: str, grid_axis: str = "both") -> Path:
    """Label, grid and legend ``ax``; save ``fig`` to ``path`` and close it."""
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis=grid_axis, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(rec: Recorder, workloads: Sequence[str], path: Path) -> Path | None:
    """Grouped bars: median GB/s of every peer on every workload, save (durable) and cold restore.
    Returns the PNG path, or None when there is nothing to plot."""
    panels = [("save (durable)", "save", None), ("restore, cold page cache", "restore", "cold")]
    wls = [w for w in workloads if rec.select(workload=w)]
    peers = [p for p in dict.fromkeys(s.peer for s in rec.samples if s.workload in wls) if not p.startswith("memcpy")]
    if not wls or not peers:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 0.35 * len(wls) * len(peers)), 5.5), squeeze=False)
    width = 0.8 / len(peers)
    cmap = plt.get_cmap("tab20")
    for ax, (title, op, cache) in zip(axes[0], panels):
        for i, peer in enumerate(peers):
            vals = [rec.summary(w, peer, op, cache, "gbps", "median") or 0.0 for w in wls]
            xs = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(wls))]
            ax.bar(xs, vals, width, label=peer, color=cmap(i % 20))
        ax.set_xticks(range(len(wls)), wls)
        ax.set_ylabel("GB/s (median, state bytes / wall time)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("tierckpt vs peers (missing bar: not measured or skipped)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_prefetch(res: PrefetchResult, path: Path) -> Path:
    """Time from the end of init to the restored state vs init time T, direct and with prefetch; every
    repeat as a dot, the medians as the curve, and the break-even as a line only where it lies inside
    the Ts tried (otherwise the title says on which side of them it lies)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ts = sorted(res.prefetch_secs)
    for t in ts:
        ax.plot([t] * len(res.prefetch_secs[t]), res.prefetch_secs[t], ".", color="C0", alpha=0.35)
    ax.plot(
        ts,
        [statistics.median(res.prefetch_secs[t]) for t in ts],
        "o-",
        color="C0",
        label="prefetch() at start (median)",
    )
    d = statistics.median(res.direct_secs)
    ax.axhline(d, color="C1", linestyle="--", label=f"direct restore from pfs ({d:.3f} s, median)")
    be = res.break_even
    if be is not None and be.secs is not None:
        ax.axvline(be.secs, color="gray", linestyle=":", label=f"break-even T = {be.secs:.3f} s")
    note = ""
    if be is not None and be.where == "below":
        note = f"\nno break-even in range: prefetch no slower at every T from {be.lo_secs:.3f} s"
    elif be is not None and be.where == "above":
        note = f"\nno break-even in range: prefetch still slower at T = {be.hi_secs:.3f} s"
    ax.set_xlabel("simulated initialization T (s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    title = f"Restart with prefetch, {res.nbytes / 1e9:.2f} GB on pfs only{note}"
    return _finish(plt, fig, ax, path, "time to restored state after init (s)", title)


def plot_sweep(res: SweepResult, path: Path) -> Path:
    """Save and cold-restore GB/s of every setting the sweep tried, best first."""
    plt = _plt()
    order = sorted(res.scores, key=lambda s: res.scores[s])
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(order)), 4.5))
    xs = range(len(order))
    ax.bar([x - 0.2 for x in xs], [res.save_gbps[s] for s in order], 0.4, label="save (durable)")
    ax.bar([x + 0.2 for x in xs], [res.restore_gbps[s] for s in order], 0.4, label="restore (cold)")
    ax.set_xticks(list(xs), [s.label for s in order], rotation=45, ha="right", fontsize=8)
    return _finish(plt, fig, ax, path, "GB/s (median)", "io: settings, best (lowest save + restore time) first", "y")
