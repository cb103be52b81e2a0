"""What the hierarchy knows about its checkpoints: save handles, per-tier states, pins."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierckpt.errors import TierFullError
from tierckpt.policies.retention import Held

if TYPE_CHECKING:
    from tierckpt.tiers.base import Tier

__all__ = ["STATES", "CheckpointInfo", "HeldCopies", "SaveHandle", "Tracker", "merge_states"]

log = logging.getLogger("tierckpt.hierarchy")

#: States of one step on one tier, in the order a copy goes through them (``absent``: no copy, none coming).
STATES = ("pending", "writing", "committed", "failed", "evicting", "absent")


@dataclass(frozen=True)
class CheckpointInfo:
    """One step as the hierarchy sees it.

    Attributes:
        step: the step.
        tiers: names of the tiers where it is committed, fastest first.
        states: per tier (every tier of the hierarchy, fastest first), one of :data:`STATES`.
        errors: per tier whose copy failed, the error.
    """

    step: int
    tiers: tuple[str, ...]
    states: Mapping[str, str] = field(default_factory=dict)
    errors: Mapping[str, BaseException] = field(default_factory=dict)


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
        if self.staged.done() and self.staged.exception() is not None:
            out["staged"] = self.staged.exception()  # type: ignore[assignment]
        out.update({n: f.exception() for n, f in self.durable.items() if f.done() and f.exception() is not None})  # type: ignore[misc]
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

    def _settle(self, timeout: float | None = None) -> None:
        """Wait until every future is done, without raising."""
        for f in (self.staged, *self.durable.values()):
            with contextlib.suppress(Exception):  # cancelled
                f.exception(timeout)

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


class Tracker:
    """Per-step, per-tier states of the copies this hierarchy writes, and the pins that keep copies
    from being evicted while a transfer still reads them. Thread-safe; ``changed`` is notified on every
    update (the backpressure wait uses it)."""

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.RLock())
        self._states: dict[int, dict[str, str]] = {}
        self._errors: dict[int, dict[str, BaseException]] = {}
        self._pins: Counter[tuple[int, str]] = Counter()
        self._promoted: set[tuple[int, str]] = set()
        self._latest: set[tuple[int, str]] = set()  # the copies of the newest save (in time)
        self._wanted: dict[int, set[str]] = {}

    def plan(self, step: int, tiers: Iterable[str]) -> None:
        """A save or promotion of ``step`` will go to ``tiers``: they become ``pending``; for a step saved by
        this hierarchy (see :meth:`saved`) they also become wanted."""
        with self.changed:
            st = self._states.setdefault(step, {})
            for t in tiers:
                st[t] = "pending"
                self._errors.get(step, {}).pop(t, None)
                if step in self._wanted:
                    self._wanted[step].add(t)
            self.changed.notify_all()

    def set(self, step: int, tier: str, state: str, error: BaseException | None = None) -> None:
        """Record a state; ``failed`` also records ``error``. A failed tier stays wanted: retention holds the
        step's slowest copy until that tier has the step or a newer one (see ``plan_retention``)."""
        with self.changed:
            self._states.setdefault(step, {})[tier] = state
            if state == "failed":
                self._errors.setdefault(step, {})[tier] = error or RuntimeError("failed")
            self.changed.notify_all()

    def forget(self, step: int, tier: str) -> None:
        """The copy is gone (evicted): drop its state."""
        with self.changed:
            self._states.get(step, {}).pop(tier, None)
            self._promoted.discard((step, tier))
            self.changed.notify_all()

    def states(self) -> dict[int, dict[str, str]]:
        with self.changed:
            return {s: dict(d) for s, d in self._states.items()}

    def errors(self) -> dict[int, dict[str, BaseException]]:
        with self.changed:
            return {s: dict(d) for s, d in self._errors.items()}

    def wanted(self) -> dict[int, set[str]]:
        """Per step saved by this hierarchy, the tiers the policy sent it to (failed ones included)."""
        with self.changed:
            return {s: set(d) for s, d in self._wanted.items()}

    def pin(self, step: int, tier: str) -> None:
        with self.changed:
            self._pins[(step, tier)] += 1

    def unpin(self, step: int, tier: str) -> None:
        with self.changed:
            self._pins[(step, tier)] -= 1
            if self._pins[(step, tier)] <= 0:
                del self._pins[(step, tier)]
            self.changed.notify_all()

    def promoted(self, step: int, tier: str, on: bool) -> None:
        """Mark a promoted copy: retention leaves it alone until a newer save commits on that tier."""
        with self.changed:
            (self._promoted.add if on else self._promoted.discard)((step, tier))

    def clear_promoted(self, tier: str, below: int) -> None:
        """A save of a newer step committed on ``tier``: its promoted older copies fall back under retention."""
        with self.changed:
            self._promoted = {(s, t) for s, t in self._promoted if t != tier or s >= below}

    def saved(self, step: int, tiers: Iterable[str]) -> None:
        """``step`` is the newest save (in time): retention keeps its copies even where its number is
        below the ``keep`` window (a job that went back to an older step keeps what it saves). ``tiers``
        become the step's wanted tiers (a step saved again is wanted where this save sends it)."""
        with self.changed:
            names = set(tiers)
            self._latest = {(step, t) for t in names}
            self._wanted[step] = names

    def protected(self) -> set[tuple[int, str]]:
        """Copies retention must not evict now: pinned by a transfer, freshly promoted, or of the newest
        save."""
        with self.changed:
            return set(self._pins) | self._promoted | self._latest

    def pinned_on(self, tier: str) -> set[int]:
        with self.changed:
            return {s for s, t in self._pins if t == tier}

    def prune(self, alive: set[int]) -> None:
        """Forget steps held by no tier that no transfer is working on (keeps memory bounded)."""
        newest = max(alive, default=-1)
        with self.changed:
            for s in list(self._states):
                if s in alive or s >= newest:
                    continue
                if any(v in ("pending", "writing", "evicting") for v in self._states[s].values()):
                    continue
                if any(p == s for p, _ in self._pins):
                    continue
                self._states.pop(s, None)
                self._errors.pop(s, None)
                self._wanted.pop(s, None)


class HeldCopies:
    """The copies retention keeps beyond their tier's window (:func:`~tierckpt.policies.plan_retention`),
    and why. Each held copy is logged once: a warning when a copy of its step failed (naming the tier and
    the error) or when the step was saved by an earlier process, INFO while its copy is only on its way
    (and a warning after all if that copy then fails); each release at INFO. A full tier's error names
    the held copies that fill it. Updated under the mover's eviction lock."""

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker
        self._held: dict[tuple[int, str], Held] = {}
        self._warned: set[tuple[int, str]] = set()

    def on(self, tier: str) -> list[int]:
        """The steps held on ``tier``, oldest first."""
        return sorted(s for s, t in dict(self._held) if t == tier)

    def why(self, h: Held) -> str:
        """Why ``h`` is held: each tier that lacks the step, and what became of its copy there."""
        return self._why(h)[0]

    def _why(self, h: Held) -> tuple[str, bool]:
        """The reason, and whether it deserves a warning (a copy failed, or nobody knows where the step
        went) rather than INFO (a copy still on its way)."""
        errors = self._tracker.errors().get(h.step, {})
        known = h.step in self._tracker.wanted()
        parts, warn = [], False
        for d in h.missing:
            if d in errors:
                what, warn = f"its copy failed: {errors[d]}", True
            elif not known:
                what, warn = "the step was saved before this process started", True
            else:
                what = "its copy has not arrived yet"
            parts.append(f"tier {d!r} has no copy of step {h.step} or newer ({what})")
        return "; ".join(parts), warn

    def update(self, held: Sequence[Held]) -> None:
        """The copies held now (a new retention plan's)."""
        now = {(h.step, h.tier): h for h in held}
        for k, h in now.items():
            if k in self._warned:
                continue
            why, warn = self._why(h)
            if k in self._held and not warn:
                continue
            if warn:
                self._warned.add(k)
            log.log(
                logging.WARNING if warn else logging.INFO,
                "retention: step %d is held on tier %r beyond its keep window: %s", h.step, h.tier, why,
            )  # fmt: skip
        for step, tier in sorted(self._held.keys() - now.keys()):
            log.info("retention: step %d is no longer held on tier %r", step, tier)
        self._held = now
        self._warned &= now.keys()

    def explain_full(self, tier: str, full: TierFullError) -> TierFullError:
        """``full``, or when held copies fill ``tier``, an error that also names them and why."""
        steps = self.on(tier)
        h = self._held.get((steps[-1], tier)) if steps else None
        if h is None:
            return full
        return TierFullError(
            f"{full}; it holds steps {steps} beyond its keep window because {self.why(h)} (a held copy is "
            "freed once that tier holds its step or a newer one)"
        )


def merge_states(tiers: Sequence[Tier], tracker: Tracker, rank: int) -> list[CheckpointInfo]:
    """``rank``'s steps, oldest first: what the tiers list as committed merged with the tracker's states
    of the copies in flight. A tier that cannot list (e.g. its directory is gone) is logged and skipped."""
    committed: dict[int, list[str]] = {}
    for t in tiers:
        try:
            keys = t.list_committed(rank)
        except OSError as e:
            log.warning("tier %r cannot list its checkpoints: %s", t.name, e)
            continue
        for k in keys:
            if k.rank == rank:
                committed.setdefault(k.step, []).append(t.name)
    tracked, errors = tracker.states(), tracker.errors()
    out = []
    for s in sorted(set(committed) | set(tracked)):
        here = committed.get(s, [])
        states = {}
        for t in tiers:
            st = tracked.get(s, {}).get(t.name, "absent")
            if t.name in here and st != "evicting":
                st = "committed"
            elif st == "committed":
                st = "absent"  # evicted, or removed from outside
            states[t.name] = st
        if any(v != "absent" for v in states.values()):
            out.append(CheckpointInfo(s, tuple(here), states, dict(errors.get(s, {}))))
    return out
