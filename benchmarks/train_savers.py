"""The checkpointing modes of ``bench_train.py``: one small class per way of saving, all with the same hooks.

Every training step that saves calls ``begin(step, state)`` before forward/backward and
``before_update()`` right before ``optimizer.step()``; the time spent in those two calls is the step's
*blocking time*. ``drain()`` runs once after the last step (timed separately), ``load(step, like)``
reads a checkpoint back for the bit-exact check (outside every timing), ``close()`` releases it all.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy

__all__ = ["MODES", "PEERS", "Saver", "make_saver"]

#: every mode, in the order they are listed by default; ``none`` trains without checkpointing.
MODES = (
    "none",
    "tierckpt-lazy",
    "tierckpt-sync",
    "dcp-async",
    "dcp-async-staged",
    "dcp-async-lazy",
    "dcp-sync",
    "torch-save",
)
#: modes that are references from other libraries: they are skipped (with a note) if they fail.
PEERS = frozenset(m for m in MODES if m.startswith(("dcp", "torch")))

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


class Saver:
    """No checkpointing (mode ``none``); the base of the others."""

    #: tiers (or ``""`` for the only copy) whose copy ``load`` can check
    check_tiers: tuple[str, ...] = ()
    #: part of the last ``begin`` spent waiting for the previous save (modes that must wait for it)
    prev_wait_secs: float | None = None

    def backlog(self) -> int | None:
        """Earlier saves not yet durable (None where the mode has no background work)."""
        return None

    def begin(self, step: int, state: dict[str, Any]) -> None:
        """Start saving ``state`` as ``step`` (called before forward/backward)."""

    def before_update(self) -> None:
        """Return once the state may be mutated (called right before ``optimizer.step()``)."""

    def drain(self) -> None:
        """Wait until every save is durable."""

    def load(self, step: int, like: Any, tier: str) -> Any:
        """The saved state of ``step`` (``like`` is a state of the same structure, to load into)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release everything."""


class _TierckptBase(Saver):
    """What both tierckpt modes share: a hierarchy ``self.h``, drained, read back and closed the same way."""

    h: Hierarchy

    def drain(self) -> None:
        self.h.wait()

    def load(self, step: int, like: Any, tier: str) -> Any:
        return self.h.restore(step, tier=tier)

    def close(self) -> None:
        self.h.close()


class TierckptLazy(_TierckptBase):
    """host → local, keep {host: 1, local: 2}: ``save()`` returns at once, ``staged`` waited before the update."""

    check_tiers = ("host", "local")

    def __init__(self, scratch: Path, ckpt_bytes: int) -> None:
        self.h = Hierarchy.from_config(
            {
                "tiers": [
                    {"name": "host", "kind": "host", "capacity": 3 * ckpt_bytes},
                    {"name": "local", "kind": "local", "path": str(scratch / "local")},
                ],
                "policy": {"keep": {"host": 1, "local": 2}},
            }
        )
        self.handle: Any = None
        self.pending: list[Any] = []

    def backlog(self) -> int:
        self.pending = [h for h in self.pending if not h.done()]
        return len(self.pending)

    def begin(self, step: int, state: dict[str, Any]) -> None:
        self.handle = self.h.save(state, step=step)
        self.pending.append(self.handle)

    def before_update(self) -> None:
        self.handle.staged.result()
        self.handle = None


class TierckptSync(_TierckptBase):
    """Only a local tier, keep 2, ``save(blocking=True)``: the synchronous save to the local tier."""

    check_tiers = ("local",)

    def __init__(self, scratch: Path) -> None:
        self.h = Hierarchy.from_config(
            {
                "tiers": [{"name": "local", "kind": "local", "path": str(scratch / "local")}],
                "policy": {"keep": {"local": 2}},
            }
        )

    def begin(self, step: int, state: dict[str, Any]) -> None:
        self.h.save(state, step=step, blocking=True).wait()


class _DcpBase(Saver):
    """A directory per checkpoint under ``scratch``; older ones are deleted once two newer ones are durable
    (like tierckpt's ``keep: 2``), by whichever thread finished the save (DCP's upload thread for async)."""

    check_tiers = ("",)

    def __init__(self, scratch: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.scratch = scratch
        self._durable: deque[Path] = deque()
        self._lock = threading.Lock()

    def _dir(self, step: int) -> Path:
        return self.scratch / f"step-{step:06d}"

    def _durable_now(self, d: Path) -> None:
        with self._lock:
            self._durable.append(d)
            old = [self._durable.popleft() for _ in range(len(self._durable) - 2)]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)

    def load(self, step: int, like: Any, tier: str) -> Any:
        self.dcp.load(like, checkpoint_id=str(self._dir(step)), no_dist=True)
        return like


class DcpSync(_DcpBase):
    """``dcp.save`` with a ``FileSystemWriter`` (fsyncs its files), no process group."""

    def begin(self, step: int, state: dict[str, Any]) -> None:
        self.dcp.save(state, storage_writer=self.dcp.FileSystemWriter(str(self._dir(step))), no_dist=True)
        self._durable_now(self._dir(step))


class DcpAsync(_DcpBase):
    """``dcp.async_save`` (thread executor, no process group); the previous save is waited for first.

    stager ``default``: the ``FileSystemWriter`` stages (a fresh CPU copy every save, DCP's default);
    ``staged``: one ``DefaultStager`` reused across saves (cached staging storages, copy in the call);
    ``lazy``: the same with ``use_async_staging``, its ``staging_completion`` waited before the update.
    """

    def __init__(self, scratch: Path, stager: str) -> None:
        super().__init__(scratch)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager: Any = None
        if stager != "default":
            # pinned/shared memory and non-blocking copies need an accelerator; this is a CPU run
            opts = StagingOptions(False, False, stager == "lazy", False)
            self.stager = DefaultStager(opts)
        self.upload: Future[Any] | None = None
        self.staging: Future[Any] | None = None

    def backlog(self) -> int:
        return int(self.upload is not None and not self.upload.done())

    def begin(self, step: int, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        if self.upload is not None:
            self.upload.result()  # DCP allows one async save in flight
        self.prev_wait_secs = time.perf_counter() - t0
        d = self._dir(step)
        writer = self.dcp.FileSystemWriter(str(d))
        out = self.dcp.async_save(state, storage_writer=writer, async_stager=self.stager, no_dist=True)
        if isinstance(out, Future):
            self.upload = out
        else:  # AsyncSaveResponse
            self.upload, self.staging = out.upload_completion, out.staging_completion
        self.upload.add_done_callback(lambda f: None if f.exception() else self._durable_now(d))

    def before_update(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()


class TorchSave(Saver):
    """``torch.save`` to an open file, flush, fsync; two files used in turn."""

    check_tiers = ("",)

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch

    def _path(self, step: int) -> Path:
        return self.scratch / f"slot{step % 2}.pt"

    def begin(self, step: int, state: dict[str, Any]) -> None:
        with open(self._path(step), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, step: int, like: Any, tier: str) -> Any:
        return torch.load(self._path(step), weights_only=True)


def make_saver(mode: str, scratch: Path, ckpt_bytes: int) -> Saver:
    """The saver for ``mode``, writing under ``scratch`` (created); ``ckpt_bytes`` sizes the host tier."""
    scratch.mkdir(parents=True, exist_ok=True)
    if mode == "none":
        return Saver()
    if mode == "tierckpt-lazy":
        return TierckptLazy(scratch, ckpt_bytes)
    if mode == "tierckpt-sync":
        return TierckptSync(scratch)
    if mode == "dcp-sync":
        return DcpSync(scratch)
    if mode.startswith("dcp-async"):
        return DcpAsync(scratch, {"dcp-async": "default", "dcp-async-staged": "staged", "dcp-async-lazy": "lazy"}[mode])
    if mode == "torch-save":
        return TorchSave(scratch)
    raise ValueError(f"unknown mode {mode!r} (modes: {', '.join(MODES)})")
