"""What ``bench_s3.py``'s children measure: a :class:`Mark` is a point in time (wall and monotonic clocks,
this process's CPU and RSS, the server's CPU); the interval between two marks is what the parent reads.
The children and ``s3_peers.py`` share this module (not ``s3_child``, which runs as ``__main__``)."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GAP_S = 0.02  # between two windows whose requests the parent counts apart (radosgw's clock: 4 ms ticks)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith(field + ":")), 0)


def cpu_secs() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


SERVER_PIDS: list[int] = []  #: radosgw's and the OSD's, where the parent runs them (``spec["server_pids"]``)
_TICK = os.sysconf("SC_CLK_TCK")


def server_cpu_secs() -> float | None:
    """CPU seconds so far of the server's processes (None when they are not known or gone)."""
    if not SERVER_PIDS:
        return None
    total = 0.0
    for pid in SERVER_PIDS:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


class Mark:
    """A point in time: wall clock, monotonic clock, process CPU, RSS; with ``reset`` the peak-RSS mark
    (VmHWM) is set to the RSS now."""

    def __init__(self, reset: bool = False) -> None:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self.wall, self.mono, self.cpu, self.rss_kib = (
            time.time(),
            time.perf_counter(),
            cpu_secs(),
            _status_kib("VmRSS"),
        )
        self.server_cpu = server_cpu_secs()

    def until(self, end: Mark) -> dict[str, Any]:
        """The interval from this mark to ``end`` as the parent reads it."""
        srv = None if self.server_cpu is None or end.server_cpu is None else end.server_cpu - self.server_cpu
        return {"secs": end.mono - self.mono, "cpu": end.cpu - self.cpu, "t0": self.wall, "t1": end.wall,
                "extra_rss": max(0, _status_kib("VmHWM") - self.rss_kib) * 1024, "server_cpu": srv}  # fmt: skip


@contextlib.contextmanager
def measured(out: dict[str, Any]) -> Iterator[None]:
    """Measure the block into ``out`` (see :meth:`Mark.until`)."""
    start = Mark(reset=True)
    yield
    out.update(start.until(Mark()))
