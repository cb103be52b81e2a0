"""Tuning sweep: which ``io:`` settings save and restore fastest on this machine's disk.

Knobs: engine (``uring``, ``threads``), O_DIRECT on/off, queue depth, chunk size. By default the sweep
goes one knob at a time (coordinate descent from the library's defaults: each knob's values are tried
with the others at their best so far, in the order engine, direct, queue depth, chunk), which needs
about a dozen settings instead of the whole grid; ``grid=True`` tries every combination. A setting's
score is the median save time (durable, to a ``local`` tier) plus the median cold restore time.
"""

from __future__ import annotations

import gc
import itertools
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.bench.compare import Progress
from tierckpt.bench.metrics import Recorder, Sample
from tierckpt.bench.system import make_cold, measure
from tierckpt.bench.workloads import Workload
from tierckpt.config import format_size
from tierckpt.hierarchy import Hierarchy
from tierckpt.ioconfig import IOConfig
from tierckpt.tiers.base import CheckpointKey

__all__ = ["KNOBS", "QUICK_KNOBS", "Setting", "SweepResult", "run_sweep", "settings_count"]

KNOBS: dict[str, tuple[Any, ...]] = {
    "engine": ("uring", "threads"),
    "direct": (True, False),
    "queue_depth": (4, 8, 16, 32),
    "chunk_bytes": (8 << 20, 32 << 20, 128 << 20),  # around the default (32 MiB), as the old grid was
}
QUICK_KNOBS: dict[str, tuple[Any, ...]] = {
    "engine": ("uring", "threads"),
    "direct": (True, False),
    "queue_depth": (4, 16),
    "chunk_bytes": (4 << 20, 16 << 20),
}


@dataclass(frozen=True)
class Setting:
    """One combination of the knobs."""

    engine: str
    direct: bool
    queue_depth: int
    chunk_bytes: int

    @property
    def label(self) -> str:
        """Short name, e.g. ``uring/direct/qd8/64MiB``."""
        return (f"{self.engine}/{'direct' if self.direct else 'buffered'}/qd{self.queue_depth}/"
                f"{format_size(self.chunk_bytes)}")  # fmt: skip

    def io(self) -> dict[str, Any]:
        """The ``io:`` mapping of a hierarchy config."""
        return {"engine": self.engine, "direct": self.direct, "queue_depth": self.queue_depth,
                "chunk": format_size(self.chunk_bytes)}  # fmt: skip

    def yaml(self) -> str:
        """The ``io:`` line to paste into a hierarchy YAML file."""
        return (f"io: {{engine: {self.engine}, direct: {str(self.direct).lower()}, "
                f"queue_depth: {self.queue_depth}, chunk: {format_size(self.chunk_bytes)}}}")  # fmt: skip


@dataclass
class SweepResult:
    """Scores (seconds, lower is better) and rates per setting, in the order tried."""

    nbytes: int
    scores: dict[Setting, float]
    save_gbps: dict[Setting, float]
    restore_gbps: dict[Setting, float]

    @property
    def best(self) -> Setting:
        """The setting with the lowest score."""
        return min(self.scores, key=lambda s: self.scores[s])

    def lines(self) -> list[str]:
        """Markdown table (best first) and the YAML block to use."""
        out = ["| setting | save GB/s | restore cold GB/s | save + restore s |", "|---|---:|---:|---:|"]
        for s in sorted(self.scores, key=lambda s: self.scores[s]):
            out.append(f"| {s.label} | {self.save_gbps[s]:.2f} | {self.restore_gbps[s]:.2f} | {self.scores[s]:.3f} |")
        out += ["", f"Best on this machine: `{self.best.label}`. Use it in the hierarchy YAML:", "", "```yaml",
                self.best.yaml(), "```"]  # fmt: skip
        return out


def settings_count(knobs: dict[str, tuple[Any, ...]], grid: bool) -> int:
    """How many settings a sweep tries (an upper bound for the one-knob-at-a-time walk)."""
    if grid:
        n = 1
        for v in knobs.values():
            n *= len(v)
        return n
    return 1 + sum(len(v) - 1 for v in knobs.values())


def _default() -> Setting:
    d = IOConfig()
    return Setting("uring", d.direct, d.queue_depth, d.chunk_bytes)


def _measure_setting(
    rec: Recorder, wl: Workload, root: Path, s: Setting, repeats: int, cold: str
) -> tuple[float, float, float]:
    """(score, save GB/s, restore GB/s) of one setting, medians over ``repeats``."""
    path = root / s.label.replace("/", "-")
    saves: list[float] = []
    restores: list[float] = []
    try:
        with Hierarchy.from_config(
            {"tiers": [{"name": "local", "kind": "local", "path": str(path)}], "io": s.io()}
        ) as h:
            for rep in range(repeats):
                gc.collect()
                with measure() as u:
                    h.save(wl.state, step=rep, blocking=True).wait()
                saves.append(u.wall_secs)
                rec.add(Sample("sweep", s.label, "save", rep, wl.nbytes, u.wall_secs, cpu_secs=u.cpu_secs))
                method = make_cold([path], cold)
                with measure() as u:
                    state = h.restore(step=rep)
                del state
                restores.append(u.wall_secs)
                rec.add(Sample("sweep", s.label, "restore", rep, wl.nbytes, u.wall_secs, cache="cold",
                               cold_method=method, cpu_secs=u.cpu_secs))  # fmt: skip
                h.tiers[0].evict(CheckpointKey(rep, h.rank))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    ms, mr = statistics.median(saves), statistics.median(restores)
    return ms + mr, wl.nbytes / ms / 1e9, wl.nbytes / mr / 1e9


def run_sweep(
    rec: Recorder,
    wl: Workload,
    scratch: Path,
    *,
    repeats: int,
    cold: str,
    knobs: dict[str, tuple[Any, ...]] | None = None,
    grid: bool = False,
    progress: Progress,
) -> SweepResult:
    """Sweep the ``io:`` knobs on ``wl``; a setting that fails (e.g. io_uring unavailable) is skipped.

    Args:
        rec: recorder.
        wl: the state to save and restore (the ``llm`` workload).
        scratch: folder for the local tier.
        repeats: repeats per setting.
        cold: cache-emptying method.
        knobs: values per knob (default :data:`KNOBS`).
        grid: every combination instead of one knob at a time.
        progress: console bar (one unit per setting).
    """
    knobs = knobs or KNOBS
    root = scratch / "sweep"
    root.mkdir(parents=True, exist_ok=True)
    res = SweepResult(wl.nbytes, {}, {}, {})

    def score(s: Setting) -> float:
        if s not in res.scores:
            progress.describe(f"sweep {s.label}")
            try:
                res.scores[s], res.save_gbps[s], res.restore_gbps[s] = _measure_setting(rec, wl, root, s, repeats, cold)
            except Exception as e:
                rec.skip(f"sweep {s.label}", f"{type(e).__name__}: {e}".splitlines()[0][:300])
                res.scores[s], res.save_gbps[s], res.restore_gbps[s] = float("inf"), 0.0, 0.0
            progress.update()
        return res.scores[s]

    if grid:
        for combo in itertools.product(*knobs.values()):
            score(Setting(*combo))
    else:
        best = _default()
        for knob, values in knobs.items():
            cands = [Setting(**{**best.__dict__, knob: v}) for v in values]
            best = min(cands, key=score)
    shutil.rmtree(root, ignore_errors=True)
    res.scores = {s: v for s, v in res.scores.items() if v != float("inf")}
    if not res.scores:
        raise RuntimeError("every setting of the sweep failed (see the skipped lines)")
    rec.emit({"kind": "sweep_best", "setting": res.best.io(), "yaml": res.best.yaml(), "bytes": wl.nbytes})
    return res
