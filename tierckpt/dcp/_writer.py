"""The DCP storage writer: each rank's items of a step go into one :meth:`Hierarchy.save` of that rank,
DCP's metadata into the part of DCP's coordinator (docs/distributed.md, "DCP backend")."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt.dcp._ids import step_of, tier_dirs, valid_id
from tierckpt.dcp._layout import build_state, place_items
from tierckpt.dcp._record import RECORD_FORMAT, Location, PathElem, encode_metadata
from tierckpt.dcp._source import HierarchyLike, Source
from tierckpt.errors import ConfigError, StateError, TierckptError
from tierckpt.facade.checks import check_step
from tierckpt.format.tree import flatten

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy, SaveHandle
    from tierckpt.tiers.base import Tier

__all__ = ["HierarchyWriter", "StepExistsError"]

log = logging.getLogger(__name__)

DURABLE = ("loadable", "shared", "persistent", "top", "all")
_NOT_PLAIN = object()

#: per hierarchy (rank 0's): its node-local tiers from which every rank reads every rank's part, as the
#: ranks' local plans of a DCP save said (DCP's plan caching sends them once: later saves reuse it)
_READABLE: weakref.WeakKeyDictionary[Hierarchy, frozenset[str]] = weakref.WeakKeyDictionary()


class StepExistsError(TierckptError, FileExistsError):
    """``HierarchyWriter(overwrite=False)``: the step is already committed on some tier."""


@dataclass(frozen=True)
class _Where:
    """What a rank's local plan tells the coordinator: its hierarchy rank (DCP's rank in its process group
    may differ), and for ``durable="loadable"`` its node, its host name (a node number may be a default: 0
    on every rank where no launcher says), and, per node-local tier, the tier's location (None: it
    declares none, e.g. process memory)."""

    node: int
    host: str
    dirs: tuple[tuple[str, str | None], ...]
    rank: int = 0


@dataclass(frozen=True)
class _Placed:
    """The coordinator's answer to a rank's plan: its items' locations, and the hierarchy rank whose part
    holds the step's metadata record (the rank of DCP's coordinator)."""

    places: tuple[Location, ...]
    record_rank: int


class HierarchyWriter(StorageWriter):
    """A DCP storage writer that saves step ``step`` of a :class:`~tierckpt.Hierarchy`.

    Each rank's write items become one ``h.save(state, step=step)`` of that rank: tensors (a DTensor's
    local chunk, as DCP resolves it) at their key paths in the user's nested state, plain values as
    plain values, and other objects as the bytes DCP's planner serialized them to. Rank 0's state also
    holds DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`, encoded without pickle.

    ``dcp.save`` returns (``dcp.async_save``'s future resolves) once every rank's part is committed on
    the tier ``durable`` names. The hierarchy commits a step on a tier only once every rank's part is
    in (a writable hierarchy of several ranks has a coordinator that connects them), so DCP's coordinator saves
    with the others and waits for its part in ``finish`` (docs/distributed.md, "DCP backend").

    The writer pickles (DCP's process executor sends it to its checkpoint process) as the hierarchy's
    configuration: the receiving process opens the hierarchy there on first use (once per configuration
    and process), under the same job identity (docs/integrations.md, "DCP async and staging").

    Args:
        h: the hierarchy, built over the ranks of the process group DCP saves with (each rank's hierarchy
            rank may differ from its rank in that group: the plans say which is which). Or its
            configuration (a YAML path, a mapping or a ``HierarchyConfig``, as for
            :meth:`Hierarchy.from_config`): the hierarchy is then opened by the first write, in the
            process that writes (every rank of the save at once), and shared by this process's writers of
            the same configuration.
        step: the step to save (``dcp.save(checkpoint_id=...)`` may replace it: see ``reset``).
        durable: which tier to wait for. ``"loadable"`` (the default): the fastest tier this step goes
            to from which a later ``dcp.load`` on every rank of this job can read it (a rank reads other
            ranks' parts, DCP's metadata in the coordinator's among them, from its own tiers). Where every
            rank is on one node, that is a shared tier or a node-local one that every rank's local plan
            names at one location (one directory that every rank writes into: not process memory, not
            a path with ``{rank}``); otherwise, or where that cannot be known, ``"shared"``'s tier.
            ``"shared"``: the fastest shared tier this step goes to, what a dcp.load on any rank of any
            job can read, else every tier it goes to (with a warning where the ranks span several
            nodes: a rank of another node than rank 0's cannot load it). ``"persistent"``: the fastest
            persistent tier this step goes to, else the top tier (a node-local tier: loadable by the
            ranks of that node only, and only from a directory they share). ``"top"``: the top tier.
            ``"all"``: every tier it goes to.
        job: the job identity a configuration is opened for (default: a live hierarchy's own, else as
            for :meth:`Hierarchy.from_config`); a process that already holds the tiers' leases under
            one identity must pass it (docs/jobs.md).
        overwrite: False: refuse (:class:`StepExistsError`, on every rank, before anything is written) to
            save a step that is already committed on some tier. True (DCP's default): replace it.

    Raises:
        ValueError: a bad ``step`` or ``durable``.
        TierckptError: the hierarchy is read-only; pickling a writer whose hierarchy was built from
            tier objects (it has no configuration another process could open).
        ConfigError: a bad configuration.
    """

    def __init__(
        self, h: HierarchyLike, step: int, *, durable: str = "loadable", overwrite: bool = True, job: str | None = None
    ) -> None:
        check_step(step)
        if durable not in DURABLE:
            raise ValueError(f"durable: expected one of {', '.join(DURABLE)}, got {durable!r}")
        self._source = Source(h, readonly=False, job=job, user="HierarchyWriter")
        if self._source.readonly:
            raise TierckptError("cannot save through DCP: the hierarchy was opened read-only")
        self.step, self.durable, self.overwrite = step, durable, overwrite
        self.reset()

    @property
    def h(self) -> Hierarchy:
        """The hierarchy (opened from its configuration on first use, in this process)."""
        return self._source.hierarchy

    def __getstate__(self) -> dict[str, Any]:
        """The configuration, step, ``durable`` and ``overwrite`` (a save's own state is not sent: DCP
        resets it)."""
        return {"_source": self._source, "step": self.step, "durable": self.durable, "overwrite": self.overwrite}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reset()

    # -- DCP's protocol ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id``, when given, chooses the step: an int or its digits; the
        directory of one of the hierarchy's file tiers (the step stays the constructor's);
        ``<that directory>/step-N`` (step N). Anything else raises ValueError naming what would do."""
        if checkpoint_id is not None:
            step = step_of(checkpoint_id, tier_dirs(self.h), self.step)
            assert step is not None  # the writer's step is never None
            self.step = step
        self.save_id = uuid.uuid4().hex
        self._coordinator = False  # this rank's part holds a metadata record (DCP's coordinator, or alone)
        self._locations: dict[MetadataIndex, Location] | None = None  # every rank's, from the global plan
        self._record: dict[str, Any] | None = None  # the metadata record this rank saved in write_data
        self._deferred: tuple[list[tuple[tuple[PathElem, ...], Any]], dict[str, Any]] | None = None
        self._handle: SaveHandle | None = None
        self._alone = False  # one plan: this rank saves alone (no_dist=True, use_collectives=False)

    @property
    def checkpoint_id(self) -> str:
        """The step, as DCP's logs name a checkpoint."""
        return str(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` has the form of one: a step (an int, or a str of decimal digits) or a
        local path (``reset`` checks that the path is one of the hierarchy's); False for a URL."""
        return valid_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta:
        """The step (as ``checkpoint_id``) and this save's id."""
        return StorageMeta(checkpoint_id=str(self.step), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Note whether this rank is DCP's coordinator (it keeps the metadata in its part); with
        ``overwrite=False``, refuse a step that is already committed."""
        self._coordinator = is_coordinator
        if not self.overwrite and any(c.step == self.step for c in self.h.checkpoints()):
            raise StepExistsError(f"step {self.step} is already committed and overwrite=False: nothing was written")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan, telling the coordinator this rank's hierarchy rank and where its node-local tiers are."""
        dirs = tuple((t.name, t.location()) for t in self.h.tiers if not t.capabilities.shared)
        where = _Where(self.h.coordinator.node, socket.gethostname(), dirs, self.h.rank)
        return replace(plan, storage_data=where)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Place every rank's items in its state (each plan's ``storage_data``: its items' locations)."""
        if not all(p.usable for p in plans):  # cached plans (plan caching): the write results say where
            return plans
        ranks = self._hierarchy_ranks(plans)
        if self.durable == "loadable" and not self._alone:
            _note_readable(self.h, [p.storage_data for p in plans])
        out, self._locations = [], {}
        for rank, p in zip(ranks, plans, strict=True):
            places = place_items(p.items, p.planner_data, rank)
            self._locations.update((item.index, loc) for item, loc in zip(p.items, places, strict=True))
            out.append(replace(p, storage_data=_Placed(tuple(places), self.h.rank)))
        return out

    def _hierarchy_ranks(self, plans: list[SavePlan]) -> list[int]:
        """Each plan's hierarchy rank (a plan per rank of DCP's group, in its order)."""
        if len(plans) == 1:  # this rank alone: its part holds its own record (use_collectives=False: every
            self._alone = self.h.world_size > 1  # rank plans alone and finishes, DCP's coordinator or not)
            self._coordinator = True
            return [self.h.rank]
        wheres = [p.storage_data for p in plans]
        ranks = [w.rank for w in wheres] if all(isinstance(w, _Where) for w in wheres) else list(range(len(plans)))
        if sorted(ranks) != list(range(self.h.world_size)):
            raise ConfigError(
                f"DCP's process group has {len(plans)} ranks (hierarchy ranks {sorted(ranks)}); the hierarchy has "
                f"world_size {self.h.world_size}. Every rank of the hierarchy saves a part of each step, so build "
                "it over the ranks of the group DCP saves with (Hierarchy(..., coordinator=StoreCoordinator(store, "
                "dist.get_rank(group), group.size()))), or save each rank alone (use_collectives=False)"
            )
        return ranks

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items (DCP's coordinator: with the metadata, when it may and the planner has
        it already; else in :meth:`finish`).

        Returns once the items are staged, with each item's location as its storage data."""
        placed = plan.storage_data  # the coordinator's placement of this rank's items, else the same here
        places = placed.places if isinstance(placed, _Placed) else ()
        if not (len(places) == len(plan.items) and all(p.rank == self.h.rank for p in places)):
            places = tuple(place_items(plan.items, plan.planner_data, self.h.rank))
        values, payloads, results = [], [], []
        for item, loc in zip(plan.items, places, strict=True):
            value, size, payload = _resolve(item, planner)
            values.append((loc.path, value))
            if payload:
                payloads.append(list(loc.path))
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=loc))
        reserved: dict[str, Any] = {
            "format": RECORD_FORMAT, "rank": self.h.rank, "payloads": payloads, "world_size": self.h.world_size,
        }  # fmt: skip
        if self._coordinator:
            reserved["scope"] = "rank" if self._alone else "job"
        elif isinstance(placed, _Placed):
            reserved["record_rank"] = placed.record_rank
        early = self._early_metadata(planner) if self._coordinator else None
        if not self._coordinator:
            self._save(values, reserved)
            self._reported_by_dcp()
        elif early is not None and self._locations is not None:
            early.storage_meta = early.storage_meta or self.storage_meta()  # DCP passes this object to finish
            self._record = encode_metadata(early, self._locations)
            self._save(values, {**reserved, "metadata": self._record})
            self._reported_by_dcp()
        else:  # the metadata comes with finish(): this rank's part is saved then
            self._deferred = (values, reserved)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's coordinator: save its part with the metadata if it waited for it, and wait until it is durable."""
        locations: dict[MetadataIndex, Location] = {}
        for rank_results in results:
            for r in rank_results:
                if not isinstance(r.storage_data, Location):
                    raise TierckptError(f"DCP item {r.index}: its write result is not a HierarchyWriter's")
                locations[r.index] = r.storage_data
        metadata.storage_data = locations
        metadata.storage_meta = metadata.storage_meta or self.storage_meta()  # DCP's planner leaves it out
        if self._handle is None:
            if self._deferred is None:
                raise TierckptError("HierarchyWriter.finish() before write_data()")
            values, reserved = self._deferred
            self._deferred = None  # the staged tensors are the hierarchy's now (a stager may reuse them)
            self._save(values, {**reserved, "metadata": encode_metadata(metadata, locations)})
        elif locations != self._locations or encode_metadata(metadata, locations) != self._record:
            raise TierckptError(
                f"step {self.step}: the metadata DCP finished with is not the planner's that this rank saved "
                "(a planner that changes it after create_global_plan?); do not load this step"
            )
        assert self._handle is not None  # _save set it
        self._wait(self._handle)

    # -- saving --------------------------------------------------------------------------------------------
    def _reported_by_dcp(self) -> None:
        """A part saved with the others' (the step commits on a tier only once every rank's part is in):
        its failures are the save's, which DCP reports on every rank (DCP's coordinator waits in ``finish``, and a
        write phase that failed anywhere raises ``CheckpointException`` everywhere), so this hierarchy's
        ``wait()`` / ``close()`` does not raise them again (a zero-timeout wait marks them seen)."""
        assert self._handle is not None
        with contextlib.suppress(BaseException):
            self._handle.wait(timeout=0)

    def _early_metadata(self, planner: SavePlanner) -> Metadata | None:
        """The metadata DCP will finish with, where the planner provably has it before the writes: DCP's
        own ``create_global_plan`` returns the object it keeps as ``planner.metadata``."""
        if type(planner).create_global_plan is not DefaultSavePlanner.create_global_plan:
            return None
        md = getattr(planner, "metadata", None)
        return md if isinstance(md, Metadata) else None

    def _save(self, values: list[tuple[tuple[PathElem, ...], Any]], reserved: dict[str, Any]) -> None:
        handle = self._handle = self.h.save(build_state(values, reserved), step=self.step)
        handle.staged.result()  # the items' bytes are in the top tier: DCP may drop or reuse them

    def _wait(self, handle: SaveHandle) -> None:
        tier = self._durable_tier([t for t in self.h.tiers if t.name in handle.durable])
        if tier is None:
            handle.wait()
            return
        try:
            handle.wait(tier=tier)
        except BaseException:
            # DCP reports this save's failure: the other tiers' failures of it are reported with it (a
            # zero-timeout wait marks them seen), not raised again by the hierarchy's close()
            with contextlib.suppress(BaseException):
                handle.wait(timeout=0)
            raise

    def _durable_tier(self, goes: list[Tier]) -> str | None:
        """The tier to wait for, of the tiers this step goes to (fastest first); None: every one."""
        if self.durable == "all":
            return None
        if self.durable in ("loadable", "shared"):
            readable = _READABLE.get(self.h, frozenset()) if self.durable == "loadable" else frozenset()
            return self._loadable_tier(goes, readable)
        persistent = [t.name for t in goes if t.capabilities.persistent] if self.durable == "persistent" else []
        return (persistent or [t.name for t in goes])[0]

    def _loadable_tier(self, goes: list[Tier], readable: frozenset[str]) -> str | None:
        """The fastest tier of ``goes`` that is shared or in ``readable`` (node-local tiers every rank
        reads every part from); None (every tier) where there is none, with a warning where the ranks
        span several nodes."""
        tiers = [t.name for t in goes if t.capabilities.shared or t.name in readable]
        if tiers:
            return tiers[0]
        if len(self.h.coordinator.ranks_on_node()) < self.h.world_size:
            log.warning(
                "DCP save of step %d: it goes to no shared tier (only to %s), so a dcp.load on a rank of another "
                "node than rank 0's cannot read it (DCP's metadata is in rank 0's part); a shared tier (pfs) "
                "in the hierarchy and a demotion policy that sends this step there make it loadable everywhere",
                self.step,
                ", ".join(t.name for t in goes),
            )
        return None


def _note_readable(h: Hierarchy, wheres: list[Any]) -> None:
    """Keep, for ``h``, its node-local tiers from which every rank reads every rank's part: where every
    rank's local plan says it is on one node (one node number and one host name: a node number alone
    may be everyone's default), those at one location on every rank (one directory every rank writes
    into; a tier that declares no location, such as process memory, is none). Where some plan does not
    say (a planner that drops the writer's ``storage_data``), nothing is kept."""
    if not wheres or not all(isinstance(w, _Where) for w in wheres):
        return
    if len({(w.node, w.host) for w in wheres}) != 1:
        _READABLE[h] = frozenset()
        return
    first = dict(wheres[0].dirs)
    same = {n for n, loc in first.items() if loc is not None and all(dict(w.dirs).get(n) == loc for w in wheres)}
    _READABLE[h] = frozenset(same)


def _resolve(item: WriteItem, planner: SavePlanner) -> tuple[Any, int, bool]:
    """(value to save, its size in bytes, whether it is DCP's serialized bytes) of one write item."""
    if item.type == WriteItemType.BYTE_IO:
        obj = _plain_object(item, planner)
        if obj is not _NOT_PLAIN:
            return obj, item.bytes_io_data.nbytes if item.bytes_io_data else 0, False
        data = planner.resolve_data(item)
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        return raw, len(raw), True
    t = planner.resolve_data(item)
    if not isinstance(t, torch.Tensor):
        raise StateError(f"DCP item {item.index.fqn!r}: the planner resolved a tensor item to a {type(t).__name__}")
    t = t.detach()
    return t, t.numel() * t.element_size(), False


def _plain_object(item: WriteItem, planner: SavePlanner) -> Any:
    """The object behind a bytes item when it is plain data (stored as itself, so ``h.restore`` and
    the CLI read it without unpickling) and the planner serializes it as DCP's own does; else
    :data:`_NOT_PLAIN`."""
    cls = type(planner)
    if not isinstance(planner, DefaultSavePlanner) or any(
        getattr(cls, m) is not getattr(DefaultSavePlanner, m) for m in ("resolve_data", "transform_object")
    ):
        return _NOT_PLAIN
    obj = planner.lookup_object(item.index)
    try:
        flat = flatten(obj)
    except StateError:
        return _NOT_PLAIN
    return _NOT_PLAIN if flat.tensors else obj
