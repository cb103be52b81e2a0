"""YAML / dict configuration → frozen dataclasses, with errors that name the bad key (the ``io:``
settings in :mod:`tierckpt.ioconfig`; this module re-exports them).

Schema (docs/config.md has every key)::

    tiers:
      - {name: host, kind: host, capacity: 2GiB}
      - {name: ssd,  kind: local, path: /scratch/ckpt, capacity: 100GiB}
      - {name: pfs,  kind: pfs,   path: /lustre/me/ckpt, io: {queue_depth: 32, bandwidth: 300MB/s}}
      - {name: obj,  kind: s3,    path: s3://bucket/prefix, options: {endpoint: https://s3.example}}
    io: {engine: auto, direct: true, queue_depth: 16, chunk: 32MiB}
    layout: {align: 4KiB, blob_size: 1GiB}
    policy:
      keep: {host: 1, ssd: 2}
      demote: {pfs: {every: 5, every_secs: 3600, on_close: true}}
      promote: {on_restore: true}
      on_full: {host: wait, ssd: fail}

A tier entry's ``path`` (its location) and ``options`` are the kind's to read: this module keeps them as
written (see :class:`TierConfig`), and each kind's ``from_config`` parses them
(:mod:`tierckpt.tiers.options`), so importing the config imports no tier kind.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tierckpt.configvalues import (
    check_bool,
    check_choice,
    check_int,
    check_keys,
    check_node,
    check_timeout,
    expand_path,
    expand_placeholders,
    format_size,
    no_nul,
    parse_size,
)
from tierckpt.configvalues import short as _short
from tierckpt.errors import ConfigError
from tierckpt.ioconfig import ENGINES, THROTTLES, IOConfig, default_io, parse_io
from tierckpt.policies.compressconfig import CompressConfig, parse_compress
from tierckpt.yamlfile import YAMLFileError, load_yaml

__all__ = [
    "ENGINES",
    "LEASE_STALE_SECS",
    "ON_FULL",
    "THROTTLES",
    "CompressConfig",
    "DemoteConfig",
    "DistributedConfig",
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

ON_FULL = ("wait", "fail")
#: how long a lease holder on another host may go without renewing before it counts as gone (docs/jobs.md)
LEASE_STALE_SECS = 60.0

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # used with fullmatch: "ssd\n" is no name


@dataclass(frozen=True)
class LayoutConfig:
    """Aggregation of tensors into blobs.

    Attributes:
        align_bytes: alignment of extents of at least this size and of blob sizes (O_DIRECT unit).
        blob_bytes: target size of one blob file; None lets the tiers choose (largest preferred size).

    Settings, inputs of the checkpoint geometry (:func:`tierckpt.io.geometry.checkpoint_geometry`).
    """

    align_bytes: int = 4096
    blob_bytes: int | None = None


@dataclass(frozen=True)
class TierConfig:
    """One tier entry, as the kind's ``from_config`` receives it.

    The common keys are parsed here; the location and the options are the kind's to read: a file tier
    resolves ``location`` as a directory (relative to ``base_dir``, ``~`` and ``$VAR`` expanded:
    :func:`tierckpt.tiers.options.local_directory`), an object-store tier parses it as a URL, and every
    kind checks ``options`` against what it takes (:func:`tierckpt.tiers.options.check_options`).

    Attributes:
        name: unique name used in policies and records.
        kind: registered kind (``host``, ``local``, ``pfs`` or a plugin's).
        location: the entry's ``path:`` exactly as written (a directory, a URL such as
            ``s3://bucket/prefix``), or None; not expanded nor resolved.
        base_dir: what a relative location is relative to: the YAML file's folder (else the
            ``base_dir`` given to :func:`parse_config`, else the current directory).
        options: the entry's ``options:`` mapping as written (read-only), for the kind to validate.
        capacity_bytes: upper bound on bytes this tier may hold, or None for unbounded.
        blob_bytes: preferred blob size on this tier, or None for the kind's default.
        io: I/O settings, the hierarchy's merged with this entry's overrides.
        key: where the entry came from (``tiers[1]``; ``h.yaml: tiers[1]`` from :func:`load_config`),
            for error messages.
        readonly: opened by a tool that only reads (``tierckpt ls``): a file tier's directory must
            exist, and nothing is created, swept or written (and no lease is taken).
        job: the job identity a writable file tier leases its directory for (None: from the
            environment, docs/jobs.md); set by ``Hierarchy.from_config(job=...)``.
        lease_stale_secs: how long a lease holder on another host may go without renewing its lease
            before another job takes it over (``lease.stale_secs``).
        rank: what ``{rank}`` in ``location`` stands for (None: this process's rank,
            :func:`~tierckpt.configvalues.process_rank`); set by ``Hierarchy.from_config``.
        node: what ``{node}`` stands for (None: this process's node,
            :func:`~tierckpt.configvalues.node_identity`); set by ``Hierarchy.from_config``.
        compress: the entry's ``compress:`` (None: the kind's default,
            :func:`tierckpt.policies.compressconfig.tier_compress`).
    """

    name: str
    kind: str
    location: str | None = None
    base_dir: Path = field(default_factory=Path.cwd)
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    capacity_bytes: int | None = None
    blob_bytes: int | None = None
    io: IOConfig = field(default_factory=IOConfig)
    key: str = "tiers[?]"
    readonly: bool = False
    job: str | None = None
    lease_stale_secs: float = LEASE_STALE_SECS
    rank: int | None = None
    node: int | None = None
    compress: CompressConfig | None = None


@dataclass(frozen=True)
class DistributedConfig:
    """How the ranks of a job agree (the ``distributed:`` section; docs/config.md).

    Attributes:
        timeout: seconds a rank waits for the others at each agreement (None: the coordinator's
            default, 600 s).
        node: this process's node index (None: from the environment, ``$TIERCKPT_NODE``,
            ``$GROUP_RANK`` ...).
    """

    timeout: float | None = None
    node: int | None = None


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
        on_full: tier name → what a save does when that tier is full and none of its copies can be
            evicted yet: ``wait`` for the background mover to free room (backpressure), or ``fail`` that
            tier's copy at once with TierFullError (absent: ``wait``).
    """

    keep: Mapping[str, int] = field(default_factory=dict)
    demote: Mapping[str, DemoteConfig] = field(default_factory=dict)
    promote_on_restore: bool = False
    on_full: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HierarchyConfig:
    """A whole hierarchy: tiers fastest first, default I/O settings, layout, policy and coordination."""

    tiers: tuple[TierConfig, ...]
    io: IOConfig = field(default_factory=IOConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def parse_config(data: Any, base_dir: str | os.PathLike[str] | None = None) -> HierarchyConfig:
    """Validate a config mapping (the YAML schema) and return a :class:`HierarchyConfig`.

    Args:
        data: the parsed YAML document.
        base_dir: what relative tier locations and policy presets are relative to (the YAML file's
            folder); defaults to the current directory. Each :class:`TierConfig` carries it.

    Raises:
        ConfigError: naming the first bad key, e.g. ``tiers[1].capacity: expected a size like '64GiB', got 'lots'``.
    """
    d = check_keys(data, "config", {"tiers", "io", "layout", "policy", "lease", "distributed"}, {"tiers"})
    io = default_io()
    if "io" in d:
        io = parse_io(d["io"], "io", io)
    layout = LayoutConfig()
    if "layout" in d:
        ld = check_keys(d["layout"], "layout", {"align", "blob_size"})
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
        no_nul(os.fspath(base_dir), "base_dir")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    tiers: list[TierConfig] = []
    on_full: dict[str, tuple[str, str]] = {}  # tier name -> (its entry's on_full, the entry's key)
    for i, t in enumerate(tiers_raw):
        tier = _parse_tier(t, f"tiers[{i}]", tiers, base, io, stale_secs)
        if "on_full" in t:
            on_full[tier.name] = (check_choice(t["on_full"], f"{tier.key}.on_full", ON_FULL), tier.key)
        tiers.append(tier)
    policy = (
        parse_policy(_policy_mapping(d["policy"], base), [t.name for t in tiers]) if "policy" in d else PolicyConfig()
    )
    dist = _parse_distributed(d["distributed"]) if "distributed" in d else DistributedConfig()
    return HierarchyConfig(
        tiers=tuple(tiers), io=io, layout=layout, policy=_fold_on_full(policy, on_full), distributed=dist
    )


def _parse_distributed(value: Any) -> DistributedConfig:
    """``distributed: {timeout: 600, node: 3}``."""
    d = check_keys(value, "distributed", {"timeout", "node"})
    return DistributedConfig(
        timeout=check_timeout(d["timeout"], "distributed.timeout") if "timeout" in d else None,
        node=check_node(d["node"], "distributed.node") if "node" in d else None,
    )


_TIER_KEYS = {"name", "kind", "path", "capacity", "blob_size", "io", "on_full", "options", "compress"}


def _parse_tier(t: Any, key: str, before: list[TierConfig], base: Path, io: IOConfig, stale_secs: float) -> TierConfig:
    """One ``tiers[i]`` entry: the common keys checked, ``path`` and ``options`` kept for the kind."""
    t = check_keys(t, key, _TIER_KEYS, {"name", "kind"})
    name, kind = t["name"], t["kind"]
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{key}.name: expected a name of letters, digits, '_', '-', '.', got {_short(name)}")
    if any(x.name == name for x in before):
        raise ConfigError(f"{key}.name: tier name {_short(name)} is used twice")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{key}.kind: expected a tier kind such as 'host', 'local' or 'pfs', got {_short(kind)}")
    location = t.get("path")
    if location is not None:
        if not isinstance(location, str) or not location:
            raise ConfigError(f"{key}.path: expected a directory path or a URL, got {_short(location)}")
        no_nul(location, f"{key}.path")  # no location of any kind holds one
        expand_placeholders(location, f"{key}.path", rank=0, node=0)  # {rank} and {node}: checked here
    options = t.get("options", {})
    if not isinstance(options, Mapping):
        raise ConfigError(f"{key}.options: expected a mapping, got {type(options).__name__} {_short(options)}")
    for k in options:
        if not isinstance(k, str):
            raise ConfigError(f"{key}.options: option names are strings, got {_short(k)}")
    capacity = None
    if "capacity" in t:
        capacity = parse_size(t["capacity"], f"{key}.capacity")
        if capacity == 0:
            raise ConfigError(f"{key}.capacity: expected a positive size, got {_short(t['capacity'])}")
    return TierConfig(
        name=name,
        kind=kind,
        location=location,
        base_dir=base,
        options=MappingProxyType(dict(options)),
        capacity_bytes=capacity,
        blob_bytes=_blob_size(t["blob_size"], f"{key}.blob_size") if "blob_size" in t else None,
        io=parse_io(t["io"], f"{key}.io", io, tier=True) if "io" in t else io,
        key=key,
        lease_stale_secs=stale_secs,
        compress=parse_compress(t["compress"], f"{key}.compress") if "compress" in t else None,
    )


def _fold_on_full(policy: PolicyConfig, entries: Mapping[str, tuple[str, str]]) -> PolicyConfig:
    """A tier entry's ``on_full`` is policy: fold it into ``policy.on_full``.

    Raises:
        ConfigError: naming both keys when the entry and ``policy.on_full`` disagree.
    """
    merged = dict(policy.on_full)
    for name, (value, key) in entries.items():
        if merged.get(name, value) != value:
            raise ConfigError(
                f"{key}.on_full: {value!r} contradicts policy.on_full.{name}: {merged[name]!r} (give it once)"
            )
        merged[name] = value
    return replace(policy, on_full=merged) if merged != policy.on_full else policy


def _parse_lease(value: Any) -> float:
    """``lease: {stale_secs: 60}``: the renewal timeout of lease holders on other hosts (docs/jobs.md)."""
    secs = check_keys(value, "lease", {"stale_secs"}).get("stale_secs", LEASE_STALE_SECS)
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not 1 <= secs <= 86400:
        raise ConfigError(f"lease.stale_secs: expected a number of seconds from 1 to 86400, got {_short(secs)}")
    return float(secs)


def _policy_mapping(value: Any, base: Path) -> Mapping[str, Any]:
    """``policy:`` is a mapping, or the path of a YAML preset (e.g. ``policies/keep-last-2.yaml``)."""
    if isinstance(value, str):
        p = expand_path(value, "policy")
        p = p if p.is_absolute() else base / p
        try:
            value = load_yaml(p)
        except OSError as e:
            raise ConfigError(f"policy: cannot read policy preset {p}: {e.strerror or e}") from e
        except YAMLFileError as e:
            raise ConfigError(f"policy: {p}: {e}") from e
    return check_keys(value, "policy", _POLICY_KEYS)


_POLICY_KEYS = {"keep", "demote", "promote", "on_full"}


def parse_policy(data: Any, tiers: list[str]) -> PolicyConfig:
    """Validate a ``policy:`` mapping for a hierarchy with these tier names (fastest first).

    Raises:
        ConfigError: naming the bad key, e.g. ``policy.demote.pfs.every: expected an integer in [1, ...]``.
    """
    pd = check_keys(data, "policy", _POLICY_KEYS)
    names = set(tiers)
    keep: dict[str, int] = {}
    if "keep" in pd:
        kd = check_keys(pd["keep"], "policy.keep", names)
        keep = {k: check_int(v, f"policy.keep.{k}", 1, 1 << 31) for k, v in kd.items()}
    demote: dict[str, DemoteConfig] = {}
    if "demote" in pd:
        dd = check_keys(pd["demote"], "policy.demote", names)
        for name, rule in dd.items():
            key = f"policy.demote.{name}"
            if name == tiers[0]:
                raise ConfigError(
                    f"{key}: {_short(name)} is the top tier, which receives every save; demotion rules are for the tiers below it"
                )
            rule = check_keys(rule, key, {"every", "every_secs", "on_close"})
            secs = rule.get("every_secs")
            if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or not secs > 0):
                raise ConfigError(f"{key}.every_secs: expected a positive number of seconds, got {_short(secs)}")
            demote[name] = DemoteConfig(
                every=check_int(rule["every"], f"{key}.every", 1, 1 << 31) if "every" in rule else None,
                every_secs=float(secs) if secs is not None else None,
                on_close=check_bool(rule.get("on_close", False), f"{key}.on_close"),
            )
    on_restore = False
    if "promote" in pd:
        prd = check_keys(pd["promote"], "policy.promote", {"on_restore"})
        on_restore = check_bool(prd.get("on_restore", False), "policy.promote.on_restore")
    on_full: dict[str, str] = {}
    if "on_full" in pd:
        fd = check_keys(pd["on_full"], "policy.on_full", names)
        on_full = {k: check_choice(v, f"policy.on_full.{k}", ON_FULL) for k, v in fd.items()}
    return PolicyConfig(keep=keep, demote=demote, promote_on_restore=on_restore, on_full=on_full)


def _blob_size(v: Any, key: str) -> int:
    n = parse_size(v, key)
    if n < 1 << 20:
        raise ConfigError(f"{key}: expected at least 1MiB, got {_short(v)}")
    return n


def load_config(path: str | os.PathLike[str]) -> HierarchyConfig:
    """Read a YAML file and validate it; relative tier locations are relative to the file's folder.

    Raises:
        ConfigError: the file is missing (or its name holds a NUL byte), is not UTF-8 YAML (or repeats a key in a mapping, or nests
            deeper than 100), or holds an invalid config.
    """
    no_nul(os.fspath(path), "config file")
    p = Path(path)
    try:
        data = load_yaml(p)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror or e}") from e
    except YAMLFileError as e:
        raise ConfigError(f"{p}: {e}") from e
    try:
        cfg = parse_config(data, base_dir=p.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    # what the kinds find wrong when they build their tiers names the file too
    return replace(cfg, tiers=tuple(replace(t, key=f"{p}: {t.key}") for t in cfg.tiers))
