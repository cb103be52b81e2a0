"""Retention policies: which checkpoints a tier keeps. Pure objects, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["KeepAll", "KeepLatest", "RetentionPolicy", "capacity_victims", "plan_evictions"]


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


def plan_evictions(
    committed: Mapping[str, Sequence[int]],
    retention: Mapping[str, RetentionPolicy],
    wanted: Mapping[int, Collection[str]],
    protected: Collection[tuple[int, str]] = (),
) -> list[tuple[str, int]]:
    """Which copies retention evicts now, as (tier, step), in order.

    Every tier's retention names its candidates; a candidate is skipped when

    * it is ``protected`` (``(step, tier)``: a pending transfer still reads it, or it was just promoted), or
    * it is the last copy of its step and another tier that the step was sent to would keep it (the step
      is in ``wanted[step]`` for that tier and inside that tier's window): a failed or unfinished
      demotion never costs the only copy of a checkpoint another rule keeps.

    Args:
        committed: per tier, the steps committed there.
        retention: per tier, its policy (tiers without one keep everything).
        wanted: per step, the tiers the policy sends it to.
        protected: copies that must stay for now.
    """
    protected = set(protected)
    copies: dict[int, set[str]] = {}
    for tier, steps in committed.items():
        for s in steps:
            copies.setdefault(s, set()).add(tier)
    out: list[tuple[str, int]] = []
    for tier, steps in committed.items():
        policy = retention.get(tier)
        if policy is None:
            continue
        for s in policy.to_evict(steps):
            if (s, tier) in protected:
                continue
            if not copies[s] - {tier} and any(
                other != tier
                and (other not in retention or s not in retention[other].to_evict([*committed.get(other, ()), s]))
                for other in wanted.get(s, ())
            ):
                continue
            copies[s].discard(tier)
            out.append((tier, s))
    return out


def capacity_victims(
    steps: Sequence[int], elsewhere: Collection[int], protected: Collection[int] = (), exclude: int | None = None
) -> list[int]:
    """Steps a full tier may give up to make room, oldest first: only copies another tier also holds
    (``elsewhere``), never a ``protected`` one, never ``exclude`` (the step being written)."""
    return [s for s in sorted(set(steps)) if s in elsewhere and s not in protected and s != exclude]
