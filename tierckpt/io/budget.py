"""A bandwidth budget: a token bucket that paces one tier's I/O (docs/tiers.md, "Bandwidth budgets").

The bucket is charged once per I/O operation, before the operation is handed to the engine (a chunk, or
a save's piece of one), so the engine's queue depth still works: the operations the bucket lets through
are in flight together, as without a budget. It holds at most ``burst_bytes`` (one chunk), so a long
idle period buys no more than one operation at once, and every window of ``w`` seconds lets through at
most ``rate * w`` bytes plus one burst (plus the window's first operation instead, where that one is
larger than the burst: it waits, before it starts, until the bucket has been full and the rest of it has
accrued, so the rate holds over every longer window).

It is the generic cell rate algorithm (virtual scheduling) with sizes: the state is one instant, up to
which the bucket's bytes are spent; a request of ``n`` bytes moves it ``n / rate`` on from where it was,
or from ``burst / rate`` ago, whichever is later, and starts once that instant has come. Oversleeping
does not slow the rate down: the next request is scheduled from the instant, not from when the sleeper
woke. Reads and writes draw from the one bucket (docs/tiers.md says why).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierckpt.ioconfig import THROTTLES

__all__ = ["Budget", "BudgetStats"]


@dataclass(frozen=True)
class BudgetStats:
    """What a :class:`Budget` has seen so far.

    Attributes:
        charged_bytes: bytes of the operations paced by the bucket.
        waited_secs: seconds the callers of :meth:`Budget.take` spent waiting, all threads together.
        unthrottled_bytes: bytes of the operations the budget was told of and did not pace
            (:meth:`Budget.record`: a prefetch, a blocking save, a restore under ``throttle: background``).
    """

    charged_bytes: int = 0
    waited_secs: float = 0.0
    unthrottled_bytes: int = 0


class Budget:
    """A token bucket of ``bytes_per_sec``, shared by every thread that moves a tier's bytes.

    Args:
        bytes_per_sec: the budget, in bytes per second (> 0).
        burst_bytes: the most the bucket holds (> 0): what may go at once after an idle period. One I/O
            operation of the tier (its chunk) lets a full bucket start one at once and no more.
        throttle: which of the tier's I/O it paces: ``background`` (the hierarchy's background copies
            and non-blocking saves) or ``all`` (also prefetches, blocking saves and restores).
        clock: seconds, monotonic (tests pass a fake one).
        sleep: waits that many seconds (tests pass one that records, or moves the fake clock).

    Raises:
        ValueError: a rate or burst that is not a positive number, or an unknown ``throttle``.
    """

    def __init__(
        self,
        bytes_per_sec: float,
        *,
        burst_bytes: int = 32 << 20,
        throttle: str = "background",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(bytes_per_sec, bool) or not isinstance(bytes_per_sec, (int, float)) or not bytes_per_sec > 0:
            raise ValueError(f"bytes_per_sec: expected a positive number, got {bytes_per_sec!r}")
        if not math.isfinite(bytes_per_sec):
            raise ValueError(f"bytes_per_sec: expected a finite number, got {bytes_per_sec!r}")
        if isinstance(burst_bytes, bool) or not isinstance(burst_bytes, int) or burst_bytes <= 0:
            raise ValueError(f"burst_bytes: expected a positive integer, got {burst_bytes!r}")
        if throttle not in THROTTLES:
            raise ValueError(f"throttle: expected one of {', '.join(THROTTLES)}, got {throttle!r}")
        self.bytes_per_sec = float(bytes_per_sec)
        self.burst_bytes = burst_bytes
        self.throttle = throttle
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._spent_until = -math.inf  # the instant up to which the bucket's bytes are spent
        self._charged, self._waited, self._unthrottled = 0, 0.0, 0

    def paces(self, background: bool) -> bool:
        """Whether an operation of this kind waits for the bucket: a background one always, a foreground
        one (a prefetch, a blocking save, a restore) under ``throttle: all``."""
        return background or self.throttle == "all"

    def take(self, nbytes: int) -> float:
        """Wait until ``nbytes`` may go, and charge them; return the seconds waited. Thread-safe: callers
        are served in the order they called, each after the bytes of those before it."""
        if nbytes <= 0:
            return 0.0
        rate = self.bytes_per_sec
        with self._lock:
            now = self._clock()
            start = max(self._spent_until, now - self.burst_bytes / rate)  # a full bucket holds one burst
            self._spent_until = start + nbytes / rate
            delay = max(0.0, self._spent_until - now)
            self._charged += nbytes
            self._waited += delay
        if delay > 0:
            self._sleep(delay)
        return delay

    def record(self, nbytes: int) -> None:
        """Count ``nbytes`` of an operation the budget does not pace (:attr:`BudgetStats.unthrottled_bytes`);
        they take nothing from the bucket, so a prefetch does not delay the background copies after it."""
        with self._lock:
            self._unthrottled += max(0, nbytes)

    def stats(self) -> BudgetStats:
        """The counters so far."""
        with self._lock:
            return BudgetStats(self._charged, self._waited, self._unthrottled)

    def describe(self) -> str:
        """``300MB/s (background)``: the rate in decimal megabytes, as it is usually written."""
        return f"{self.bytes_per_sec / 1e6:.4g}MB/s ({self.throttle})"

    def __repr__(self) -> str:
        return f"Budget({self.bytes_per_sec:.0f} B/s, burst {self.burst_bytes} B, throttle={self.throttle!r})"
