"""A tier's I/O geometry: every size its reads, writes and buffers use, decided in one place.

Like ROMIO's MPI-IO hints (``striping_unit``, ``cb_buffer_size``), the facts of the storage and the
user's settings become sizes here and nowhere else:

* :class:`FsFacts`: what the file system says about a tier's directory, as plain values, probed at open
  by :func:`tierckpt.io.fsutil.probe_fs` (tests use recorded ones);
* :func:`io_geometry`: a pure function from a tier's capabilities, those facts and its ``io`` settings
  (the hierarchy's merged with the tier's own) to its :class:`IOGeometry`;
* :func:`checkpoint_geometry`: a hierarchy's checkpoints, from its ``layout`` settings and its tiers'
  geometries: one alignment and blob size, and each tier's geometry in that alignment.

Which setting or fact sets each field: docs/tiers.md, "I/O geometry".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from tierckpt.config import LayoutConfig
from tierckpt.ioconfig import IOConfig

__all__ = [
    "DIRECT_READ_MIN",
    "FIRST_READS",
    "MAX_BLOB_ALIGN",
    "MAX_FS_ALIGN",
    "MAX_STAGING_BYTES",
    "MAX_STRIPE_CHUNK",
    "PAGE",
    "PIECES",
    "READ_SLOTS",
    "READ_SLOT_BYTES",
    "STAGING_SLOTS",
    "STEADY_READS",
    "CheckpointGeometry",
    "FsFacts",
    "IOGeometry",
    "checkpoint_geometry",
    "io_geometry",
]

PAGE = 4096  #: the least alignment of file I/O (O_DIRECT's unit almost everywhere)
#: the largest file-system block a tier aligns its I/O to (a larger or odd one is not a block size)
MAX_FS_ALIGN = 16 << 20
#: A save's or copy's staging buffers per tier worker, each one chunk (32 MiB by default, 192 MiB in
#: all). A virtual disk here completes a whole queue of writes at once, so the packer must have slots
#: free to fill while a full queue is in flight; 3 slots of 64 MiB (the same memory) left the disk idle
#: while they were refilled (docs/io.md, "Staging buffers: how many").
STAGING_SLOTS = 6
#: A save hands each staging chunk to the writers in this many pieces, each as soon as it is packed, so
#: the disk always has several writes queued (whole-chunk writes from 3 slots kept only 2 in flight).
PIECES = 4
#: ``restore(into=)``'s staging buffers: until the target is matched every slot reads, so the slots hold
#: what the disk reads while the match runs: 16 x 16 MiB (256 MiB, 70-80 ms here) covers a 20,000-tensor
#: match even with cold caches (docs/restore.md).
READ_SLOTS = 16
READ_SLOT_BYTES = 16 << 20
#: ``restore(into=)``'s reads in flight once the target is matched, from a tier of one node: each read
#: that lands submits the next while its bytes are copied out (a shared tier keeps every slot reading: a
#: striped file wants many reads in flight; docs/io.md).
STEADY_READS = 2
#: ``restore(into=)`` reads a tensor body at least this long straight into its destination, where the
#: tier's reader allows it (smaller ones go through the staging slots and are copied out).
DIRECT_READ_MIN = 4 << 20
#: A restore into new tensors reads its first chunk in this many parts, so that the disk starts once the
#: first part's fresh pages are faulted in rather than a whole chunk's.
FIRST_READS = 4
#: The largest chunk a tier's asked chunk is raised to so that each write covers a whole stripe (stripe
#: unit x count): 6 staging slots of a 64 MiB stripe are 384 MiB per tier worker, twice the default.
#: A wider stripe is written in chunks of whole stripe units, with more slots (:data:`MAX_STAGING_BYTES`).
MAX_STRIPE_CHUNK = 64 << 20
#: A tier worker's staging in all (slots x slot) when slots are added so that a wide stripe has two writes
#: in flight on each of its targets; it never has fewer than :data:`STAGING_SLOTS`.
MAX_STAGING_BYTES = 512 << 20
#: The largest unit blobs (and so data files) are whole multiples of: one blob pads at most this much.
#: A stripe wider than this (or one whose object size makes it so) pads blobs to whole stripe units.
MAX_BLOB_ALIGN = 64 << 20


@dataclass(frozen=True)
class FsFacts:
    """What the file system holding a tier's directory says about it, as plain values.

    Attributes:
        block_bytes: the file system's block size (``statvfs`` ``f_bsize``).
        io_block_bytes: the directory's preferred I/O size (``st_blksize``; Lustre and GPFS set it from
            the stripe or block size).
        direct: files there can be opened with O_DIRECT.
        dio_mem_align: the memory alignment O_DIRECT needs (``statx`` ``STATX_DIOALIGN``; None: not
            reported).
        dio_offset_align: the offset and length alignment O_DIRECT needs (as above).
        readonly: the file system is mounted read-only.
        fs_type: the mount's type as ``/proc/self/mountinfo`` names it (``ext4``, ``xfs``, ``tmpfs``,
            ``fuse.ceph-fuse``, ``ceph``, ``fuse.glusterfs``, ``nfs4``, ``lustre``, ``gpfs`` ...; empty:
            unknown).
        family: what kind of storage that is, for sizing: ``cephfs``, ``glusterfs``, ``lustre``,
            ``gpfs``, ``nfs``, ``beegfs``, ``local`` (a disk file system of this node), ``memory``
            (tmpfs, ramfs) or ``unknown`` (:func:`tierckpt.io.fsdetect.decide_family`).
        mount_point: where that file system is mounted (empty: unknown).
        stripe_unit_bytes: the bytes written to one stripe target before the next (CephFS
            ``stripe_unit``, Lustre ``lmm_stripe_size``; GPFS: its block size); None: not striped or
            not known.
        stripe_count: the stripe targets a file's consecutive stripe units go to (CephFS
            ``stripe_count``, Lustre ``lmm_stripe_count``); None: not known.
        object_bytes: the size of one backing object (CephFS ``object_size``); None: not known.
        layout_settable: a new file's layout can be set by the writer before its first byte (CephFS
            ``ceph.file.layout.*`` xattrs, Lustre ``lustre.lov``).
    """

    block_bytes: int = PAGE
    io_block_bytes: int = PAGE
    direct: bool = False
    dio_mem_align: int | None = None
    dio_offset_align: int | None = None
    readonly: bool = False
    fs_type: str = ""
    family: str = "unknown"
    mount_point: str = ""
    stripe_unit_bytes: int | None = None
    stripe_count: int | None = None
    object_bytes: int | None = None
    layout_settable: bool = False

    @property
    def buffered_is_faster(self) -> bool:
        """Whether buffered writes beat O_DIRECT here, so a tier writes buffered unless told otherwise
        (then fsyncs as always): CephFS through ``ceph-fuse``, where O_DIRECT bypasses the client's
        object cache and write-back batching (measured on a loopback CephFS: fio's buffered writes of
        the same files at 1.9-2.8x its O_DIRECT ones; docs/tiers.md, "I/O geometry")."""
        return self.fs_type == "fuse.ceph-fuse"

    @property
    def direct_alignment_bytes(self) -> int:
        """The alignment O_DIRECT needs of memory, offsets and lengths: at least a page."""
        return max(PAGE, self.dio_mem_align or 0, self.dio_offset_align or 0)

    @property
    def fs_block_bytes(self) -> int:
        """The larger of ``block_bytes`` and ``io_block_bytes``, where that is a power of two from a page
        to :data:`MAX_FS_ALIGN`; else a page."""
        block = max(self.block_bytes, self.io_block_bytes)
        return block if PAGE <= block <= MAX_FS_ALIGN and not block & (block - 1) else PAGE


class Needs(Protocol):
    """What the geometry reads of a tier's capabilities (:class:`tierckpt.tiers.base.TierCapabilities`)."""

    @property
    def shared(self) -> bool: ...
    @property
    def device(self) -> str: ...
    @property
    def alignment_bytes(self) -> int: ...
    @property
    def min_part_bytes(self) -> int: ...
    @property
    def max_part_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class IOGeometry:
    """The sizes of one tier's I/O (docs/tiers.md, "I/O geometry"); made by :func:`io_geometry`.

    Attributes:
        alignment_bytes: memory, offsets and lengths of its reads and writes are multiples of it (the
            checkpoint's alignment is the largest of the layout's and every tier's).
        memory_alignment_bytes: the least alignment of memory it may read into or write from as it is
            (a memory tier's blob buffer, say): O_DIRECT's (``statx``'s, a page at least) for a file
            tier, its capabilities' alignment for another kind.
        direct: its files are opened with O_DIRECT.
        blob_bytes: the blob size it writes best (the hierarchy packs with the largest of its tiers').
        one_file: a copy's blobs go into one data file (its size: the sum of the blobs') rather than a
            file each.
        chunk_bytes: one read or write of a copy to or from it, within its part sizes.
        piece_bytes: one write of a save packed for it (a staging chunk is handed over in pieces).
        queue_depth: operations in flight on its I/O engine.
        staging_slots: staging buffers of its worker (saves packed for it, copies to it).
        staging_slot_bytes: the size of each (its chunk; a memory tier's: the hierarchy's ``io.chunk``).
        read_slots: staging buffers of ``restore(into=)``.
        read_slot_bytes: the size of each.
        steady_reads: ``restore(into=)``'s reads in flight from it once the target is matched
            (:data:`STEADY_READS`; a shared tier's: every read slot).
        direct_read_min_bytes: ``restore(into=)`` reads a tensor body at least this long from it straight
            into its destination, where its reader allows it (:data:`DIRECT_READ_MIN`).
        min_part_bytes: its smallest write but a blob's last (its capabilities').
        max_part_bytes: its largest write (its capabilities'; None: no bound).
        stripe_unit_bytes: its writes start on multiples of it and are whole multiples of it (its
            pieces and chunks): the file system's stripe unit (or, on a ``pfs`` tier, its block), else
            the alignment.
        stripe_width_bytes: one stripe over every target (unit x count): its chunk is a whole multiple of
            it where that fits :data:`MAX_STRIPE_CHUNK`; else the stripe unit.
        blob_align_bytes: its blobs, and so its data files, are whole multiples of it (the stripe width
            and the object size; the stripe unit where that is over :data:`MAX_BLOB_ALIGN`).
    """

    alignment_bytes: int
    direct: bool
    blob_bytes: int
    one_file: bool
    chunk_bytes: int
    piece_bytes: int
    queue_depth: int
    staging_slots: int
    staging_slot_bytes: int
    read_slots: int
    read_slot_bytes: int
    memory_alignment_bytes: int = PAGE
    steady_reads: int = STEADY_READS
    direct_read_min_bytes: int = DIRECT_READ_MIN
    min_part_bytes: int = 0
    max_part_bytes: int | None = None
    stripe_unit_bytes: int = 0  # 0 (a geometry made by hand): the alignment
    stripe_width_bytes: int = 0  # 0: the stripe unit
    blob_align_bytes: int = 0  # 0: the alignment

    def __post_init__(self) -> None:
        unit = self.stripe_unit_bytes or self.alignment_bytes
        object.__setattr__(self, "stripe_unit_bytes", unit)
        object.__setattr__(self, "stripe_width_bytes", self.stripe_width_bytes or unit)
        object.__setattr__(self, "blob_align_bytes", self.blob_align_bytes or self.alignment_bytes)

    @property
    def read_staging_bytes(self) -> int:
        """The bytes its reads may hold in flight at once (its read slots'): ``restore(into=)``'s staging,
        and the buffers of a resharding restore's range reads."""
        return self.read_slots * self.read_slot_bytes

    def read_chunk(self, align: int) -> int:
        """One read of a copy whose alignment is ``align`` from the tier (a restore into new tensors, a
        shard's range read): its :attr:`chunk_bytes` rounded down to a multiple of ``align``, at least
        ``align``. The copy's alignment is the one it was written with, which may be another than this
        hierarchy's."""
        return max(align, self.chunk_bytes // align * align)

    def first_read(self, align: int) -> int:
        """The parts a restore into new tensors reads its first chunk in (:data:`FIRST_READS` of them),
        each a multiple of ``align``."""
        return max(align, self.read_chunk(align) // FIRST_READS // align * align)

    def buffer_alignment(self, align: int) -> int:
        """The memory alignment of a buffer that reads of alignment ``align`` from the tier land in: a
        page at least (buffers are whole pages), its :attr:`memory_alignment_bytes`, ``align``."""
        return max(PAGE, self.memory_alignment_bytes, align)

    def aligned_to(self, align: int) -> IOGeometry:
        """This geometry in a checkpoint whose alignment is ``align`` (a power of two, a multiple of
        :attr:`alignment_bytes`): every size a multiple of it, the parts still within bounds, the chunk
        still whole stripes (or stripe units) and the blobs whole multiples of :attr:`blob_align_bytes`.

        Raises:
            ValueError: ``align`` is not such a power of two.
        """
        if align == self.alignment_bytes:
            return self
        if align < self.alignment_bytes or align & (align - 1):
            raise ValueError(f"alignment {align} is not a power of two of at least {self.alignment_bytes}")
        unit, width = math.lcm(self.stripe_unit_bytes, align), math.lcm(self.stripe_width_bytes, align)
        step = width if self.chunk_bytes % self.stripe_width_bytes == 0 else unit  # as io_geometry chose
        chunk = _within_parts(self.chunk_bytes, step, self.min_part_bytes, self.max_part_bytes)
        # a tier that stages through its own chunk goes on doing so; a memory tier's slots are rounded up
        slot = chunk if self.staging_slot_bytes == self.chunk_bytes else _round_up(self.staging_slot_bytes, align)
        granule = math.lcm(self.blob_align_bytes, align)
        return replace(
            self,
            alignment_bytes=align,
            blob_bytes=_round_up(self.blob_bytes, granule),
            chunk_bytes=chunk,
            piece_bytes=_piece(slot, unit if slot % unit == 0 else align, self.min_part_bytes),
            staging_slot_bytes=slot,
            read_slot_bytes=_round_up(self.read_slot_bytes, align),
            stripe_unit_bytes=unit,
            stripe_width_bytes=width,
            blob_align_bytes=granule,
        )


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _within_parts(chunk: int, align: int, lo: int, hi: int | None) -> int:
    """``chunk`` within ``[lo, hi]``, a multiple of ``align`` (rounded down, but never below ``lo``)."""
    chunk = max(chunk, lo)
    if hi is not None:
        chunk = min(chunk, hi)
    chunk = max(align, chunk // align * align)
    return chunk if chunk >= lo else _round_up(lo, align)


def _piece(chunk: int, unit: int, min_part: int) -> int:
    """A quarter chunk (:data:`PIECES`), a multiple of ``unit``; the whole chunk where that is below the
    smallest part."""
    piece = max(unit, chunk // PIECES // unit * unit)
    return chunk if piece < min_part else piece


@dataclass(frozen=True)
class Stripes:
    """The stripes a file tier sizes its I/O for (:func:`stripes_of`).

    Attributes:
        unit_bytes: bytes written to one target before the next (None: not striped, or not known).
        count: the targets a stripe spans.
        object_bytes: the size of one backing object (None: not known).
    """

    unit_bytes: int | None = None
    count: int = 1
    object_bytes: int | None = None


def stripes_of(io: IOConfig, facts: FsFacts | None, *, least: int = PAGE, whole_blocks: bool = False) -> Stripes:
    """The stripes a file tier sizes for: the tier's ``io`` overrides (``stripe_unit``,
    ``stripe_count``, ``object_size``) over its file system's facts; without a stripe unit, a
    ``whole_blocks`` tier's file-system block (:attr:`FsFacts.fs_block_bytes`) where larger than a page
    (GPFS's block, NFS's ``wsize``, Lustre's ``st_blksize``). A unit that is not a multiple of ``least``
    (the tier's alignment) is no unit its writes can keep to: none. No facts (a memory or object tier):
    none."""
    if facts is None:
        return Stripes()
    unit = io.stripe_unit_bytes or facts.stripe_unit_bytes
    if unit is None and whole_blocks and facts.fs_block_bytes > PAGE:
        unit = facts.fs_block_bytes
    if unit is not None and (unit < least or unit % least):
        unit = None
    return Stripes(unit, max(1, io.stripe_count or facts.stripe_count or 1), io.object_bytes or facts.object_bytes)


def _largest_power_of_two_in(n: int) -> int:
    """The largest power of two that divides ``n``."""
    return n & -n


def io_geometry(
    caps: Needs,
    io: IOConfig,
    facts: FsFacts | None = None,
    *,
    blob_bytes: int,
    chunk_bytes: int | None = None,
    direct: bool | None = None,
    one_file: bool = False,
    whole_blocks: bool = False,
) -> IOGeometry:
    """A tier's geometry. Pure: the same arguments always give the same sizes.

    A striped file system's facts (:func:`stripes_of`: unit, count, object size) set, beyond the
    capabilities and settings:

    * the alignment: at least the unit's largest power-of-two divisor, up to :data:`MAX_FS_ALIGN`;
    * the chunk: the asked chunk rounded down to whole stripes (unit x count), at least one stripe where
      a stripe is at most :data:`MAX_STRIPE_CHUNK` (or the asked chunk); else to whole stripe units (a
      unit larger than that is not sized for);
    * the pieces: a quarter chunk in whole stripe units;
    * the staging slots: :data:`STAGING_SLOTS`, more where they would not hold two writes for each target
      of the stripe (up to :data:`MAX_STAGING_BYTES` in all);
    * the queue depth: ``io.queue_depth``, more where that does not keep two writes (pieces) in flight
      on each target, up to what the staging slots hold;
    * the blob granule (:attr:`IOGeometry.blob_align_bytes`): the least common multiple of the stripe
      width, the object size and the alignment (whole stripe units where over :data:`MAX_BLOB_ALIGN`);
    * a tier of one node's ``steady_reads``: enough read slots for two reads on each target.

    Args:
        caps: the tier's capabilities: its alignment, part sizes and device.
        io: the tier's ``io`` settings (the hierarchy's, with the tier's own ``io:`` entry merged in).
        facts: its file system's facts (None: a tier without one, such as memory or an object store).
        blob_bytes: the blob size the tier prefers (its kind's, or its ``blob_size``).
        chunk_bytes: the tier's own chunk (its constructor's, or its kind's), over ``io.chunk_bytes``. A
            memory tier's staging slots are the hierarchy's ``io.chunk_bytes`` whatever it says.
        direct: the tier's own O_DIRECT setting, over ``io.direct``; only where ``facts.direct``.
        one_file: a copy's blobs go into one data file.
        whole_blocks: size writes to the file system's block where it says nothing of stripes
            (:func:`stripes_of`), as a parallel file system wants whole stripes or blocks written (the
            ``pfs`` kind).
    """
    asked = io.chunk_bytes if chunk_bytes is None else chunk_bytes
    bound = max(MAX_STRIPE_CHUNK, asked)  # the largest chunk a stripe raises it to
    stripes = stripes_of(io, facts, least=caps.alignment_bytes, whole_blocks=whole_blocks)
    if stripes.unit_bytes is not None and stripes.unit_bytes > bound:
        stripes = Stripes()  # no chunk holds one unit: not sized for
    align = caps.alignment_bytes
    if stripes.unit_bytes is not None:
        align = max(align, min(MAX_FS_ALIGN, _largest_power_of_two_in(stripes.unit_bytes)))
    unit = stripes.unit_bytes or align
    width = unit * stripes.count
    lo, hi = caps.min_part_bytes, caps.max_part_bytes
    chunk = _within_parts(asked, width if width <= bound else unit, lo, hi)
    memory = caps.device not in ("file", "object")  # its blobs are memory: staging only for device copies
    slot = _round_up(io.chunk_bytes, align) if memory else _round_up(chunk, align)
    piece = _piece(slot, unit if slot % unit == 0 else align, lo)
    slots = max(STAGING_SLOTS, min(-(-2 * width // slot), MAX_STAGING_BYTES // slot))
    depth = max(io.queue_depth, min(slots * PIECES, -(-2 * width // piece)))
    read_slot = _round_up(READ_SLOT_BYTES, align)
    steady = READ_SLOTS if caps.shared else max(STEADY_READS, min(READ_SLOTS, -(-2 * width // read_slot)))
    wants_direct = io.direct if direct is None else direct
    if direct is None and facts is not None and facts.buffered_is_faster:
        wants_direct = False  # the tier's own direct=True still asks for O_DIRECT
    mem_align = caps.alignment_bytes if facts is None else max(PAGE, facts.dio_mem_align or 0)
    granule = _blob_align(stripes, width, align)
    return IOGeometry(
        alignment_bytes=align,
        direct=wants_direct and facts is not None and facts.direct,
        blob_bytes=_round_up(blob_bytes, granule),
        one_file=one_file,
        chunk_bytes=chunk,
        piece_bytes=piece,
        queue_depth=depth,
        staging_slots=slots,
        staging_slot_bytes=slot,
        read_slots=READ_SLOTS,
        read_slot_bytes=read_slot,
        memory_alignment_bytes=mem_align,
        steady_reads=steady,
        direct_read_min_bytes=DIRECT_READ_MIN,
        min_part_bytes=lo,
        max_part_bytes=hi,
        stripe_unit_bytes=unit,
        stripe_width_bytes=width,
        blob_align_bytes=granule,
    )


def _blob_align(stripes: Stripes, width: int, align: int) -> int:
    """What blobs are whole multiples of: the least common multiple of the stripe width, the object size
    and ``align``; whole stripe units where that is over :data:`MAX_BLOB_ALIGN`; ``align`` without
    stripes."""
    if stripes.unit_bytes is None:
        return align
    granule = math.lcm(width, stripes.object_bytes or 1, align)
    if granule <= MAX_BLOB_ALIGN:
        return granule
    unit = math.lcm(stripes.unit_bytes, align)
    return unit if unit <= MAX_BLOB_ALIGN else align


@dataclass(frozen=True)
class CheckpointGeometry:
    """The sizes of a hierarchy's checkpoints; made by :func:`checkpoint_geometry`.

    Attributes:
        align_bytes: the checkpoint's alignment (extents of large tensors, blob sizes, every I/O).
        blob_bytes: the target blob size of a save.
        read_slots: ``restore(into=)``'s staging buffers (one pool for the hierarchy).
        read_slot_bytes: the size of each.
        tiers: per tier name, its geometry in that alignment (:meth:`IOGeometry.aligned_to`).
        blob_align_bytes: a save's blobs are whole multiples of it (every tier's
            :attr:`IOGeometry.blob_align_bytes`, so that a data file holding them is too).
    """

    align_bytes: int
    blob_bytes: int
    read_slots: int
    read_slot_bytes: int
    tiers: Mapping[str, IOGeometry]
    blob_align_bytes: int = 0  # 0 (made by hand): the alignment

    def __post_init__(self) -> None:
        object.__setattr__(self, "blob_align_bytes", self.blob_align_bytes or self.align_bytes)

    def read_staging(self, align: int) -> tuple[int, int]:
        """``restore(into=)``'s slot size and the slots' memory alignment for a copy whose alignment is
        ``align`` (the one it was written with): :attr:`read_slot_bytes` rounded up to a multiple of it,
        in memory aligned to it and to what every tier's reads need (:meth:`IOGeometry.buffer_alignment`)."""
        mem = max([PAGE, align, *(g.buffer_alignment(align) for g in self.tiers.values())])
        return _round_up(self.read_slot_bytes, align), mem


def checkpoint_geometry(layout: LayoutConfig, tiers: Mapping[str, IOGeometry]) -> CheckpointGeometry:
    """A hierarchy's checkpoint geometry: the alignment is the largest of ``layout.align_bytes`` and
    every tier's; blobs are whole multiples of every tier's blob granule (their least common multiple;
    the largest alone where that is over :data:`MAX_BLOB_ALIGN`); the blob size is ``layout.blob_bytes``,
    else the largest any tier prefers, rounded up to that granule; ``restore(into=)`` reads through the
    most and largest slots any tier asks for."""
    align = max([layout.align_bytes, *(g.alignment_bytes for g in tiers.values())])
    blob = layout.blob_bytes or max(g.blob_bytes for g in tiers.values())
    aligned = {name: g.aligned_to(align) for name, g in tiers.items()}
    granules = [align, *(g.blob_align_bytes for g in aligned.values())]
    granule = math.lcm(*granules)
    if granule > MAX_BLOB_ALIGN:
        granule = max(granules)
    return CheckpointGeometry(
        align_bytes=align,
        blob_bytes=_round_up(blob, granule),
        read_slots=max(g.read_slots for g in aligned.values()),
        read_slot_bytes=max(g.read_slot_bytes for g in aligned.values()),
        tiers=aligned,
        blob_align_bytes=granule,
    )
