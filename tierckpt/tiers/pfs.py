"""``pfs`` tier: a shared directory on a parallel file system (Lustre, GPFS, BeeGFS, CephFS, NFS).

Differences from ``local``, all about metadata load and stripes: a copy's blobs go into one data file
(``one_file``; file count is load on the metadata server), blobs are larger (1 GiB by default), and I/O is
aligned to the larger of the file system's block size and the directory's preferred I/O size
(``st_blksize``, which parallel file systems may set to their stripe or block size), so writes cover
whole blocks (``whole_blocks``: :func:`tierckpt.io.geometry.io_geometry` reads it with the file
system's facts).
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
