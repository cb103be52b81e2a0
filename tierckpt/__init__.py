"""tierckpt: multi-tier checkpoint/restore for PyTorch training.

>>> from tierckpt import Hierarchy                 # doctest: +SKIP
>>> h = Hierarchy.from_yaml("tiers/local.yaml")
>>> h.save(state, step=100).wait()
>>> state = h.restore()
"""

from tierckpt.config import DemoteConfig, HierarchyConfig, IOConfig, LayoutConfig, PolicyConfig, TierConfig, load_config
from tierckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    StateError,
    TierckptError,
    TierFullError,
    TierIOError,
    UnsupportedFormatError,
)
from tierckpt.hierarchy import CheckpointInfo, Hierarchy, SaveHandle
from tierckpt.registry import available_kinds, get_tier_class, register_tier
from tierckpt.tiers.base import CheckpointKey, Tier, TierCapabilities, TierReader, TierWriter

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo",
    "CheckpointKey",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DemoteConfig",
    "Hierarchy",
    "HierarchyConfig",
    "IOConfig",
    "LayoutConfig",
    "PolicyConfig",
    "SaveHandle",
    "StateError",
    "Tier",
    "TierCapabilities",
    "TierConfig",
    "TierFullError",
    "TierIOError",
    "TierReader",
    "TierWriter",
    "TierckptError",
    "UnsupportedFormatError",
    "__version__",
    "available_kinds",
    "get_tier_class",
    "load_config",
    "register_tier",
]
