"""The ``io:`` settings: how bytes move between memory and files, hierarchy-wide and per tier.

:class:`IOConfig` holds the settings as written (docs/config.md, "io"); :func:`parse_io` reads the
top-level ``io:`` and a tier entry's, which may also hold that tier's bandwidth budget (docs/tiers.md,
"Bandwidth budgets"). Each tier's I/O geometry (:mod:`tierckpt.io.geometry`) decides every size used
from them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tierckpt.configvalues import check_choice, check_int, check_keys, format_size, parse_rate, parse_size, short
from tierckpt.errors import ConfigError

__all__ = ["ENGINES", "ENV_ENGINE", "MIN_BANDWIDTH", "THROTTLES", "IOConfig", "default_io", "parse_io"]

ENGINES = ("auto", "uring", "threads")
#: which of a budgeted tier's I/O its bandwidth budget paces (docs/tiers.md, "Bandwidth budgets")
THROTTLES = ("background", "all")
#: the smallest bandwidth budget: below it a chunk of 32 MiB would wait over half a minute (a typo for MB/s)
MIN_BANDWIDTH = 10**6
ENV_ENGINE = "TIERCKPT_ENGINE"


@dataclass(frozen=True)
class IOConfig:
    """How bytes move between memory and files.

    Attributes:
        engine: ``auto`` (io_uring, falling back to threads with one log line), ``uring`` or ``threads``.
        direct: open blob files with O_DIRECT where the file system allows it.
        queue_depth: operations in flight per engine.
        chunk_bytes: size of one read/write operation and of one staging buffer.
        stripe_unit_bytes: the file system's stripe unit to size for, over the one detected (None: as
            detected).
        stripe_count: its stripe count, likewise.
        object_bytes: its object size, likewise.
        bandwidth_bytes_per_sec: a tier's bandwidth budget (None: none); a tier's own setting, never
            the hierarchy's (docs/tiers.md, "Bandwidth budgets").
        throttle: what the budget paces: ``background`` (background copies and non-blocking saves) or
            ``all`` (prefetches, blocking saves and restores too).

    These are settings, inputs of each tier's I/O geometry (:func:`tierckpt.io.geometry.io_geometry`),
    which decides every size used from them, and of its budget.
    """

    engine: str = "auto"
    direct: bool = True
    queue_depth: int = 16
    chunk_bytes: int = 32 << 20
    # the file system's stripes, over its detected facts (docs/tiers.md, "I/O geometry")
    stripe_unit_bytes: int | None = None
    stripe_count: int | None = None
    object_bytes: int | None = None
    bandwidth_bytes_per_sec: int | None = None
    throttle: str = "background"


def default_io() -> IOConfig:
    """The ``io`` settings of a hierarchy whose config (or constructor) names none: the defaults, with
    the engine from ``$TIERCKPT_ENGINE`` when it is set.

    Raises:
        ConfigError: ``$TIERCKPT_ENGINE`` names no engine.
    """
    engine = os.environ.get(ENV_ENGINE, "auto")
    if engine not in ENGINES:
        raise ConfigError(f"${ENV_ENGINE}: expected one of {', '.join(ENGINES)}, got {short(engine)}")
    return IOConfig(engine=engine)


_STRIPE_KEYS = ("stripe_unit", "stripe_count", "object_size")
_BUDGET_KEYS = ("bandwidth", "throttle")


def parse_io(d: Any, key: str, base: IOConfig, *, tier: bool = False) -> IOConfig:
    """The top-level ``io:`` (over ``base``, the defaults), or a tier entry's (``tier``: over the
    top-level one), which may also hold the tier's bandwidth budget."""
    if not tier and isinstance(d, Mapping):
        for k in _BUDGET_KEYS:
            if k in d:
                raise ConfigError(
                    f"{key}.{k}: a bandwidth budget is one tier's: give it in that tier's entry, e.g. "
                    "tiers[2].io: {bandwidth: 300MB/s} (here it would give every tier a budget of its own "
                    "that size, not one for the whole hierarchy; docs/tiers.md, 'Bandwidth budgets')"
                )
    keys = {"engine", "direct", "queue_depth", "chunk", *_STRIPE_KEYS, *(_BUDGET_KEYS if tier else ())}
    d = check_keys(d, key, keys)
    out = base
    if "engine" in d:
        if d["engine"] not in ENGINES:
            raise ConfigError(f"{key}.engine: expected one of {', '.join(ENGINES)}, got {short(d['engine'])}")
        out = replace(out, engine=d["engine"])
    if "direct" in d:
        if not isinstance(d["direct"], bool):
            raise ConfigError(f"{key}.direct: expected true or false, got {short(d['direct'])}")
        out = replace(out, direct=d["direct"])
    if "queue_depth" in d:
        out = replace(out, queue_depth=check_int(d["queue_depth"], f"{key}.queue_depth", 1, 1024))
    if "chunk" in d:
        chunk = parse_size(d["chunk"], f"{key}.chunk")  # what a setting may be; the geometry sizes from it
        if chunk < 4096 or chunk % 4096 or chunk > 1 << 30:
            raise ConfigError(
                f"{key}.chunk: expected a multiple of 4KiB between 4KiB and 1GiB, got {short(d['chunk'])}"
            )
        out = replace(out, chunk_bytes=chunk)
    return _parse_budget(d, key, _parse_stripes(d, key, out))


def _parse_stripes(d: Mapping[str, Any], key: str, out: IOConfig) -> IOConfig:
    """``stripe_unit``, ``stripe_count``, ``object_size``: the stripes to size for, over the detected."""
    if "stripe_unit" in d:
        unit = parse_size(d["stripe_unit"], f"{key}.stripe_unit")
        if unit < 4096 or unit % 4096 or unit > 1 << 32:
            raise ConfigError(
                f"{key}.stripe_unit: expected a multiple of 4KiB between 4KiB and 4GiB, got {short(d['stripe_unit'])}"
            )
        out = replace(out, stripe_unit_bytes=unit)
    if "stripe_count" in d:
        out = replace(out, stripe_count=check_int(d["stripe_count"], f"{key}.stripe_count", 1, 65535))
    if "object_size" in d:
        obj = parse_size(d["object_size"], f"{key}.object_size")
        of = out.stripe_unit_bytes
        if obj < 4096 or obj % 4096 or obj > 1 << 32 or (of is not None and obj % of):
            within = f"a multiple of the stripe unit ({format_size(of)})" if of else "a multiple of 4KiB"
            raise ConfigError(f"{key}.object_size: expected {within} up to 4GiB, got {short(d['object_size'])}")
        out = replace(out, object_bytes=obj)
    return out


def _parse_budget(d: Mapping[str, Any], key: str, io: IOConfig) -> IOConfig:
    """A tier entry's ``io.bandwidth`` (a rate such as ``300MB/s``) and ``io.throttle``."""
    if "bandwidth" in d:
        rate = parse_rate(d["bandwidth"], f"{key}.bandwidth")
        if rate < MIN_BANDWIDTH:
            raise ConfigError(f"{key}.bandwidth: expected a rate of at least 1MB/s, got {short(d['bandwidth'])}")
        io = replace(io, bandwidth_bytes_per_sec=rate)
    if "throttle" in d:
        if "bandwidth" not in d:
            raise ConfigError(f"{key}.throttle: there is no {key}.bandwidth for it to apply to")
        io = replace(io, throttle=check_choice(d["throttle"], f"{key}.throttle", THROTTLES))
    return io
