"""The implementations compared on each workload: tierckpt itself, its peers, and the raw limits.

A :class:`Peer` saves a state as checkpoint ``rep`` into its own folder and restores it. ``save`` returns
a :class:`Pending` whose ``staged`` and ``durable`` the harness waits for in turn, so one call gives the
API-return time, the time until the state may be mutated and the time until it is durable. Peers whose
packages are missing raise ``ImportError`` from :meth:`Peer.check` and are skipped with a note.

tierckpt's own rows are here; the peers from other packages (DCP, TorchSnapshot, safetensors) are in
:mod:`tierckpt.bench.peers_ext`.
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tierckpt.bench.rawio import (
    fio_available,
    raw_read_engine,
    raw_read_pread,
    raw_write_engine,
    raw_write_pwrite,
    run_fio,
)
from tierckpt.bench.workloads import Workload, same_state, zeros_like_state
from tierckpt.hierarchy import Hierarchy
from tierckpt.io.buffers import aligned_empty
from tierckpt.io.engine import IOEngine
from tierckpt.tiers.base import CheckpointKey

__all__ = [
    "ALIGN", "Fio", "Memcpy", "Peer", "Pending", "RawBuffers", "RawIO", "Tierckpt", "TierckptInto", "TierckptLazy",
]  # fmt: skip

ALIGN = 4096


def _noop() -> None:
    return None


@dataclass
class Pending:
    """A save in flight.

    Attributes:
        staged: blocks until the caller may mutate the state it passed.
        durable: blocks until the checkpoint is durable (fsynced / committed); re-raises a failure.
        reported_secs: the operation's own measurement of its duration (fio), used instead of the
            harness's wall clock. A restore may return a ``Pending`` for this alone.
    """

    staged: Callable[[], Any] = _noop
    durable: Callable[[], Any] = _noop
    reported_secs: float | None = None


def fsync_tree(root: Path) -> None:
    """fsync every file and directory at or below ``root`` (for peers that do not fsync themselves)."""
    dirs = [root] if root.is_dir() else [root.parent]
    files = [root] if root.is_file() else []
    if root.is_dir():
        for d, dnames, fnames in os.walk(root):
            dirs += [Path(d) / n for n in dnames]
            files += [Path(d) / n for n in fnames]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for p in dirs:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Peer:
    """One implementation on one workload at a time.

    Lifecycle, driven by the harness: ``check()`` once (ImportError: skipped), then per workload
    ``open(scratch, workload)``, optionally ``warmup(state)``, then per repeat ``save`` → ``files`` →
    ``prepare_restore`` (untimed) → ``restore`` (timed) for each cache state in ``caches`` →
    ``discard``; finally ``close()``.

    Attributes:
        name: row label.
        requires: modules imported by ``check``.
        saves: whether a save is measured.
        caches: the restore measurements: ``cold``, ``warm`` (page cache), ``memory`` (no file read).
        how: one line on what is called (for the report).
        durability: how the save is made durable (for the report).
        note: anything the reader must know to interpret the row.
    """

    name: str = "?"
    requires: ClassVar[tuple[str, ...]] = ()
    saves: bool = True
    caches: tuple[str, ...] = ("cold", "warm")
    durability: str = ""
    note: str = ""
    how: str = ""

    def check(self) -> None:
        """Import what the peer needs; raises ImportError (or RuntimeError) when it cannot run here."""
        for m in self.requires:
            importlib.import_module(m)

    def open(self, scratch: Path, wl: Workload) -> None:
        """Set up for ``wl``; checkpoints go below ``scratch``."""
        self.dir = scratch / self.name.replace(":", "-").replace(".", "-")
        self.dir.mkdir(parents=True, exist_ok=True)

    def warmup(self, state: Any) -> None:
        """An untimed save before the first timed one (peers with buffers reused across saves)."""

    def save(self, state: Any, rep: int) -> Pending:
        """Start saving ``state`` as checkpoint ``rep``."""
        raise NotImplementedError

    def files(self, rep: int) -> list[Path]:
        """The files (or folders) that hold checkpoint ``rep``."""
        return [self.dir / str(rep)]

    def prepare_restore(self, rep: int, like: Any) -> Any:
        """Untimed set-up of a restore (e.g. the template a peer loads into); passed to ``restore``."""
        return None

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        """Read checkpoint ``rep`` back; returns the state (or None where there is nothing to return)."""
        raise NotImplementedError

    def same(self, state: Any, restored: Any) -> bool:
        """Whether ``restored`` holds what was saved."""
        return same_state(state, restored)

    def discard(self, rep: int) -> None:
        """Delete checkpoint ``rep``."""
        for p in self.files(rep):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        """Release what ``open`` set up."""


# -- tierckpt ----------------------------------------------------------------------------------------------
class Tierckpt(Peer):
    """``Hierarchy.save(blocking=True)`` to a hierarchy with one ``local`` tier; restore from it."""

    name = "tierckpt"
    how = "`Hierarchy.save(state, step=N, blocking=True)` to a hierarchy with one `local` tier; `restore(step=N, tier='local')`"
    durability = "blobs and manifest fsynced, directory renamed and fsynced before save returns"

    def __init__(self, io: dict[str, Any] | None = None) -> None:
        self.io = dict(io or {})
        self.h: Hierarchy | None = None

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"tiers": [{"name": "local", "kind": "local", "path": str(self.dir)}]}
        if self.io:
            cfg["io"] = self.io
        return cfg

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        self.h = Hierarchy.from_config(self.config())

    def save(self, state: Any, rep: int) -> Pending:
        assert self.h is not None
        handle = self.h.save(state, step=rep, blocking=True)
        return Pending(durable=handle.wait)

    def files(self, rep: int) -> list[Path]:
        return [self.dir / f"step-{rep:012d}"]

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        assert self.h is not None
        return self.h.restore(step=rep, tier="local")

    def discard(self, rep: int) -> None:
        assert self.h is not None
        for t in self.h.tiers:
            if t.holds(CheckpointKey(rep, self.h.rank)):
                t.evict(CheckpointKey(rep, self.h.rank))

    def close(self) -> None:
        if self.h is not None:
            self.h.close()
            self.h = None


class TierckptLazy(Tierckpt):
    """Lazy save to host → local: ``save`` returns at once, ``handle.staged`` resolves when the bytes
    are in the host tier, ``handle.durable['local']`` when the local tier has committed them. Restore:
    from the host tier (memory), to compare with memcpy."""

    name = "tierckpt-lazy"
    how = (
        "`save(state, step=N)` to host → local: returns at once; safe to mutate = `handle.staged`; durable = "
        "`handle.wait()` (local committed); restore from the host tier"
    )
    caches = ("memory",)
    durability = "durable = the local tier's commit (fsync + rename), in the background"

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["tiers"] = [{"name": "host", "kind": "host"}, *cfg["tiers"]]
        return cfg

    def save(self, state: Any, rep: int) -> Pending:
        assert self.h is not None
        handle = self.h.save(state, step=rep)
        return Pending(staged=handle.staged.result, durable=handle.wait)

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        assert self.h is not None
        return self.h.restore(step=rep, tier="host")


class TierckptInto(Tierckpt):
    """Like :class:`Tierckpt`, restoring with ``restore(into=target)`` into a live state (the training
    restart path; compare with DCP's and TorchSnapshot's in-place loads)."""

    name = "tierckpt:into"
    how = (
        "`Hierarchy.save(state, step=N, blocking=True)` to one `local` tier; `restore(step=N, into=target)` "
        "into tensors allocated and written before the timer"
    )

    def prepare_restore(self, rep: int, like: Any) -> Any:
        return zeros_like_state(like)

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        assert self.h is not None
        return self.h.restore(step=rep, tier="local", into=arg)


# -- torch.save --------------------------------------------------------------------------------------------
class TorchSave(Peer):
    """``torch.save`` to an open file, flush, fsync; ``torch.load(weights_only=True)``."""

    name = "torch.save"
    how = "`torch.save` into an open file, flush, `os.fsync`; `torch.load(weights_only=True)`"
    durability = "file fsynced (flush + os.fsync)"

    def files(self, rep: int) -> list[Path]:
        return [self.dir / f"{rep}.pt"]

    def save(self, state: Any, rep: int) -> Pending:
        with open(self.files(rep)[0], "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return Pending()

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        return torch.load(self.files(rep)[0], weights_only=True)


# -- raw limits --------------------------------------------------------------------------------------------
class RawBuffers:
    """One random source buffer and one pre-faulted destination buffer of a workload's size, shared
    by the raw peers (so they cost the memory once)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.wbuf: torch.Tensor | None = None
        self.rbuf: torch.Tensor | None = None

    def get(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(source, destination, aligned size) for ``nbytes``, allocated on first use."""
        n = -(-nbytes // ALIGN) * ALIGN
        if self.wbuf is None or self.nbytes != n:
            self.release()
            self.wbuf = aligned_empty(n, ALIGN, pin=False)
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1), out=self.wbuf)
            self.rbuf = aligned_empty(n, ALIGN, pin=False)
            self.rbuf.fill_(0)  # fault the pages in once: the raw read measures the disk, not the allocator
            self.nbytes = n
        assert self.rbuf is not None
        return self.wbuf, self.rbuf, n

    def release(self) -> None:
        """Free the buffers."""
        self.wbuf = self.rbuf = None
        self.nbytes = 0


class RawIO(Peer):
    """The disk's limit: one aligned buffer of the state's size written with O_DIRECT + posix_fallocate +
    fsync, and read back with O_DIRECT into memory faulted in beforehand.

    Args:
        bufs: the shared buffers.
        engine: None for ``os.pwrite``/``os.preadv`` one 64 MiB chunk at a time; else every chunk queued
            on this tierckpt I/O engine.
    """

    caches = ("cold",)
    durability = "O_DIRECT writes + fsync"
    note = "read back with O_DIRECT into memory faulted in before"

    def __init__(self, bufs: RawBuffers, engine: IOEngine | None = None) -> None:
        self.bufs, self.engine = bufs, engine
        self.name = f"raw:{engine.name if engine is not None else 'pwrite'}"
        self.how = (
            "one aligned buffer: O_DIRECT, posix_fallocate, 64 MiB `os.pwrite`/`os.preadv` one at a time, fsync"
            if engine is None
            else f"one aligned buffer: O_DIRECT, posix_fallocate, every 64 MiB chunk queued on tierckpt's {engine.name} engine, fsync"
        )

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        self.nbytes = wl.nbytes
        self.bufs.get(self.nbytes)  # allocate and fill before anything is timed

    def files(self, rep: int) -> list[Path]:
        return [self.dir / f"{rep}.bin"]

    def save(self, state: Any, rep: int) -> Pending:
        wbuf, _, n = self.bufs.get(self.nbytes)
        if self.engine is None:
            raw_write_pwrite(self.files(rep)[0], wbuf, n)
        else:
            raw_write_engine(self.engine, self.files(rep)[0], wbuf, n)
        return Pending()

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        _, rbuf, n = self.bufs.get(self.nbytes)
        if self.engine is None:
            raw_read_pread(self.files(rep)[0], rbuf, n)
        else:
            raw_read_engine(self.engine, self.files(rep)[0], rbuf, n)
        return None

    def same(self, state: Any, restored: Any) -> bool:
        return True

    def close(self) -> None:
        self.bufs.release()


class Fio(Peer):
    """fio, 16 MiB sequential O_DIRECT at QD16 (io_uring, preallocated, end_fsync), as an outside
    reference; the rate is fio's own."""

    name = "fio"
    how = "fio 16 MiB sequential, QD16, io_uring, O_DIRECT, fallocate, end_fsync; fio's own rate"
    caches = ("cold",)
    durability = "O_DIRECT + end_fsync"

    def check(self) -> None:
        if not fio_available():
            raise ImportError("fio is not installed (apt-get install fio)")

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        self.nbytes = -(-wl.nbytes // ALIGN) * ALIGN

    def files(self, rep: int) -> list[Path]:
        return [self.dir / f"{rep}.dat"]

    def _run(self, rep: int, rw: str) -> Pending:
        g = run_fio(self.files(rep)[0], self.nbytes, rw)
        if g is None:
            raise RuntimeError(f"fio {rw} failed (see the log)")
        return Pending(reported_secs=self.nbytes / (g * 1e9))

    def save(self, state: Any, rep: int) -> Pending:
        return self._run(rep, "write")

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        return self._run(rep, "read")

    def same(self, state: Any, restored: Any) -> bool:
        return True


class Memcpy(Peer):
    """``Tensor.copy_`` of the state's byte count into new memory (``prefaulted``: into memory faulted in
    beforehand): the bound for a restore from a tier in memory."""

    saves = False
    caches = ("memory",)

    def __init__(self, prefaulted: bool = False) -> None:
        self.prefaulted = prefaulted
        self.name = "memcpy-prefaulted" if prefaulted else "memcpy"
        self.how = f"`Tensor.copy_` of the state's byte count into {'memory faulted in before' if prefaulted else 'new, untouched memory'}"
        self.src: torch.Tensor | None = None

    def open(self, scratch: Path, wl: Workload) -> None:
        self.src = torch.randint(0, 256, (wl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))

    def files(self, rep: int) -> list[Path]:
        return []

    def prepare_restore(self, rep: int, like: Any) -> Any:
        assert self.src is not None
        dst = aligned_empty(self.src.numel(), ALIGN, pin=False)
        if self.prefaulted:
            dst.fill_(0)
        return dst

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        assert self.src is not None
        arg.copy_(self.src)
        return None

    def same(self, state: Any, restored: Any) -> bool:
        return True

    def close(self) -> None:
        self.src = None
