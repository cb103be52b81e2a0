"""The CPU time a tier's writes cost, for ``auto``'s decisions (:meth:`~tierckpt.policies.compression.
Adaptive.observe_cpu`): compressing pays only where there is CPU to compress with, and writing to a tier
takes CPU too — the client's system calls and copies, a FUSE daemon, and, where the servers run on the
same machine (a loopback Ceph, a single-node test cluster), the servers themselves.

A :class:`CpuMeter` (one per :class:`~tierckpt.policies.compression.Adaptive`, so one per tier) reads,
while the tier is being written, how busy the CPUs this process may run on were (every process's time on
them: ``/proc/stat``), subtracts the time the process's codec threads spent (:mod:`codecpool` counts it),
and reports that CPU time with the stored bytes written meanwhile, once the spells it measured add up to
:data:`WINDOW_SECONDS` (or the bytes to :data:`WINDOW_BYTES`). Only the spells while writes are in flight are measured, so the time between
checkpoints (training) is never charged to a tier's bytes; work that runs beside the writes (a
training step's CPU side) is: it competes for the same CPUs.

Where ``/proc/stat`` cannot be read (not Linux), nothing is measured and the decisions rest on the
compressor's speed and the tier's throughput alone.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable

from tierckpt.datapath import codecpool
from tierckpt.policies.compression import Adaptive

__all__ = ["WINDOW_BYTES", "WINDOW_SECONDS", "CpuMeter", "busy_cpu_seconds", "meter_for", "usable_cpus"]

#: the writes' busy time one report adds up at least (``/proc/stat`` counts in clock ticks of 10 ms)...
WINDOW_SECONDS = 0.1
#: ...or the stored bytes (writes paced by a budget are short spells: each one's ticks are few, but their
#: sum counts the CPUs' time without bias, and the running averages smooth it)
WINDOW_BYTES = 32 << 20
#: the fields of a ``/proc/stat`` cpu line that count busy time: user nice system irq softirq steal
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)

Clock = Callable[[], "tuple[float, float] | None"]


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return set(range(os.cpu_count() or 1))


def busy_cpu_seconds(cpus: set[int] | None = None, stat: str = "/proc/stat") -> float | None:
    """Seconds the CPUs ``cpus`` (default: :func:`usable_cpus`) have been busy since boot, counting every
    process; None where ``stat`` cannot be read or parsed."""
    cpus = usable_cpus() if cpus is None else cpus
    try:
        with open(stat, encoding="ascii") as f:
            lines = f.read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    total, seen = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        try:
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
        except ValueError:
            return None
        seen += 1
    return total / tick if seen and tick > 0 else None


def _clock() -> tuple[float, float] | None:
    busy = busy_cpu_seconds()
    return None if busy is None else (busy, codecpool.cpu_seconds())


class CpuMeter:
    """Measures the CPU time a tier's writes take (see the module docstring) for its ``adaptive``.

    Its writers tell it when each write starts and ends; it reads the clock when the first write in flight
    starts and when the last one ends, and adds up the busy spells until they last
    :data:`WINDOW_SECONDS`, then reports them.

    Args:
        adaptive: where the measurements go (:meth:`~tierckpt.policies.compression.Adaptive.observe_cpu`).
        clock: ``(busy seconds of the CPUs, codec threads' CPU seconds)``, or None when unknown.
        now: a monotonic clock in seconds.
    """

    def __init__(self, adaptive: Adaptive, clock: Clock = _clock, now: Callable[[], float] = time.monotonic) -> None:
        self._adaptive, self._clock, self._now = adaptive, clock, now
        self._lock = threading.Lock()
        self._inflight = 0
        self._mark: tuple[float, tuple[float, float] | None] = (0.0, None)  # the spell's start: time, clock
        self._seconds = self._cpu = 0.0  # the spells added up since the last report
        self._bytes = 0

    def start(self) -> None:
        """A write to the tier starts."""
        with self._lock:
            self._inflight += 1
            if self._inflight == 1:
                self._mark = (self._now(), self._clock())

    def end(self, nbytes: int) -> None:
        """A write started with :meth:`start` ended, having stored ``nbytes`` (0: it failed)."""
        with self._lock:
            self._inflight -= 1
            if self._inflight:
                self._bytes += nbytes
                return
            (t0, c0), t1, c1 = self._mark, self._now(), self._clock()
            if c0 is None or c1 is None:  # the spell is not measured: neither are its bytes
                self._bytes = 0
                return
            self._bytes += nbytes
            self._seconds += t1 - t0
            self._cpu += (c1[0] - c0[0]) - (c1[1] - c0[1])
            if (self._seconds < WINDOW_SECONDS and self._bytes < WINDOW_BYTES) or not self._bytes:
                return
            cpu, nbytes = max(0.0, self._cpu), self._bytes
            self._seconds = self._cpu = 0.0
            self._bytes = 0
        self._adaptive.observe_cpu(cpu, nbytes)


_meters: weakref.WeakKeyDictionary[Adaptive, CpuMeter] = weakref.WeakKeyDictionary()
_meters_lock = threading.Lock()


def meter_for(adaptive: Adaptive) -> CpuMeter:
    """The meter of ``adaptive`` (made on first use): one per tier, shared by the tier's writers, so that
    concurrent copies to it are measured together."""
    with _meters_lock:
        m = _meters.get(adaptive)
        if m is None:
            m = _meters[adaptive] = CpuMeter(adaptive)
        return m
