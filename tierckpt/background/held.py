"""The copies retention keeps beyond their tier's window, and why (logged once each; named by a full
tier's error)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierckpt.errors import TierFullError
from tierckpt.policies.retention import Held

if TYPE_CHECKING:
    from tierckpt.background.catalog import Catalog

__all__ = ["HeldCopies"]

log = logging.getLogger("tierckpt.hierarchy")


class HeldCopies:
    """The copies retention keeps beyond their tier's window (:func:`~tierckpt.policies.plan_retention`),
    and why. Each held copy is logged once: a warning when a copy of its step failed (naming the tier and
    the error) or when the step was saved by an earlier process, INFO while its copy is only on its way
    (and a warning after all if that copy then fails); each release at INFO. A full tier's error names
    the held copies that fill it. Updated under the mover's eviction lock."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._held: dict[tuple[int, str], Held] = {}
        self._warned: set[tuple[int, str]] = set()

    def copies(self) -> set[tuple[int, str]]:
        """Every held copy, as (step, tier)."""
        return set(self._held)

    def on(self, tier: str) -> list[int]:
        """The steps held on ``tier``, oldest first."""
        return sorted(s for s, t in dict(self._held) if t == tier)

    def why(self, h: Held) -> str:
        """Why ``h`` is held: each tier that lacks the step, and what became of its copy there."""
        return self._why(h)[0]

    def _why(self, h: Held) -> tuple[str, bool]:
        """The reason, and whether it deserves a warning (a copy failed, or nobody knows where the step
        went) rather than INFO (a copy still on its way)."""
        errors = self._catalog.errors().get(h.step, {})
        known = h.step in self._catalog.wanted()
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
