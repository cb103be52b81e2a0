"""tierckpt as a storage backend of torch.distributed.checkpoint (DCP).

DCP plans (which rank writes which tensor chunk, deduplication, resharding on load); tierckpt stores:
each rank's items of a step go into one :meth:`Hierarchy.save` of that rank (packed into a few blobs,
checksummed, demoted and evicted as the hierarchy's policy says), and DCP's metadata goes, encoded as
plain data (no pickle), into rank 0's part of the step::

    from tierckpt.dcp import HierarchyReader, HierarchyWriter
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=n))
    dcp.async_save(sd, storage_writer=HierarchyWriter(h, step=n))
    dcp.load(sd, storage_reader=HierarchyReader(h, step=n))  # step=None: the newest

docs/distributed.md, "DCP backend", says what each rank writes, when ``dcp.save`` returns, and the limits.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tierckpt.dcp._layout import RESERVED, build_state, lookup, place_items
from tierckpt.dcp._record import RECORD_FORMAT, Location, PathElem, decode_metadata, encode_metadata
from tierckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, StateError, TierckptError
from tierckpt.format.tree import flatten, resolve_tree
from tierckpt.orchestration.checks import check_step
from tierckpt.orchestration.coordinator import SoloCoordinator
from tierckpt.orchestration.restore import load_manifest, load_tree, read_checkpoint
from tierckpt.orchestration.verify import holds
from tierckpt.tiers.base import CheckpointKey, Tier

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy, SaveHandle

__all__ = ["RESERVED", "HierarchyReader", "HierarchyWriter", "Location"]

log = logging.getLogger(__name__)
DURABLE = ("persistent", "top", "all")
_NOT_PLAIN = object()


def _step_of(checkpoint_id: object) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a str of its decimal digits."""
    raw = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else checkpoint_id
    step = int(raw) if isinstance(raw, str) and raw.isdecimal() and raw.isascii() else raw
    check_step(step)
    return step  # type: ignore[return-value]  # check_step raised unless it is an int


def _valid_id(checkpoint_id: object) -> bool:
    try:
        _step_of(checkpoint_id)
    except (ValueError, TypeError):
        return False
    return True


class HierarchyWriter(StorageWriter):
    """A DCP storage writer that saves step ``step`` of a :class:`~tierckpt.Hierarchy`.

    Each rank's write items become one ``h.save(state, step=step)`` of that rank: tensors (a DTensor's
    local chunk, as DCP resolves it) at their key paths in the user's nested state, plain values as
    plain values, and other objects as the bytes DCP's planner serialized them to. Rank 0's state also
    holds DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`, encoded without pickle.

    ``dcp.save`` returns (``dcp.async_save``'s future resolves) once every rank's part is committed on
    the tier ``durable`` names. Ranks that commit alone (several ranks with a ``SoloCoordinator``) each
    wait for their own part in DCP's write phase, and rank 0 saves its part, with the metadata, in
    ``finish`` once all of them are in: the metadata is the step's commit record, as in DCP's own
    writer. With a coordinator that commits a step only once every rank's part is in, rank 0 saves
    with the others and waits for its part in ``finish`` (docs/distributed.md, "DCP backend").

    Args:
        h: the hierarchy; its ``rank`` and ``world_size`` must be DCP's (torch.distributed's).
        step: the step to save (``dcp.save(checkpoint_id=...)`` may replace it: an int or its digits).
        durable: which tier to wait for: ``"persistent"`` (the fastest persistent tier this step goes
            to, else the top tier), ``"top"`` (the top tier) or ``"all"`` (every tier it goes to).

    Raises:
        ValueError: a bad ``step`` or ``durable``.
        TierckptError: the hierarchy is read-only.
    """

    def __init__(self, h: Hierarchy, step: int, *, durable: str = "persistent") -> None:
        check_step(step)
        if durable not in DURABLE:
            raise ValueError(f"durable: expected one of {', '.join(DURABLE)}, got {durable!r}")
        if h.readonly:
            raise TierckptError("cannot save through DCP: the hierarchy was opened read-only")
        self.h, self.step, self.durable = h, step, durable
        self.reset()

    # -- DCP's protocol ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (of step ``checkpoint_id`` when given)."""
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._coordinator = False
        self._locations: dict[MetadataIndex, Location] | None = None  # every rank's, from the global plan
        self._record: dict[str, Any] | None = None  # the metadata record rank 0 saved in write_data
        self._deferred: tuple[list[tuple[tuple[PathElem, ...], Any]], dict[str, Any]] | None = None
        self._handle: SaveHandle | None = None

    @property
    def checkpoint_id(self) -> str:
        """The step, as DCP's logs name a checkpoint."""
        return str(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a step (an int, or a str of decimal digits)."""
        return _valid_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta:
        """The step (as ``checkpoint_id``) and this save's id."""
        return StorageMeta(checkpoint_id=str(self.step), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Check that DCP's rank is the hierarchy's, and that DCP coordinates the ranks."""
        rank = kwargs.get("rank")
        if rank is not None and rank != self.h.rank:
            raise ConfigError(
                f"DCP's rank {rank} is not the hierarchy's rank {self.h.rank}: build the hierarchy in each rank "
                "after init_process_group (or with rank=dist.get_rank() of the process group DCP uses)"
            )
        if is_coordinator and self.h.rank != 0:
            raise ConfigError(f"DCP's coordinator is rank {self.h.rank}; tierckpt keeps DCP's metadata with rank 0")
        if kwargs.get("use_collectives", True) is False and self.h.world_size > 1:
            raise ConfigError("HierarchyWriter needs DCP's collectives (use_collectives=True) with several ranks")
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as it is."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Place every rank's items in its state (each plan's ``storage_data``: its items' locations)."""
        if len(plans) != self.h.world_size:
            raise ConfigError(f"DCP planned {len(plans)} ranks; the hierarchy has world_size {self.h.world_size}")
        if not all(p.usable for p in plans):  # cached plans (plan caching): the write results say where
            return plans
        out, self._locations = [], {}
        for rank, p in enumerate(plans):
            places = place_items(p.items, p.planner_data, rank)
            self._locations.update((item.index, loc) for item, loc in zip(p.items, places, strict=True))
            out.append(replace(p, storage_data=tuple(places)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items (rank 0: with the metadata, when it may and the planner has it already;
        else in :meth:`finish`).

        Returns once the items are staged (and committed on the ``durable`` tier, on a rank that
        commits alone), with each item's location as its storage data."""
        places = plan.storage_data  # the coordinator's placement of this rank's items, else the same here
        if not (
            isinstance(places, tuple)
            and len(places) == len(plan.items)
            and all(isinstance(p, Location) and p.rank == self.h.rank for p in places)
        ):
            places = tuple(place_items(plan.items, plan.planner_data, self.h.rank))
        values, payloads, results = [], [], []
        for item, loc in zip(plan.items, places, strict=True):
            value, size, payload = _resolve(item, planner)
            values.append((loc.path, value))
            if payload:
                payloads.append(list(loc.path))
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=loc))
        reserved: dict[str, Any] = {"format": RECORD_FORMAT, "rank": self.h.rank, "payloads": payloads}
        early = self._early_metadata(planner) if self._coordinator and not self._alone() else None
        if not self._coordinator:
            self._save(values, reserved, wait=self._alone())
            if not self._alone():
                self._reported_by_dcp()
        elif early is not None and self._locations is not None:
            self._record = encode_metadata(early, self._locations)
            self._save(values, {**reserved, "world_size": self.h.world_size, "metadata": self._record}, wait=False)
            self._reported_by_dcp()
        else:  # the metadata comes with finish(): rank 0's part is saved then
            self._deferred = (values, reserved)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: save its part with the metadata if it waited for it, and wait until it is durable."""
        locations: dict[MetadataIndex, Location] = {}
        for rank_results in results:
            for r in rank_results:
                if not isinstance(r.storage_data, Location):
                    raise TierckptError(f"DCP item {r.index}: its write result is not a HierarchyWriter's")
                locations[r.index] = r.storage_data
        metadata.storage_data = locations
        if self._handle is None:
            if self._deferred is None:
                raise TierckptError("HierarchyWriter.finish() before write_data()")
            values, reserved = self._deferred
            record = encode_metadata(metadata, locations)
            self._save(values, {**reserved, "world_size": self.h.world_size, "metadata": record}, wait=False)
        elif locations != self._locations or encode_metadata(metadata, locations) != self._record:
            raise TierckptError(
                f"step {self.step}: the metadata DCP finished with is not the planner's that rank 0 saved "
                "(a planner that changes it after create_global_plan?); do not load this step"
            )
        assert self._handle is not None  # _save set it
        self._wait(self._handle)

    # -- saving --------------------------------------------------------------------------------------------
    def _reported_by_dcp(self) -> None:
        """A part saved with the others' (the step commits on a tier only once every rank's part is in):
        its failures are the save's, which DCP reports on every rank (rank 0 waits in ``finish``, and a
        write phase that failed anywhere raises ``CheckpointException`` everywhere), so this hierarchy's
        ``wait()`` / ``close()`` does not raise them again (a zero-timeout wait marks them seen)."""
        assert self._handle is not None
        with contextlib.suppress(BaseException):
            self._handle.wait(timeout=0)

    def _alone(self) -> bool:
        """Whether the ranks commit their parts alone (several ranks, a SoloCoordinator): then rank 0's
        part, with the metadata, is the step's commit record, saved in finish() once every other rank's
        part is durable (DCP's rule: no metadata, no checkpoint). With a coordinator that commits a step
        on a tier only once every rank's part is there, rank 0 saves with the others."""
        return self.h.world_size > 1 and isinstance(self.h.coordinator, SoloCoordinator)

    def _early_metadata(self, planner: SavePlanner) -> Metadata | None:
        """The metadata DCP will finish with, where the planner provably has it before the writes: DCP's
        own ``create_global_plan`` returns the object it keeps as ``planner.metadata``."""
        if type(planner).create_global_plan is not DefaultSavePlanner.create_global_plan:
            return None
        md = getattr(planner, "metadata", None)
        return md if isinstance(md, Metadata) else None

    def _save(self, values: list[tuple[tuple[PathElem, ...], Any]], reserved: dict[str, Any], *, wait: bool) -> None:
        handle = self._handle = self.h.save(build_state(values, reserved), step=self.step)
        handle.staged.result()  # the items' bytes are in the top tier: DCP may drop or reuse them
        if wait:
            self._wait(handle)

    def _wait(self, handle: SaveHandle) -> None:
        if self.durable == "all":
            handle.wait()
            return
        goes = [t for t in self.h.tiers if t.name in handle.durable]
        persistent = [t for t in goes if t.capabilities.persistent] if self.durable == "persistent" else []
        try:
            handle.wait(tier=(persistent or goes)[0].name)
        except BaseException:
            # DCP reports this save's failure: the other tiers' failures of it are reported with it (a
            # zero-timeout wait marks them seen), not raised again by the hierarchy's close()
            with contextlib.suppress(BaseException):
                handle.wait(timeout=0)
            raise


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


class HierarchyReader(StorageReader):
    """A DCP storage reader of step ``step`` (default: the newest) of a :class:`~tierckpt.Hierarchy`.

    ``read_metadata`` reads rank 0's manifest only (the metadata is in its tree). ``read_data`` reads,
    for each saved rank holding an item this rank asks for, that rank's part of the step, whole and
    verified, from the fastest tier holding it (a damaged copy: the next tier's, with a warning), and
    copies the requested region of each item into DCP's target. Resharding is DCP's: any world size
    loads any other.

    Args:
        h: the hierarchy (read-only is fine: an evaluation job).
        step: the step; None: the newest step whose rank-0 part is committed on some tier (the ranks
            agree on it through the hierarchy's coordinator).
    """

    def __init__(self, h: Hierarchy, step: int | None = None) -> None:
        if step is not None:
            check_step(step)
        self.h, self.step = h, step
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (of step ``checkpoint_id`` when given)."""
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._read: int | None = None  # the step read_metadata read
        self._locations: dict[MetadataIndex, Location] = {}

    @property
    def checkpoint_id(self) -> str | None:
        """The step, as DCP's logs name a checkpoint (None: the newest, not chosen yet)."""
        step = self._read if self._read is not None else self.step
        return None if step is None else str(step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a step (an int, or a str of decimal digits)."""
        return _valid_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the step, from rank 0's manifest on the fastest tier that holds a good one.

        Raises:
            CheckpointNotFoundError: no tier holds rank 0's part of the step (or, without a step, any).
            CorruptCheckpointError: the record is damaged on every tier holding it, naming the field.
            TierckptError: the step was not written through DCP.
        """
        if kwargs.get("rank") is not None:
            raise TierckptError("a tierckpt DCP checkpoint has one metadata record (rank 0's), none per rank")
        step = self.step if self.step is not None else self._newest()
        md = self._record(step)
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._read = step
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the items' locations."""
        locs = metadata.storage_data
        if self._read is None or not isinstance(locs, dict) or not all(isinstance(v, Location) for v in locs.values()):
            raise TierckptError("HierarchyReader: the metadata is not one its read_metadata() returned")
        self._locations = locs

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as it is."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as they are."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each item of ``plan`` from its saved rank's part, into DCP's targets (one part at a time)."""
        if self._read is None:
            raise TierckptError("HierarchyReader.read_data() before read_metadata()")
        by_rank: dict[int, list[tuple[ReadItem, Location]]] = {}
        for req in plan.items:
            loc = self._locations.get(req.storage_index)
            if loc is None:
                raise CorruptCheckpointError(f"DCP metadata: no location for item {req.storage_index}", step=self._read)
            by_rank.setdefault(loc.rank, []).append((req, loc))
        for rank in sorted(by_rank, key=lambda r: (r != self.h.rank, r)):  # its own first: maybe in memory
            state, tier = self._read_part(rank)
            payloads = {tuple(p) for p in _reserved(state, rank, tier, self._read)["payloads"]}
            for req, loc in by_rank[rank]:
                self._load(planner, req, loc, lookup_value(state, loc, tier, self._read), loc.path in payloads)
            del state
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- reading -------------------------------------------------------------------------------------------
    def _newest(self) -> int:
        steps = []
        for t in self.h.tiers:
            try:
                steps += [k.step for k in t.list_committed(0)]
            except OSError as e:
                log.warning("tier %r: cannot list it: %s", t.name, e)
        agreed = self.h.coordinator.agree_step(max(steps, default=None))
        if agreed is None:
            raise CheckpointNotFoundError("no tier holds a committed step of rank 0 (a DCP checkpoint's metadata)")
        return agreed

    def _first_good(self, rank: int, step: int, read: Any) -> Any:
        """``read(tier)`` of the fastest tier holding ``rank``'s part of ``step`` whose copy reads."""
        key, errors = CheckpointKey(step, rank), []
        for tier in self.h.tiers:
            if not holds(tier, key):
                continue
            try:
                return read(tier, key)
            except (CorruptCheckpointError, CheckpointNotFoundError, OSError) as e:
                log.warning("DCP load: rank %d's part of step %d on tier %r: %s", rank, step, tier.name, e)
                errors.append((tier.name, e))
        if len(errors) == 1:
            raise errors[0][1]
        if errors:
            each = "; ".join(f"tier {n!r}: {e}" for n, e in errors)
            raise CorruptCheckpointError(f"rank {rank}'s part of step {step} is unusable on every tier: {each}")
        raise CheckpointNotFoundError(f"step {step}: no tier holds rank {rank}'s part")

    def _record(self, step: int) -> Metadata:
        def read(tier: Tier, key: CheckpointKey) -> Metadata:
            m = load_manifest(tier, key, allow_pickle=False)
            tree, ref = load_tree(tier, key, m, allow_pickle=False)
            if not isinstance(tree, dict) or RESERVED not in tree:
                raise TierckptError(f"step {step} on tier {tier.name!r} was not written through DCP (no {RESERVED!r})")
            rec = _reserved(
                {RESERVED: resolve_tree(tree[RESERVED], ref, _no_tensor, len(m.tensors))}, 0, tier.name, step
            )
            world = rec.get("world_size")
            if type(world) is not int or world < 1:
                raise CorruptCheckpointError(f"DCP record: world_size: got {world!r}", tier=tier.name, step=step)
            return decode_metadata(rec.get("metadata"), world, tier=tier.name, step=step)

        md: Metadata = self._first_good(0, step, read)
        return md

    def _read_part(self, rank: int) -> tuple[Any, str]:
        assert self._read is not None  # read_data checked
        return self._first_good(rank, self._read, lambda t, k: (read_checkpoint(t, k)[0], t.name))  # type: ignore[no-any-return]

    def _load(self, planner: LoadPlanner, req: ReadItem, loc: Location, value: Any, payload: bool) -> None:
        if req.type == LoadItemType.BYTE_IO:
            buf = io.BytesIO()
            if payload:
                buf.write(value)
            else:  # a plain value: the bytes DCP's planner would have made of it
                torch.save(value, buf)
            buf.seek(0)
            planner.load_bytes(req, buf)
            return
        t = value
        for d, (off, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            if off != 0 or n != t.size(d):
                t = t.narrow(d, off, n)
        target = planner.resolve_tensor(req).detach()
        if target.size() != t.size():
            raise ValueError(f"DCP item {req.storage_index}: target size {target.size()}, stored region {t.size()}")
        target.copy_(t)
        planner.commit_tensor(req, target)


def lookup_value(state: Any, loc: Location, tier: str, step: int) -> Any:
    """The value at ``loc`` in a rank's restored part; CorruptCheckpointError if there is none."""
    try:
        return lookup(state, loc.path)
    except (LookupError, TypeError):
        raise CorruptCheckpointError(
            f"rank {loc.rank}'s part has nothing at {list(loc.path)} (where DCP's metadata says)", tier=tier, step=step
        ) from None


def _no_tensor(i: int) -> torch.Tensor:
    raise CorruptCheckpointError(f"DCP record: holds tensor {i}; it is plain data")


def _reserved(state: Any, rank: int, tier: str, step: int | None) -> dict[str, Any]:
    """A rank's DCP bookkeeping entry, checked."""
    rec = state.get(RESERVED) if isinstance(state, dict) else None
    if not isinstance(rec, dict):
        raise CorruptCheckpointError(f"rank {rank}'s part: no DCP entry {RESERVED!r}", tier=tier, step=step)
    if rec.get("format") != RECORD_FORMAT:
        raise CorruptCheckpointError(
            f"DCP entry: format: expected {RECORD_FORMAT}, got {rec.get('format')!r}", tier=tier, step=step
        )
    if rec.get("rank") != rank:
        raise CorruptCheckpointError(f"DCP entry: rank: expected {rank}, got {rec.get('rank')!r}", tier=tier, step=step)
    p = rec.get("payloads")
    if not isinstance(p, list) or not all(isinstance(x, list) and all(type(e) in (str, int) for e in x) for x in p):
        raise CorruptCheckpointError("DCP entry: payloads: expected a list of key paths", tier=tier, step=step)
    return rec
