"""The end of a hierarchy's work: waiting for it (``flush``, ``wait``), the SIGTERM flush, ``close``.

A mixin of :class:`~tierckpt.hierarchy.Hierarchy`, which owns every attribute declared here.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from tierckpt.errors import TierckptError
from tierckpt.orchestration.catalog import SaveHandle
from tierckpt.orchestration.runtime import install_flush_handler
from tierckpt.policies import Demotion
from tierckpt.tiers.base import CheckpointKey, Tier

if TYPE_CHECKING:
    from typing_extensions import Self

    from tierckpt.orchestration.catalog import CheckpointInfo
    from tierckpt.orchestration.mover import Mover
    from tierckpt.orchestration.restore_into import RestoreStaging

__all__ = ["Lifecycle", "resolved"]

log = logging.getLogger("tierckpt.hierarchy")


def resolved(value: Any = None) -> Future[Any]:
    """A future already done with ``value``."""
    f: Future[Any] = Future()
    f.set_result(value)
    return f


class Lifecycle:
    """``flush``, ``wait``, ``install_sigterm_handler`` and ``close`` of a hierarchy."""

    readonly: bool
    rank: int
    demotion: dict[str, Demotion]
    _tiers: tuple[Tier, ...]
    _index: dict[str, int]
    _lock: threading.RLock
    _closed: bool
    _handles: list[SaveHandle]
    _promotions: dict[int, Future[str]]
    _extra: list[Future[None]]
    _fills: list[Future[None]]
    _mover: Mover
    _in_place: RestoreStaging
    _engines: Any

    def checkpoints(self) -> list[CheckpointInfo]:  # pragma: no cover - Hierarchy's
        raise NotImplementedError

    def _settle(self, deadline: float | None) -> bool:
        """Wait (until ``deadline``, a monotonic time) for every save, promotion and flush; True if all ended."""
        with self._lock:
            futs = [f for h in self._handles for f in (h.staged, *h.durable.values())]
            futs += list(self._promotions.values()) + list(self._extra) + list(self._fills)
        for f in futs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.exception(left)
            except FutureTimeout:
                return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Finish what the policy wants durable: every pending copy, then the newest checkpoint to each
        tier with ``on_close: true``. Returns False if ``timeout`` seconds passed first.

        ``close()`` calls it without a timeout; the SIGTERM handler with its deadline.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._settle(deadline):
            return False
        if self.readonly:  # it copied nothing, and must copy nothing
            return True
        wanted = [t.name for t in self._tiers[1:] if self.demotion.get(t.name, Demotion()).on_close]
        infos = [i for i in self.checkpoints() if i.tiers]
        if wanted and infos:
            newest = infos[-1]
            key = CheckpointKey(newest.step, self.rank)
            with self._lock:
                for name in wanted:
                    if name in newest.tiers:
                        continue
                    above = [n for n in newest.tiers if self._index[n] < self._index[name]][::-1]
                    if not above:
                        log.warning("flush: step %d is only below tier %r; not sent up", newest.step, name)
                        continue
                    log.info("flush: sending step %d to tier %r", newest.step, name)
                    done: Future[None] = Future()
                    self._mover.transfer(key, name, [(n, resolved()) for n in above], done)
                    self._extra.append(done)
        return self._settle(deadline)

    def wait(self) -> None:
        """Wait for every save, prefetch and flush; raise the first failure nobody has seen yet: of a tier
        whose outcome was never waited for through the save's handle, or of an ``on_close`` flush (each
        failure is raised once; prefetch failures stay in the future ``prefetch`` returned)."""
        self._settle(None)
        with self._lock:
            handles, self._handles = self._handles, []
            extra, self._extra = self._extra, []
            self._promotions = {s: f for s, f in self._promotions.items() if not f.done()}
            self._fills = [f for f in self._fills if not f.done()]
        failures = [e for e in [*(h._unobserved() for h in handles), *(f.exception() for f in extra)] if e is not None]
        if len(failures) > 1:  # each was logged when it happened; all stay in checkpoints()
            log.error("%d failures nobody waited for; raising the first (see h.checkpoints())", len(failures))
        if failures:
            raise failures[0]

    def install_sigterm_handler(self, deadline: float = 60.0, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """On SIGTERM (preemption), flush within ``deadline`` seconds, then let the signal do what it did
        before (the default: terminate). Call from the main thread.

        Raises:
            ValueError: not called from the main thread (Python only runs signal handlers there).
        """
        install_flush_handler(lambda: self._closed or self.flush(deadline), deadline, signals)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the hierarchy is closed")

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.readonly:
            raise TierckptError(f"cannot {what}: the hierarchy was opened read-only")

    def close(self) -> None:
        """Flush (pending copies and ``on_close`` demotions), release tiers and engines; raise unobserved
        save failures."""
        if self._closed:
            return
        try:
            self.flush()
            self.wait()
        finally:
            self._closed = True
            self._mover.close()
            self._in_place.release()
            for t in self._tiers:
                t.close()
            self._engines.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
