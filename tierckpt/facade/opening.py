"""A hierarchy's parts built from its configuration, in the order they depend on each other: the
coordinator first (its rank and node fill the tier paths' ``{rank}`` and ``{node}``), then the job
identity every rank shares (rank 0's where none is given: the ranks share their tiers' leases), then each
tier by its kind, on engines shared by all of them (docs/config.md, docs/distributed.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from tierckpt.config import HierarchyConfig, TierConfig, parse_config
from tierckpt.datapath.storing import set_compression
from tierckpt.errors import ConfigError
from tierckpt.facade.checks import MEMORY_DEVICES, memory_budget
from tierckpt.facade.engines import Engines
from tierckpt.io.budget import Budget
from tierckpt.ranks.coordinator import Coordinator, check_coordinator
from tierckpt.ranks.distributed import default_coordinator, shared_job
from tierckpt.registry import get_tier_class
from tierckpt.tiers.base import Tier
from tierckpt.tiers.jobs import resolve_job

__all__ = ["Parts", "open_parts"]

H = TypeVar("H")


@dataclass
class Parts:
    """What :func:`open_parts` built; :meth:`close` releases it where the hierarchy could not be made."""

    config: HierarchyConfig
    tiers: list[Tier]
    coordinator: Coordinator
    engines: Engines
    job: str | None

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self.engines.close()

    def build(self, make: Callable[..., H], *, readonly: bool) -> H:
        """``make`` (the hierarchy's class) called with these parts and the config's policy, io and layout;
        the parts are released where it raises."""
        cfg = self.config
        try:
            return make(
                self.tiers,
                policy=cfg.policy,
                io=cfg.io,
                layout=cfg.layout,
                readonly=readonly,
                job=self.job,
                coordinator=self.coordinator,
                _engines=self.engines,
            )
        except BaseException:
            self.close()
            raise


def open_parts(
    config: HierarchyConfig | Mapping[str, Any],
    base_dir: str | os.PathLike[str] | None,
    *,
    readonly: bool,
    job: str | None,
    coordinator: Coordinator | None,
) -> Parts:
    """The coordinator, job identity, tiers and engines of a hierarchy configured by ``config``
    (arguments as for :meth:`tierckpt.Hierarchy.from_config`).

    Raises:
        ConfigError: naming the bad key (nothing is left open).
        TierBusyError: another job holds the lease of a file tier's directory (naming it).
        CoordinationError: some rank did not build its coordinator in time.
    """
    cfg = config if isinstance(config, HierarchyConfig) else parse_config(config, base_dir)
    coord = check_coordinator(
        coordinator
        or default_coordinator(timeout=cfg.distributed.timeout, node=cfg.distributed.node, readonly=readonly)
    )
    cfg = replace(cfg, tiers=tuple(replace(t, rank=coord.rank, node=coord.node) for t in cfg.tiers))
    if readonly:
        cfg = replace(cfg, tiers=tuple(replace(t, readonly=True) for t in cfg.tiers))
    else:
        resolve_job(job)  # a bad identity (or $TIERCKPT_JOB) is refused before any directory is made
        job = shared_job(coord, job)
        cfg = replace(cfg, tiers=tuple(replace(t, job=job or t.job) for t in cfg.tiers))
    parts = Parts(cfg, [], coord, Engines(), job)
    try:
        for t in cfg.tiers:
            parts.tiers.append(get_tier_class(t.kind, f"{t.key}.kind").from_config(t, parts.engines))
            _give_budget(parts.tiers[-1], t)
            set_compression(parts.tiers[-1], t.compress, f"{t.key}.compress")
    except BaseException:
        parts.close()
        raise
    return parts


def _give_budget(tier: Tier, cfg: TierConfig) -> None:
    """The entry's ``io.bandwidth``, on a tier whose kind did not take it (a file tier takes it itself):
    a bucket of one chunk of the tier's, which the data path charges as it does a file tier's.

    Raises:
        ConfigError: naming the key, for a memory tier (whose copies no budget paces).
    """
    rate = cfg.io.bandwidth_bytes_per_sec
    if rate is None or tier.budget is not None:
        return
    if tier.capabilities.device in MEMORY_DEVICES:
        raise ConfigError(f"{cfg.key}.io.bandwidth: {memory_budget(tier)}")
    tier.budget = Budget(rate, burst_bytes=tier.geometry.chunk_bytes, throttle=cfg.io.throttle)
