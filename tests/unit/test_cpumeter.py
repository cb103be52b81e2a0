"""The CPU time a tier's writes cost (tierckpt/datapath/cpumeter.py) and the codec pool's CPU count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zstandard

from tierckpt.datapath import codecpool
from tierckpt.datapath.cpumeter import WINDOW_BYTES, WINDOW_SECONDS, CpuMeter, busy_cpu_seconds, meter_for
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.compression import Adaptive

W = WINDOW_SECONDS * 1.5  # a step that ends a window

STAT = """cpu  900 90 900 9000 90 9 9 9 0 0
cpu0 100 10 100 1000 10 1 1 1 0 0
cpu1 200 20 200 2000 20 2 2 2 0 0
cpu2 400 40 400 4000 40 4 4 4 0 0
intr 12345 1 2 3
ctxt 999
"""


def test_busy_seconds_count_the_usable_cpus_busy_fields(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system irq softirq steal; not idle (4th) nor iowait (5th)
    assert busy_cpu_seconds({0}, str(stat)) == pytest.approx((100 + 10 + 100 + 1 + 1 + 1) / tick)
    assert busy_cpu_seconds({0, 2}, str(stat)) == pytest.approx((213 + 852) / tick)
    assert busy_cpu_seconds({7}, str(stat)) is None  # none of them listed
    assert busy_cpu_seconds({0}, str(tmp_path / "missing")) is None
    stat.write_text("cpu0 1 2 x 4\n")
    assert busy_cpu_seconds({0}, str(stat)) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat")
def test_busy_seconds_of_this_machine_grow() -> None:
    a = busy_cpu_seconds()
    assert a is not None and a > 0
    x = os.urandom(1 << 20) * 16
    for _ in range(20):
        zstandard.ZstdCompressor(level=3).compress(x)
    b = busy_cpu_seconds()
    assert b is not None and b > a


def test_the_codec_pool_counts_its_tasks_cpu_time() -> None:
    before = codecpool.cpu_seconds()
    x = os.urandom(1 << 20) * 16

    def work() -> None:
        for _ in range(10):
            zstandard.ZstdCompressor(level=3).compress(x)

    codecpool.submit(work).result()
    assert codecpool.cpu_seconds() > before


class Clock:
    def __init__(self) -> None:
        self.t = 100.0
        self.busy = 1000.0
        self.codec = 10.0
        self.readable = True

    def now(self) -> float:
        return self.t

    def read(self) -> tuple[float, float] | None:
        return (self.busy, self.codec) if self.readable else None


class Seen(Adaptive):
    def __init__(self) -> None:
        super().__init__(CompressConfig("auto"), 2, cpus=2)
        self.seen: list[tuple[float, int]] = []

    def observe_cpu(self, cpu_seconds: float, stored_bytes: int) -> None:
        self.seen.append((cpu_seconds, stored_bytes))


def write(c: Clock, m: CpuMeter, seconds: float, busy: float, codec: float, nbytes: int) -> None:
    """One write alone in flight, of ``seconds``, while the CPUs were busy ``busy`` s, the codec ``codec``."""
    m.start()
    c.t += seconds
    c.busy += busy
    c.codec += codec
    m.end(nbytes)


def idle(c: Clock, seconds: float, busy: float) -> None:
    c.t += seconds
    c.busy += busy


def test_a_meter_reports_the_cpu_beside_the_codec_once_a_window_is_measured() -> None:
    c, a = Clock(), Seen()
    m = CpuMeter(a, c.read, c.now)
    write(c, m, WINDOW_SECONDS / 2, 0.15, 0.05, 1 << 20)  # shorter than a window: kept
    assert a.seen == []
    write(c, m, W, 0.5, 0.2, 3 << 20)
    assert a.seen == [(pytest.approx(0.65 - 0.25), 4 << 20)]
    write(c, m, W, 0.1, 0.3, 2 << 20)  # the codec took more than the CPUs were busy: 0, not less
    assert a.seen[-1] == (0.0, 2 << 20)


def test_only_the_spells_with_writes_in_flight_are_charged() -> None:
    c, a = Clock(), Seen()
    m = CpuMeter(a, c.read, c.now)
    write(c, m, WINDOW_SECONDS / 2, 0.2, 0.0, 1 << 20)
    idle(c, 3600.0, 7000.0)  # an hour of training between two checkpoints: charged to no bytes
    write(c, m, W, 0.3, 0.0, 5 << 20)
    assert a.seen == [(pytest.approx(0.5), 6 << 20)]


def test_overlapping_writes_make_one_spell() -> None:
    c, a = Clock(), Seen()
    m = CpuMeter(a, c.read, c.now)
    m.start()
    c.t, c.busy = c.t + W / 2, c.busy + 0.1
    m.start()  # a second write (another copy to the same tier) while the first is in flight
    c.t, c.busy = c.t + W / 2, c.busy + 0.1
    m.end(4 << 20)
    assert a.seen == []  # a write is still in flight
    c.t, c.busy = c.t + W / 2, c.busy + 0.1
    m.end(4 << 20)
    assert a.seen == [(pytest.approx(0.3), 8 << 20)]


def test_short_spells_are_reported_once_they_wrote_enough() -> None:
    c, a = Clock(), Seen()
    m = CpuMeter(a, c.read, c.now)
    for _ in range(WINDOW_BYTES // (4 << 20) - 1):  # paced writes: 2 ms each, far below a window
        write(c, m, 0.002, 0.004, 0.0, 4 << 20)
        idle(c, 0.1, 0.05)
    assert a.seen == []
    write(c, m, 0.002, 0.004, 0.0, 4 << 20)
    assert a.seen == [(pytest.approx(0.004 * WINDOW_BYTES / (4 << 20)), WINDOW_BYTES)]


def test_a_failed_write_ends_its_spell_without_bytes() -> None:
    c, a = Clock(), Seen()
    m = CpuMeter(a, c.read, c.now)
    write(c, m, W, 0.4, 0.0, 0)
    assert a.seen == []  # no bytes: nothing to charge it to yet
    write(c, m, W, 0.2, 0.0, 1 << 20)
    assert a.seen == [(pytest.approx(0.6), 1 << 20)]


def test_a_meter_without_a_clock_measures_nothing() -> None:
    c, a = Clock(), Seen()
    c.readable = False
    m = CpuMeter(a, c.read, c.now)
    for _ in range(10):
        write(c, m, W, 1.0, 0.0, 1 << 20)
    assert a.seen == []
    c.readable = True  # readable again (a transient error): measured from then on
    for _ in range(3):
        write(c, m, W, 1.0, 0.0, 1 << 20)
    assert a.seen == [(pytest.approx(1.0), 1 << 20)] * 3


def test_one_meter_per_adaptive() -> None:
    a, b = Adaptive(CompressConfig("auto"), 2), Adaptive(CompressConfig("auto"), 2)
    assert meter_for(a) is meter_for(a)
    assert meter_for(a) is not meter_for(b)
