"""Everything a hierarchy has in flight: its saves' handles, prefetches, flush copies and the fills of
the tiers between a prefetch's source and target (:class:`Pending`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tierckpt.background.handles import SaveHandle

__all__ = ["Pending"]

log = logging.getLogger("tierckpt.hierarchy")


class Pending:
    """The futures of one hierarchy's work in flight. Thread-safe.

    Attributes:
        promotions: per step, the future of its newest prefetch (resolving to the target tier's name).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self.promotions: dict[int, Future[str]] = {}
        self._extra: list[Future[None]] = []  # on-close copies: their failures are raised by wait()
        self._fills: list[Future[None]] = []  # prefetch copies below the target: logged on failure only

    def add_save(self, handle: SaveHandle) -> None:
        """A new save (settled handles whose failures were all seen are dropped)."""
        with self._lock:
            self._handles = [h for h in self._handles if not h.done() or set(h.errors()) - h._observed]
            self._handles.append(handle)

    def add_promotion(self, step: int, to: str, copies: Mapping[str, Future[None]]) -> Future[str]:
        """A promotion of ``step`` to tier ``to`` (``copies``: per tier, its copy's future); returns the
        future resolving to ``to`` once it has committed the copy, or holding that copy's error (the
        copies to the tiers in between are fills: logged on failure only)."""
        out: Future[str] = Future()
        copies[to].add_done_callback(lambda f: out.set_exception(err) if (err := f.exception()) else out.set_result(to))
        with self._lock:
            self.promotions[step] = out
            self._fills.extend(f for n, f in copies.items() if n != to)
        return out

    def add_flush(self, futs: Iterable[Future[None]]) -> None:
        with self._lock:
            self._extra.extend(futs)

    def climbing(self, step: int) -> Future[str] | None:
        """The prefetch of ``step`` still running, if any."""
        with self._lock:
            f = self.promotions.get(step)
        return f if f is not None and not f.done() else None

    def wait_climbing(self, step: int) -> None:
        """Wait for the prefetch of ``step`` still running, if any (its failure stays in its future)."""
        climbing = self.climbing(step)
        if climbing is not None:
            log.info("restore: waiting for the prefetch of step %d", step)
            climbing.exception()

    def any_climbing(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self.promotions.values())

    def waited_climbing(self, step: int) -> bool:
        """Wait for a prefetch of ``step`` still climbing; True if any prefetch was climbing (what a
        restore listed may have changed)."""
        if not self.any_climbing():
            return False
        self.wait_climbing(step)
        return True

    def settle_top(self, top: str) -> None:
        """Wait until every save has committed (or failed) on tier ``top``."""
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            h._settle_one(top)

    def settle(self, deadline: float | None) -> bool:
        """Wait (until ``deadline``, a monotonic time) for everything; True if all of it ended."""
        with self._lock:
            futs: list[Future[Any]] = [f for h in self._handles for f in (h.staged, *h.durable.values())]
            futs += [*self.promotions.values(), *self._extra, *self._fills]
        for f in futs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.exception(left)
            except FutureTimeout:
                return False
        return True

    def raise_unseen(self) -> None:
        """After :meth:`settle`: forget what ended, and raise the first failure nobody has seen (of a
        save's tier never waited for through its handle, or of an on-close copy); each is raised once."""
        with self._lock:
            handles, self._handles = self._handles, []
            extra, self._extra = self._extra, []
            self.promotions = {s: f for s, f in self.promotions.items() if not f.done()}
            self._fills = [f for f in self._fills if not f.done()]
        failures = [e for e in [*(h._unobserved() for h in handles), *(f.exception() for f in extra)] if e is not None]
        if len(failures) > 1:  # each was logged when it happened; all stay in checkpoints()
            log.error("%d failures nobody waited for; raising the first (see h.checkpoints())", len(failures))
        if failures:
            raise failures[0]
