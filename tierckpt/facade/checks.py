"""What a hierarchy checks of its arguments before it builds anything: tier names and directories,
what the tiers declare, the names its policies use, and the steps it is asked for."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tierckpt.config import PolicyConfig
from tierckpt.errors import ConfigError
from tierckpt.ioconfig import IOConfig
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import Tier

__all__ = [
    "MAX_STEP",
    "MEMORY_DEVICES",
    "check_connected",
    "check_io",
    "check_on_full",
    "check_policy_names",
    "check_step",
    "check_tiers",
    "memory_budget",
]

log = logging.getLogger("tierckpt.hierarchy")

MAX_STEP = 10**12 - 1  #: file tiers name a step with 12 decimal digits (docs/format.md)
#: the devices whose copies are memory copies (``memmove``, a device copy), which no budget paces
MEMORY_DEVICES = ("cpu", "cuda")


def check_step(step: object) -> int:
    """``step``, once checked: ValueError unless it is an int a checkpoint can have (bools and floats are
    not)."""
    if not isinstance(step, int) or type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return step


def check_tiers(tiers: Sequence[Tier]) -> list[str]:
    """The tiers' names, once checked: at least one tier, unique names, no two tiers in one directory
    (each one's retention would evict the other's copies). A chain with no persistent tier is allowed
    (a job that only wants in-memory snapshots) but warned about: its checkpoints die with the process.

    Raises:
        ConfigError: naming what is wrong.
    """
    if not tiers:
        raise ConfigError("tiers: a hierarchy needs at least one tier")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: names must be unique, got {names}")
    seen: dict[str, int] = {}
    for i, t in enumerate(tiers):
        where = t.location()
        if where is None:
            continue
        if where in seen:
            j = seen[where]
            raise ConfigError(f"tiers[{i}].path: {where} is the location of tiers[{j}] ({names[j]!r})")
        seen[where] = i
    for i, t in enumerate(tiers):
        if t.capabilities.persistent and type(t).write_record is Tier.write_record:
            raise ConfigError(
                f"tiers[{i}] ({t.name!r}): tier kind {t.kind!r} is persistent but keeps no commit records: "
                "it must implement Tier.write_record / read_record / remove_record / list_records (docs/tiers.md)"
            )
        if t.budget is not None and t.capabilities.device in MEMORY_DEVICES:
            raise ConfigError(f"tiers[{i}] ({t.name!r}): {memory_budget(t)}")
    if not any(t.capabilities.persistent for t in tiers):
        log.warning(
            "no tier of %s is persistent: its checkpoints are lost when this process ends (add a file tier)",
            names,
        )
    return names


def memory_budget(tier: Tier) -> str:
    """Why a memory tier takes no bandwidth budget (the end of an error message)."""
    return (
        f"a {tier.kind} tier's copies are memory copies, which a bandwidth budget does not pace: give the "
        "budget to the file or object tier they go to or come from (docs/tiers.md, 'Bandwidth budgets')"
    )


def check_io(io: IOConfig) -> None:
    """A hierarchy's ``io`` settings hold no bandwidth budget: that is a tier's (each file tier's
    ``bandwidth_bytes_per_sec``, or its YAML entry's ``io.bandwidth``).

    Raises:
        ConfigError: the settings hold one.
    """
    if io.bandwidth_bytes_per_sec is not None:
        raise ConfigError(
            "io.bandwidth_bytes_per_sec: a bandwidth budget is one tier's: give it to the tier "
            "(LocalTier(..., bandwidth_bytes_per_sec=...), or tiers[i].io.bandwidth in a config), not to "
            "the hierarchy's io settings (docs/tiers.md, 'Bandwidth budgets')"
        )


def check_policy_names(
    names: list[str], policy: PolicyConfig, retention: Mapping[str, Any], demotion: Mapping[str, Any]
) -> None:
    """Every tier a policy names exists (and a demotion rule is for a tier below the top one).

    Raises:
        ConfigError: naming the key.
    """
    for section, keys in (("keep", policy.keep), ("demote", policy.demote), ("on_full", policy.on_full)):
        for name in keys:
            if name not in names:
                raise ConfigError(f"policy.{section}.{name}: no tier of that name (tiers: {', '.join(names)})")
    for arg, given in (("retention", retention), ("demotion", demotion)):
        for name in given:
            if name not in names or (arg == "demotion" and name == names[0]):
                raise ConfigError(f"{arg}: {name!r} is not a tier below the top one (tiers: {', '.join(names)})")


def check_on_full(tiers: Sequence[Tier], policy: PolicyConfig) -> None:
    """No ``on_full: wait`` for a tier whose copies share node files (``files: per_node``): waiting for
    copies to move down so that one can be evicted frees no room there (docs/distributed.md, "Full tiers").

    Raises:
        ConfigError: naming the tier.
    """
    for t in tiers:
        if t.node_files and policy.on_full.get(t.name) == "wait":
            raise ConfigError(
                f"policy.on_full.{t.name}: 'wait' cannot free room on a tier with files: per_node (evicting one "
                "rank's copy frees no node file, so a full tier is never evicted from); use 'fail'"
            )


def check_connected(coordinator: Coordinator, *, readonly: bool) -> None:
    """A writable hierarchy of several ranks needs a coordinator that connects them: each commit waits for
    every rank's copy.

    Raises:
        ConfigError: nothing connects the ranks (naming how to connect them).
    """
    if coordinator.world_size > 1 and not coordinator.connects_ranks and not readonly:
        raise ConfigError(
            f"rank {coordinator.rank} of {coordinator.world_size}: the ranks of a job must agree on each commit (a "
            "step is committed only once every rank's copy is in), and nothing connects these ones: initialize "
            "torch.distributed first, or pass coordinator=StoreCoordinator(store, rank, world_size) over a "
            "store every rank reaches (torch.distributed.TCPStore / FileStore; docs/distributed.md)"
        )
