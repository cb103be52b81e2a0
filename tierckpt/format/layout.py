"""Aggregation planner: tensors → few large aligned blobs. Pure function, no I/O.

Greedy bucketing in state order (like DCP's ``_split_by_size_and_type`` and torchsnapshot's slab
batcher): items are appended to the current blob until the next one would cross the target blob size.
Each extent starts on the largest power of two that is at most 1/64 of its length, between
``small_align`` (64 B, enough for any dtype and for SIMD) and ``align``: a large tensor (>= 64 x
``align``, 256 KiB for 4 KiB pages) starts on an ``align`` boundary, so it can be read alone with
O_DIRECT, and alignment padding never costs more than 1/64 of the bytes (20,000 tensors of 1-64 KiB
wasted 6 % of the blob bytes when every extent of at least ``align`` bytes started on a page, and a
1.1 MiB tensor nearly half when ``align`` is a 1 MiB Lustre stripe). Blobs are written and read whole,
in aligned chunks, so the alignment of a tensor inside them costs no I/O. Blob sizes are rounded up to
``align`` (zero padding), so a blob is always written and read in whole aligned units, or to a larger
``blob_align`` (a parallel file system's stripe width: a data file holding the blobs back to back is
then whole stripes, and each blob starts on one), which pads a blob by less than ``blob_align``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tierckpt.format.manifest import BlobEntry

__all__ = ["PAD_RATIO", "SMALL_ALIGN", "Extent", "Layout", "data_offsets", "extent_align", "plan", "round_up"]

SMALL_ALIGN = 64
PAD_RATIO = 64  #: alignment padding before an extent is at most 1/PAD_RATIO of its length


def round_up(n: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


class Extent(NamedTuple):
    """Where one item's bytes live: ``length`` bytes at ``offset`` of blob number ``blob``."""

    blob: int
    offset: int
    length: int


@dataclass(frozen=True)
class Layout:
    """The extent of every item, as three columns in item order, and the (aligned) size of every blob."""

    blobs: list[int]
    offsets: list[int]
    lengths: list[int]
    blob_sizes: tuple[int, ...]
    align: int

    @property
    def extents(self) -> tuple[Extent, ...]:
        """The extents as rows (built on each access; the data path reads the columns)."""
        return tuple(map(Extent, self.blobs, self.offsets, self.lengths))

    @property
    def total_bytes(self) -> int:
        return sum(self.blob_sizes)


def extent_align(n: int, align: int, small_align: int = SMALL_ALIGN) -> int:
    """Alignment of an extent of ``n`` bytes: the largest power of two <= ``n / PAD_RATIO``, clamped to
    [``small_align``, ``align``]."""
    return min(align, max(small_align, 1 << max(0, (n // PAD_RATIO).bit_length() - 1)))


def plan(
    lengths: Sequence[int],
    *,
    align: int,
    blob_bytes: int,
    small_align: int = SMALL_ALIGN,
    blob_align: int | None = None,
) -> Layout:
    """Assign every item an extent.

    Args:
        lengths: byte length of each item, in the order they are stored.
        align: power of two; blob sizes, and the offsets of extents of at least ``PAD_RATIO * align``
            bytes, are multiples of it.
        blob_bytes: target blob size; an item larger than it gets a blob of its own.
        small_align: the least alignment of any extent (see :func:`extent_align`).
        blob_align: blob sizes are multiples of it (a multiple of ``align``; None: ``align``).

    Returns:
        A deterministic :class:`Layout`: the same lengths always give the same extents.
    """
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    if small_align <= 0 or small_align & (small_align - 1) or small_align > align:
        raise ValueError(f"small_align must be a power of two <= align, got {small_align}")
    if blob_bytes < align:
        raise ValueError(f"blob_bytes ({blob_bytes}) must be at least align ({align})")
    granule = align if blob_align is None else blob_align
    if granule <= 0 or granule % align:
        raise ValueError(f"blob_align ({blob_align}) must be a positive multiple of align ({align})")
    lengths = list(lengths)
    if lengths and min(lengths) < 0:
        raise ValueError(f"negative length {min(lengths)}")
    blobs: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    blob, end = 0, 0
    big_mask, small_mask = align - 1, small_align - 1
    lo, hi = small_align * PAD_RATIO, align * PAD_RATIO  # extent_align(), inlined: ~0.5 us per call saved
    for n in lengths:
        if n == 0:  # zero-size tensors take no bytes and never start a blob
            blobs.append(blob)
            offsets.append(end)
            continue
        if n >= hi:
            mask = big_mask
        elif n < lo:
            mask = small_mask
        else:
            mask = (1 << ((n // PAD_RATIO).bit_length() - 1)) - 1
        off = (end + mask) & ~mask
        if off + n > blob_bytes and end > 0:
            sizes.append(round_up(end, granule))
            blob, off = blob + 1, 0
        blobs.append(blob)
        offsets.append(off)
        end = off + n
    if end > 0:
        sizes.append(round_up(end, granule))
    return Layout(blobs=blobs, offsets=offsets, lengths=lengths, blob_sizes=tuple(sizes), align=align)


def data_offsets(blobs: Sequence[BlobEntry]) -> list[int]:
    """Where each blob starts in a ``data.bin`` holding them all back to back."""
    return list(itertools.accumulate((b.size for b in blobs), initial=0))[: len(blobs)]
