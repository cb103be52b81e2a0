"""``pfs`` tier: a shared directory on a parallel file system (Lustre, GPFS, BeeGFS, CephFS, NFS).

Differences from ``local``, all about metadata load and stripes: blobs are larger (1 GiB by default), so
each rank creates few files (file count is load on the metadata server), and I/O is aligned to the file
system's preferred block (``st_blksize``: the stripe size on Lustre, the block size on GPFS), so every
write covers whole stripes.
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

    def _fs_alignment(self) -> int:
        try:
            blksize = os.statvfs(self.path).f_bsize
        except OSError:
            return 4096
        if blksize <= 4096 or blksize & (blksize - 1) or blksize > _MAX_ALIGN:
            return 4096
        return blksize
