"""Freeing evicted copies beside the tiers' workers (:class:`Reclaimer`).

Retention unlists the copies it evicts at once (``Tier.evict(key, free=False)``) and leaves deleting them
to ``Tier.reclaim()``: seconds for a gigabyte file on some file systems. Run on the tier's worker, that
deletion stalled the next copy to the tier for as long (a gap of 0.2-0.5 s between back-to-back
demotions here, which a bandwidth budget could not make up: docs/benchmarks.md, "Bandwidth budgets").
Here it runs on a thread of its own, overlapping the next copy, with two rules that keep what running it
in line gave: a job's outcome resolves only once the deletions queued before it are done (a later save
still implies the earlier evictions' files are gone), and a tier that is full waits for its deletions
in flight before anything else makes room (no copy is evicted for space that is about to be freed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["Reclaimer"]

log = logging.getLogger(__name__)


class Reclaimer:
    """Runs ``reclaim(name)`` for tier names, one at a time, in the order asked, on a thread of its own.

    Args:
        reclaim: frees what was evicted from the named tier (``tiers[name].reclaim()``).
    """

    def __init__(self, reclaim: Callable[[str], None]) -> None:
        self._reclaim = reclaim
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierckpt-reclaim")
        self._latest: dict[
            str, Future[None]
        ] = {}  # per tier, its last deletion queued (FIFO: the earlier are done first)
        self._lock = threading.Lock()

    def _run(self, name: str) -> None:
        try:
            self._reclaim(name)
        except Exception as e:  # logged, never raised into a save: the next start's sweep frees it
            log.warning("freeing the evicted copies on tier %r failed: %s", name, e)

    def free(self, names: Iterable[str]) -> None:
        """Queue the deletion of what was evicted from each of these tiers (after :meth:`close`: at once)."""
        for name in names:
            with self._lock:
                try:
                    self._latest[name] = self._pool.submit(self._run, name)
                    continue
                except RuntimeError:  # closed: a worker that outlived close(timeout) frees its own
                    pass
            self._run(name)

    def settle(self, tier: str | None = None) -> bool:
        """Wait for the deletions queued so far (of ``tier``'s evicted copies; None: of every tier's);
        whether any of them was still running."""
        with self._lock:
            pending = [f for n, f in self._latest.items() if (tier is None or n == tier) and not f.done()]
        for f in pending:
            f.result()
        return bool(pending)

    def close(self) -> None:
        """Finish the deletions queued; later ones run in their caller's thread."""
        with self._lock:
            self._pool.shutdown(wait=False)
        self._pool.shutdown(wait=True)
