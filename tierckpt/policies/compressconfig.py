"""A tier's ``compress:`` setting: parsed from its YAML entry, and its default for the tier's kind.

What ``auto`` decides with the setting, frame by frame, is :mod:`tierckpt.policies.compression`'s; how a
compressed copy is stored is the format's (docs/format.md). This module imports neither numpy nor zstd:
the config is parsed without them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierckpt.configvalues import check_int, check_keys, short
from tierckpt.errors import ConfigError

__all__ = ["LEVELS", "MODES", "NONE", "CompressConfig", "default_compress", "parse_compress", "tier_compress"]

MODES = ("none", "zstd", "auto")
LEVELS = range(-7, 20)
_MAX_THREADS = 256


# -- the setting ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressConfig:
    """A tier's ``compress:`` setting.

    Attributes:
        mode: ``none`` (raw), ``zstd`` (every frame) or ``auto`` (where it makes the transfer shorter).
        level: the zstd level, -7 (fastest) to 19.
        threads: compressor threads (None: the writer's default).
    """

    mode: str
    level: int = 1
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.level, bool) or self.level not in LEVELS:
            raise ValueError(f"level: expected an integer from -7 to 19, got {self.level!r}")
        if self.threads is not None and not 1 <= self.threads <= _MAX_THREADS:
            raise ValueError(f"threads: expected 1 to {_MAX_THREADS}, got {self.threads!r}")


NONE = CompressConfig("none")
_FORMS = "none, zstd, auto, 'zstd:LEVEL' or a mapping {mode, level, threads}"
_LEVEL_RE = re.compile(r"(zstd|auto):(-?[0-9]{1,3})", re.ASCII)


def parse_compress(value: object, where: str) -> CompressConfig | None:
    """Parse a tier entry's ``compress:``.

    Accepts ``none``, ``zstd``, ``auto``, ``zstd:LEVEL`` (also ``auto:LEVEL``), ``false`` (what YAML
    makes of ``off``: none), or a mapping ``{mode, level, threads}`` (``mode`` required). None (the key
    given no value) is the tier kind's default, returned as None.

    Args:
        value: the parsed YAML value.
        where: the key, for errors (``tiers[2].compress``).

    Raises:
        ConfigError: naming ``where`` (or the mapping's bad key) and what is accepted.
    """
    if value is None:
        return None
    if value is False:
        return NONE
    if isinstance(value, str):
        if value in MODES:
            return CompressConfig(value)
        m = _LEVEL_RE.fullmatch(value)
        if m is None:
            raise ConfigError(f"{where}: expected {_FORMS}, got {short(value)}")
        return CompressConfig(m.group(1), _level(int(m.group(2)), where))
    if isinstance(value, Mapping):
        d = check_keys(value, where, {"mode", "level", "threads"}, {"mode"})
        mode = d["mode"]
        if mode is False:
            mode = "none"
        if mode not in MODES:
            raise ConfigError(f"{where}.mode: expected one of {', '.join(MODES)}, got {short(mode)}")
        if mode == "none" and len(d) > 1:
            extra = next(k for k in d if k != "mode")
            raise ConfigError(f"{where}.{extra}: mode none compresses nothing (remove {extra}, or pick zstd or auto)")
        level = _level(d["level"], f"{where}.level") if "level" in d else 1
        threads = check_int(d["threads"], f"{where}.threads", 1, _MAX_THREADS) if "threads" in d else None
        return CompressConfig(mode, level, threads)
    hint = " (true is ambiguous: say zstd or auto)" if value is True else ""
    raise ConfigError(f"{where}: expected {_FORMS}, got {short(value)}{hint}")


def _level(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v not in LEVELS:
        raise ConfigError(f"{key}: expected a zstd level from -7 (fastest) to 19, got {short(v)}")
    return v


def default_compress(kind_device: str, shared: bool, persistent: bool) -> CompressConfig:
    """The ``compress:`` of a tier whose entry names none: ``auto`` on shared persistent file tiers (a
    parallel file system) and object stores, ``none`` on memory tiers and node-local disks."""
    if kind_device == "object" or (kind_device == "file" and shared and persistent):
        return CompressConfig("auto")
    return NONE


def tier_compress(
    cfg: CompressConfig | None,
    kind_device: str,
    shared: bool,
    persistent: bool,
    where: str,
    encoded_copies: bool = True,
) -> CompressConfig:
    """A tier's effective setting: ``cfg``, or the default for its capabilities.

    Args:
        encoded_copies: whether the tier can store a compressed copy (its capabilities say): one that
            cannot gets ``none`` by default.

    Raises:
        ConfigError: naming ``where``, for compression asked of a ``cuda`` tier (device memory is
            written by copies on the device, where no compressor runs) or of a tier that cannot store it.
    """
    if cfg is None:
        return default_compress(kind_device, shared, persistent) if encoded_copies else NONE
    if kind_device == "cuda" and cfg.mode != "none":
        raise ConfigError(f"{where}: a gpu tier stores device memory as it is and compresses nothing, got {cfg.mode}")
    if not encoded_copies and cfg.mode != "none":
        raise ConfigError(
            f"{where}: this tier does not declare that it can store compressed copies "
            f"(TierCapabilities.encoded_copies), got {cfg.mode}"
        )
    return cfg
