"""``pfs`` tier: a shared directory on a parallel file system (Lustre, GPFS, BeeGFS, CephFS, NFS).

Differences from ``local``, all about metadata load and stripes: a copy's blobs go into one data file
(``one_file``; file count is load on the metadata server), blobs are larger (1 GiB by default), I/O is
sized for the file system's stripes (writes of whole stripe units, chunks of whole stripes, blobs of
whole stripe widths and objects: :func:`tierckpt.io.geometry.io_geometry`) and, where the file system
names none, aligned to the larger of its block size and the directory's preferred I/O size
(``st_blksize``, which parallel file systems may set to their stripe or block size: ``whole_blocks``),
and its ``file_layout`` option sets the layout of new data files on CephFS and Lustre
(:mod:`tierckpt.io.fslayout`).
"""

from __future__ import annotations

from tierckpt.tiers._files import FileTier

__all__ = ["PfsTier"]


class PfsTier(FileTier):
    """Shared parallel-file-system directory tier; see :class:`~tierckpt.tiers._files.FileTier` for the
    arguments."""

    kind = "pfs"
    shared = True
    preferred_blob_bytes = 1 << 30  # declared: an input of the geometry (Tier)
    one_file = True
    whole_blocks = True
