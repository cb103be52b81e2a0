"""Tier kinds. Import a kind's module only when it is used (see :mod:`tierckpt.registry`)."""

from tierckpt.tiers.base import CheckpointKey, Tier, TierCapabilities, TierReader, TierWriter

__all__ = ["CheckpointKey", "Tier", "TierCapabilities", "TierReader", "TierWriter"]
