"""What ``Hierarchy.save`` returns: a :class:`SaveHandle`, one future per tier the save goes to."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future

__all__ = ["SaveHandle"]


class SaveHandle:
    """What ``Hierarchy.save`` returns.

    Attributes:
        step: the saved step.
        staged: resolves once every tensor byte has been copied out of the caller's state into the top
            tier: the caller may mutate its tensors from then on.
        durable: per tier the policy sends this checkpoint to, resolves once that tier has committed it.
    """

    def __init__(self, step: int, tiers: Sequence[str]) -> None:
        self.step = step
        self.staged: Future[None] = Future()
        self.durable: dict[str, Future[None]] = {name: Future() for name in tiers}
        self._observed: set[str] = set()  # tiers whose outcome the caller has waited for

    def done(self) -> bool:
        """True when every future has resolved (successfully or not)."""
        return self.staged.done() and all(f.done() for f in self.durable.values())

    def errors(self) -> dict[str, BaseException]:
        """Failures so far, by tier name (``"staged"`` for a failure before any tier got the bytes)."""
        out: dict[str, BaseException] = {}
        for name, f in [("staged", self.staged), *self.durable.items()]:
            err = f.exception() if f.done() else None
            if err is not None:
                out[name] = err
        return out

    def wait(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Block until ``tier`` (default: every tier this checkpoint goes to) has committed it; re-raise a
        failure with its cause.

        Raises:
            KeyError: ``tier`` is not a tier this checkpoint goes to.
            concurrent.futures.TimeoutError: ``timeout`` seconds passed.
            Exception: the first failure, e.g. ``TierIOError`` for ENOSPC on a slow tier.
        """
        if tier is not None and tier not in self.durable:
            raise KeyError(f"step {self.step} does not go to tier {tier!r} (it goes to: {', '.join(self.durable)})")
        self._observed.update([tier, "staged"] if tier is not None else [*self.durable, "staged"])
        futs = [self.durable[tier]] if tier is not None else list(self.durable.values())
        for f in futs:
            f.result(timeout)
        self.staged.result(timeout)

    def _unobserved(self) -> BaseException | None:
        """The first failure of a tier the caller never waited for (``Hierarchy.wait`` raises it); marks
        every failure as observed."""
        errors = self.errors()
        first = next((e for n, e in errors.items() if n not in self._observed), None)
        self._observed.update(errors)
        return first

    def settle(self, timeout: float | None = None) -> bool:
        """Block until every tier has committed this checkpoint or failed (what ``save(blocking=True)``
        waits for), without raising: the failures stay for :meth:`wait` and :meth:`errors`.

        Args:
            timeout: seconds to wait at most (None: until done).

        Returns:
            Whether every future is done (False: ``timeout`` passed first).
        """
        futures.wait([self.staged, *self.durable.values()], timeout)
        return self.done()

    def _settle_one(self, tier: str) -> None:
        """Wait until ``tier``'s future (if this checkpoint goes there) is done, without raising."""
        f = self.durable.get(tier)
        if f is not None:
            with contextlib.suppress(Exception):
                f.exception()

    def __repr__(self) -> str:
        def show(f: Future[None]) -> str:
            if not f.done():
                return "running"
            return "ok" if f.exception() is None else f"failed: {f.exception()!r}"

        tiers = ", ".join(f"{n}: {show(f)}" for n, f in self.durable.items())
        return f"<SaveHandle step={self.step} staged: {show(self.staged)}; {tiers}>"
