"""The user-facing API: a chain of tiers, fastest first, with ``save`` / ``restore``."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tierckpt._restore import copy_into, load_manifest, read_checkpoint, verify_checkpoint
from tierckpt._save import build_manifest, pack_and_write
from tierckpt.config import HierarchyConfig, IOConfig, LayoutConfig, PolicyConfig, load_config, parse_config
from tierckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    StateError,
    TierFullError,
)
from tierckpt.format.layout import plan, round_up
from tierckpt.format.manifest import BlobEntry, Manifest
from tierckpt.format.tree import flatten
from tierckpt.io.buffers import StagingPool
from tierckpt.io.engine import IOEngine, make_engine
from tierckpt.policies.retention import KeepAll, KeepLatest, RetentionPolicy
from tierckpt.registry import get_tier_class
from tierckpt.tiers.base import CheckpointKey, EngineSource, Tier, TierWriter

__all__ = ["CheckpointInfo", "Hierarchy", "SaveHandle"]

log = logging.getLogger(__name__)
_STAGING_SLOTS = 3


@dataclass(frozen=True)
class CheckpointInfo:
    """One step as the hierarchy sees it: ``tiers`` names the tiers where it is committed, fastest first."""

    step: int
    tiers: tuple[str, ...]


class SaveHandle:
    """What ``Hierarchy.save`` returns.

    Attributes:
        step: the saved step.
        staged: resolves once every tensor byte has been copied out of the caller's state (safe to mutate).
        durable: per tier name, resolves once that tier has committed the checkpoint.
    """

    def __init__(self, step: int, tiers: Sequence[str]) -> None:
        self.step = step
        self.staged: Future[None] = Future()
        self.durable: dict[str, Future[None]] = {name: Future() for name in tiers}
        self._observed = False

    def done(self) -> bool:
        """True when every future has resolved (successfully or not)."""
        return self.staged.done() and all(f.done() for f in self.durable.values())

    def errors(self) -> dict[str, BaseException]:
        """Failures so far, by tier name (``"staged"`` for a failure before any tier got the bytes)."""
        out: dict[str, BaseException] = {}
        if self.staged.done() and self.staged.exception() is not None:
            out["staged"] = self.staged.exception()  # type: ignore[assignment]
        out.update({n: f.exception() for n, f in self.durable.items() if f.done() and f.exception() is not None})  # type: ignore[misc]
        return out

    def wait(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Block until ``tier`` (default: every tier) has committed; re-raise a failure with its cause.

        Raises:
            KeyError: ``tier`` is not a tier this checkpoint goes to.
            Exception: the first failure, e.g. ``TierIOError`` for ENOSPC on a slow tier.
        """
        self._observed = True
        self.staged.result(timeout)
        futs = [self.durable[tier]] if tier is not None else list(self.durable.values())
        for f in futs:
            f.result(timeout)


class _Engines(EngineSource):
    def __init__(self) -> None:
        self._engines: dict[tuple[str, int], IOEngine] = {}
        self._lock = threading.Lock()

    def get(self, engine: str, queue_depth: int) -> IOEngine:
        with self._lock:
            e = self._engines.get((engine, queue_depth))
            if e is None:
                e = self._engines[(engine, queue_depth)] = make_engine(engine, queue_depth)
            return e

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for e in engines:
            e.close()


_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_enabled": False}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (re-entrant, thread-safe; also a decorator). With 20,000 tensors it otherwise
    runs dozens of times per save or restore and doubles the Python-side cost; reference counting
    still frees everything meanwhile."""
    with _gc_lock:
        if _gc_state["depth"] == 0:
            _gc_state["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0 and _gc_state["was_enabled"]:
                gc.enable()


def _dist_rank() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover
        pass
    return 0, 1


class Hierarchy:
    """A chain of storage tiers, fastest first, and the policy that decides what each keeps.

    ``save`` packs the state once into a few large aligned blobs and commits them to every tier;
    ``restore`` reads the newest (or a given) step from the fastest tier holding a good copy.

    Args:
        tiers: tier objects, fastest first; names must be unique.
        policy: retention settings (``PolicyConfig`` or a mapping like ``{"keep": {"ssd": 2}}``).
        io: default I/O settings (staging chunk size).
        layout: aggregation settings.
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: number of ranks (default: torch.distributed's, else 1).

    Example:
        >>> with Hierarchy.from_yaml("tiers/local.yaml") as h:   # doctest: +SKIP
        ...     h.save({"model": model.state_dict()}, step=100).wait()
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
        _engines: _Engines | None = None,
    ) -> None:
        if not tiers:
            raise ConfigError("tiers: a hierarchy needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")
        if isinstance(policy, Mapping):
            policy = parse_config(
                {"tiers": [{"name": n, "kind": "host"} for n in names], "policy": dict(policy)}
            ).policy
        self.policy = policy or PolicyConfig()
        for name in self.policy.keep:
            if name not in names:
                raise ConfigError(f"policy.keep.{name}: no tier of that name (tiers: {', '.join(names)})")
        self._tiers = tuple(tiers)
        self.io = io or IOConfig()
        self.layout = layout or LayoutConfig()
        dr, dw = _dist_rank()
        self.rank = dr if rank is None else rank
        self.world_size = dw if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank: {self.rank} is not in [0, {self.world_size})")
        self._retention: dict[str, RetentionPolicy] = {
            t.name: KeepLatest(self.policy.keep[t.name]) if t.name in self.policy.keep else KeepAll() for t in tiers
        }
        self.align = max([self.layout.align_bytes] + [t.capabilities.alignment_bytes for t in tiers])
        self._engines = _engines or _Engines()
        self._pool: StagingPool | None = None
        self._handles: list[SaveHandle] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls, config: HierarchyConfig | Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None
    ) -> Hierarchy:
        """Build from a validated :class:`HierarchyConfig` or a mapping with the YAML schema.

        Raises:
            ConfigError: naming the bad key.
        """
        cfg = config if isinstance(config, HierarchyConfig) else parse_config(config, base_dir)
        engines = _Engines()
        tiers: list[Tier] = []
        try:
            for t in cfg.tiers:
                klass = get_tier_class(t.kind, f"{t.key}.kind")
                tiers.append(klass.from_config(t, engines))
            return cls(tiers, policy=cfg.policy, io=cfg.io, layout=cfg.layout, _engines=engines)
        except BaseException:
            for t in tiers:
                t.close()
            engines.close()
            raise

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Hierarchy:
        """Build from a YAML file; relative tier paths are relative to the file."""
        return cls.from_config(load_config(path))

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return self._tiers

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; KeyError if there is none."""
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r} (tiers: {', '.join(t.name for t in self._tiers)})")

    # -- save ---------------------------------------------------------------------------------------------
    def _staging(self) -> StagingPool:
        if self._pool is None:
            self._pool = StagingPool(_STAGING_SLOTS, round_up(self.io.chunk_bytes, self.align), self.align)
        return self._pool

    @_gc_paused()
    def save(self, state: Any, *, step: int, allow_pickle: bool = False) -> SaveHandle:
        """Save ``state`` as ``step`` to every tier; returns when every tier has committed or failed.

        The state is checked before a byte is written: a value that is not a tensor or a plain value
        raises :class:`StateError` naming its key path (unless ``allow_pickle``). A failure on one tier
        does not stop the others; it is raised by ``handle.wait()`` (and by ``wait()``/``close()`` if the
        handle was never waited on).

        Args:
            state: nested dict/list/tuple of tensors and plain values.
            step: non-negative integer identifying the checkpoint.
            allow_pickle: pickle values that are neither tensors nor plain values.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        flat = flatten(state, allow_pickle=allow_pickle)
        srcs = [r.tensor for r in flat.tensors]
        lengths = [t.numel() * t.element_size() for t in srcs]
        blob_target = self.layout.blob_bytes or max(t.preferred_blob_bytes for t in self._tiers)
        layout = plan(lengths, align=self.align, blob_bytes=round_up(blob_target, self.align))
        blobs = tuple(BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(layout.blob_sizes))
        key = CheckpointKey(step, self.rank)
        handle = SaveHandle(step, [t.name for t in self._tiers])
        with self._lock:
            self._handles.append(handle)
        failed: dict[str, BaseException] = {}
        writers: dict[str, TierWriter] = {}
        try:
            for t in self._tiers:
                try:
                    writers[t.name] = self._reserve(t, key, blobs)
                except Exception as e:
                    log.error("tier %r cannot take step %d: %s", t.name, step, e)
                    failed[t.name] = e
            checksums = pack_and_write(
                flat, layout, writers, failed, self._staging, round_up(self.io.chunk_bytes, self.align),
                on_staged=lambda: handle.staged.set_result(None),
            )  # fmt: skip
            manifest = build_manifest(
                flat, srcs, layout, blobs, checksums, step=step, rank=self.rank, world_size=self.world_size,
                align=self.align,
            )  # fmt: skip
        except BaseException as e:
            for w in writers.values():
                w.abort()
            if not handle.staged.done():
                handle.staged.set_exception(e)
            for f in handle.durable.values():
                if not f.done():
                    f.set_exception(e)
            raise
        for t in self._tiers:
            w = writers.get(t.name)
            if t.name not in failed and w is not None:
                try:
                    w.commit(manifest)
                except Exception as e:
                    log.error("tier %r cannot commit step %d: %s", t.name, step, e)
                    failed[t.name] = e
            elif w is not None:
                w.abort()
            if t.name in failed:
                handle.durable[t.name].set_exception(failed[t.name])
            else:
                handle.durable[t.name].set_result(None)
        self._apply_retention()
        return handle

    def _reserve(self, tier: Tier, key: CheckpointKey, blobs: tuple[BlobEntry, ...]) -> TierWriter:
        """Reserve room on ``tier``; when it is full, evict its oldest copies that another tier also holds."""
        while True:
            try:
                return tier.reserve(key, blobs)
            except TierFullError:
                elsewhere = {k for t in self._tiers if t is not tier for k in t.list_committed()}
                victims = [k for k in tier.list_committed() if k in elsewhere and k != key]
                if not victims:
                    raise
                log.info("tier %r is full: evicting step %d (another tier holds it)", tier.name, victims[0].step)
                tier.evict(victims[0])

    def _apply_retention(self) -> None:
        for t in self._tiers:
            mine = [k.step for k in t.list_committed() if k.rank == self.rank]
            for s in self._retention[t.name].to_evict(mine):
                log.debug("retention: evicting step %d from tier %r", s, t.name)
                try:
                    t.evict(CheckpointKey(s, self.rank))
                except OSError as e:
                    log.warning("retention: cannot evict step %d from tier %r: %s", s, t.name, e)

    # -- read side ---------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed steps of this rank, oldest first, with the tiers holding each (fastest first)."""
        where: dict[int, list[str]] = {}
        for t in self._tiers:
            for k in t.list_committed():
                if k.rank == self.rank:
                    where.setdefault(k.step, []).append(t.name)
        return [CheckpointInfo(s, tuple(where[s])) for s in sorted(where)]

    def _locate(self, step: int | None, tier: str | None = None) -> CheckpointInfo:
        infos = self.checkpoints()
        if tier is not None:
            self.tier(tier)
            infos = [CheckpointInfo(i.step, (tier,)) for i in infos if tier in i.tiers]
        if not infos:
            where = f"tier {tier!r}" if tier else "any tier"
            raise CheckpointNotFoundError(f"no committed checkpoint for rank {self.rank} on {where}")
        if step is None:
            return infos[-1]
        for i in infos:
            if i.step == step:
                return i
        raise CheckpointNotFoundError(f"step {step} is not committed (committed steps: {[i.step for i in infos]})")

    @_gc_paused()
    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        allow_pickle: bool = False,
        tier: str | None = None,
    ) -> Any:
        """Read a checkpoint back, verifying every checksum.

        The fastest tier holding ``step`` (default: the newest committed step) is read; if its copy is
        damaged, a warning is logged and the next tier's copy is used.

        Args:
            step: the step, or None for the newest.
            into: a state whose tensors receive the bytes in place (returned); None for fresh CPU tensors.
            allow_pickle: accept checkpoints that hold pickled values.
            tier: read only from this tier.

        Raises:
            CheckpointNotFoundError: no such step.
            CorruptCheckpointError: every copy failed validation (names tier, blob and key).
            StateError: ``into`` does not match the checkpoint, or it holds pickled values.
        """
        self._check_open()
        info = self._locate(step, tier)
        first: BaseException | None = None
        for name in info.tiers:
            try:
                state, _ = read_checkpoint(
                    self.tier(name), CheckpointKey(info.step, self.rank), allow_pickle=allow_pickle
                )
            except StateError:
                raise
            except (CorruptCheckpointError, OSError) as e:
                log.warning("step %d on tier %r is unusable (%s); trying the next tier", info.step, name, e)
                first = first or e
                continue
            if first is not None:
                log.warning("restored step %d from tier %r instead", info.step, name)
            return state if into is None else copy_into(into, state)
        assert first is not None
        raise first

    def inspect(self, step: int | None = None) -> tuple[str, Manifest]:
        """The manifest of ``step`` (default: newest) from the fastest tier holding it, and that tier's name."""
        info = self._locate(step)
        return info.tiers[0], load_manifest(self.tier(info.tiers[0]), CheckpointKey(info.step, self.rank))

    def verify(self, step: int | None = None) -> list[tuple[int, str, BaseException | None]]:
        """Re-read every copy of ``step`` (default: every step) on every tier; (step, tier, error or None)."""
        infos = [self._locate(step)] if step is not None else self.checkpoints()
        out: list[tuple[int, str, BaseException | None]] = []
        for info in infos:
            for name in info.tiers:
                try:
                    verify_checkpoint(self.tier(name), CheckpointKey(info.step, self.rank))
                    out.append((info.step, name, None))
                except (CorruptCheckpointError, OSError) as e:
                    out.append((info.step, name, e))
        return out

    # -- lifecycle ---------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every save; raise the first failure of a save whose handle nobody waited on."""
        with self._lock:
            handles, self._handles = self._handles, []
        first: BaseException | None = None
        for h in handles:
            try:
                if h._observed:
                    continue
                h.wait()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the hierarchy is closed")

    def close(self) -> None:
        """Wait for pending work, release tiers and engines; raise unobserved save failures."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for t in self._tiers:
                t.close()
            self._engines.close()
            self._pool = None

    def __enter__(self) -> Hierarchy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
