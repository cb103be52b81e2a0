"""What a tier kind's ``from_config`` uses to read its entry: its ``options:`` and its location.

Each kind declares the options it takes and checks them with :func:`check_options`; unknown keys,
missing required ones and bad values are :class:`~tierckpt.errors.ConfigError` naming
``tiers[i].options.<key>``::

    OPTIONS = {
        "endpoint": Option(text(), doc="the S3 endpoint URL"),
        "part_size": Option(size(lo=5 << 20), default=8 << 20),
    }

    @classmethod
    def from_config(cls, cfg, engines):
        opts = check_options(cfg, OPTIONS)      # {"endpoint": ..., "part_size": ...}

A file tier turns its location into a directory with :func:`local_directory`; a kind whose location
is a URL parses ``cfg.location`` itself (e.g. with :func:`urllib.parse.urlsplit`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.config import TierConfig
from tierckpt.configvalues import expand_placeholders, parse_size, resolve_path, short
from tierckpt.errors import ConfigError

__all__ = [
    "REQUIRED",
    "Option",
    "boolean",
    "check_options",
    "choice",
    "integer",
    "local_directory",
    "number",
    "refuse_location",
    "size",
    "text",
    "tier_location",
]

Parser = Callable[[Any, str], Any]
REQUIRED: Any = object()  #: an :class:`Option` default meaning "the key must be given"
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class Option:
    """One key a kind takes under ``options:``.

    Attributes:
        parse: ``parse(value, key)`` returns the checked value or raises ConfigError naming ``key``
            (:func:`size`, :func:`integer`, :func:`number`, :func:`boolean`, :func:`text`, :func:`choice`).
        default: the value when the key is absent; :data:`REQUIRED` (the default) makes it required.
        doc: one line for humans (listed in the error for an unknown key).
    """

    parse: Parser
    default: Any = REQUIRED
    doc: str = ""


def check_options(cfg: TierConfig, spec: Mapping[str, Option]) -> dict[str, Any]:
    """Check ``cfg.options`` against the options a kind takes; return every option's value.

    Raises:
        ConfigError: naming ``tiers[i].options.<key>``: an unknown key (listing what the kind takes),
            a required key that is missing, or a bad value.
    """
    where = f"{cfg.key}.options"
    for k in cfg.options:
        if k not in spec:
            takes = ", ".join(sorted(spec)) if spec else "none"
            raise ConfigError(f"{where}.{k}: unknown option (a {cfg.kind} tier takes: {takes})")
    out: dict[str, Any] = {}
    for k, opt in spec.items():
        if k in cfg.options:
            out[k] = opt.parse(cfg.options[k], f"{where}.{k}")
        elif opt.default is REQUIRED:
            doc = f" ({opt.doc})" if opt.doc else ""
            raise ConfigError(f"{where}.{k}: required option of a {cfg.kind} tier is missing{doc}")
        else:
            out[k] = opt.default
    return out


def tier_location(cfg: TierConfig) -> str | None:
    """The entry's location with ``{rank}`` and ``{node}`` replaced by ``cfg.rank`` and ``cfg.node``
    (``{{`` / ``}}``: literal braces); None when it has none.

    Raises:
        ConfigError: naming ``tiers[i].path``: an unknown placeholder or a stray brace.
    """
    if cfg.location is None:
        return None
    return expand_placeholders(cfg.location, f"{cfg.key}.path", rank=cfg.rank, node=cfg.node)


def local_directory(cfg: TierConfig) -> Path:
    """A file tier's location as a directory: ``{rank}`` and ``{node}`` replaced (:func:`tier_location`),
    ``~`` and ``$VAR`` / ``${VAR}`` expanded, relative to ``cfg.base_dir`` (the YAML file's folder),
    absolute.

    Raises:
        ConfigError: naming ``tiers[i].path``: no location, a URL, a variable that is not set or empty,
            an unknown placeholder.
    """
    key = f"{cfg.key}.path"
    location = tier_location(cfg)
    if location is None:
        raise ConfigError(f"{key}: a {cfg.kind} tier needs a directory path")
    if _URL_RE.match(location):
        raise ConfigError(f"{key}: a {cfg.kind} tier takes a directory, not a URL, got {short(location)}")
    return resolve_path(location, key, cfg.base_dir)


def refuse_location(cfg: TierConfig, why: str) -> None:
    """For kinds that take no location.

    Raises:
        ConfigError: naming ``tiers[i].path`` and ``why`` when the entry gives one.
    """
    if cfg.location is not None:
        raise ConfigError(f"{cfg.key}.path: {why}")


# -- value parsers for Option.parse ---------------------------------------------------------------------
def size(lo: int = 0, hi: int | None = None) -> Parser:
    """A size such as ``8MiB`` or ``4096`` (:func:`tierckpt.configvalues.parse_size`), in ``[lo, hi]``."""

    def parse(v: Any, key: str) -> int:
        n = parse_size(v, key)
        if n < lo or (hi is not None and n > hi):
            bound = f"at least {lo} bytes" if hi is None else f"from {lo} to {hi} bytes"
            raise ConfigError(f"{key}: expected a size {bound}, got {short(v)}")
        return n

    return parse


def integer(lo: int, hi: int) -> Parser:
    """An integer in ``[lo, hi]`` (not a bool)."""

    def parse(v: Any, key: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {short(v)}")
        return v

    return parse


def number(lo: float, hi: float) -> Parser:
    """A number (int or float, not a bool) in ``[lo, hi]``, returned as a float."""

    def parse(v: Any, key: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ConfigError(f"{key}: expected a number in [{lo}, {hi}], got {short(v)}")
        return float(v)

    return parse


def boolean() -> Parser:
    """``true`` or ``false``."""

    def parse(v: Any, key: str) -> bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{key}: expected true or false, got {short(v)}")
        return v

    return parse


def text(pattern: str | None = None) -> Parser:
    """A non-empty string, matching ``pattern`` (a regular expression, whole) when given."""
    compiled = re.compile(pattern) if pattern is not None else None

    def parse(v: Any, key: str) -> str:
        if not isinstance(v, str) or not v or (compiled is not None and not compiled.fullmatch(v)):
            want = f"a string matching {pattern!r}" if pattern is not None else "a non-empty string"
            raise ConfigError(f"{key}: expected {want}, got {short(v)}")
        return v

    return parse


def choice(*values: str) -> Parser:
    """One of ``values``."""

    def parse(v: Any, key: str) -> str:
        if v not in values:
            raise ConfigError(f"{key}: expected one of {', '.join(values)}, got {short(v)}")
        picked: str = v  # one of the str values
        return picked

    return parse
