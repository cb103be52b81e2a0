"""Retention policies: which checkpoints a tier keeps. Pure objects, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Held",
    "KeepAll",
    "KeepLatest",
    "RetentionPlan",
    "RetentionPolicy",
    "capacity_victims",
    "missing_tiers",
    "plan_evictions",
    "plan_retention",
]


class RetentionPolicy(Protocol):
    """Decides, from the steps committed on a tier, which ones to evict."""

    def to_evict(self, steps: Sequence[int]) -> list[int]:
        """Steps to evict, given every step committed on the tier (any order)."""
        ...


@dataclass(frozen=True)
class KeepAll:
    """Never evict."""

    def to_evict(self, steps: Sequence[int]) -> list[int]:
        return []


@dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``k`` steps; evict the older ones, oldest first."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"KeepLatest needs k >= 1, got {self.k}")

    def to_evict(self, steps: Sequence[int]) -> list[int]:
        ordered = sorted(set(steps))
        return ordered[: max(0, len(ordered) - self.k)]


@dataclass(frozen=True)
class Held:
    """A copy retention would evict but keeps, because its step is not yet safely where the policy wants it.

    Attributes:
        step: the step.
        tier: the tier whose window would evict the copy (the slowest tier holding the step).
        missing: the tiers the policy wants the step on that hold neither it nor a newer step.
    """

    step: int
    tier: str
    missing: tuple[str, ...]


@dataclass(frozen=True)
class RetentionPlan:
    """What retention does now.

    Attributes:
        evict: copies to evict, as (tier, step), in order.
        held: copies kept beyond their tier's window (see :func:`plan_retention`).
    """

    evict: list[tuple[str, int]]
    held: list[Held]


def missing_tiers(step: int, want: Collection[str], newest: Mapping[str, int]) -> tuple[str, ...]:
    """The tiers of ``want`` that hold neither ``step`` nor a newer step.

    Args:
        step: the step.
        want: the tiers the policy wants it on.
        newest: per tier, fastest first, the newest step committed there (-1 or absent: none).
    """
    names = [*newest, *sorted(set(want) - set(newest))]
    return tuple(d for d in names if d in want and newest.get(d, -1) < step)


def plan_retention(
    committed: Mapping[str, Sequence[int]],
    retention: Mapping[str, RetentionPolicy],
    wanted: Mapping[int, Collection[str]],
    protected: Collection[tuple[int, str]] = (),
) -> RetentionPlan:
    """Which copies retention evicts now, and which it holds beyond their window.

    Every tier's retention names its candidates. A step is *safe* when every tier below its slowest copy
    that the policy sent it to (``wanted[step]``) has committed it or a newer step. A candidate is kept
    when

    * it is ``protected`` (``(step, tier)``: a pending transfer still reads it, or it was just promoted,
      or it is the newest save), or
    * its step is not safe and this is the step's slowest copy (it is *held*): a failed or unfinished
      copy to a lower tier never costs the step. The other copies of the step follow their own windows,
      and a failed copy to a tier above the slowest copy holds nothing (the slower copy is the safer one).

    A step missing from ``wanted`` (saved by an earlier process: nobody knows where it was sent) is
    wanted on every tier below its slowest copy.

    Args:
        committed: per tier, fastest first, the steps committed there.
        retention: per tier, its policy (tiers without one keep everything).
        wanted: per step, the tiers the policy sent it to (failed copies included).
        protected: copies that must stay for now.
    """
    protected = set(protected)
    order = list(committed)
    newest = {t: max(committed[t], default=-1) for t in order}
    slowest: dict[int, str] = {}
    for tier in order:
        for s in committed[tier]:
            slowest[s] = tier
    evict: list[tuple[str, int]] = []
    held: list[Held] = []
    for tier in order:
        policy = retention.get(tier)
        if policy is None:
            continue
        for s in policy.to_evict(committed[tier]):
            if (s, tier) in protected:
                continue
            if slowest[s] == tier:
                below = order[order.index(tier) + 1 :]
                missing = missing_tiers(s, set(wanted.get(s, below)) & set(below), newest)
                if missing:
                    held.append(Held(s, tier, missing))
                    continue
            evict.append((tier, s))
    return RetentionPlan(evict, held)


def plan_evictions(
    committed: Mapping[str, Sequence[int]],
    retention: Mapping[str, RetentionPolicy],
    wanted: Mapping[int, Collection[str]],
    protected: Collection[tuple[int, str]] = (),
) -> list[tuple[str, int]]:
    """The copies :func:`plan_retention` evicts, as (tier, step), in order."""
    return plan_retention(committed, retention, wanted, protected).evict


def capacity_victims(
    steps: Sequence[int], elsewhere: Collection[int], protected: Collection[int] = (), exclude: int | None = None
) -> list[int]:
    """Steps a full tier may give up to make room, oldest first: only copies another tier also holds
    (``elsewhere``), never a ``protected`` one, never ``exclude`` (the step being written)."""
    return [s for s in sorted(set(steps)) if s in elsewhere and s not in protected and s != exclude]
