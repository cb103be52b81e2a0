"""The bandwidth budget's token bucket (tierckpt/io/budget.py), on a fake clock: its rate, its burst of one
chunk after an idle period, requests larger than the burst, many threads at once, and the bound on every
window (at most one burst, or one larger request, more than the rate allows)."""

from __future__ import annotations

import random
import threading

import pytest

from tierckpt.io.budget import Budget

MB = 10**6
CHUNK = 4 << 20


class FakeTime:
    """A clock that only moves when someone sleeps (one thread) or the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.slept.append(secs)
        self.now += secs


def bucket(t: FakeTime, rate: float = 100 * MB, burst: int = CHUNK, throttle: str = "background") -> Budget:
    return Budget(rate, burst_bytes=burst, throttle=throttle, clock=t.clock, sleep=t.sleep)


def check_windows(releases: list[tuple[float, int]], rate: float, burst: int) -> None:
    """Every window [a, b] between two releases lets through at most ``rate * (b - a)`` bytes plus one
    burst, or plus its first request where that one is larger (released whole, once paid for)."""
    releases = sorted(releases)
    for i in range(len(releases)):
        total = 0
        for j in range(i, len(releases)):
            total += releases[j][1]
            span = releases[j][0] - releases[i][0]
            assert total <= max(burst, releases[i][1]) + rate * span + 1e-6 * rate, (i, j, total, span)


def test_a_steady_stream_goes_at_the_rate() -> None:
    """100 chunks back to back: the first goes at once (a full bucket holds one), the rest at the rate."""
    t = FakeTime()
    b = bucket(t)
    start = t.now
    for _ in range(100):
        b.take(CHUNK)
    assert t.now - start == pytest.approx(99 * CHUNK / (100 * MB))
    stats = b.stats()
    assert stats.charged_bytes == 100 * CHUNK
    assert stats.waited_secs == pytest.approx(t.now - start)
    assert stats.unthrottled_bytes == 0


def test_an_idle_period_buys_one_burst_only() -> None:
    """After an hour idle, one chunk goes at once and the next waits its full share."""
    t = FakeTime()
    b = bucket(t)
    b.take(CHUNK)
    t.now += 3600
    assert b.take(CHUNK) == 0.0
    assert b.take(CHUNK) == pytest.approx(CHUNK / (100 * MB))
    assert b.take(CHUNK) == pytest.approx(CHUNK / (100 * MB))


def test_a_request_larger_than_the_burst_waits_for_the_rest_first() -> None:
    """10 chunks at once on a full bucket wait until 9 more have accrued; the rate stays exact after it."""
    t = FakeTime()
    b = bucket(t)
    assert b.take(10 * CHUNK) == pytest.approx(9 * CHUNK / (100 * MB))
    assert b.take(CHUNK) == pytest.approx(CHUNK / (100 * MB))
    t.now += 3600  # full again: still one burst, however long the request
    assert b.take(3 * CHUNK) == pytest.approx(2 * CHUNK / (100 * MB))


def test_no_window_exceeds_the_budget_by_more_than_one_burst() -> None:
    """Random sizes (some far over the burst) and random idle gaps: every window holds at most the
    rate's bytes plus one burst, and a busy stream gets the whole rate."""
    rng = random.Random(7)
    t = FakeTime()
    rate = 50 * MB
    b = bucket(t, rate=rate)
    releases: list[tuple[float, int]] = []
    busy_bytes, busy_start = 0, t.now
    for i in range(400):
        if i % 50 == 49:
            t.now += rng.uniform(0, 2)  # an idle gap
        n = rng.choice([4096, CHUNK // 4, CHUNK, 3 * CHUNK])
        b.take(n)
        releases.append((t.now, n))
        busy_bytes += n
    check_windows(releases, rate, CHUNK)
    idle = t.now - busy_start - sum(t.slept)
    assert busy_bytes <= CHUNK * 9 + rate * (t.now - busy_start)  # at most a burst per idle gap more
    assert busy_bytes >= rate * (t.now - busy_start - idle)  # never slower than the rate while busy


def test_many_threads_share_one_bucket_without_losing_a_charge() -> None:
    """8 threads x 50 requests with the clock stopped: each request is given its own slot, so the slots
    end where the total bytes at the rate say, and no window holds more than the budget allows."""
    t = FakeTime()
    lock = threading.Lock()
    delays: list[tuple[float, int]] = []
    rate = 100 * MB
    b = Budget(rate, burst_bytes=CHUNK, clock=t.clock, sleep=lambda s: None)
    sizes = [CHUNK // 2, CHUNK, 2 * CHUNK, 4096]

    def worker(k: int) -> None:
        for i in range(50):
            n = sizes[(k + i) % len(sizes)]
            d = b.take(n)
            with lock:
                delays.append((t.now + d, n))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = sum(n for _, n in delays)
    assert b.stats().charged_bytes == total
    assert max(r for r, _ in delays) - t.now == pytest.approx((total - CHUNK) / rate)
    assert b.stats().waited_secs == pytest.approx(sum(r - t.now for r, _ in delays))
    check_windows(delays, rate, CHUNK)


def test_unpaced_operations_are_counted_and_take_nothing() -> None:
    t = FakeTime()
    b = bucket(t)
    b.take(CHUNK)
    b.record(100 * CHUNK)  # a prefetch: counted only
    assert b.take(CHUNK) == pytest.approx(CHUNK / (100 * MB))
    assert b.stats().unthrottled_bytes == 100 * CHUNK
    assert b.stats().charged_bytes == 2 * CHUNK


def test_what_each_throttle_paces() -> None:
    t = FakeTime()
    assert bucket(t).paces(background=True) and not bucket(t).paces(background=False)
    assert bucket(t, throttle="all").paces(background=True) and bucket(t, throttle="all").paces(background=False)


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"bytes_per_sec": 0}, "bytes_per_sec: expected a positive number"),
     ({"bytes_per_sec": -5}, "bytes_per_sec"), ({"bytes_per_sec": float("inf")}, "finite"),
     ({"bytes_per_sec": True}, "bytes_per_sec"), ({"bytes_per_sec": 1, "burst_bytes": 0}, "burst_bytes"),
     ({"bytes_per_sec": 1, "throttle": "some"}, "throttle: expected one of background, all")],
)  # fmt: skip
def test_bad_arguments_name_themselves(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Budget(**kw)
