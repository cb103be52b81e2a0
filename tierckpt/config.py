"""YAML / dict configuration → frozen dataclasses, with errors that name the bad key.

Schema (docs/config.md has every key)::

    tiers:
      - {name: host, kind: host, capacity: 2GiB}
      - {name: ssd,  kind: local, path: /scratch/ckpt, capacity: 100GiB}
      - {name: pfs,  kind: pfs,   path: /lustre/me/ckpt, io: {queue_depth: 32}}
    io: {engine: auto, direct: true, queue_depth: 16, chunk: 32MiB}
    layout: {align: 4KiB, blob_size: 1GiB}
    policy:
      keep: {host: 1, ssd: 2}
      demote: {pfs: {every: 5, every_secs: 3600, on_close: true}}
      promote: {on_restore: true}
"""

from __future__ import annotations

import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.yamlfile import YAMLFileError, load_yaml

__all__ = [
    "ENGINES",
    "LEASE_STALE_SECS",
    "ON_FULL",
    "DemoteConfig",
    "HierarchyConfig",
    "IOConfig",
    "LayoutConfig",
    "PolicyConfig",
    "TierConfig",
    "default_io",
    "format_size",
    "load_config",
    "parse_config",
    "parse_policy",
    "parse_size",
]

ENGINES = ("auto", "uring", "threads")
ON_FULL = ("wait", "fail")
ENV_ENGINE = "TIERCKPT_ENGINE"
#: how long a lease holder on another host may go without renewing before it counts as gone (docs/jobs.md)
LEASE_STALE_SECS = 60.0

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
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # used with fullmatch: "ssd\n" is no name
_ENV_RE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # what os.path.expandvars replaces


class _Repr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr() refuses an int of over 4300 digits (and 0x<5000 hex digits> is valid YAML)
        return super().repr_int(x, level) if x.bit_length() <= 128 else f"<an integer of {x.bit_length()} bits>"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 40, 40, 40


def _short(value: Any) -> str:
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
        raise ConfigError(f"{key}: expected a size like '64GiB', got {_short(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: expected a non-negative size, got {_short(value)}")
        if value > _MAX_SIZE:
            raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {_short(value)}")
        return value
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None or m.group(3).lower() not in _UNITS:
        raise ConfigError(f"{key}: expected a size like '64GiB', got {_short(value)}")
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
    # Bound the digits before int() (which refuses over 4300): 20 whole digits exceed 2**63, and a
    # fraction of more than 40 digits (2**-40 has 40) never makes whole bytes with any unit.
    if len(whole) > 19:
        raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {_short(value)}")
    n, rest = 0, 1
    if len(frac) <= 40:
        n, rest = divmod(int(whole + frac or "0") * _UNITS[m.group(3).lower()], 10 ** len(frac))
    if rest:
        raise ConfigError(f"{key}: expected a whole number of bytes, got {_short(value)}")
    if n > _MAX_SIZE:
        raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {_short(value)}")
    return n


def format_size(n: int) -> str:
    """Format bytes the way :func:`parse_size` reads them back (``1.5GiB``)."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class IOConfig:
    """How bytes move between memory and files.

    Attributes:
        engine: ``auto`` (io_uring, falling back to threads with one log line), ``uring`` or ``threads``.
        direct: open blob files with O_DIRECT where the file system allows it.
        queue_depth: operations in flight per engine.
        chunk_bytes: size of one read/write operation and of one staging buffer.
    """

    engine: str = "auto"
    direct: bool = True
    queue_depth: int = 16
    chunk_bytes: int = 32 << 20


def default_io() -> IOConfig:
    """The ``io`` settings of a hierarchy whose config (or constructor) names none: the defaults, with
    the engine from ``$TIERCKPT_ENGINE`` when it is set.

    Raises:
        ConfigError: ``$TIERCKPT_ENGINE`` names no engine.
    """
    engine = os.environ.get(ENV_ENGINE, "auto")
    if engine not in ENGINES:
        raise ConfigError(f"${ENV_ENGINE}: expected one of {', '.join(ENGINES)}, got {_short(engine)}")
    return IOConfig(engine=engine)


@dataclass(frozen=True)
class LayoutConfig:
    """Aggregation of tensors into blobs.

    Attributes:
        align_bytes: alignment of extents of at least this size and of blob sizes (O_DIRECT unit).
        blob_bytes: target size of one blob file; None lets the tiers choose (largest preferred size).
    """

    align_bytes: int = 4096
    blob_bytes: int | None = None


@dataclass(frozen=True)
class TierConfig:
    """One tier entry.

    Attributes:
        name: unique name used in policies and records.
        kind: registered kind (``host``, ``local``, ``pfs`` or a plugin's).
        path: directory for file tiers (absolute, or relative to the YAML file).
        capacity_bytes: upper bound on bytes this tier may hold, or None for unbounded.
        blob_bytes: preferred blob size on this tier, or None for the kind's default.
        io: I/O settings, the hierarchy's merged with this entry's overrides.
        on_full: when the tier is full and nothing can be evicted yet: ``wait`` for the background
            mover to free room (backpressure), or ``fail`` the save at once.
        key: where the entry came from (``tiers[1]``), for error messages.
        readonly: opened by a tool that only reads (``tierckpt ls``): a file tier's directory must
            exist, and nothing is created, swept or written (and no lease is taken).
        job: the job identity a writable file tier leases its directory for (None: from the
            environment, docs/jobs.md); set by ``Hierarchy.from_config(job=...)``.
        lease_stale_secs: how long a lease holder on another host may go without renewing its lease
            before another job takes it over (``lease.stale_secs``).
    """

    name: str
    kind: str
    path: Path | None = None
    capacity_bytes: int | None = None
    blob_bytes: int | None = None
    io: IOConfig = field(default_factory=IOConfig)
    on_full: str = "wait"
    key: str = "tiers[?]"
    readonly: bool = False
    job: str | None = None
    lease_stale_secs: float = LEASE_STALE_SECS


@dataclass(frozen=True)
class DemoteConfig:
    """When saves reach one tier below the top (docs/policies.md).

    Attributes:
        every: every N-th save (None: not by count).
        every_secs: the first save at least T seconds after the last one sent there (None: not by time).
        on_close: on ``close()`` / preemption, send the newest checkpoint there if it is not yet there.
    """

    every: int | None = None
    every_secs: float | None = None
    on_close: bool = False


@dataclass(frozen=True)
class PolicyConfig:
    """Policy settings.

    Attributes:
        keep: tier name → newest K checkpoints kept on it (absent: keep all).
        demote: tier name → its cadence (absent: every save goes there).
        promote_on_restore: a restore that reads from a lower tier also copies the checkpoint up to the
            top tier, in the background.
        on_full: tier name → ``wait`` (backpressure, the default) or ``fail`` when the tier is full and
            nothing can be evicted yet.
    """

    keep: Mapping[str, int] = field(default_factory=dict)
    demote: Mapping[str, DemoteConfig] = field(default_factory=dict)
    promote_on_restore: bool = False
    on_full: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HierarchyConfig:
    """A whole hierarchy: tiers fastest first, default I/O settings, layout and policy."""

    tiers: tuple[TierConfig, ...]
    io: IOConfig = field(default_factory=IOConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)


def _check_keys(d: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> Mapping[str, Any]:  # type: ignore[assignment]
    if not isinstance(d, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(d).__name__} {_short(d)}")
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{key}.{k}: unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in required:
        if k not in d:
            raise ConfigError(f"{key}.{k}: required key is missing")
    return d


def _int(v: Any, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _parse_io(d: Any, key: str, base: IOConfig) -> IOConfig:
    d = _check_keys(d, key, {"engine", "direct", "queue_depth", "chunk"})
    out = base
    if "engine" in d:
        if d["engine"] not in ENGINES:
            raise ConfigError(f"{key}.engine: expected one of {', '.join(ENGINES)}, got {_short(d['engine'])}")
        out = replace(out, engine=d["engine"])
    if "direct" in d:
        if not isinstance(d["direct"], bool):
            raise ConfigError(f"{key}.direct: expected true or false, got {_short(d['direct'])}")
        out = replace(out, direct=d["direct"])
    if "queue_depth" in d:
        out = replace(out, queue_depth=_int(d["queue_depth"], f"{key}.queue_depth", 1, 1024))
    if "chunk" in d:
        chunk = parse_size(d["chunk"], f"{key}.chunk")
        if chunk < 4096 or chunk % 4096 or chunk > 1 << 30:
            raise ConfigError(
                f"{key}.chunk: expected a multiple of 4KiB between 4KiB and 1GiB, got {_short(d['chunk'])}"
            )
        out = replace(out, chunk_bytes=chunk)
    return out


def parse_config(data: Any, base_dir: str | os.PathLike[str] | None = None) -> HierarchyConfig:
    """Validate a config mapping (the YAML schema) and return a :class:`HierarchyConfig`.

    Args:
        data: the parsed YAML document.
        base_dir: directory that relative tier paths are resolved against (the YAML file's folder);
            defaults to the current directory.

    Raises:
        ConfigError: naming the first bad key, e.g. ``tiers[1].capacity: expected a size like '64GiB', got 'lots'``.
    """
    d = _check_keys(data, "config", {"tiers", "io", "layout", "policy", "lease"}, {"tiers"})
    io = default_io()
    if "io" in d:
        io = _parse_io(d["io"], "io", io)
    layout = LayoutConfig()
    if "layout" in d:
        ld = _check_keys(d["layout"], "layout", {"align", "blob_size"})
        if "align" in ld:
            align = parse_size(ld["align"], "layout.align")
            if align < 512 or align & (align - 1) or align > 1 << 24:
                raise ConfigError(
                    f"layout.align: expected a power of two between 512B and 16MiB, got {_short(ld['align'])}"
                )
            layout = replace(layout, align_bytes=align)
        if "blob_size" in ld:
            layout = replace(layout, blob_bytes=_blob_size(ld["blob_size"], "layout.blob_size"))
    stale_secs = _parse_lease(d["lease"]) if "lease" in d else LEASE_STALE_SECS
    tiers_raw = d["tiers"]
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError(f"tiers: expected a non-empty list of tier entries, got {_short(tiers_raw)}")
    if base_dir is not None:
        _no_nul(os.fspath(base_dir), "base_dir")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    tiers: list[TierConfig] = []
    for i, t in enumerate(tiers_raw):
        key = f"tiers[{i}]"
        t = _check_keys(t, key, {"name", "kind", "path", "capacity", "blob_size", "io", "on_full"}, {"name", "kind"})
        name, kind = t["name"], t["kind"]
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{key}.name: expected a name of letters, digits, '_', '-', '.', got {_short(name)}")
        if any(x.name == name for x in tiers):
            raise ConfigError(f"{key}.name: tier name {_short(name)} is used twice")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{key}.kind: expected a tier kind such as 'host', 'local' or 'pfs', got {_short(kind)}")
        path = None
        if "path" in t:
            if not isinstance(t["path"], str) or not t["path"]:
                raise ConfigError(f"{key}.path: expected a directory path, got {_short(t['path'])}")
            p = _expand_path(t["path"], f"{key}.path")
            path = p if p.is_absolute() else (base / p).resolve()
        capacity = None
        if "capacity" in t:
            capacity = parse_size(t["capacity"], f"{key}.capacity")
            if capacity == 0:
                raise ConfigError(f"{key}.capacity: expected a positive size, got {_short(t['capacity'])}")
        tiers.append(
            TierConfig(
                name=name,
                kind=kind,
                path=path,
                capacity_bytes=capacity,
                blob_bytes=_blob_size(t["blob_size"], f"{key}.blob_size") if "blob_size" in t else None,
                io=_parse_io(t["io"], f"{key}.io", io) if "io" in t else io,
                on_full=_choice(t.get("on_full", "wait"), f"{key}.on_full", ON_FULL),
                key=key,
                lease_stale_secs=stale_secs,
            )
        )
    policy = (
        parse_policy(_policy_mapping(d["policy"], base), [t.name for t in tiers]) if "policy" in d else PolicyConfig()
    )
    on_full = {t.name: t.on_full for t in tiers if t.on_full != "wait"}
    if on_full:
        policy = replace(policy, on_full={**policy.on_full, **on_full})
    return HierarchyConfig(tiers=tuple(tiers), io=io, layout=layout, policy=policy)


def _no_nul(value: str, key: str) -> None:
    """No path of the operating system holds a NUL byte (``open`` would raise a bare ValueError).

    Raises:
        ConfigError: naming ``key`` when ``value`` holds one.
    """
    if "\0" in value:
        raise ConfigError(f"{key}: a path cannot contain a NUL byte, got {_short(value)}")


def _parse_lease(value: Any) -> float:
    """``lease: {stale_secs: 60}``: the renewal timeout of lease holders on other hosts (docs/jobs.md)."""
    secs = _check_keys(value, "lease", {"stale_secs"}).get("stale_secs", LEASE_STALE_SECS)
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not 1 <= secs <= 86400:
        raise ConfigError(f"lease.stale_secs: expected a number of seconds from 1 to 86400, got {_short(secs)}")
    return float(secs)


def _expand_path(value: str, key: str) -> Path:
    """Expand a leading ``~`` / ``~user``, then ``$VAR`` and ``${VAR}``, as a shell would.

    Raises:
        ConfigError: naming ``key`` and the variable when one is not set or is empty (``$SCRATCH/ckpt``
            would otherwise name a directory ``$SCRATCH``, or ``/ckpt``).
    """
    _no_nul(value, key)
    head, sep, tail = value.partition("/") if value.startswith("~") else ("", "", value)

    def var(m: re.Match[str]) -> str:
        got = os.environ.get(m.group(1)[1:-1] if m.group(1).startswith("{") else m.group(1))
        if not got:
            raise ConfigError(f"{key}: {m.group(0)} is {'empty' if got == '' else 'not set'}")
        return got

    return Path(os.path.expanduser(head) + sep + _ENV_RE.sub(var, tail))


def _policy_mapping(value: Any, base: Path) -> Mapping[str, Any]:
    """``policy:`` is a mapping, or the path of a YAML preset (e.g. ``policies/keep-last-2.yaml``)."""
    if isinstance(value, str):
        p = _expand_path(value, "policy")
        p = p if p.is_absolute() else base / p
        try:
            value = load_yaml(p)
        except OSError as e:
            raise ConfigError(f"policy: cannot read policy preset {p}: {e.strerror or e}") from e
        except YAMLFileError as e:
            raise ConfigError(f"policy: {p}: {e}") from e
    return _check_keys(value, "policy", {"keep", "demote", "promote", "on_full"})


def _choice(v: Any, key: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {_short(v)}")
    return v  # type: ignore[no-any-return]


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {_short(v)}")
    return v


def parse_policy(data: Any, tiers: list[str]) -> PolicyConfig:
    """Validate a ``policy:`` mapping for a hierarchy with these tier names (fastest first).

    Raises:
        ConfigError: naming the bad key, e.g. ``policy.demote.pfs.every: expected an integer in [1, ...]``.
    """
    pd = _check_keys(data, "policy", {"keep", "demote", "promote", "on_full"})
    names = set(tiers)
    keep: dict[str, int] = {}
    if "keep" in pd:
        kd = _check_keys(pd["keep"], "policy.keep", names)
        keep = {k: _int(v, f"policy.keep.{k}", 1, 1 << 31) for k, v in kd.items()}
    demote: dict[str, DemoteConfig] = {}
    if "demote" in pd:
        dd = _check_keys(pd["demote"], "policy.demote", names)
        for name, rule in dd.items():
            key = f"policy.demote.{name}"
            if name == tiers[0]:
                raise ConfigError(
                    f"{key}: {_short(name)} is the top tier, which receives every save; demotion rules are for the tiers below it"
                )
            rule = _check_keys(rule, key, {"every", "every_secs", "on_close"})
            secs = rule.get("every_secs")
            if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or not secs > 0):
                raise ConfigError(f"{key}.every_secs: expected a positive number of seconds, got {_short(secs)}")
            demote[name] = DemoteConfig(
                every=_int(rule["every"], f"{key}.every", 1, 1 << 31) if "every" in rule else None,
                every_secs=float(secs) if secs is not None else None,
                on_close=_bool(rule.get("on_close", False), f"{key}.on_close"),
            )
    on_restore = False
    if "promote" in pd:
        prd = _check_keys(pd["promote"], "policy.promote", {"on_restore"})
        on_restore = _bool(prd.get("on_restore", False), "policy.promote.on_restore")
    on_full: dict[str, str] = {}
    if "on_full" in pd:
        od = _check_keys(pd["on_full"], "policy.on_full", names)
        on_full = {k: _choice(v, f"policy.on_full.{k}", ON_FULL) for k, v in od.items()}
    return PolicyConfig(keep=keep, demote=demote, promote_on_restore=on_restore, on_full=on_full)


def _blob_size(v: Any, key: str) -> int:
    n = parse_size(v, key)
    if n < 1 << 20:
        raise ConfigError(f"{key}: expected at least 1MiB, got {_short(v)}")
    return n


def load_config(path: str | os.PathLike[str]) -> HierarchyConfig:
    """Read a YAML file and validate it; relative tier paths resolve against the file's folder.

    Raises:
        ConfigError: the file is missing (or its name holds a NUL byte), is not UTF-8 YAML (or repeats a key in a mapping, or nests
            deeper than 100), or holds an invalid config.
    """
    _no_nul(os.fspath(path), "config file")
    p = Path(path)
    try:
        data = load_yaml(p)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror or e}") from e
    except YAMLFileError as e:
        raise ConfigError(f"{p}: {e}") from e
    try:
        return parse_config(data, base_dir=p.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
