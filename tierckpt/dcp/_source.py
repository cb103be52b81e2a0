"""Where a DCP writer's or reader's hierarchy comes from: a live :class:`~tierckpt.Hierarchy`, or its
configuration, opened in the process that writes or reads.

DCP's process executor (``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``)
pickles the storage writer into a background process that has its own process group. A
:class:`Source` pickles as its configuration (with the job identity whose leases the tiers are held
under), never as tiers, engines, leases or threads; the receiving process opens the hierarchy on first
use, once per configuration: later writers of the same configuration in that process share it, and it
is closed when that process exits normally.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import pickle
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypeAlias

from tierckpt.config import HierarchyConfig, load_config, parse_config
from tierckpt.errors import TierckptError
from tierckpt.hierarchy import Hierarchy

__all__ = ["HierarchyLike", "Source", "close_opened"]

log = logging.getLogger(__name__)

#: what a HierarchyWriter or HierarchyReader takes: a live hierarchy, a parsed config, a mapping with
#: the YAML schema (relative paths: relative to the current directory), or a YAML file's path
HierarchyLike: TypeAlias = Hierarchy | HierarchyConfig | Mapping[str, Any] | str | os.PathLike[str]

_OPENED: dict[bytes, Hierarchy] = {}  # per portable (config, job, readonly): the hierarchy this process opened
_LOCK = threading.Lock()


def _config_of(target: HierarchyConfig | Mapping[str, Any] | str | os.PathLike[str]) -> HierarchyConfig:
    if isinstance(target, HierarchyConfig):
        return target
    if isinstance(target, Mapping):
        return parse_config(target)
    if isinstance(target, (str, os.PathLike)):
        return load_config(target)
    raise TypeError(
        f"expected a Hierarchy, a HierarchyConfig, a config mapping or a YAML path, got {type(target).__name__}"
    )


def _portable(cfg: HierarchyConfig) -> HierarchyConfig:
    """``cfg`` with plain dicts for its tiers' read-only ``options`` views (which do not pickle)."""
    return replace(cfg, tiers=tuple(replace(t, options=dict(t.options)) for t in cfg.tiers))


class Source:
    """A hierarchy, live or opened from its configuration on first use; pickles as the configuration.

    Args:
        target: a live hierarchy, or what :meth:`Hierarchy.from_config` / :meth:`Hierarchy.from_yaml` take.
        readonly: open the configuration read-only (a reader); ignored for a live hierarchy.
        job: the job identity to open it for (default: a live hierarchy's, else as for ``from_config``).
        user: the class that holds it, for error messages.
    """

    def __init__(self, target: HierarchyLike, *, readonly: bool, job: str | None, user: str) -> None:
        self.user = user
        if isinstance(target, Hierarchy):
            self._h: Hierarchy | None = target
            self.config, self.readonly = target.config, target.readonly
            self.job = job if job is not None else target.job
        else:
            self._h = None
            self.config, self.readonly, self.job = _config_of(target), readonly, job

    @property
    def hierarchy(self) -> Hierarchy:
        """The hierarchy (opened now, in this process, the first time; shared by this process's users of
        the same configuration). Every rank must ask at the same point: opening it agrees with the others."""
        if self._h is None:
            assert self.config is not None  # a Source without a live hierarchy has its config
            self._h = _open(self.config, self.job, self.readonly)
        return self._h

    @property
    def opened(self) -> bool:
        """Whether the hierarchy is live in this process."""
        return self._h is not None

    def __getstate__(self) -> dict[str, Any]:
        if self.config is None:
            raise TierckptError(
                f"{self.user} cannot be sent to another process (DCP's process executor pickles it): its "
                "hierarchy was built from tier objects, and another process can open only a hierarchy built "
                f"from a configuration. Build it with Hierarchy.from_config / from_yaml, or give {self.user} "
                "the configuration (a YAML path or a mapping) instead of the hierarchy"
            )
        return {"user": self.user, "config": _portable(self.config), "readonly": self.readonly, "job": self.job}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._h = None


def _open(cfg: HierarchyConfig, job: str | None, readonly: bool) -> Hierarchy:
    key = pickle.dumps((_portable(cfg), job, readonly))
    with _LOCK:
        h = _OPENED.get(key)
        if h is None:
            h = _OPENED[key] = Hierarchy.from_config(cfg, readonly=readonly, job=None if readonly else job)
            log.info("opened a hierarchy of %d tiers for DCP in process %d", len(h.tiers), os.getpid())
        return h


def close_opened() -> None:
    """Close the hierarchies this process opened from a configuration (at exit; a failure is logged)."""
    with _LOCK:
        opened = list(_OPENED.values())
        _OPENED.clear()
    for h in opened:
        try:
            h.close()
        except Exception as e:  # at exit: nobody to raise to
            log.error("closing a hierarchy opened for DCP: %s: %s", type(e).__name__, e)


atexit.register(close_opened)
# a multiprocessing child (DCP's checkpoint process) runs these finalizers at exit, not atexit's
multiprocessing.util.Finalize(None, close_opened, exitpriority=10)
