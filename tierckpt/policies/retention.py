"""Retention policies: which checkpoints a tier keeps. Pure objects, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["KeepAll", "KeepLatest", "RetentionPolicy"]


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
