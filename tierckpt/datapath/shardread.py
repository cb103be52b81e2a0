"""Range reads of the saved ranks' copies for a resharding restore (datapath/reshard.py): which
copies to open, which whole checksum chunks of which rows to read for a target's box, their
verification, and the copy of each overlap into place.

The overlap of a saved shard with a target box is found with DCP's helpers
(``_check_shard_metadata_pair_overlap``, ``_shards_get_overlap_region_wrt_saved_tensor``); the boxes are
:func:`~tierckpt.format.sharding.shard_box`'s.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tierckpt.datapath.manifests import UnnamedCopyError, absent, load_manifest
from tierckpt.datapath.openblobs import open_blobs
from tierckpt.datapath.verifier import Where, verify_range
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import Manifest, dtype_from_name
from tierckpt.format.sharding import ShardRow, chunk_span, shard_box, writer_of
from tierckpt.io.buffers import aligned_empty, memmove
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader

__all__ = ["Box", "Copies", "Dest", "Filler"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (sizes, global offsets)
_Reads = list[tuple[Future[int], int]]  # the reads of one piece, with the bytes each must return


@dataclass
class _Copy:
    """One saved rank's copy: its validated manifest and an open reader (closed by :class:`Copies`)."""

    rank: int
    m: Manifest
    reader: TierReader
    tier: Tier
    rows: dict[str, int] | None = None  # key path -> row, built on first lookup

    def row(self, path: str) -> int | None:
        if self.rows is None:
            self.rows = {p: i for i, p in enumerate(self.m.tensors.paths)}
        return self.rows.get(path)


@dataclass
class Copies:
    """The copies of one step that a restore opened, by rank; opened on first use, from ``tier`` or,
    for another rank's copy that ``tier`` lacks (a node-local tier holds only its node's ranks'),
    from the first of ``others`` that holds it."""

    tier: Tier
    step: int
    allow_pickle: bool
    others: Sequence[Tier] = ()
    opened: dict[int, _Copy] = field(default_factory=dict)

    def get(self, rank: int) -> _Copy:
        """Rank ``rank``'s copy, opened (and its manifest validated) on first use: from ``tier``, else from
        the first of ``others`` that holds it.

        Raises:
            TierIOError: no tier holds such a copy and ``tier`` holds the step's record (a node-local tier
                holds only its node's ranks' copies): the restore tries the next tier that holds the step.
            CheckpointNotFoundError: the copy went away (the step was evicted: its record too).
            UnnamedCopyError: ``tier``'s copy is not the one the step's record names.
        """
        try:
            return self._open(rank)
        except UnnamedCopyError:
            raise
        except CheckpointNotFoundError as e:
            for t in self.others:
                try:
                    return self._open(rank, t)
                except CheckpointNotFoundError:
                    continue
            tiers = ", ".join(repr(t.name) for t in (self.tier, *self.others))
            raise absent(self.tier, CheckpointKey(self.step, rank), e, tiers) from e

    def _open(self, rank: int, tier: Tier | None = None) -> _Copy:
        got = self.opened.get(rank)
        if got is None:
            tier = tier or self.tier
            key = CheckpointKey(self.step, rank)
            with tier.open_copy(key) as copy:
                m = load_manifest(tier, key, allow_pickle=self.allow_pickle, copy=copy)
                where = Where(tier.name, self.step, rank)
                got = self.opened[rank] = _Copy(rank, m, open_blobs(tier, copy, m, background=False, where=where), tier)
        return got

    def base(self, rank: int) -> _Copy:
        """This rank's copy on ``tier``, or rank 0's there where this rank is beyond the ranks that saved
        (read from ``tier`` alone: the restore names the tier it read).

        Raises:
            CheckpointNotFoundError: the copy needed went away (the step was evicted: its record too).
            TierIOError: ``tier`` holds the step's record and not the copy needed (a node-local tier holds
                only its node's ranks' copies): the restore tries the next tier that holds the step.
            UnnamedCopyError: the copy is not the one the step's record names.
        """
        try:
            return self._open(rank)
        except UnnamedCopyError:
            raise
        except CheckpointNotFoundError as e:
            if rank == 0:
                raise absent(self.tier, CheckpointKey(self.step, rank), e) from e
            try:
                first = self._open(0)
            except UnnamedCopyError:
                raise
            except CheckpointNotFoundError as e0:
                raise absent(self.tier, CheckpointKey(self.step, 0), e0) from e0
            if rank < first.m.world_size:  # it saved: its copy is what is missing, not beyond the saved ranks
                raise absent(self.tier, CheckpointKey(self.step, rank), e) from e
            return first

    def close(self) -> None:
        for c in self.opened.values():
            c.reader.close()
        self.opened.clear()


@dataclass
class Dest:
    """A tensor to fill with manifest row ``row`` of the base copy: ``out`` holds the global box
    ``box`` (plain rows: the whole tensor)."""

    row: int
    out: torch.Tensor
    box: Box


@dataclass
class _Piece:
    """One verified range read: bytes ``[c0, c1)`` of row ``row`` of ``copy`` (whole checksum chunks),
    and where its overlap goes: the saved shard's sub-box ``(offsets, sizes)`` into ``out``'s narrowed
    region at ``dst_off``."""

    copy: _Copy
    row: int
    c0: int
    c1: int
    src_off: tuple[int, ...]
    sizes: tuple[int, ...]
    out: torch.Tensor
    dst_off: tuple[int, ...]


class Filler:
    """Plans the range reads of a restore and runs them, a bounded number of bytes in flight (as many as
    the base copy's tier's read slots hold: its geometry's
    :attr:`~tierckpt.io.geometry.IOGeometry.read_staging_bytes`)."""

    def __init__(self, copies: Copies, base: _Copy) -> None:
        self.copies, self.base = copies, base

    def fill(self, dests: list[Dest]) -> None:
        inflight: deque[tuple[_Piece, torch.Tensor, int, _Reads]] = deque()
        held, most = 0, self.base.tier.geometry.read_staging_bytes
        try:
            for piece in (p for d in dests for p in self.pieces(d)):
                while inflight and held > most:
                    held -= self.finish(*inflight.popleft())
                buf, skip, futs = self.submit(piece)
                inflight.append((piece, buf, skip, futs))
                held += buf.numel()
            while inflight:
                self.finish(*inflight.popleft())
        finally:
            for _, _, _, futs in inflight:  # never free a buffer the engine may still read into
                for f, _ in futs:
                    f.exception()

    def pieces(self, d: Dest) -> Iterator[_Piece]:
        """The reads that fill destination ``d``."""
        m = self.base.m
        spec = m.sharding.get(d.row)
        sizes, offsets = d.box
        if spec is None:  # a plain row: one box, the whole tensor, read whole from the base copy
            n = m.tensors.lengths[d.row]
            if n and math.prod(sizes):
                yield _Piece(self.base, d.row, 0, n, offsets, sizes, d.out, (0,) * len(sizes))
            return
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.resharding import (
            _check_shard_metadata_pair_overlap,
            _shards_get_overlap_region_wrt_saved_tensor,
        )

        if not math.prod(sizes):
            return
        want = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        mesh = m.meshes[spec.mesh]
        path = m.tensors.paths[d.row]
        for flat, coord in enumerate(mesh.coordinates()):
            if writer_of(coord, spec.placements) != coord:
                continue  # a replica that stored only the reference
            try:
                s_sizes, s_offsets = shard_box(spec.global_shape, mesh.shape, coord, spec.placements)
            except ValueError as e:
                raise self._bad(f"sharding of {path}: {e}", self.base) from None
            have = ChunkStorageMetadata(offsets=torch.Size(s_offsets), sizes=torch.Size(s_sizes))
            if not math.prod(s_sizes) or not _check_shard_metadata_pair_overlap(have, want):
                continue
            copy = self.copies.get(mesh.ranks[flat])
            row = self._row(copy, path, spec, s_sizes, d.row)
            narrows = _shards_get_overlap_region_wrt_saved_tensor(have, want)
            src_off = tuple(n[1] for n in narrows)
            dst_off = tuple(n[2] for n in narrows)
            lens = tuple(n[3] for n in narrows)
            c0, c1 = self._span(copy, row, s_sizes, src_off, lens)
            yield _Piece(copy, row, c0, c1, src_off, lens, d.out, dst_off)

    def _row(self, copy: _Copy, path: str, spec: ShardRow, sizes: tuple[int, ...], base_row: int) -> int:
        """The row of ``copy`` holding the shard of ``path``, checked against the base copy's record
        (``spec``, row ``base_row`` of the base copy's manifest)."""
        i = copy.row(path)
        other = copy.m.sharding.get(i) if i is not None else None
        if (
            i is None
            or other is None
            or other.global_shape != spec.global_shape
            or other.placements != spec.placements
            or copy.m.meshes[other.mesh] != self.base.m.meshes[spec.mesh]
            or not other.stored
            or copy.m.tensors.shapes[i] != sizes
            or copy.m.tensors.dtypes[i] != self.base.m.tensors.dtypes[base_row]
        ):
            raise self._bad(
                f"rank {copy.rank}'s manifest does not store {path} as rank {self.base.rank}'s sharding record says",
                copy,
            )
        return i

    def _span(
        self, copy: _Copy, row: int, sizes: tuple[int, ...], off: tuple[int, ...], lens: tuple[int, ...]
    ) -> tuple[int, int]:
        """The whole checksum chunks of ``row`` holding the sub-box ``off`` + ``lens`` of its shard."""
        isz = dtype_from_name(copy.m.tensors.dtypes[row]).itemsize
        strides = _strides(sizes)
        first = sum(o * s for o, s in zip(off, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(off, lens, strides))
        return chunk_span(first * isz, (last + 1) * isz, copy.m.tensors.lengths[row], copy.m.chunk_bytes)

    def submit(self, p: _Piece) -> tuple[torch.Tensor, int, _Reads]:
        """Read the chunks of piece ``p``: ``(buffer, offset of byte c0 in it, reads in flight)``."""
        t, m = p.copy.m.tensors, p.copy.m
        blob = t.blobs[p.row]
        start = t.offsets[p.row] + p.c0
        mem = p.copy.reader.buffer(blob)
        if mem is not None:  # a memory tier: the bytes are there already
            return mem[start : t.offsets[p.row] + p.c1].cpu(), 0, []
        align = m.align
        a0 = start // align * align
        a1 = min(m.blobs[blob].size, round_up(t.offsets[p.row] + p.c1, align))
        geometry = p.copy.tier.geometry
        buf = aligned_empty(a1 - a0, geometry.buffer_alignment(align))
        step = geometry.read_chunk(align)
        futs = [
            (p.copy.reader.read(blob, o, buf.data_ptr() + o - a0, min(step, a1 - o)), min(step, a1 - o))
            for o in range(a0, a1, step)
        ]
        return buf, start - a0, futs

    def finish(self, p: _Piece, buf: torch.Tensor, skip: int, futs: _Reads) -> int:
        """Wait for piece ``p``'s reads, verify its chunks, copy its overlap into place; returns the
        buffer's size."""
        m = p.copy.m
        t = m.tensors
        for f, _ in futs:  # all landed before any is looked at (the buffer is freed on an error)
            f.exception()
        where = Where(p.copy.tier.name, self.copies.step, p.copy.rank)
        blob = m.blobs[t.blobs[p.row]].name
        for f, n in futs:
            where.check_read(blob, t.offsets[p.row] + p.c0, n, f.result())
        data = buf[skip : skip + p.c1 - p.c0]
        if data.numel():
            verify_range(
                where, data.data_ptr(), p.c0, p.c1, length=t.lengths[p.row], checksum=t.checksums[p.row],
                chunk_bytes=m.chunk_bytes, chunks=m.sharding[p.row].chunks if p.row in m.sharding else (),
                blob=blob, key=t.paths[p.row],
            )  # fmt: skip
        dtype = dtype_from_name(t.dtypes[p.row])
        src = _as_box(data, dtype, t.shapes[p.row], p.c0, p.src_off, p.sizes)
        dst = p.out
        for dim, (o, n) in enumerate(zip(p.dst_off, p.sizes)):
            dst = dst.narrow(dim, o, n)
        _copy_into(dst, src)
        return buf.numel()

    def _bad(self, msg: str, copy: _Copy, *, blob: str | None = None) -> CorruptCheckpointError:
        where = "" if "rank" in msg else f" (rank {copy.rank}'s copy)"
        return CorruptCheckpointError(f"{msg}{where}", tier=copy.tier.name, step=self.copies.step, blob=blob)


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _as_box(
    data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], c0: int, off: tuple[int, ...], lens: tuple[int, ...]
) -> torch.Tensor:
    """The sub-box ``off`` + ``lens`` of a row of ``shape``, from ``data``: its bytes from ``c0`` on."""
    isz = dtype.itemsize
    elems = data.view(dtype) if data.numel() else torch.empty(0, dtype=dtype)
    strides = _strides(shape)
    first = sum(o * s for o, s in zip(off, strides)) - c0 // isz
    return elems.as_strided(lens, strides, elems.storage_offset() + first)  # offsets count from the storage


#: integer dtypes by item size: bytes are copied as one of them where torch has no copy for a dtype
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s values into ``dst`` (any device, any strides), bit for bit."""
    with torch.no_grad():
        if dst.is_cpu and dst.is_contiguous() and src.is_contiguous() and dst.numel():
            memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
            return
        try:
            dst.copy_(src)
        except (RuntimeError, NotImplementedError):
            same = _SAME_SIZE_INT.get(dst.element_size())
            if same is None:
                raise
            dst.view(same).copy_(src.view(same))
