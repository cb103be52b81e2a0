"""A directory tier's ``file_layout`` option: the layout it sets on each new data file, where its file
system lets the writer choose one (CephFS, Lustre; :mod:`tierckpt.io.fslayout`).

The option is read from the tier's entry, checked against the file system's facts when the tier is
built (a file system that takes no layout, or refuses this one on a probe, is an error then, not at the
first save), and set by the writer on each copy's data files (:mod:`tierckpt.tiers._filewrite`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierckpt.configvalues import parse_size, short
from tierckpt.errors import ConfigError, TierIOError
from tierckpt.io.fslayout import FileLayout, check_settable, probe_layout
from tierckpt.io.geometry import FsFacts

__all__ = ["check_file_layout", "parse_file_layout"]

_KEYS = ("stripe_unit", "stripe_count", "object_size")
_UNIT = 64 << 10  # CephFS and Lustre both take stripe units in multiples of 64 KiB
_MAX_UNIT = (1 << 32) - _UNIT  # Lustre's stripe size is a 32-bit field
_MAX_COUNT = 2000  # Lustre's most stripes (LOV_MAX_STRIPE_COUNT)


def parse_file_layout(value: Any, key: str) -> FileLayout | None:
    """``{stripe_unit: 4MiB, stripe_count: 4, object_size: 4MiB}`` (``object_size``: CephFS only, a
    multiple of the stripe unit; ``stripe_count`` default 1); None (``file_layout: null``): none set.

    Raises:
        ConfigError: naming ``key.<field>``: an unknown or missing field, a bad size or count.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{key}: expected a mapping such as {{stripe_unit: 4MiB, stripe_count: 4}}, got {short(value)}"
        )
    for k in value:
        if k not in _KEYS:
            raise ConfigError(f"{key}.{k}: unknown field (a file layout takes: {', '.join(_KEYS)})")
    if "stripe_unit" not in value:
        raise ConfigError(f"{key}.stripe_unit: required field of a file layout is missing")
    unit = parse_size(value["stripe_unit"], f"{key}.stripe_unit")
    if not _UNIT <= unit <= _MAX_UNIT or unit % _UNIT:
        raise ConfigError(
            f"{key}.stripe_unit: expected a multiple of 64KiB below 4GiB, got {short(value['stripe_unit'])}"
        )
    count = value.get("stripe_count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= _MAX_COUNT:
        raise ConfigError(f"{key}.stripe_count: expected an integer in [1, {_MAX_COUNT}], got {short(count)}")
    obj = None
    if "object_size" in value:
        obj = parse_size(value["object_size"], f"{key}.object_size")
        if not unit <= obj <= 1 << 32 or obj % unit:
            raise ConfigError(
                f"{key}.object_size: expected a multiple of the stripe unit ({unit} bytes) up to 4GiB, "
                f"got {short(value['object_size'])}"
            )
    return FileLayout(unit, count, obj)


def check_file_layout(name: str, path: Path, facts: FsFacts, layout: FileLayout, *, probe: bool) -> None:
    """Whether tier ``name``'s file system (``facts``) takes ``layout``: by its family, and where
    ``probe`` (a writable tier) by setting it once on a probe in ``path``.

    Raises:
        ConfigError: the file system takes no layout from a client (or not this one: an object size
            on Lustre).
        TierIOError: it refused the layout on the probe (its errno: EOPNOTSUPP, EINVAL, EPERM ...).
    """
    what = f"tier {name!r}: file_layout ({layout.describe()})"
    try:
        check_settable(facts, layout)
    except ValueError as e:
        raise ConfigError(f"{what}: {path}: {e}") from None
    if not probe:
        return
    try:
        probe_layout(path, facts.family, layout)
    except OSError as e:
        raise TierIOError(
            e.errno, f"{what}: the file system of {path} refused it on a probe file: {e.strerror or e}", str(path)
        ) from e
