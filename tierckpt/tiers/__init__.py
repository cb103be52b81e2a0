"""Tier kinds. Import a kind's module only when it is used (see :mod:`tierckpt.registry`); docs/tiers.md
is the guide to writing one."""

from tierckpt.tiers.base import (
    DEVICES,
    CheckpointKey,
    EngineSource,
    Tier,
    TierCapabilities,
    TierCopy,
    TierReader,
    TierWriter,
)

__all__ = [
    "DEVICES",
    "CheckpointKey",
    "EngineSource",
    "Tier",
    "TierCapabilities",
    "TierCopy",
    "TierReader",
    "TierWriter",
]
