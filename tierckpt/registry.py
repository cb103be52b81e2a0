"""Tier kinds → classes, like fsspec's registry.

Kinds are lazy: built-ins are dotted paths (``"tierckpt.tiers.local:LocalTier"``), and this module
imports no tier module (nor torch, CUDA or liburing). :func:`available_kinds` reads names only; a kind's
module is imported by :func:`get_tier_class` when a hierarchy is built with it. Third-party packages
add kinds through the ``tierckpt.tiers`` entry-point group::

    [project.entry-points."tierckpt.tiers"]
    objdir = "objdir_tier:ObjdirTier"

or call :func:`register_tier` (with a class or a ``"module:Class"`` path). Registering a different
class under a taken kind raises unless ``clobber=True``. docs/tiers.md is the guide to writing a kind.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from tierckpt.errors import ConfigError

if TYPE_CHECKING:
    from tierckpt.tiers.base import Tier

__all__ = ["available_kinds", "get_tier_class", "register_tier"]

ENTRY_POINT_GROUP = "tierckpt.tiers"

_known: dict[str, str] = {
    "gpu": "tierckpt.tiers.gpu:GpuTier",
    "host": "tierckpt.tiers.host:HostTier",
    "local": "tierckpt.tiers.local:LocalTier",
    "pfs": "tierckpt.tiers.pfs:PfsTier",
    "s3": "tierckpt.tiers.s3:S3Tier",
}
_registry: dict[str, type[Tier]] = {}


def register_tier(kind: str, cls: type | str, *, clobber: bool = False) -> None:
    """Register a tier class (or a ``"module:Class"`` path) under ``kind``.

    Raises:
        ValueError: ``kind`` is taken by another class and ``clobber`` is False.
    """
    current = _registry.get(kind) or _known.get(kind)
    if current is not None and current != cls and not clobber:
        raise ValueError(f"tier kind {kind!r} is already registered to {current!r}; pass clobber=True to replace it")
    if isinstance(cls, str):
        _known[kind] = cls
        _registry.pop(kind, None)
    else:
        _registry[kind] = cls


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_kinds() -> list[str]:
    """Every kind that can be built: built-ins, registered ones and installed plugins."""
    return sorted(set(_known) | set(_registry) | set(_entry_points()))


def get_tier_class(kind: str, key: str = "kind") -> type[Tier]:
    """The class for ``kind``, importing it on first use.

    Raises:
        ConfigError: naming ``key`` when the kind is unknown, its module does not import, or what it
            names is not a :class:`~tierckpt.tiers.base.Tier` subclass.
    """
    if kind in _registry:
        return _registry[kind]
    target = _known.get(kind) or _entry_points().get(kind)
    if target is None:
        raise ConfigError(f"{key}: unknown tier kind {kind!r} (available: {', '.join(available_kinds())})")
    mod_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}: tier kind {kind!r} ({target}) cannot be imported: {e}") from e
    from tierckpt.tiers.base import Tier as _Tier  # only now: a kind is being used

    if not (isinstance(cls, type) and issubclass(cls, _Tier)):
        raise ConfigError(f"{key}: tier kind {kind!r} ({target}) is not a tierckpt.tiers.base.Tier subclass")
    _registry[kind] = cls
    return cls
