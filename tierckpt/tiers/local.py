"""``local`` tier: a node-local directory (NVMe, SSD). 4 KiB-aligned O_DIRECT blobs of 256 MiB."""

from __future__ import annotations

from tierckpt.tiers._files import FileTier

__all__ = ["LocalTier"]


class LocalTier(FileTier):
    """Node-local directory tier; see :class:`~tierckpt.tiers._files.FileTier` for the arguments."""

    kind = "local"
    shared = False
    preferred_blob_bytes = 256 << 20  # declared: an input of the geometry (Tier)
