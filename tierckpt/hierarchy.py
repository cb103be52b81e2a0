"""The user-facing API: a chain of tiers, fastest first, with ``save`` / ``restore`` / ``prefetch``.

``save`` checks and flattens the state in the caller's thread, then hands the copy to the background
mover (``tierckpt._mover``): the top tier's worker packs the tensors into the top tier (``staged``
resolves when the last byte is copied out of the caller's tensors) and commits; each tier below that
the demotion policy picks for this save gets a copy from the nearest tier above it. Retention runs
after every change. ``prefetch`` climbs the other way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from tierckpt._checks import check_policy_names, check_rank, check_step, check_tiers
from tierckpt._choose import choose_and_read
from tierckpt._lifecycle import Lifecycle, resolved
from tierckpt._mover import Mover
from tierckpt._records import STATES, CheckpointInfo, SaveHandle, Tracker, merge_states
from tierckpt._restore import load_manifest, read_checkpoint, verify_checkpoint
from tierckpt._restore_into import RestoreStaging
from tierckpt._runtime import Engines, dist_rank, gc_paused
from tierckpt._stage import make_stage_job
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
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.format.layout import plan, round_up
from tierckpt.format.manifest import BlobEntry, Manifest
from tierckpt.format.tree import flatten
from tierckpt.io.buffers import StagingPool
from tierckpt.policies.demotion import Cadence, Demotion
from tierckpt.policies.retention import KeepAll, KeepLatest, RetentionPolicy
from tierckpt.registry import get_tier_class
from tierckpt.tiers._jobs import hierarchy_job, resolve_job
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["STATES", "CheckpointInfo", "Hierarchy", "SaveHandle"]

log = logging.getLogger(__name__)
# A save's staging pool: 6 slots of one io chunk (32 MiB by default, 192 MiB in all). A virtual disk
# here completes a whole queue of writes at once, so the packer must have slots free to fill while
# a full queue is in flight; 3 slots of 64 MiB (the same memory) left the disk idle while they were
# refilled (docs/benchmarks-journal.md, "Six staging slots").
_STAGING_SLOTS = 6


def _clock() -> float:
    """The clock demotion cadences read (a function so that tests can move time forward)."""
    return time.monotonic()


class Hierarchy(Lifecycle):
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
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: number of ranks (default: torch.distributed's, else 1).
        retention: per tier name, a retention policy object; overrides ``policy.keep`` for that tier.
        demotion: per tier name, a :class:`~tierckpt.policies.Demotion`; overrides ``policy.demote``.
        readonly: only look: :meth:`save` and :meth:`prefetch` raise, :meth:`close` copies nothing,
            a restore promotes nothing (see :meth:`from_config` for what it means to file tiers).
        job: the job identity its writable file tiers lease their directories for (docs/jobs.md):
            checked against the tiers' leases; default: theirs, else the environment's
            (``$TIERCKPT_JOB``, ``$TORCHELASTIC_RUN_ID``, ``$SLURM_JOB_ID`` …), else this process's own.

    Attributes:
        job: that identity (None for a read-only hierarchy, which leases nothing).

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
        _engines: Engines | None = None,
    ) -> None:
        names = check_tiers(tiers)
        self.readonly = readonly
        self.job = None if readonly else hierarchy_job(tiers, job)
        if isinstance(policy, Mapping):
            policy = parse_policy(policy, names)
        self.policy = policy or PolicyConfig()
        check_policy_names(names, self.policy, retention or {}, demotion or {})
        self._tiers = tuple(tiers)
        self._index = {n: i for i, n in enumerate(names)}
        self.io = io or default_io()
        self.layout = layout or LayoutConfig()
        dr, dw = dist_rank()
        self.rank = dr if rank is None else rank
        self.world_size = dw if world_size is None else world_size
        check_rank(self.rank, self.world_size)
        self.retention: dict[str, RetentionPolicy] = {
            n: KeepLatest(self.policy.keep[n]) if n in self.policy.keep else KeepAll() for n in names
        }
        self.retention.update(retention or {})
        self.demotion: dict[str, Demotion] = {
            n: Demotion.from_settings(d.every, d.every_secs, d.on_close) for n, d in self.policy.demote.items()
        }
        self.demotion.update(demotion or {})
        self.align = max([self.layout.align_bytes] + [t.capabilities.alignment_bytes for t in tiers])
        self._engines = _engines or Engines()
        for t in self._tiers:  # tiers built from Python without an engine or io settings take this io's
            t.use_io(self._engines, self.io)
        self._tracker = Tracker()
        self._mover = Mover(self._tiers, self.retention, self._tracker, self.rank, self._staging)
        now = _clock()
        self._cadence = {n: [0, now] for n in names[1:]}  # saves since the last one sent, when it was sent
        self._handles: list[SaveHandle] = []
        self._newest: int | None = None  # newest step committed or saved (found at the first save)
        self._warned_order = False
        self._promotions: dict[int, Future[str]] = {}
        self._extra: list[Future[None]] = []  # on-close demotions
        self._fills: list[Future[None]] = []  # prefetch copies into the tiers below its target (logged on failure)
        self._lock = threading.RLock()
        self._closed = False
        self.last_restore: tuple[int, str] | None = None  #: (step, tier) of the latest restore
        self._in_place = RestoreStaging()

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: HierarchyConfig | Mapping[str, Any],
        base_dir: str | os.PathLike[str] | None = None,
        *,
        readonly: bool = False,
        job: str | None = None,
    ) -> Hierarchy:
        """Build from a validated :class:`HierarchyConfig` or a mapping with the YAML schema.

        Args:
            config: the hierarchy's settings.
            base_dir: what a mapping's relative paths are relative to (default: the current directory).
            readonly: for tools that only look (``tierckpt ls``) and jobs that only restore (evaluation):
                every file tier's directory must exist and nothing is created or written: no lease, no
                scratch sweep, no ``on_close`` copies at :meth:`close`, no promotion; :meth:`save` and
                :meth:`prefetch` raise.
            job: the job identity to lease the file tiers' directories for (docs/jobs.md); default:
                the environment's (``$TIERCKPT_JOB``, ``$TORCHELASTIC_RUN_ID``, ``$SLURM_JOB_ID`` …),
                else one of this process alone.

        Raises:
            ConfigError: naming the bad key.
            TierBusyError: another job holds the lease of a file tier's directory (naming it).
        """
        cfg = config if isinstance(config, HierarchyConfig) else parse_config(config, base_dir)
        if readonly:
            cfg = replace(cfg, tiers=tuple(replace(t, readonly=True) for t in cfg.tiers))
        else:
            resolve_job(job)  # a bad identity (or $TIERCKPT_JOB) is refused before any directory is made
            cfg = replace(cfg, tiers=tuple(replace(t, job=job or t.job) for t in cfg.tiers))
        engines = Engines()
        tiers: list[Tier] = []
        try:
            for t in cfg.tiers:
                klass = get_tier_class(t.kind, f"{t.key}.kind")
                tier = klass.from_config(t, engines)
                tier.on_full = t.on_full
                tiers.append(tier)
            return cls(
                tiers, policy=cfg.policy, io=cfg.io, layout=cfg.layout, readonly=readonly, job=job, _engines=engines
            )
        except BaseException:
            for t in tiers:
                t.close()
            engines.close()
            raise

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, readonly: bool = False, job: str | None = None) -> Hierarchy:
        """Build from a YAML file; relative tier paths are relative to the file (``readonly``, ``job``: as
        for :meth:`from_config`)."""
        return cls.from_config(load_config(path), readonly=readonly, job=job)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return self._tiers

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; KeyError if there is none."""
        if name not in self._index:
            raise KeyError(f"no tier named {name!r} (tiers: {', '.join(t.name for t in self._tiers)})")
        return self._tiers[self._index[name]]

    def _staging(self, tier: Tier) -> StagingPool:
        # a file tier's own chunk (the hierarchy's io block with that tier's overrides); memory tiers
        # take no io settings, so theirs is the hierarchy's
        chunk = tier.chunk_bytes if tier.capabilities.device == "file" else self.io.chunk_bytes
        return StagingPool(_STAGING_SLOTS, round_up(chunk, self.align), self.align)

    # -- save ---------------------------------------------------------------------------------------------
    def _check_order(self, step: int) -> None:
        """Warn once when a save's step is older than one already committed: ``restore()`` without a
        step still picks the newer one (a job that went back to an older step should remove the steps
        it abandoned, or restore by step)."""
        newest = self._newest_step()
        if step < newest and not self._warned_order:
            self._warned_order = True
            log.warning(
                "saving step %d, older than step %d already saved: restore() without a step picks step %d; "
                "keep: windows count steps by number (this save is kept until a later save replaces it)",
                step, newest, newest,
            )  # fmt: skip
        self._newest = max(newest, step)

    def _newest_step(self) -> int:
        """The newest step committed anywhere or saved by this hierarchy (-1: none); the tiers are listed
        once, at the first save, and the saves keep it up to date after that."""
        if self._newest is None:
            self._newest = max((c.step for c in self.checkpoints() if c.tiers), default=-1)
        return self._newest

    def _holds(self, tier: Tier, key: CheckpointKey) -> bool:
        try:
            return tier.holds(key)
        except Exception as e:  # an unreachable tier holds nothing this save can replace
            log.warning("tier %r: cannot tell whether it holds step %d: %s", tier.name, key.step, e)
            return False

    def _destinations(self) -> list[str]:
        """The top tier, and each lower tier whose demotion rule is due for this save."""
        now = _clock()
        out = [self._tiers[0].name]
        for t in self._tiers[1:]:
            c = self._cadence[t.name]
            c[0] += 1
            if self.demotion.get(t.name, Demotion()).rule.due(Cadence(c[0], now - c[1])):
                out.append(t.name)
                c[0], c[1] = 0, now
        return out

    @gc_paused()
    def save(self, state: Any, *, step: int, allow_pickle: bool = False, blocking: bool = False) -> SaveHandle:
        """Save ``state`` as ``step``; returns as soon as the copy into the top tier is scheduled.

        The state is checked and flattened before this returns: a value that is not a tensor or a plain
        value raises :class:`StateError` naming its key path (unless ``allow_pickle``), and nothing is
        written. The copy itself runs in the background; **do not modify the state's tensors in place
        before** ``handle.staged`` **resolves** (e.g. wait on it right before ``optimizer.step()``). A tensor
        replaced by one of another size meanwhile (``t.data = ...``) fails this save with
        :class:`StateError` naming its key, rather than have its bytes read past their end.

        Tensors are read as the bytes in their storage, so only tensors whose value is those bytes are
        saved: plain tensors, ``nn.Parameter`` and Python subclasses without a ``__torch_dispatch__``
        (saved as plain tensors, their ``__torch_function__`` not called). A ``DTensor`` (save
        ``t.full_tensor()`` or ``t.to_local()``; sharded states are not supported yet), any other
        subclass with its own ``__torch_dispatch__`` (FakeTensor, FunctionalTensor, wrapper subclasses),
        torch.func's wrappers, and a tensor whose storage was freed or shrunk under it raise
        :class:`StateError` naming the key, as do conjugate or negative views whose value torch cannot
        compute for their dtype.
        Copies to the lower tiers follow in the background, in order, as the demotion policy says.

        A failure on one tier does not stop the others; it is raised by ``handle.wait()`` (and by
        ``wait()``/``close()`` if the handle was never waited on).

        Args:
            state: nested dict/list/tuple of tensors and plain values.
            step: non-negative integer identifying the checkpoint.
            allow_pickle: pickle values that are neither tensors nor plain values.
            blocking: return only when every tier this save goes to has committed it or failed.
        """
        self._check_writable("save")
        check_step(step)
        flat = flatten(state, allow_pickle=allow_pickle)
        blob_target = self.layout.blob_bytes or max(t.preferred_blob_bytes for t in self._tiers)
        layout = plan(flat.nbytes, align=self.align, blob_bytes=round_up(blob_target, self.align))
        blobs = tuple(BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(layout.blob_sizes))
        key = CheckpointKey(step, self.rank)
        with self._lock:
            dests = self._destinations()
            # A step saved again replaces its older copies on every tier that holds one, due or not: a
            # tier left with the old bytes would restore them later, as if they were this save's. Only
            # a step no newer than one seen before can be held anywhere: a new step asks no tier (a
            # save must not wait for a slow shared tier).
            if step <= self._newest_step():
                older = [t.name for t in self._tiers[1:] if t.name not in dests and self._holds(t, key)]
                if older:
                    log.info("step %d is saved again: its older copies on %s are replaced too", step, older)
                    dests = [t.name for t in self._tiers if t.name in dests or t.name in older]
            self._check_order(step)
            handle = SaveHandle(step, dests)
            self._handles = [h for h in self._handles if not h.done() or set(h.errors()) - h._observed]
            self._handles.append(handle)
            self._tracker.plan(step, dests)
            self._tracker.saved(step, dests)

            def stage_into(name: str) -> Callable[[], None]:
                return make_stage_job(
                    self._mover, self.tier(name), handle, flat, layout, blobs, key,
                    first=name == dests[0], last=name == dests[-1], world_size=self.world_size, align=self.align,
                )  # fmt: skip

            self._mover.run_commit(dests[0], step, stage_into(dests[0]), handle.durable[dests[0]])
            for i, name in enumerate(dests[1:], 1):
                sources = [(dests[j], handle.durable[dests[j]]) for j in range(i - 1, -1, -1)]
                self._mover.transfer(key, name, sources, handle.durable[name], blobs, fallback=stage_into(name))
        if blocking:
            handle._settle()
        return handle

    # -- promotion ------------------------------------------------------------------------------------------
    def prefetch(self, step: int | None = None, to: str | None = None) -> Future[str]:
        """Copy a checkpoint up the chain (e.g. pfs → host, then host → local) in the background.

        Call it early (while the model is being built) so that ``restore()`` later reads from memory.
        The copy goes straight from the fastest tier holding the step to ``to`` (one read of the slow
        tier); every tier in between then receives a copy from ``to``'s (or, if that failed, from the
        source).

        Args:
            step: the step (default: the newest committed one).
            to: the tier to bring it to (default: the top tier).

        Returns:
            A future resolving to the name of ``to`` once it has committed the copy (at once if the step
            is already there or higher). It holds :class:`CheckpointNotFoundError` when there is no such
            step, or the copy's error.
        """
        self._check_writable("prefetch")
        if to is not None:
            self.tier(to)
        to_i = self._index[to] if to is not None else 0
        out: Future[str] = Future()
        try:
            info = self._locate(step)
        except CheckpointNotFoundError as e:
            out.set_exception(e)
            return out
        src_i = min(self._index[n] for n in info.tiers)
        if src_i <= to_i:
            out.set_result(self._tiers[to_i].name)
            return out
        key = CheckpointKey(info.step, self.rank)
        src, to_name = self._tiers[src_i].name, self._tiers[to_i].name
        with self._lock:
            # ``to`` first, straight from the source: a restart waits for one read of the slow tier, not
            # for a write and a read per tier in between. Those tiers are filled from ``to``'s copy after
            # it (a memory tier's copy costs them no read of the source), or from the source if it failed.
            top: Future[None] = Future()
            self._mover.transfer(key, to_name, [(src, resolved())], top, promoted=True)
            for i in range(to_i + 1, src_i):
                between: Future[None] = Future()
                self._mover.transfer(
                    key, self._tiers[i].name, [(to_name, top), (src, resolved())], between, promoted=True
                )
                self._fills.append(between)
            top.add_done_callback(
                lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(to_name)  # type: ignore[arg-type]
            )
            self._promotions[info.step] = out
        return out

    # -- read side ---------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """This rank's steps, oldest first: where each is committed, and its state on every tier
        (``pending``, ``writing``, ``committed``, ``failed``, ``evicting`` or ``absent``)."""
        return merge_states(self._tiers, self._tracker, self.rank)

    def _listing(self, tier: str | None = None) -> list[CheckpointInfo]:
        """Committed steps, oldest first (only those on ``tier``, as held there, if given)."""
        infos = [i for i in self.checkpoints() if i.tiers]
        if tier is not None:
            infos = [CheckpointInfo(i.step, (tier,)) for i in infos if tier in i.tiers]
        return infos

    def _locate(self, step: int | None, tier: str | None = None) -> CheckpointInfo:
        if step is not None:
            check_step(step)
        if tier is not None:
            self.tier(tier)
        infos = self._listing(tier)
        if not infos:
            where = f"rank {self.rank} on " + (f"tier {tier!r}" if tier else "any tier")
            raise CheckpointNotFoundError(f"no committed checkpoint for rank {self.rank} on {where}")
        if step is None:
            return infos[-1]
        for i in infos:
            if i.step == step:
                return i
        raise CheckpointNotFoundError(f"step {step} is not committed (committed steps: {[i.step for i in infos]})")

    def _settle_top(self) -> None:
        """Wait until every save of this hierarchy has committed (or failed) on the top tier."""
        with self._lock:
            handles = list(self._handles)
        top = self._tiers[0].name
        for h in handles:
            h._settle_one(top)

    @gc_paused()
    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        allow_pickle: bool = False,
        tier: str | None = None,
        strict: bool = True,
    ) -> Any:
        """Read a checkpoint back, verifying every checksum.

        Saves of this hierarchy still being staged are waited for first, and so is a ``prefetch`` of the
        step still climbing. The fastest tier holding ``step`` (default: the newest committed step) is
        read; if its copy is damaged, a warning is logged and the next tier's copy is used. With
        ``policy.promote.on_restore``, a copy read from a lower tier is then promoted in the background.

        With no ``step``, a step whose copies are damaged on every tier is skipped with a warning naming
        each tier's problem, and the newest older step that restores is returned (``last_restore``
        says which). Another process may save and evict on the same tiers meanwhile (an evaluation job
        following a training run): a copy is read as the snapshot it was when opened, and one that is
        evicted or replaced before it is fully opened makes the restore look again (docs/restore.md,
        "What a reader sees"); it is never reported as damaged.

        Args:
            step: the step, or None for the newest that restores.
            into: a state whose tensors receive the bytes in place (returned); None for fresh CPU tensors.
                The bytes stream through a few reused staging buffers straight into its tensors
                (docs/restore.md); its structure, shapes and dtypes are checked first.
            allow_pickle: accept checkpoints that hold pickled values.
            tier: read only from this tier.
            strict: with ``into``, every dict of ``into`` must have exactly the keys the checkpoint's
                dict has at the same path; all mismatches are listed in one ``StateError`` before
                anything changes. Strict by default because a silently ignored key is how resumes go
                wrong (a renamed layer left at its initial values, a fresh optimizer's empty ``state``
                left empty). ``strict=False`` leaves keys only the target has as they are and adds
                keys only the checkpoint has to the target's dicts (logged as a warning). Shapes and
                dtypes must match either way. To restore model, optimizer, scheduler, RNG and data
                position together, use :class:`tierckpt.TrainState` (docs/resume.md).

        Raises:
            CheckpointNotFoundError: no such step; :class:`CheckpointEvictedError` where ``step`` was
                evicted by another process while it was being opened.
            CorruptCheckpointError: every copy failed validation; with several copies (or older steps
                to suggest) one error names every tier's failure and the older committed steps.
            StateError: ``into`` does not match the checkpoint, or it holds pickled values.
        """
        self._check_open()
        self._settle_top()
        if step is not None:
            check_step(step)
        if tier is not None:
            self.tier(tier)
        if tier is None and any(not f.done() for f in self._promotions.values()):
            info = self._locate(step)
            climbing = self._promotions.get(info.step)
            if climbing is not None and not climbing.done():
                log.info("restore: waiting for the prefetch of step %d", info.step)
                climbing.exception()

        def read(s: int, name: str) -> Any:
            key = CheckpointKey(s, self.rank)
            if into is None:
                return read_checkpoint(self.tier(name), key, allow_pickle=allow_pickle)[0]
            return self._in_place.restore(self.tier(name), key, into, allow_pickle=allow_pickle, strict=strict)

        where = f"rank {self.rank} on " + (f"tier {tier!r}" if tier else "any tier")
        state, got, name = choose_and_read(lambda: self._listing(tier), read, step, where)
        self.last_restore = (got, name)
        if tier is None and self.policy.promote_on_restore and self._index[name] > 0 and not self.readonly:
            self.prefetch(got)
        return state

    def inspect(self, step: int | None = None) -> tuple[str, Manifest]:
        """The manifest of ``step`` (default: newest) from the fastest tier holding it, and that tier's name."""
        info = self._locate(step)
        return info.tiers[0], load_manifest(self.tier(info.tiers[0]), CheckpointKey(info.step, self.rank))

    def verify(self, step: int | None = None) -> list[tuple[int, str, BaseException | None]]:
        """Re-read every copy of ``step`` (default: every step) on every tier; (step, tier, error or None).

        A copy that another process evicts while it is being verified is left out (it is gone, not
        damaged); one replaced by a new save of its step is verified again."""
        infos = [self._locate(step)] if step is not None else self._listing()
        out: list[tuple[int, str, BaseException | None]] = []
        for info in infos:
            for name in info.tiers:
                key = CheckpointKey(info.step, self.rank)
                for _ in range(3):  # a copy replaced (saved again) while being opened is verified again
                    try:
                        verify_checkpoint(self.tier(name), key)
                        out.append((info.step, name, None))
                    except CheckpointNotFoundError:  # evicted by another process: gone, not damaged
                        if self._holds(self.tier(name), key):
                            continue
                        log.info("step %d on tier %r was evicted while being verified: not listed", info.step, name)
                    except (CorruptCheckpointError, OSError) as e:
                        out.append((info.step, name, e))
                    break
                else:
                    log.info(
                        "step %d on tier %r was replaced 3 times while being verified: not listed", info.step, name
                    )
        return out

    # -- lifecycle ---------------------------------------------------------------------------------------
