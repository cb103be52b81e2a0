"""The DCP storage reader: DCP's metadata from the part of a step that DCP's coordinator saved, each read item from the part of
the rank that wrote it (docs/distributed.md, "DCP backend")."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt.datapath.manifests import load_manifest, load_tree
from tierckpt.dcp._copy import copy_tensor
from tierckpt.dcp._direct import read_part
from tierckpt.dcp._ids import step_of, tier_dirs, valid_id
from tierckpt.dcp._layout import CHUNKS, RESERVED, lookup
from tierckpt.dcp._record import Location, check_format, decode_metadata
from tierckpt.dcp._source import HierarchyLike, Source
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, TierckptError
from tierckpt.facade.checks import check_step
from tierckpt.facade.verify import holds
from tierckpt.format.tree import resolve_tree
from tierckpt.tiers.base import CheckpointKey, Tier

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy

__all__ = ["HierarchyReader"]

log = logging.getLogger(__name__)


class HierarchyReader(StorageReader):
    """A DCP storage reader of step ``step`` (default: the newest) of a :class:`~tierckpt.Hierarchy`.

    ``read_metadata`` reads manifests only: rank 0's, and, where DCP's coordinator was another rank, that
    rank's (the metadata is in its tree). ``read_data`` reads,
    for each saved rank holding an item this rank asks for, that rank's part of the step, whole and
    verified, from the fastest tier holding it (a damaged copy: the next tier's, with a warning): an
    item asked for whole into a tensor of its dtype streams straight into DCP's target, and the
    requested region of any other is copied there from a fresh tensor. Resharding is DCP's: any world
    size loads any other.

    Like :class:`HierarchyWriter`, the reader pickles as the hierarchy's configuration.

    Args:
        h: the hierarchy (read-only is fine: an evaluation job), or its configuration (a YAML path, a
            mapping or a ``HierarchyConfig``): then opened read-only by the first read, in the process
            that reads (every rank of the load at once), and shared by this process's readers of it.
        step: the step; None: the newest step whose rank-0 part is committed on some tier (the ranks
            agree on it through the hierarchy's coordinator).
    """

    def __init__(self, h: HierarchyLike, step: int | None = None) -> None:
        if step is not None:
            check_step(step)
        self._source = Source(h, readonly=True, job=None, user="HierarchyReader")
        self.step = step
        self.reset()

    @property
    def h(self) -> Hierarchy:
        """The hierarchy (opened read-only from its configuration on first use, in this process)."""
        return self._source.hierarchy

    def __getstate__(self) -> dict[str, Any]:
        """The configuration and step (a load's own state is not sent: DCP resets it)."""
        return {"_source": self._source, "step": self.step}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; ``checkpoint_id``, when given, chooses the step as for ``HierarchyWriter.reset``
        (the directory of one of the hierarchy's file tiers: the step given so far, None: the newest)."""
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id, tier_dirs(self.h), self.step)
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
        """Whether ``checkpoint_id`` has the form of one: a step (an int, or a str of decimal digits) or a
        local path (``reset`` checks that the path is one of the hierarchy's); False for a URL."""
        return valid_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the step: the job's record (in the part of the rank that was DCP's
        coordinator; rank 0's part says which), or, with ``rank=`` (DCP's fallback where there is no job
        record), the record this rank's part holds of its own (a step each rank saved alone: ``no_dist``
        or ``use_collectives=False``). Manifests only, from the fastest tier holding a good copy.

        Raises:
            CheckpointNotFoundError: no tier holds rank 0's part of the step (or, without a step, any).
            CorruptCheckpointError: the record is damaged on every tier holding it, naming the field.
            TierckptError: the step was not written through DCP, or has no record of the kind asked for.
        """
        step = self.step if self.step is not None else self._newest()
        md = self._record(step, own=kwargs.get("rank") is not None)
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._read = step
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the items' locations (any rank may be DCP's coordinator)."""
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
        with _gc_paused():
            self._read_items(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        assert self._read is not None  # read_data checked
        by_rank: dict[int, list[tuple[ReadItem, Location]]] = {}
        for req in plan.items:
            loc = self._locations.get(req.storage_index)
            if loc is None:
                raise CorruptCheckpointError(f"DCP metadata: no location for item {req.storage_index}", step=self._read)
            by_rank.setdefault(loc.rank, []).append((req, loc))
        for rank in sorted(by_rank, key=lambda r: (r != self.h.rank, r)):  # its own first: maybe in memory
            items, targets = by_rank[rank], dict[int, torch.Tensor]()
            state, tier, streamed = self._read_part(rank, items, _resolver(planner, items, targets))
            payloads = {tuple(p) for p in _reserved(state, rank, tier, self._read)["payloads"]}
            for i, (req, loc) in enumerate(items):
                if i not in streamed:
                    value = lookup_value(state, loc, tier, self._read)
                    self._load(planner, req, loc, value, loc.path in payloads, targets.get(i))
            for i, t in streamed.items():  # every byte verified: the part has been read whole
                planner.commit_tensor(items[i][0], t)
            del state

    # -- reading -------------------------------------------------------------------------------------------
    def _newest(self) -> int:
        steps: list[int] = []
        infos = None  # the hierarchy's listing, for the tiers it lists once (their listing is not cheap)
        for t in self.h.tiers:
            if not t.capabilities.cheap_listing:  # one rank listed it for all when the hierarchy opened
                infos = self.h.checkpoints() if infos is None else infos
                steps += [c.step for c in infos if t.name in c.tiers]
                continue
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
            cheap = tier.capabilities.cheap_listing  # else not asked first: the read says whether it is there
            if cheap and not holds(tier, key):
                continue
            try:
                return read(tier, key)
            except (CorruptCheckpointError, CheckpointNotFoundError, OSError) as e:
                if not cheap and type(e) is CheckpointNotFoundError:  # not there, or not committed there
                    continue
                log.warning("DCP load: rank %d's part of step %d on tier %r: %s", rank, step, tier.name, e)
                errors.append((tier.name, e))
        if len(errors) == 1:
            raise errors[0][1]
        if errors:
            each = "; ".join(f"tier {n!r}: {e}" for n, e in errors)
            raise CorruptCheckpointError(f"rank {rank}'s part of step {step} is unusable on every tier: {each}")
        raise CheckpointNotFoundError(self._missing(rank, step))

    def _missing(self, rank: int, step: int) -> str:
        """Why this rank finds no copy of ``rank``'s part of ``step`` on its tiers."""
        me, tiers = self.h.rank, self.h.tiers
        msg = f"step {step}: none of rank {me}'s tiers ({', '.join(t.name for t in tiers)}) holds rank {rank}'s part"
        if rank == me:
            return msg
        own = [t.name for t in tiers if holds(t, CheckpointKey(step, me))]
        shared = [t.name for t in tiers if t.capabilities.shared]
        return (
            f"{msg}{' (with DCP metadata)' if rank == 0 else ''}; this rank's own part is "
            f"{'on ' + ', '.join(own) if own else 'on none of them either'}. Another rank's part is read from a "
            f"tier every rank reads, so the step loads on every rank once it is on a shared tier "
            f"({', '.join(shared) if shared else 'this hierarchy has none'}): HierarchyWriter's default, "
            "durable='loadable', waits for that where the ranks span nodes (durable='shared' always); "
            "durable='persistent' or 'top', or a demotion policy that does not send the step there, leaves it on "
            "the tiers of the node that saved it"
        )

    def _record(self, step: int, *, own: bool) -> Metadata:
        want = "rank" if own else "job"  # own: the record of this rank's part, whichever it is

        def read(tier: Tier, key: CheckpointKey) -> Metadata | _Elsewhere:
            m = load_manifest(tier, key, allow_pickle=False)
            tree, ref = load_tree(tier, key, m, allow_pickle=False)
            if not isinstance(tree, dict) or RESERVED not in tree:
                raise TierckptError(f"step {step} on tier {tier.name!r} was not written through DCP (no {RESERVED!r})")
            entry = tree[RESERVED]
            if isinstance(entry, dict):  # items kept in the entry are read with the part, not as the record
                entry = {k: v for k, v in entry.items() if k != CHUNKS}
            rec = _reserved({RESERVED: resolve_tree(entry, ref, _no_tensor, len(m.tensors))}, key.rank, tier.name, step)
            world, scope = rec.get("world_size"), rec.get("scope", "job")
            if rec.get("metadata") is None or (scope != want and not own):  # own: a job record holds its items too
                return _Elsewhere(rec.get("record_rank"), world, scope if rec.get("metadata") is not None else None)
            if type(world) is not int or world < 1:
                raise CorruptCheckpointError(f"DCP record: world_size: got {world!r}", tier=tier.name, step=step)
            return decode_metadata(rec.get("metadata"), world, tier=tier.name, step=step)

        got: Metadata | _Elsewhere = self._first_good(self.h.rank if own else 0, step, read)
        if isinstance(got, Metadata):
            return got
        if own:
            raise TierckptError(
                f"step {step}: rank {self.h.rank}'s part holds no DCP metadata of its own (the ranks saved it "
                "together: its metadata is the job's, which read_metadata() without rank= reads)"
            )
        if got.scope == "rank":
            raise TierckptError(
                f"step {step} was saved by each rank alone (no_dist=True or use_collectives=False): it has no "
                "job-wide DCP metadata; each rank loads its own part's (DCP's fallback, read_metadata(rank=...))"
            )
        return self._record_elsewhere(step, got, read)

    def _record_elsewhere(self, step: int, got: _Elsewhere, read: Any) -> Metadata:
        """The job's record from the part rank 0's names (or, where it names none, the first part holding
        one: a save whose plans came cached from an earlier one)."""
        world = got.world_size if type(got.world_size) is int else 1
        ranks = [got.record_rank] if type(got.record_rank) is int else list(range(1, world))
        for r in ranks:
            try:
                md = self._first_good(r, step, read)
            except CheckpointNotFoundError:
                if len(ranks) == 1:
                    raise
                continue
            if isinstance(md, Metadata):
                return md
        raise CorruptCheckpointError(f"step {step}: no rank's part holds DCP's metadata record", step=step)

    def _read_part(
        self, rank: int, items: list[tuple[ReadItem, Location]], target: Callable[[int], torch.Tensor]
    ) -> tuple[Any, str, dict[int, torch.Tensor]]:
        """``rank``'s part, from the fastest tier whose copy reads, with the items that can be streamed
        straight into their targets (``_direct.py``); the tier's name; the items streamed, by index."""
        assert self._read is not None  # read_data checked
        staging = self.h.restore_staging

        def read(tier: Tier, key: CheckpointKey) -> tuple[Any, str, dict[int, torch.Tensor]]:
            state, streamed = read_part(tier, key, items, target, staging)
            return state, tier.name, streamed

        got: tuple[Any, str, dict[int, torch.Tensor]] = self._first_good(rank, self._read, read)
        return got

    def _load(
        self, planner: LoadPlanner, req: ReadItem, loc: Location, value: Any, payload: bool, target: Any = None
    ) -> None:
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
        target = planner.resolve_tensor(req).detach() if target is None else target
        if target.size() != t.size():
            raise ValueError(f"DCP item {req.storage_index}: target size {target.size()}, stored region {t.size()}")
        copy_tensor(target, t)
        planner.commit_tensor(req, target)


@dataclass(frozen=True)
class _Elsewhere:
    """A part with no record of the kind asked for: where rank 0's part says the job's record is (DCP's
    coordinator's hierarchy rank; None: not said), the saving world size, and the scope of the record it
    holds (None: none)."""

    record_rank: Any
    world_size: Any
    scope: Any


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection meanwhile: decoding a part's tree makes thousands of objects (none in
    a cycle), which set off a full collection, and in a process holding torch's and DCP's objects one costs
    0.1-0.15 s here (most of a restart's first load's Python time, docs/integrations.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _resolver(
    planner: LoadPlanner, items: list[tuple[ReadItem, Location]], targets: dict[int, torch.Tensor]
) -> Callable[[int], torch.Tensor]:
    """DCP's target tensor of ``items[i]``, resolved once (kept in ``targets``: a retry on another tier
    and the copy of an item not streamed take the same tensor)."""

    def target(i: int) -> torch.Tensor:
        if i not in targets:
            targets[i] = planner.resolve_tensor(items[i][0]).detach()
        return targets[i]

    return target


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
    check_format(rec.get("format"), "DCP entry", tier, step)
    if rec.get("rank") != rank:
        raise CorruptCheckpointError(f"DCP entry: rank: expected {rank}, got {rec.get('rank')!r}", tier=tier, step=step)
    p = rec.get("payloads")
    if not isinstance(p, list) or not all(isinstance(x, list) and all(type(e) in (str, int) for e in x) for x in p):
        raise CorruptCheckpointError("DCP entry: payloads: expected a list of key paths", tier=tier, step=step)
    return rec
