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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tierckpt.errors import ConfigError

__all__ = [
    "ENGINES",
    "ON_FULL",
    "DemoteConfig",
    "HierarchyConfig",
    "IOConfig",
    "LayoutConfig",
    "PolicyConfig",
    "TierConfig",
    "format_size",
    "load_config",
    "parse_config",
    "parse_policy",
    "parse_size",
]

ENGINES = ("auto", "uring", "threads")
ON_FULL = ("wait", "fail")
ENV_ENGINE = "TIERCKPT_ENGINE"

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_size(value: Any, key: str) -> int:
    """Parse ``64GiB``, ``100 MB``, ``4096`` or an int into bytes.

    Raises:
        ConfigError: naming ``key`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '64GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: expected a non-negative size, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n == int(n):
                return int(n)
    raise ConfigError(f"{key}: expected a size like '64GiB', got {value!r}")


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
    """

    name: str
    kind: str
    path: Path | None = None
    capacity_bytes: int | None = None
    blob_bytes: int | None = None
    io: IOConfig = field(default_factory=IOConfig)
    on_full: str = "wait"
    key: str = "tiers[?]"


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
    """

    keep: Mapping[str, int] = field(default_factory=dict)
    demote: Mapping[str, DemoteConfig] = field(default_factory=dict)
    promote_on_restore: bool = False


@dataclass(frozen=True)
class HierarchyConfig:
    """A whole hierarchy: tiers fastest first, default I/O settings, layout and policy."""

    tiers: tuple[TierConfig, ...]
    io: IOConfig = field(default_factory=IOConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)


def _check_keys(d: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> Mapping[str, Any]:  # type: ignore[assignment]
    if not isinstance(d, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(d).__name__} {d!r}")
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{key}.{k}: unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in required:
        if k not in d:
            raise ConfigError(f"{key}.{k}: required key is missing")
    return d


def _int(v: Any, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _parse_io(d: Any, key: str, base: IOConfig) -> IOConfig:
    d = _check_keys(d, key, {"engine", "direct", "queue_depth", "chunk"})
    out = base
    if "engine" in d:
        if d["engine"] not in ENGINES:
            raise ConfigError(f"{key}.engine: expected one of {', '.join(ENGINES)}, got {d['engine']!r}")
        out = replace(out, engine=d["engine"])
    if "direct" in d:
        if not isinstance(d["direct"], bool):
            raise ConfigError(f"{key}.direct: expected true or false, got {d['direct']!r}")
        out = replace(out, direct=d["direct"])
    if "queue_depth" in d:
        out = replace(out, queue_depth=_int(d["queue_depth"], f"{key}.queue_depth", 1, 1024))
    if "chunk" in d:
        chunk = parse_size(d["chunk"], f"{key}.chunk")
        if chunk < 4096 or chunk % 4096 or chunk > 1 << 30:
            raise ConfigError(f"{key}.chunk: expected a multiple of 4KiB between 4KiB and 1GiB, got {d['chunk']!r}")
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
    d = _check_keys(data, "config", {"tiers", "io", "layout", "policy"}, {"tiers"})
    io = IOConfig(engine=os.environ.get(ENV_ENGINE, "auto"))
    if io.engine not in ENGINES:
        raise ConfigError(f"${ENV_ENGINE}: expected one of {', '.join(ENGINES)}, got {io.engine!r}")
    if "io" in d:
        io = _parse_io(d["io"], "io", io)
    layout = LayoutConfig()
    if "layout" in d:
        ld = _check_keys(d["layout"], "layout", {"align", "blob_size"})
        if "align" in ld:
            align = parse_size(ld["align"], "layout.align")
            if align < 512 or align & (align - 1) or align > 1 << 24:
                raise ConfigError(f"layout.align: expected a power of two between 512B and 16MiB, got {ld['align']!r}")
            layout = replace(layout, align_bytes=align)
        if "blob_size" in ld:
            layout = replace(layout, blob_bytes=_blob_size(ld["blob_size"], "layout.blob_size"))
    tiers_raw = d["tiers"]
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError(f"tiers: expected a non-empty list of tier entries, got {tiers_raw!r}")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    tiers: list[TierConfig] = []
    for i, t in enumerate(tiers_raw):
        key = f"tiers[{i}]"
        t = _check_keys(t, key, {"name", "kind", "path", "capacity", "blob_size", "io", "on_full"}, {"name", "kind"})
        name, kind = t["name"], t["kind"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(f"{key}.name: expected a name of letters, digits, '_', '-', '.', got {name!r}")
        if any(x.name == name for x in tiers):
            raise ConfigError(f"{key}.name: tier name {name!r} is used twice")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{key}.kind: expected a tier kind such as 'host', 'local' or 'pfs', got {kind!r}")
        path = None
        if "path" in t:
            if not isinstance(t["path"], str) or not t["path"]:
                raise ConfigError(f"{key}.path: expected a directory path, got {t['path']!r}")
            p = Path(os.path.expandvars(os.path.expanduser(t["path"])))
            path = p if p.is_absolute() else (base / p).resolve()
        tiers.append(
            TierConfig(
                name=name,
                kind=kind,
                path=path,
                capacity_bytes=parse_size(t["capacity"], f"{key}.capacity") if "capacity" in t else None,
                blob_bytes=_blob_size(t["blob_size"], f"{key}.blob_size") if "blob_size" in t else None,
                io=_parse_io(t["io"], f"{key}.io", io) if "io" in t else io,
                on_full=_choice(t.get("on_full", "wait"), f"{key}.on_full", ON_FULL),
                key=key,
            )
        )
    policy = (
        parse_policy(_policy_mapping(d["policy"], base), [t.name for t in tiers]) if "policy" in d else PolicyConfig()
    )
    return HierarchyConfig(tiers=tuple(tiers), io=io, layout=layout, policy=policy)


def _policy_mapping(value: Any, base: Path) -> Mapping[str, Any]:
    """``policy:`` is a mapping, or the path of a YAML preset (e.g. ``policies/keep-last-2.yaml``)."""
    if isinstance(value, str):
        p = Path(os.path.expandvars(os.path.expanduser(value)))
        p = p if p.is_absolute() else base / p
        try:
            value = yaml.safe_load(p.read_text())
        except OSError as e:
            raise ConfigError(f"policy: cannot read policy preset {p}: {e.strerror or e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"policy: {p} is not valid YAML: {e}") from e
    return _check_keys(value, "policy", {"keep", "demote", "promote"})


def _choice(v: Any, key: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {v!r}")
    return v  # type: ignore[no-any-return]


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {v!r}")
    return v


def parse_policy(data: Any, tiers: list[str]) -> PolicyConfig:
    """Validate a ``policy:`` mapping for a hierarchy with these tier names (fastest first).

    Raises:
        ConfigError: naming the bad key, e.g. ``policy.demote.pfs.every: expected an integer in [1, ...]``.
    """
    pd = _check_keys(data, "policy", {"keep", "demote", "promote"})
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
                    f"{key}: {name!r} is the top tier, which receives every save; demotion rules are for the tiers below it"
                )
            rule = _check_keys(rule, key, {"every", "every_secs", "on_close"})
            secs = rule.get("every_secs")
            if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or not secs > 0):
                raise ConfigError(f"{key}.every_secs: expected a positive number of seconds, got {secs!r}")
            demote[name] = DemoteConfig(
                every=_int(rule["every"], f"{key}.every", 1, 1 << 31) if "every" in rule else None,
                every_secs=float(secs) if secs is not None else None,
                on_close=_bool(rule.get("on_close", False), f"{key}.on_close"),
            )
    on_restore = False
    if "promote" in pd:
        prd = _check_keys(pd["promote"], "policy.promote", {"on_restore"})
        on_restore = _bool(prd.get("on_restore", False), "policy.promote.on_restore")
    return PolicyConfig(keep=keep, demote=demote, promote_on_restore=on_restore)


def _blob_size(v: Any, key: str) -> int:
    n = parse_size(v, key)
    if n < 1 << 20:
        raise ConfigError(f"{key}: expected at least 1MiB, got {v!r}")
    return n


def load_config(path: str | os.PathLike[str]) -> HierarchyConfig:
    """Read a YAML file and validate it; relative tier paths resolve against the file's folder.

    Raises:
        ConfigError: the file is missing, is not YAML, or holds an invalid config.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    try:
        return parse_config(data, base_dir=p.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
