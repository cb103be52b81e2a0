"""Freeing evicted copies beside the tiers' workers (:class:`Reclaimer`).

Retention unlists the copies it evicts at once (``Tier.evict(key, free=False)``) and leaves deleting them
to ``Tier.reclaim()``: seconds for a gigabyte file on some file systems. Run on the tier's worker, that
deletion stalled the next copy to the tier for as long (a gap of 0.2-0.5 s between back-to-back
demotions here, which a bandwidth budget could not make up: docs/benchmarks.md, "Bandwidth budgets").
Here each tier's deletions run on a thread of the tier's own, overlapping the next copy (a deletion that
hangs on a vanished mount holds up that tier alone), with two rules that keep what running them in line
gave: a job's outcome resolves only once the deletions from its tier queued before it are done (a later
save to a tier still implies that the earlier evictions' files there are gone), and a tier that is full
waits for its deletions in flight before anything else makes room (no copy is evicted for space that is
about to be freed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial

from tierckpt.background.worker import Worker

__all__ = ["Reclaimer"]

log = logging.getLogger(__name__)


class Reclaimer:
    """Runs ``reclaim(name)`` for tier names: per tier one at a time, in the order asked, on a thread of
    the tier's own (started on first use).

    Args:
        reclaim: frees what was evicted from the named tier (``tiers[name].reclaim()``).
    """

    def __init__(self, reclaim: Callable[[str], None]) -> None:
        self._reclaim = reclaim
        self._workers: dict[str, Worker] = {}
        self._latest: dict[str, Future[None]] = {}  # per tier, its last deletion queued: the earlier are done first
        self._lock = threading.Lock()
        self._closed = False

    def _run(self, name: str) -> None:
        try:
            self._reclaim(name)
        except Exception as e:  # logged, never raised into a save: the next start's sweep frees it
            log.warning("freeing the evicted copies on tier %r failed: %s", name, e)

    def free(self, names: Iterable[str]) -> None:
        """Queue the deletion of what was evicted from each of these tiers (after :meth:`close`: at once)."""
        for name in names:
            with self._lock:
                if not self._closed:
                    worker = self._workers.get(name)
                    if worker is None:
                        worker = self._workers[name] = Worker(f"{name}-reclaim")
                    self._latest[name] = worker.submit(partial(self._run, name))
                    continue
            self._run(name)  # closed: a worker that outlived close(timeout) frees its own

    def settle(self, tier: str | None = None) -> bool:
        """Wait for the deletions queued so far (of ``tier``'s evicted copies; None: of every tier's);
        whether any of them was still running."""
        with self._lock:
            pending = [f for n, f in self._latest.items() if (tier is None or n == tier) and not f.done()]
        for f in pending:
            f.result()
        return bool(pending)

    def close(self, timeout: float | None = None) -> None:
        """Finish the deletions queued (waiting at most ``timeout`` seconds for each tier's); later ones
        run in their caller's thread."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        for w in workers:
            w.close(timeout)
