"""The user-facing API: a chain of tiers, fastest first, with ``save`` / ``restore`` / ``prefetch``.

:class:`Hierarchy` is a facade: each method checks its arguments, asks placement
(:func:`tierckpt.policies.place`) what to do, through the coordinator where every rank must agree, and
hands the plan to the orchestration below it (:mod:`tierckpt.ranks`, :mod:`tierckpt.datapath`,
:mod:`tierckpt.background`, :mod:`tierckpt.facade`): a save becomes a
:class:`~tierckpt.background.savejob.SaveJob` run by the mover, a restore a
:class:`~tierckpt.facade.restorejob.RestoreJob`, and the catalog records every copy's state.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tierckpt.background.catalog import STATES, Catalog, CheckpointInfo
from tierckpt.background.handles import SaveHandle
from tierckpt.background.listing import Listing
from tierckpt.background.mover import Mover
from tierckpt.background.pending import Pending
from tierckpt.background.process import gc_paused, install_flush_handler
from tierckpt.background.savejob import SaveJob
from tierckpt.config import (
    HierarchyConfig,
    IOConfig,
    LayoutConfig,
    PolicyConfig,
    default_io,
    load_config,
    parse_config,
    parse_policy,
)
from tierckpt.datapath.keymap import KeyMap, KeyMapLike
from tierckpt.datapath.manifests import load_manifest
from tierckpt.datapath.measured import keep as keep_measured
from tierckpt.datapath.restore_into import RestoreStaging
from tierckpt.datapath.storing import set_compression
from tierckpt.errors import CheckpointNotFoundError, TierckptError
from tierckpt.facade.checks import (
    check_connected,
    check_io,
    check_on_full,
    check_policy_names,
    check_step,
    check_tiers,
)
from tierckpt.facade.deletion import delete_step
from tierckpt.facade.engines import Engines
from tierckpt.facade.opening import open_parts
from tierckpt.facade.planner import Planner
from tierckpt.facade.restorejob import CopyReader, RestoreJob
from tierckpt.facade.verify import verify_copies
from tierckpt.format.manifest import Manifest
from tierckpt.format.tree import flatten
from tierckpt.io.geometry import CheckpointGeometry, checkpoint_geometry
from tierckpt.policies.demotion import Demotion
from tierckpt.policies.placement import CopyPlan, Policy
from tierckpt.policies.protocol import ThisRank
from tierckpt.policies.retention import RetentionPolicy
from tierckpt.ranks.coordinator import Coordinator, check_coordinator
from tierckpt.ranks.distributed import default_coordinator
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.jobs import hierarchy_job

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["STATES", "CheckpointInfo", "Hierarchy", "SaveHandle"]

log = logging.getLogger(__name__)


def _clock() -> float:
    """The clock demotion cadences read (a function so that tests can move time forward)."""
    return time.monotonic()


class Hierarchy:
    """A chain of storage tiers, fastest first, and the policy that decides what each keeps.

    ``save`` packs the state once into a few large aligned blobs in the top tier and returns at once;
    background workers demote copies down the chain as the policy says, and retention evicts old ones.
    ``restore`` reads the newest (or a given) step from the fastest tier holding a good copy.

    Args:
        tiers: tier objects, fastest first; names must be unique.
        policy: ``PolicyConfig`` or a mapping with the YAML schema (``{"keep": {"ssd": 2},
            "demote": {"pfs": {"every": 5}}}``).
        io: I/O settings: the staging chunk size, and the engine, ``direct`` and chunk size of file
            tiers built without them (default: ``IOConfig()``, with ``$TIERCKPT_ENGINE``).
        layout: aggregation settings.
        rank: this process's rank (default: the coordinator's; torch.distributed's, else, read-only, the
            launcher's: ``$RANK``, ``$OMPI_COMM_WORLD_RANK`` …, else 0).
        world_size: number of ranks (default: the coordinator's; torch.distributed's, else, read-only, the
            launcher's: ``$WORLD_SIZE``, ``$OMPI_COMM_WORLD_SIZE`` …, else 1).
        retention: per tier name, a retention policy object; overrides ``policy.keep`` for that tier.
        demotion: per tier name, a :class:`~tierckpt.policies.Demotion`; overrides ``policy.demote``.
        readonly: only look: :meth:`save` and :meth:`prefetch` raise, :meth:`close` copies nothing,
            a restore promotes nothing (see :meth:`from_config` for what it means to file tiers).
        job: the job identity its writable file tiers lease their directories for (docs/jobs.md):
            checked against the tiers' leases; default: theirs, else the environment's
            (``$TIERCKPT_JOB``, ``$TORCHELASTIC_RUN_ID``, ``$SLURM_JOB_ID`` …), else this process's own.
        coordinator: how the ranks of a job agree (default: a
            :class:`~tierckpt.ranks.distributed.StoreCoordinator` on torch.distributed's store
            when a process group of several ranks is initialized and ``rank`` / ``world_size`` are not
            given or are its own; else a :class:`SoloCoordinator`, every rank alone).

    Attributes:
        job: that identity (None for a read-only hierarchy, which leases nothing).
        config: the configuration it was built from (:meth:`from_config`, :meth:`from_yaml`; relative
            paths resolved), from which another process opens the same hierarchy (DCP's process
            executor); None where it was built from tier objects.
        placement: the placement policy every decision comes from.
        last_restore: (step, tier) of the latest restore.

    Example:
        >>> with Hierarchy.from_yaml("tiers/local.yaml") as h:   # doctest: +SKIP
        ...     handle = h.save({"model": model.state_dict()}, step=100)
        ...     handle.staged.result()         # before the next optimizer.step()
        ...     state = h.restore()
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        policy: PolicyConfig | Mapping[str, Any] | None = None,
        io: IOConfig | None = None,
        layout: LayoutConfig | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        retention: Mapping[str, RetentionPolicy] | None = None,
        demotion: Mapping[str, Demotion] | None = None,
        readonly: bool = False,
        job: str | None = None,
        coordinator: Coordinator | None = None,
        _engines: Engines | None = None,
    ) -> None:
        names = check_tiers(tiers)
        self.readonly = readonly
        self.job = None if readonly else hierarchy_job(tiers, job)
        self.policy = parse_policy(policy, names) if isinstance(policy, Mapping) else policy or PolicyConfig()
        check_policy_names(names, self.policy, retention or {}, demotion or {})
        check_on_full(tiers, self.policy)
        self._tiers = tuple(tiers)
        self._index = {n: i for i, n in enumerate(names)}
        self.io = io or default_io()
        check_io(self.io)
        self.layout = layout or LayoutConfig()
        self.coordinator = check_coordinator(coordinator or default_coordinator(rank, world_size, readonly=readonly))
        self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        check_connected(self.coordinator, readonly=readonly)
        self.placement = Policy.from_config(names, self.policy, retention, demotion)
        self._engines = _engines or Engines()
        for t in self._tiers:  # tiers built from Python without an engine or io settings take this io's
            t.use_io(self._engines, self.io)
            set_compression(t)  # its compress: setting (a tier built from Python: the default for its kind)
        # every size: each tier's geometry for this io (fixed here, whatever an override of use_io did),
        # the checkpoint's alignment (the largest of the layout's and the tiers'), blob size, and each
        # tier's chunks and staging in that alignment (docs/tiers.md, "I/O geometry")
        self._geometry = checkpoint_geometry(self.layout, {t.name: t.fix_geometry(self.io) for t in self._tiers})
        self.align = self._geometry.align_bytes
        self._catalog = Catalog(self._tiers, self.rank, now=_clock(), world_size=self.world_size)
        me = ThisRank(self.rank, self.world_size, frozenset(self.coordinator.ranks_on_node()))
        self._listing = Listing(self._tiers, self._catalog, me)
        self._listing.open(self.coordinator)  # a tier whose listing is not cheap: one rank lists it for all
        self._mover = Mover(
            self._tiers, self.placement, self._catalog, self._listing, self.coordinator, self._geometry.tiers
        )
        self._planner = Planner(
            self._tiers,
            self.placement,
            self._catalog,
            self._listing,
            self.coordinator,
            self._mover.keys,
            lambda: _clock(),
        )
        self._pending = Pending()
        self._deleted: set[int] = set()  # steps delete() removed (and not saved since): never promoted
        self._lock = threading.RLock()
        self._closed = False
        self.last_restore: tuple[int, str] | None = None
        self.config: HierarchyConfig | None = None  # from_config sets it
        self._in_place = RestoreStaging(self._geometry, tiers=self._tiers)

    @property
    def retention(self) -> Mapping[str, RetentionPolicy]:
        """Per tier, its retention policy (the placement policy's)."""
        return self.placement.retention

    @property
    def demotion(self) -> Mapping[str, Demotion]:
        """Per tier below the top one, its demotion policy (the placement policy's)."""
        return self.placement.demotion

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: HierarchyConfig | Mapping[str, Any],
        base_dir: str | os.PathLike[str] | None = None,
        *,
        readonly: bool = False,
        job: str | None = None,
        coordinator: Coordinator | None = None,
    ) -> Hierarchy:
        """Build from a validated :class:`HierarchyConfig` or a mapping with the YAML schema.

        The coordinator comes first: its rank and node fill the tiers' ``{rank}`` and ``{node}``, and in a
        job of several ranks every rank takes rank 0's job identity where none is given.

        Args:
            config: the hierarchy's settings.
            base_dir: what a mapping's relative paths are relative to (default: the current directory).
            readonly: for tools that only look and jobs that only restore: every file tier's directory
                must exist and nothing is written (no lease, no scratch sweep, no ``on_close`` copy, no
                promotion); :meth:`save` and :meth:`prefetch` raise.
            job: the job identity to lease the file tiers' directories for (docs/jobs.md); default:
                the environment's (``$TIERCKPT_JOB``, ``$TORCHELASTIC_RUN_ID``, ``$SLURM_JOB_ID`` …),
                else rank 0's (in a job of several ranks), else one of this process alone.
            coordinator: how the ranks agree (default: as for :class:`Hierarchy`, with the config's
                ``distributed.timeout`` and ``distributed.node``).

        Raises:
            ConfigError: naming the bad key.
            TierBusyError: another job holds the lease of a file tier's directory (naming it).
            CoordinationError: some rank did not build its hierarchy in time.
        """
        cfg = config if isinstance(config, HierarchyConfig) else parse_config(config, base_dir)
        h = open_parts(cfg, None, readonly=readonly, job=job, coordinator=coordinator).build(cls, readonly=readonly)
        h.config = cfg
        return h

    @classmethod
    def from_yaml(
        cls,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        job: str | None = None,
        coordinator: Coordinator | None = None,
    ) -> Hierarchy:
        """Build from a YAML file; relative tier paths are relative to the file (``readonly``, ``job``,
        ``coordinator``: as for :meth:`from_config`)."""
        return cls.from_config(load_config(path), readonly=readonly, job=job, coordinator=coordinator)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return self._tiers

    @property
    def geometry(self) -> CheckpointGeometry:
        """The sizes of its checkpoints and of each tier's I/O in them (docs/tiers.md, "I/O geometry")."""
        return self._geometry

    @property
    def restore_staging(self) -> RestoreStaging:
        """The staging buffers in-place restores stream through (``restore(into=)``, the DCP reader's
        loads): one restore at a time, allocated on first use, freed by :meth:`close`."""
        return self._in_place

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; KeyError if there is none."""
        if name not in self._index:
            raise KeyError(f"no tier named {name!r} (tiers: {', '.join(t.name for t in self._tiers)})")
        return self._tiers[self._index[name]]

    # -- save ---------------------------------------------------------------------------------------------
    @gc_paused()
    def save(self, state: Any, *, step: int, allow_pickle: bool = False, blocking: bool = False) -> SaveHandle:
        """Save ``state`` as ``step``; returns as soon as the copy into the top tier is scheduled.

        The state is checked and flattened before this returns: a value that is not a tensor or a plain
        value raises :class:`StateError` naming its key path (unless ``allow_pickle``), and nothing is
        written. The copy itself runs in the background; **do not modify the state's tensors in place
        before** ``handle.staged`` **resolves** (e.g. wait on it right before ``optimizer.step()``). A tensor
        replaced by one of another size meanwhile (``t.data = ...``) fails this save with
        :class:`StateError` naming its key, rather than have its bytes read past their end.

        Tensors are saved as the bytes in their storage: plain tensors, ``nn.Parameter`` and Python
        subclasses without a ``__torch_dispatch__`` (as plain tensors); a ``DTensor`` as its local shard
        and where it sits (docs/distributed.md). Other tensor subclasses, ``Partial`` DTensors and freed
        storages raise :class:`StateError` naming the key (docs/format.md, "What a state may hold").
        Copies to the lower tiers follow in the background, in order, as the demotion policy says.

        A failure on one tier does not stop the others; it is raised by ``handle.wait()`` (and by
        ``wait()``/``close()`` if the handle was never waited on).

        Args:
            state: nested dict/list/tuple of tensors and plain values.
            step: non-negative integer identifying the checkpoint.
            allow_pickle: pickle values that are neither tensors nor plain values.
            blocking: return only when every tier this save goes to has committed it or failed. Its
                copies are then not paced by the tiers' bandwidth budgets (unless ``throttle: all``); a
                non-blocking save's are (docs/tiers.md, "Bandwidth budgets").
        """
        self._check_writable("save")
        check_step(step)
        flat = flatten(state, allow_pickle=allow_pickle)
        layout = SaveJob.lay_out(flat, self._geometry)
        key = CheckpointKey(step, self.rank)
        with self._lock:
            self._deleted.discard(step)
            plan = self._planner.save(key)
            self._listing.saw_step(step)
            handle = SaveHandle(step, plan.tiers)
            self._pending.add_save(handle)
            SaveJob(
                self._mover, plan, handle, flat, layout, key,
                world_size=self.world_size, align=self.align, background=not blocking,
            ).start()  # fmt: skip
        if blocking:
            handle.settle()
        return handle

    # -- promotion ------------------------------------------------------------------------------------------
    def prefetch(self, step: int | None = None, to: str | None = None) -> Future[str]:
        """Copy a checkpoint up the chain (e.g. pfs → host, then host → local) in the background.

        Call it early (while the model is being built) so that ``restore()`` later reads from memory.
        The copy goes straight from the fastest tier holding the step to ``to`` (one read of the slow
        tier); every tier in between then receives a copy from ``to``'s (or, if that failed, from the
        source). Its reads and writes are not paced by the tiers' bandwidth budgets, unless a budget says
        ``throttle: all``.

        Args:
            step: the step (default: the newest committed one).
            to: the tier to bring it to (default: the top tier).

        Returns:
            A future resolving to the name of ``to`` once it has committed the copy (at once if the step
            is already there or higher). It holds :class:`CheckpointNotFoundError` when there is no such
            step, or the copy's error.
        """
        self._check_writable("prefetch")
        to = self.tier(to).name if to is not None else self._tiers[0].name
        out: Future[str] = Future()
        try:
            info = self._locate(step)
        except CheckpointNotFoundError as e:
            out.set_exception(e)
            return out
        return self._promote(self._planner.prefetch(info, to), to, background=False)

    def _promote(self, plan: CopyPlan, to: str, *, background: bool) -> Future[str]:
        """Execute a promotion plan (``background``: paced by the tiers' budgets, as a promotion after a
        restore is; a prefetch is not, unless a budget paces everything); the future resolves to ``to``
        once it has committed the copy."""
        if plan.there is not None or plan.step is None:  # already there, or higher
            out: Future[str] = Future()
            out.set_result(to)
            return out
        with self._lock:
            if plan.step in self._deleted:  # deleted since it was found (another thread): nothing to copy
                gone: Future[str] = Future()
                gone.set_exception(CheckpointNotFoundError(f"step {plan.step} was deleted (delete())"))
                return gone
            return self._pending.add_promotion(plan.step, to, self._mover.execute(plan, background=background))

    # -- read side ---------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """This rank's steps, oldest first: where each is committed, and its state on every tier
        (``pending``, ``writing``, ``committed``, ``failed``, ``evicting`` or ``absent``)."""
        return self._listing.checkpoints()

    def _locate(self, step: int | None, tier: str | None = None) -> CheckpointInfo:
        if step is not None:
            check_step(step)
        if tier is not None:
            self.tier(tier)
        return self._listing.locate(step, tier)

    @gc_paused()
    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        allow_pickle: bool = False,
        tier: str | None = None,
        strict: bool = True,
        key_map: KeyMapLike = None,
    ) -> Any:
        """Read a checkpoint back, verifying every checksum.

        Saves of this hierarchy still being staged are waited for first, and so is a ``prefetch`` of the
        step still climbing. The fastest tier holding ``step`` (default: the newest committed step) is
        read; if its copy is damaged, a warning is logged and the next tier's copy is used. With
        ``policy.promote.on_restore``, a copy read from a lower tier is then promoted in the background.

        With no ``step``, a step damaged on every tier is skipped with a warning naming each tier's
        problem, and the newest older step that restores is returned (``last_restore`` says which). A
        copy evicted or replaced by another process while it is opened, or one the step's commit record
        does not name, is never reported as damaged: the restore looks again, or reads the next tier
        (docs/restore.md). In a job, every rank restores the same step (docs/distributed.md).

        Args:
            step: the step, or None for the newest that restores.
            into: a state whose tensors receive the bytes in place (returned); None for fresh CPU tensors
                (a DTensor shard: the box this rank saved). The bytes stream through a few reused
                staging buffers straight into its tensors (docs/restore.md); its structure, shapes and
                dtypes are checked first. Its DTensors may be sharded for any mesh and world size: each
                is filled from the saved shards that overlap it (docs/distributed.md).
            allow_pickle: accept checkpoints that hold pickled values.
            tier: read only this tier: the steps committed on it, this rank's copy from it alone (a damaged
                or unreadable one is raised, never replaced by another tier's; a given ``step`` it lacks
                raises :class:`CheckpointNotFoundError`); no prefetch waited for, nothing promoted
                (docs/restore.md, "Reading one tier").
            strict: with ``into``, every dict of ``into`` must have exactly the keys the checkpoint's
                dict has at the same path (a silently ignored key is how resumes go wrong); all mismatches
                are listed in one ``StateError`` before anything changes. ``strict=False`` leaves keys only
                the target has as they are and adds those only the checkpoint has (a warning). Shapes and
                dtypes must match either way. Model, optimizer, RNG and data position together:
                :class:`tierckpt.TrainState` (docs/resume.md).
            key_map: renames the saved key paths (``model._orig_mod.fc.weight``) to the target's: a
                mapping of prefix to replacement, a function (None: leave the value out) or a
                :class:`~tierckpt.KeyMap`, e.g. ``KeyMap.torch_compile()`` (docs/restore.md, "Renamed keys").

        Raises:
            CheckpointNotFoundError: no such step; :class:`CheckpointEvictedError` where ``step`` was
                evicted by another process while it was being opened; where the step's copies are not
                the ones its commit records name.
            CorruptCheckpointError: every copy failed validation; with several copies (or older steps
                to suggest) one error names every tier's failure and the older committed steps.
            TierIOError: no copy could be read, one of them for an I/O error (or a copy no tier holds).
            StateError: ``into`` does not match the checkpoint, or it holds pickled values.
            CoordinationError: in a job, another rank failed its part of the agreement on the step, of
                the restore of a given ``step`` or of the exchange of replicated DTensors (naming it and
                its error), or did not take part in time.
            KeyError: ``tier`` names no tier of the hierarchy.
        """
        self._check_open()
        keymap = None if key_map is None else KeyMap(key_map)
        self._pending.settle_top(self._tiers[0].name)
        if step is not None:
            check_step(step)
        if tier is not None:
            self.tier(tier)
        job = RestoreJob(
            CopyReader(
                self._tiers, self.rank, self._in_place, into, allow_pickle=allow_pickle, strict=strict, key_map=keymap
            ),
            lambda: self._listing.committed_steps(tier),
            self.coordinator,
            into=into,
            where=f"rank {self.rank} on " + (f"tier {tier!r}" if tier else "any tier"),
            may_commit=self.readonly,  # a writable hierarchy holds its tiers' leases: no other job saves there
            climbing=lambda s: tier is None and self._pending.waited_climbing(s),
        )
        state, got, name = job.run(step)
        self.last_restore = (got, name)
        if tier is None and not self.readonly:  # promote_on_restore
            self._promote(self._planner.restored(got, name), self._tiers[0].name, background=True)
        return state

    def delete(self, step: int) -> None:
        """Remove ``step`` from every tier (for a framework's own retention). Waits for this hierarchy's
        work on the step (its save, demotions, a prefetch); afterwards ``checkpoints()`` and ``restore()``
        no longer see it, it may be saved again, and its space is freed in the background. In a job,
        every rank calls it. What a reader or a crash meanwhile sees: docs/policies.md, "Deleting a step".

        Raises:
            CheckpointNotFoundError: no tier holds the step committed (naming the committed steps).
            TierckptError: the hierarchy is read-only; or a commit record could not be removed (naming
                the tiers where the step stays committed, whole).
            CoordinationError: in a job, another rank did not take part in time.
        """
        self._check_writable("delete")
        check_step(step)
        with self._lock:  # no save, prefetch or flush of the step is queued meanwhile
            delete_step(
                step, tiers=self._tiers, catalog=self._catalog, listing=self._listing, mover=self._mover,
                coordinator=self.coordinator,
            )  # fmt: skip
            self._deleted.add(step)

    def inspect(self, step: int | None = None) -> tuple[str, Manifest]:
        """The manifest of ``step`` (default: newest) from the fastest tier holding it, and that tier's name."""
        info = self._locate(step)
        return info.tiers[0], load_manifest(self.tier(info.tiers[0]), CheckpointKey(info.step, self.rank))

    def verify(self, step: int | None = None) -> list[tuple[int, str, BaseException | None]]:
        """Re-read every copy of ``step`` (default: every committed step) on every tier that holds it:
        (step, tier, error or None) for each copy, in the order (step, tier, rank).

        Whose copies: in a job whose ranks are connected (every rank verifies), this rank's; in a
        process alone (an evaluation or a tool: ``tierckpt verify``), every rank's that the step's
        commit record names, on the shared tiers and on this node's node-local ones.

        A copy that another process evicts while it is being verified is left out (it is gone, not
        damaged); one replaced by a new save of its step is verified again. A copy the step's record
        does not name (a save of the step again that did not commit) is reported, as is one the record
        names that a shared tier lacks, this rank's own copy that its node-local tier lacks, and a step
        whose record a node-local tier holds with none of the copies it names; none of them is damage
        (their errors are not :class:`CorruptCheckpointError`)."""
        infos = [self._locate(step)] if step is not None else self._listing.committed_steps()
        ranks = {self.rank} if self.coordinator.connects_ranks else None
        checks = verify_copies(
            self._tiers, infos, self.rank, may_commit=self.readonly, ranks=ranks, world_size=self.world_size
        )
        return [(c.step, c.tier, c.error) for c in checks]

    # -- the end -------------------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Finish what the policy wants durable: every pending copy, then the newest checkpoint to each
        tier with ``on_close: true``. Returns False if ``timeout`` seconds passed first.

        ``close()`` calls it without a timeout; the SIGTERM handler with its deadline.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._pending.settle(deadline):
            return False
        if self.readonly:  # it copied nothing, and must copy nothing
            return True
        plan = self._planner.close()
        if plan.copies:
            with self._lock:
                self._pending.add_flush(self._mover.execute(plan).values())
        return self._pending.settle(deadline)

    def wait(self) -> None:
        """Wait for every save, prefetch and flush; raise the first failure nobody has seen yet: of a tier
        whose outcome was never waited for through the save's handle, or of an ``on_close`` flush (each
        failure is raised once; prefetch failures stay in the future ``prefetch`` returned)."""
        self._pending.settle(None)
        self._pending.raise_unseen()

    def install_sigterm_handler(self, deadline: float = 60.0, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """On SIGTERM (preemption), flush within ``deadline`` seconds, then let the signal do what it did
        before (the default: terminate). Call from the main thread.

        Raises:
            ValueError: not called from the main thread (Python only runs signal handlers there).
        """
        install_flush_handler(lambda: self._closed or self.flush(deadline), deadline, signals)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the hierarchy is closed")

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.readonly:
            raise TierckptError(f"cannot {what}: the hierarchy was opened read-only")

    def close(self) -> None:
        """Flush (pending copies and ``on_close`` demotions), release tiers and engines; raise unobserved
        save failures."""
        if self._closed:
            return
        try:
            self.flush()
            self.wait()
        finally:
            self._closed = True
            self._mover.close()
            self._in_place.release()
            for t in self._tiers:
                keep_measured(t, now=True)  # what auto measured of it, for the next process (never raises)
                t.close()
            self._engines.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """:meth:`close`. With an exception of the ``with`` block in flight, that exception is what
        propagates: a failure of the close (a background copy's) is logged and added to it as a note
        (Python 3.11+), never raised in its place."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # a KeyboardInterrupt while closing still ends the process
            what = f"{type(err).__name__}: {err}"
            log.error("closing the hierarchy after %s was raised in its with block: %s", type(exc).__name__, what)
            add_note = getattr(exc, "add_note", None)  # BaseException.add_note: Python 3.11+
            if add_note is not None:
                add_note(f"tierckpt: closing the hierarchy then failed too: {what}")
