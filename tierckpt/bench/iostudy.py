"""The writers and readers of the I/O study's experiment (arXiv 2512.24511), one rank's part each.

Each :class:`Variant` saves one rank's flat dict of tensors as checkpoint ``rep`` under its own folder of
a mount, durably (every file fsynced before ``save`` returns), and restores it into new tensors, in the
same or in a fresh process:

* ``tierckpt:detected`` / ``tierckpt:default``: a ``pfs`` tier sized from what tierckpt detects on the
  mount, or from plain 4 KiB-block facts (only O_DIRECT support and its alignment kept): the
  file-system-aware aggregation and the same code without the awareness. ``:buffered``: ``io.direct``
  off.
* ``uncoalesced``: one ``pwrite`` per tensor into one file per rank, straight from the tensor's memory
  (``:direct``: O_DIRECT, each tensor copied into a 4 KiB-padded bounce buffer first), as a naive
  writer does; read back with one ``pread`` per tensor.
* ``datastates``: DataStates-LLM's pattern without file-system awareness: the tensors packed back to back
  after a header (no alignment), the stream written in 16 MiB writes at those unaligned offsets,
  buffered, all queued on tierckpt's io_uring engine, one file per rank.
* ``torch.save``, ``dcp-tN`` (``FileSystemWriter(thread_count=N)``; each rank's tensors under a key of its own,
  so that DCP writes every rank's) and ``torchsnapshot``.

File format of ``uncoalesced`` and ``datastates``: an 8-byte little-endian header length, a JSON index
(name, dtype, shape, offset, bytes of each tensor) and the tensors' bytes at those offsets.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.peers import fsync_tree
from tierckpt.hierarchy import Hierarchy
from tierckpt.io.buffers import aligned_empty, ptr_mv
from tierckpt.io.engine import make_engine
from tierckpt.io.geometry import PAGE, FsFacts
from tierckpt.ioconfig import IOConfig
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.pfs import PfsTier

__all__ = ["STREAM_CHUNK", "VARIANTS", "Variant", "make_variant", "plain_facts"]

JOB = "bench-iostudy"
STREAM_CHUNK = 16 << 20  #: one write of the DataStates-style stream
_STREAM_SLOTS = 8


def plain_facts(f: FsFacts) -> FsFacts:
    """What tierckpt would assume knowing nothing of the file system: 4 KiB blocks, no stripes, no
    family; only whether O_DIRECT works there, and its alignment, are kept."""
    return FsFacts(
        direct=f.direct, dio_mem_align=f.dio_mem_align, dio_offset_align=f.dio_offset_align, readonly=f.readonly
    )


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dt, torch.dtype)
    return dt


class Variant:
    """One way of saving and restoring a rank's tensors. ``save``/``restore`` are what is timed."""

    name = "?"

    def __init__(self, root: Path, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.dir = root / self.name.replace(":", "-").replace(".", "-")
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, rep: int) -> Path:
        """Where checkpoint ``rep`` of this rank lies (a file or folder)."""
        return self.dir / f"{rep}-r{self.rank}"

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        raise NotImplementedError

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint ``rep`` into new tensors (``like``: the saved state's structure, for templates)."""
        raise NotImplementedError

    def checkpoint_paths(self, rep: int) -> list[Path]:
        """Every file or folder checkpoint ``rep`` of all ranks occupies (for counting files)."""
        return [self.dir / f"{rep}-r{r}" for r in range(self.world)]

    def discard(self, rep: int) -> None:
        """Delete this rank's part of checkpoint ``rep`` (a folder shared by the ranks: rank 0 deletes it
        after a barrier)."""
        p = self.path(rep)
        if p.is_file():
            p.unlink()
        elif p.is_dir():
            torch.distributed.barrier()
            if self.rank == 0:
                shutil.rmtree(p)

    def info(self) -> dict[str, Any]:
        """What the report shows of the variant's settings."""
        return {}

    def close(self) -> None:
        """Release what the variant holds."""


# -- tierckpt ----------------------------------------------------------------------------------------------
class Tierckpt(Variant):
    """A ``pfs`` tier at the variant's folder, sized from the detected facts or from :func:`plain_facts`."""

    def __init__(self, root: Path, rank: int, world: int, *, detected: bool, direct: bool) -> None:
        self.name = f"tierckpt:{'detected' if detected else 'default'}{'' if direct else ':buffered'}"
        super().__init__(root, rank, world)
        tier = None
        for r in range(world):  # one rank after the other: 4 ranks taking a GlusterFS directory's lease
            if r == rank:  # together failed there (``close`` answering ENOENT)
                tier = PfsTier("pfs", self.dir, job=JOB)
            if world > 1:
                torch.distributed.barrier()
        assert tier is not None
        self.detected_facts = tier.facts
        if not detected:
            tier.facts = plain_facts(tier.facts)
        self.tier = tier
        self.h = Hierarchy([tier], io=replace(IOConfig(), direct=direct), job=JOB)

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        self.h.save(flat, step=rep + 1).wait()

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = self.h.restore(step=rep + 1, tier="pfs")
        return out

    def checkpoint_paths(self, rep: int) -> list[Path]:
        return [p for p in self.dir.iterdir() if p.name.startswith(f"step-{rep + 1:012d}")]

    def discard(self, rep: int) -> None:
        key = CheckpointKey(rep + 1, self.h.rank)
        if self.tier.holds(key):
            self.tier.evict(key)

    def info(self) -> dict[str, Any]:
        return {"geometry": asdict(self.tier.geometry), "facts": asdict(self.tier.facts),
                "detected": asdict(self.detected_facts)}  # fmt: skip

    def close(self) -> None:
        self.h.close()


# -- naive writers -----------------------------------------------------------------------------------------
def _index(flat: dict[str, torch.Tensor], start: int, pad: int) -> list[dict[str, Any]]:
    """Where each tensor goes: offsets from ``start``, each body padded to a multiple of ``pad``."""
    out, off = [], start
    for k, t in flat.items():
        n = t.numel() * t.element_size()
        out.append({"k": k, "dtype": str(t.dtype), "shape": list(t.shape), "off": off, "n": n})
        off += -(-n // pad) * pad
    return out


def _header(index: list[dict[str, Any]], pad: int) -> bytes:
    """The header: 8-byte length, the JSON index, zeros up to a multiple of ``pad``."""
    body = json.dumps(index).encode()
    raw = struct.pack("<Q", len(body)) + body
    return raw + b"\0" * (-len(raw) % pad)


def _header_size(flat: dict[str, torch.Tensor], pad: int) -> int:
    """The header's size for ``flat`` (offsets are written as 20 digits so that the size is fixed)."""
    probe = [{**e, "off": "0" * 20} for e in _index(flat, 0, 1)]
    return len(_header(probe, pad))


def _read_index(fd: int) -> tuple[list[dict[str, Any]], int]:
    """The index of a file written by :class:`Uncoalesced` or :class:`DataStatesStyle`, and where its
    JSON ends."""
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    out: list[dict[str, Any]] = json.loads(os.pread(fd, n, 8))
    return out, 8 + n


def _fresh(e: dict[str, Any]) -> torch.Tensor:
    return torch.empty(e["shape"], dtype=_dtype(e["dtype"]))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], off + done)


def _pread_all(fd: int, mv: memoryview, off: int) -> None:
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], off + done)
        if got == 0:
            raise EOFError(f"short file at {off + done}")
        done += got


class Uncoalesced(Variant):
    """One ``pwrite`` per tensor into one file per rank; ``direct``: O_DIRECT through a padded bounce buffer."""

    def __init__(self, root: Path, rank: int, world: int, *, direct: bool) -> None:
        self.name = "uncoalesced:direct" if direct else "uncoalesced"
        super().__init__(root, rank, world)
        self.direct, self.pad = direct, PAGE if direct else 1
        self.bounce = aligned_empty(1 << 20, PAGE, pin=False)

    def _bounce(self, n: int) -> torch.Tensor:
        if self.bounce.numel() < n:
            self.bounce = aligned_empty(-(-n // PAGE) * PAGE, PAGE, pin=False)
        return self.bounce

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        start = _header_size(flat, PAGE if self.direct else 1)
        index = _index(flat, start, self.pad)
        head = _header([{**e, "off": f"{e['off']:020d}"} for e in index], PAGE if self.direct else 1)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.path(rep), flags, 0o644)
        try:
            self._write_bytes(fd, head, 0)
            for e, t in zip(index, flat.values()):
                src = _bytes_of(t.contiguous())
                if self.direct:
                    n = -(-e["n"] // PAGE) * PAGE
                    buf = self._bounce(n)
                    buf[: e["n"]].copy_(src)
                    _pwrite_all(fd, ptr_mv(buf.data_ptr(), n, writable=False), e["off"])
                elif e["n"]:
                    _pwrite_all(fd, ptr_mv(src.data_ptr(), e["n"], writable=False), e["off"])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_bytes(self, fd: int, data: bytes, off: int) -> None:
        buf = self._bounce(len(data))
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        _pwrite_all(fd, ptr_mv(buf.data_ptr(), len(data), writable=False), off)

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fd = os.open(self.path(rep), os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        try:
            if self.direct:
                return self._restore_direct(fd)
            out = {}
            for e in _read_index(fd)[0]:
                t = _fresh(e)
                if e["n"]:
                    _pread_all(fd, ptr_mv(t.data_ptr(), e["n"]), int(e["off"]))
                out[e["k"]] = t
            return out
        finally:
            os.close(fd)

    def _restore_direct(self, fd: int) -> dict[str, torch.Tensor]:
        buf = self._bounce(PAGE)
        _pread_all(fd, ptr_mv(buf.data_ptr(), PAGE), 0)
        (hn,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
        size = -(-(hn + 8) // PAGE) * PAGE
        buf = self._bounce(size)
        _pread_all(fd, ptr_mv(buf.data_ptr(), size), 0)
        index = json.loads(bytes(buf[8 : 8 + hn].numpy()))
        out = {}
        for e in index:
            t, n = _fresh(e), -(-e["n"] // PAGE) * PAGE
            if n:
                buf = self._bounce(n)
                _pread_all(fd, ptr_mv(buf.data_ptr(), n), int(e["off"]))
                _bytes_of(t).copy_(buf[: e["n"]])
            out[e["k"]] = t
        return out


class DataStatesStyle(Variant):
    """Tensors packed back to back after the header, written as a stream of 16 MiB buffered writes at
    unaligned offsets, every one queued on the io_uring engine (8 staging slots); one file per rank."""

    name = "datastates"

    def __init__(self, root: Path, rank: int, world: int) -> None:
        super().__init__(root, rank, world)
        self.engine = make_engine("auto", _STREAM_SLOTS)
        self.slots = [aligned_empty(STREAM_CHUNK, PAGE, pin=False) for _ in range(_STREAM_SLOTS)]

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        index = _index(flat, 0, 1)
        head = _header(index, 1)
        fd = os.open(self.path(rep), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _pwrite_all(fd, memoryview(head), 0)
            pending: list[Any] = [None] * _STREAM_SLOTS
            slot, fill, off = 0, 0, len(head)

            def flush() -> None:
                nonlocal slot, fill, off
                buf = self.slots[slot]
                pending[slot] = self.engine.pwrite(fd, buf.data_ptr(), fill, off)
                off, fill, slot = off + fill, 0, (slot + 1) % _STREAM_SLOTS
                if pending[slot] is not None:
                    pending[slot].result()
                    pending[slot] = None

            for t in flat.values():
                src = _bytes_of(t.contiguous())
                pos = 0
                while pos < src.numel():
                    n = min(src.numel() - pos, STREAM_CHUNK - fill)
                    self.slots[slot][fill : fill + n].copy_(src[pos : pos + n])
                    fill, pos = fill + n, pos + n
                    if fill == STREAM_CHUNK:
                        flush()
            if fill:
                flush()
            for f in pending:
                if f is not None:
                    f.result()
            self.engine.fsync(fd).result()
        finally:
            os.close(fd)

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fd = os.open(self.path(rep), os.O_RDONLY | os.O_CLOEXEC)
        try:
            index, start = _read_index(fd)
            total = sum(e["n"] for e in index)
            data = torch.empty(total, dtype=torch.uint8)
            futs: list[Any] = []
            for p in range(0, total, STREAM_CHUNK):  # as many reads in flight as the save had writes
                if len(futs) == _STREAM_SLOTS:
                    futs.pop(0).result()
                futs.append(self.engine.pread(fd, data.data_ptr() + p, min(STREAM_CHUNK, total - p), start + p))
            for f in futs:
                f.result()
        finally:
            os.close(fd)
        out, pos = {}, 0
        for e in index:
            t = _fresh(e)
            _bytes_of(t).copy_(data[pos : pos + e["n"]])
            out[e["k"]], pos = t, pos + e["n"]
        return out

    def close(self) -> None:
        self.engine.close()


# -- peers -------------------------------------------------------------------------------------------------
class TorchSave(Variant):
    """``torch.save`` into an open file + fsync; ``torch.load(weights_only=True)``."""

    name = "torch.save"

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        with open(self.path(rep), "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = torch.load(self.path(rep), weights_only=True)
        return out


class _SharedFolder(Variant):
    """A variant whose checkpoint is one folder that every rank writes into."""

    def path(self, rep: int) -> Path:
        return self.dir / str(rep)

    def checkpoint_paths(self, rep: int) -> list[Path]:
        return [self.path(rep)]


class Dcp(_SharedFolder):
    """``dcp.save`` with ``FileSystemWriter(thread_count=N)`` in the process group, each rank's tensors
    under ``r{rank}/``; ``dcp.load`` into a template of zeros."""

    def __init__(self, root: Path, rank: int, world: int, *, threads: int) -> None:
        self.name, self.threads = f"dcp-t{threads}", threads
        super().__init__(root, rank, world)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        writer = self.dcp.FileSystemWriter(str(self.path(rep)), thread_count=self.threads)
        self.dcp.save({f"r{self.rank}": flat}, storage_writer=writer)

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        target = {f"r{self.rank}": {k: torch.zeros_like(v) for k, v in like.items()}}
        self.dcp.load(target, storage_reader=self.dcp.FileSystemReader(str(self.path(rep))))
        return target[f"r{self.rank}"]


class TorchSnapshot(_SharedFolder):
    """``torchsnapshot.Snapshot.take`` of ``{"s": StateDict(tensors)}`` (each rank's its own: not
    replicated) + fsync of what it wrote (it does not fsync); restore into a template of zeros."""

    name = "torchsnapshot"

    def __init__(self, root: Path, rank: int, world: int) -> None:
        super().__init__(root, rank, world)
        import torchsnapshot

        self.ts = torchsnapshot

    def save(self, flat: dict[str, torch.Tensor], rep: int) -> None:
        self.ts.Snapshot.take(path=str(self.path(rep)), app_state={"s": self.ts.StateDict(flat)})
        torch.distributed.barrier()
        if self.rank == 0:
            fsync_tree(self.path(rep))

    def restore(self, rep: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        target = self.ts.StateDict({k: torch.zeros_like(v) for k, v in like.items()})
        self.ts.Snapshot(path=str(self.path(rep))).restore({"s": target})
        return dict(target)


VARIANTS = (
    "tierckpt:detected", "tierckpt:detected:buffered", "tierckpt:default", "tierckpt:default:buffered",
    "uncoalesced", "uncoalesced:direct", "datastates", "torch.save", "dcp-t1", "dcp-t2", "dcp-t4",
    "torchsnapshot",
)  # fmt: skip


def make_variant(name: str, root: Path, rank: int, world: int) -> Variant:
    """The variant called ``name`` (one of :data:`VARIANTS`), its folder under ``root``.

    Raises:
        ValueError: unknown name.
        ImportError: its package is missing.
    """
    if name.startswith("tierckpt:"):
        parts = name.split(":")
        return Tierckpt(root, rank, world, detected=parts[1] == "detected", direct=len(parts) == 2)
    if name.startswith("uncoalesced"):
        return Uncoalesced(root, rank, world, direct=name.endswith(":direct"))
    if name.startswith("dcp-t"):
        return Dcp(root, rank, world, threads=int(name.removeprefix("dcp-t")))
    simple: dict[str, type[Variant]] = {"datastates": DataStatesStyle, "torch.save": TorchSave,
                                        "torchsnapshot": TorchSnapshot}  # fmt: skip
    if name not in simple:
        raise ValueError(f"unknown variant {name!r} (one of {', '.join(VARIANTS)})")
    return simple[name](root, rank, world)
