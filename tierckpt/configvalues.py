"""Checks of single configuration values shared by :mod:`tierckpt.config` and the tier kinds: sizes,
bounded reprs for error messages, and paths with ``~`` and ``$VAR`` expanded as a shell would."""

from __future__ import annotations

import os
import re
import reprlib
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError

__all__ = ["expand_path", "format_size", "no_nul", "parse_size", "resolve_path", "short"]

_ENV_RE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # what os.path.expandvars replaces
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}  # fmt: skip
_MAX_SIZE = (1 << 63) - 1
# ASCII only: \d and \s would also take Unicode digits (and int() would read them)
_SIZE_RE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([A-Za-z]*)\s*", re.ASCII)


class _Repr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr() refuses an int of over 4300 digits (and 0x<5000 hex digits> is valid YAML)
        return super().repr_int(x, level) if x.bit_length() <= 128 else f"<an integer of {x.bit_length()} bits>"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 40, 40, 40


def short(value: Any) -> str:
    """``repr(value)`` for an error message, bounded: YAML aliases make a 200-byte file hold a list
    whose full repr is gigabytes, and a bad size may be 5000 digits long."""
    return _REPR.repr(value)


def parse_size(value: Any, key: str) -> int:
    """Parse ``64GiB``, ``100 MB``, ``4096`` or an int into bytes.

    A fraction (``1.5GiB``) must come to a whole number of bytes; the arithmetic is exact.

    Raises:
        ConfigError: naming ``key`` when the value is not a size from 0 to 2**63 - 1 bytes.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '64GiB', got {short(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: expected a non-negative size, got {short(value)}")
        if value > _MAX_SIZE:
            raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {short(value)}")
        return value
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None or m.group(3).lower() not in _UNITS:
        raise ConfigError(f"{key}: expected a size like '64GiB', got {short(value)}")
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
    # Bound the digits before int() (which refuses over 4300): 20 whole digits exceed 2**63, and a
    # fraction of more than 40 digits (2**-40 has 40) never makes whole bytes with any unit.
    if len(whole) > 19:
        raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {short(value)}")
    n, rest = 0, 1
    if len(frac) <= 40:
        n, rest = divmod(int(whole + frac or "0") * _UNITS[m.group(3).lower()], 10 ** len(frac))
    if rest:
        raise ConfigError(f"{key}: expected a whole number of bytes, got {short(value)}")
    if n > _MAX_SIZE:
        raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {short(value)}")
    return n


def format_size(n: int) -> str:
    """Format bytes the way :func:`parse_size` reads them back (``1.5GiB``)."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g}{unit}"
    return f"{n}B"


def no_nul(value: str, key: str) -> None:
    """No path of the operating system holds a NUL byte (``open`` would raise a bare ValueError).

    Raises:
        ConfigError: naming ``key`` when ``value`` holds one.
    """
    if "\0" in value:
        raise ConfigError(f"{key}: a path cannot contain a NUL byte, got {short(value)}")


def expand_path(value: str, key: str) -> Path:
    """Expand a leading ``~`` / ``~user``, then ``$VAR`` and ``${VAR}``, as a shell would.

    Raises:
        ConfigError: naming ``key`` and the variable when one is not set or is empty (``$SCRATCH/ckpt``
            would otherwise name a directory ``$SCRATCH``, or ``/ckpt``), or a NUL byte.
    """
    no_nul(value, key)
    head, sep, tail = value.partition("/") if value.startswith("~") else ("", "", value)

    def var(m: re.Match[str]) -> str:
        got = os.environ.get(m.group(1)[1:-1] if m.group(1).startswith("{") else m.group(1))
        if not got:
            raise ConfigError(f"{key}: {m.group(0)} is {'empty' if got == '' else 'not set'}")
        return got

    return Path(os.path.expanduser(head) + sep + _ENV_RE.sub(var, tail))


def resolve_path(value: str, key: str, base_dir: str | os.PathLike[str]) -> Path:
    """:func:`expand_path`, then relative to ``base_dir`` (the YAML file's folder), made absolute.

    Raises:
        ConfigError: as :func:`expand_path`.
    """
    p = expand_path(value, key)
    return p if p.is_absolute() else (Path(base_dir) / p).resolve()
