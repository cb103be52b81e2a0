"""``pfs`` tier: a shared directory on a parallel file system (Lustre, GPFS, BeeGFS, CephFS, NFS).

Differences from ``local``, all about metadata load and stripes: a copy's blobs go into one data file
(``one_file``; file count is load on the metadata server), blobs are larger (1 GiB by default), and I/O is aligned to the
larger of the file system's block size and the directory's preferred I/O size (``st_blksize``, which
parallel file systems may set to their stripe or block size), so writes cover whole blocks.
"""

from __future__ import annotations

import os

from tierckpt.tiers._files import FileTier

__all__ = ["PfsTier"]

_MAX_ALIGN = 16 << 20


class PfsTier(FileTier):
    """Shared parallel-file-system directory tier."""

    kind = "pfs"
    shared = True
    preferred_blob_bytes = 1 << 30
    one_file = True

    def _fs_alignment(self) -> int:
        """The larger of the file system's block size (``statvfs``) and the directory's preferred I/O
        size (``st_blksize``, which Lustre and GPFS set from the stripe or block size)."""
        try:
            blksize = max(os.statvfs(self.path).f_bsize, os.stat(self.path).st_blksize)
        except OSError:
            return 4096
        if blksize <= 4096 or blksize & (blksize - 1) or blksize > _MAX_ALIGN:
            return 4096
        return blksize
