"""Demotion policies: which saves travel down to a tier. Pure objects, no I/O, no clock of their own.

A tier below the top one receives a save when its rule is *due*. The hierarchy keeps one
:class:`Cadence` per tier (saves and seconds since the last checkpoint sent there) and asks the rule::

    rule = Every(5) | EverySecs(600)          # whichever comes first
    rule.due(Cadence(saves=5, secs=12.0))     # True: the 5th save since the last one sent

``on_close`` is separate (see :class:`Demotion`): on ``close()`` or preemption the newest checkpoint
goes to every tier that asks for it, whatever the cadence says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

__all__ = ["AnyOf", "Cadence", "Demotion", "DemotionRule", "Every", "EverySecs", "Never"]


@dataclass(frozen=True)
class Cadence:
    """What happened since a tier last received a checkpoint.

    Attributes:
        saves: saves since then, counting the one being decided (the first save ever counts 1).
        secs: seconds since then (or since the hierarchy was created, before the first one).
    """

    saves: int
    secs: float


class DemotionRule(Protocol):
    """Decides whether the save being planned goes to a tier."""

    def due(self, c: Cadence) -> bool:
        """True if this save should be demoted to the tier."""
        ...


class _Combinable:
    def __or__(self, other: DemotionRule) -> AnyOf:
        return AnyOf((cast("DemotionRule", self), other))  # every subclass defines due()


@dataclass(frozen=True)
class Every(_Combinable):
    """Every ``n``-th save (``n=1``: every save). The count restarts with each process."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Every needs n >= 1, got {self.n}")

    def due(self, c: Cadence) -> bool:
        return c.saves >= self.n


@dataclass(frozen=True)
class EverySecs(_Combinable):
    """The first save at least ``secs`` seconds after the last one sent to the tier."""

    secs: float

    def __post_init__(self) -> None:
        if not self.secs > 0:
            raise ValueError(f"EverySecs needs secs > 0, got {self.secs}")

    def due(self, c: Cadence) -> bool:
        return c.secs >= self.secs


@dataclass(frozen=True)
class Never(_Combinable):
    """No save goes to the tier by cadence (use with ``on_close``)."""

    def due(self, c: Cadence) -> bool:
        return False


@dataclass(frozen=True)
class AnyOf(_Combinable):
    """Due when any of ``rules`` is due."""

    rules: tuple[DemotionRule, ...]

    def due(self, c: Cadence) -> bool:
        return any(r.due(c) for r in self.rules)


@dataclass(frozen=True)
class Demotion:
    """A tier's demotion policy.

    Attributes:
        rule: the cadence (default: every save).
        on_close: on ``close()`` and on preemption, send the newest checkpoint here if it is not yet here.
    """

    rule: DemotionRule = Every(1)
    on_close: bool = False

    @classmethod
    def from_settings(
        cls, every: int | None = None, every_secs: float | None = None, on_close: bool = False
    ) -> Demotion:
        """Build from the YAML keys: both cadences given means whichever comes first; neither with
        ``on_close`` means only on close; nothing at all means every save."""
        rules: list[DemotionRule] = []
        if every is not None:
            rules.append(Every(every))
        if every_secs is not None:
            rules.append(EverySecs(every_secs))
        if not rules:
            return cls(Never() if on_close else Every(1), on_close)
        return cls(rules[0] if len(rules) == 1 else AnyOf(tuple(rules)), on_close)
