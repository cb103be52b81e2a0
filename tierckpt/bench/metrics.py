"""Samples, their statistics, and the JSON-lines file every benchmark writes.

Every timed operation becomes one ``sample`` record; :class:`Recorder` keeps them in memory (for the
tables and plots) and appends them to ``<out>/<prefix>-<stamp>.jsonl`` as they happen, so an interrupted
run keeps what it measured.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GB", "MB", "Recorder", "Sample", "Skip", "stat"]

GB = 1e9
MB = 1e6


@dataclass
class Sample:
    """One timed operation.

    Attributes:
        workload: workload name.
        peer: implementation (``tierckpt``, ``torch.save``, ``raw:uring`` …).
        op: ``save`` or ``restore`` (or ``memcpy``).
        repeat: repeat index.
        nbytes: tensor bytes of the state (rates are always state bytes / seconds).
        wall_secs: the operation's time: durable for a save, state in memory for a restore.
        api_secs: save only: until the call returned.
        blocking_secs: save only: until the state may be mutated (the staging future, waited at once).
        cache: restore only: ``cold`` or ``warm`` page cache, or ``memory`` (a tier in memory).
        resident: restore only: fraction of the files' pages in the page cache just before the read.
        cold_method: restore only: how the cache was emptied (``drop_caches`` or ``fadvise``).
        cpu_secs: process CPU seconds (all threads) during the operation.
        peak_extra_rss_bytes: peak RSS during the operation minus RSS before it.
        file_bytes: bytes on disk the operation wrote or read, where known.
    """

    workload: str
    peer: str
    op: str
    repeat: int
    nbytes: int
    wall_secs: float
    api_secs: float | None = None
    blocking_secs: float | None = None
    cache: str | None = None
    resident: float | None = None
    cold_method: str | None = None
    cpu_secs: float | None = None
    peak_extra_rss_bytes: int | None = None
    file_bytes: int | None = None

    @property
    def gbps(self) -> float:
        """State bytes (10^9) per second of ``wall_secs``."""
        return self.nbytes / self.wall_secs / GB if self.wall_secs > 0 else float("inf")

    def record(self) -> dict[str, Any]:
        """The JSON record (rounded, ``None`` fields left out)."""
        d = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items() if v is not None}
        return {"kind": "sample", **d, "gbps": round(self.gbps, 4)}


@dataclass
class Skip:
    """A peer (or benchmark) that did not run, and why."""

    peer: str
    why: str
    workload: str | None = None


def stat(values: Iterable[float | None], which: str) -> float | None:
    """``median`` or ``min`` of the values that are not None; None when there are none."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return statistics.median(xs) if which == "median" else min(xs)


@dataclass
class Recorder:
    """Collects samples and writes every record as one JSON line.

    Args:
        out: folder for the file.
        prefix: file name prefix (``bench``, ``prefetch``, ``sweep``).
        echo: called with a one-line description of each sample (e.g. the progress bar's ``write``).
    """

    out: Path
    prefix: str = "bench"
    echo: Callable[[str], None] = print
    samples: list[Sample] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = self.out / f"{self.prefix}-{self.stamp}.jsonl"

    def emit(self, rec: dict[str, Any]) -> None:
        """Append one record to the JSON-lines file."""
        with self.path.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def add(self, s: Sample) -> None:
        """Keep a sample, write it, and echo a line about it."""
        self.samples.append(s)
        self.emit(s.record())
        extra = ""
        if s.op == "save" and s.blocking_secs is not None and s.api_secs is not None:
            extra = f"  (returned {s.api_secs:.3f} s, safe to mutate {s.blocking_secs:.3f} s)"
        elif s.cache:
            res = "" if s.resident is None else f", {100 * s.resident:.0f} % resident"
            extra = f"  ({s.cache}{res})"
        self.echo(f"  [{s.workload} r{s.repeat}] {s.peer:>22} {s.op:<7} {s.wall_secs:8.3f} s {s.gbps:7.3f} GB/s{extra}")

    def skip(self, peer: str, why: str, workload: str | None = None) -> None:
        """Note that ``peer`` did not run (once per peer and workload)."""
        if any(k.peer == peer and k.workload == workload for k in self.skips):
            return
        self.skips.append(Skip(peer, why, workload))
        self.emit({"kind": "skip", "peer": peer, "workload": workload, "why": why})
        self.echo(f"  skipped {peer}{f' on {workload}' if workload else ''}: {why}")

    def note(self, text: str) -> None:
        """A remark that goes into the markdown report and the JSON lines."""
        if text not in self.notes:
            self.notes.append(text)
            self.emit({"kind": "note", "text": text})

    def select(self, **match: Any) -> list[Sample]:
        """The samples whose fields equal ``match``."""
        return [s for s in self.samples if all(getattr(s, k) == v for k, v in match.items())]

    def summary(self, workload: str, peer: str, op: str, cache: str | None, field_: str, which: str) -> float | None:
        """``median``/``min`` over repeats of one field of the matching samples (``gbps`` for the rate)."""
        sel = self.select(workload=workload, peer=peer, op=op, cache=cache)
        if field_ == "gbps":
            secs = stat((s.wall_secs for s in sel), "median" if which == "median" else "min")
            return None if secs is None or not sel else sel[0].nbytes / secs / GB
        return stat((getattr(s, field_) for s in sel), which)
