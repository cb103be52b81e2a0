"""Checks of single configuration values shared by :mod:`tierckpt.config` and the tier kinds: bounded
reprs for error messages, and paths with ``~`` and ``$VAR`` expanded as a shell would."""

from __future__ import annotations

import os
import re
import reprlib
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError

__all__ = ["expand_path", "no_nul", "resolve_path", "short"]

_ENV_RE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # what os.path.expandvars replaces


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
