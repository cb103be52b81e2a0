"""tierckpt: multi-tier checkpoint/restore for PyTorch training.

>>> from tierckpt import Hierarchy                 # doctest: +SKIP
>>> h = Hierarchy.from_yaml("tiers/local.yaml")
>>> h.save(state, step=100).wait()
>>> state = h.restore()

The public names below are imported on first use (PEP 562), so ``import tierckpt`` and the
``tierckpt`` command's ``--help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (a new export: here, in __all__ and under TYPE_CHECKING)
_LAZY: dict[str, str] = {
    "DemoteConfig": "tierckpt.config",
    "HierarchyConfig": "tierckpt.config",
    "IOConfig": "tierckpt.ioconfig",
    "LayoutConfig": "tierckpt.config",
    "PolicyConfig": "tierckpt.config",
    "TierConfig": "tierckpt.config",
    "load_config": "tierckpt.config",
    "CoordinationError": "tierckpt.errors",
    "CheckpointEvictedError": "tierckpt.errors",
    "CheckpointNotFoundError": "tierckpt.errors",
    "ConfigError": "tierckpt.errors",
    "CorruptCheckpointError": "tierckpt.errors",
    "DeviceFullError": "tierckpt.errors",
    "StateError": "tierckpt.errors",
    "TierckptError": "tierckpt.errors",
    "TierBusyError": "tierckpt.errors",
    "TierFullError": "tierckpt.errors",
    "TierIOError": "tierckpt.errors",
    "UnsupportedFormatError": "tierckpt.errors",
    "CheckpointInfo": "tierckpt.hierarchy",
    "Hierarchy": "tierckpt.hierarchy",
    "KeyMap": "tierckpt.datapath.keymap",
    "SaveHandle": "tierckpt.hierarchy",
    "available_kinds": "tierckpt.registry",
    "get_tier_class": "tierckpt.registry",
    "register_tier": "tierckpt.registry",
    "Coordinator": "tierckpt.ranks.coordinator",
    "SoloCoordinator": "tierckpt.ranks.coordinator",
    "StoreCoordinator": "tierckpt.ranks.distributed",
    "ResumableLoader": "tierckpt.resume",
    "TrainState": "tierckpt.resume",
    "rng_state": "tierckpt.resume",
    "set_rng_state": "tierckpt.resume",
    "CheckpointKey": "tierckpt.tiers.base",
    "Tier": "tierckpt.tiers.base",
    "TierCapabilities": "tierckpt.tiers.base",
    "TierReader": "tierckpt.tiers.base",
    "TierWriter": "tierckpt.tiers.base",
    "export": "tierckpt.interop.exporting",
    "load_safetensors": "tierckpt.interop.loading",
}

__all__ = [
    "CheckpointEvictedError",
    "CheckpointInfo",
    "CheckpointKey",
    "CheckpointNotFoundError",
    "ConfigError",
    "CoordinationError",
    "Coordinator",
    "CorruptCheckpointError",
    "DemoteConfig",
    "DeviceFullError",
    "Hierarchy",
    "HierarchyConfig",
    "IOConfig",
    "KeyMap",
    "LayoutConfig",
    "PolicyConfig",
    "ResumableLoader",
    "SaveHandle",
    "SoloCoordinator",
    "StateError",
    "StoreCoordinator",
    "Tier",
    "TierBusyError",
    "TierCapabilities",
    "TierConfig",
    "TierFullError",
    "TierIOError",
    "TierReader",
    "TierWriter",
    "TierckptError",
    "TrainState",
    "UnsupportedFormatError",
    "__version__",
    "available_kinds",
    "export",
    "get_tier_class",
    "load_config",
    "load_safetensors",
    "register_tier",
    "rng_state",
    "set_rng_state",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from tierckpt.config import (
        DemoteConfig,
        HierarchyConfig,
        LayoutConfig,
        PolicyConfig,
        TierConfig,
        load_config,
    )
    from tierckpt.datapath.keymap import KeyMap
    from tierckpt.errors import (
        CheckpointEvictedError,
        CheckpointNotFoundError,
        ConfigError,
        CoordinationError,
        CorruptCheckpointError,
        DeviceFullError,
        StateError,
        TierBusyError,
        TierckptError,
        TierFullError,
        TierIOError,
        UnsupportedFormatError,
    )
    from tierckpt.hierarchy import CheckpointInfo, Hierarchy, SaveHandle
    from tierckpt.interop.exporting import export
    from tierckpt.interop.loading import load_safetensors
    from tierckpt.ioconfig import IOConfig
    from tierckpt.ranks.coordinator import Coordinator, SoloCoordinator
    from tierckpt.ranks.distributed import StoreCoordinator
    from tierckpt.registry import available_kinds, get_tier_class, register_tier
    from tierckpt.resume import ResumableLoader, TrainState, rng_state, set_rng_state
    from tierckpt.tiers.base import CheckpointKey, Tier, TierCapabilities, TierReader, TierWriter


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name in this module."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
