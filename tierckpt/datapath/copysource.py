"""The source side of a copy between two tiers, as the two tiers' storing of it says (docs/tiers.md,
"Compression"): which bytes are read, which are written, and which manifest the destination commits.

| source copy | destination compresses | read | written | committed |
| --- | --- | --- | --- | --- |
| plain | no | raw blobs | as they are | the manifest |
| plain | yes | raw blobs | encoded by the codec writer | the manifest, wrapped with the new frame index |
| compressed (version 6) | no | decoded (the codec reader) | raw | the inner manifest |
| compressed (version 6) | yes | each blob's stored stream | as it is: the frames pass through | the version-6 file as it is |

So a copy between two tiers that both compress re-encodes nothing: a frame is encoded once, by the
first tier that stores it compressed. Commit records name the inner manifest's tag on every tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt.datapath.manifests import load_manifest, located
from tierckpt.datapath.openblobs import open_source, stored_entries
from tierckpt.datapath.throttle import throttled_reader
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frames import FORMAT_V6, unwrap_manifest
from tierckpt.format.manifest import HEADER, BlobEntry, Manifest, decode_head, manifest_version
from tierckpt.tiers.base import CheckpointKey, Tier, TierCopy, TierReader

__all__ = ["CopySource", "open_copy_source"]


@dataclass
class CopySource:
    """What a copy reads and what it commits.

    Attributes:
        reader: the source's reader (the caller closes it).
        blobs: the blobs as the destination reserves them (raw sizes: its layout and room).
        copied: the blobs as they are copied (their stored sizes where frames pass through).
        manifest: what the destination commits (a codec writer wraps it in its own frame index).
        inner: the copy's manifest (versions 1-5): what commit records name.
        plan: for a destination that encodes, the manifest its frames are planned from; else None.
        held: where frames pass through, each blob's stored bytes (the destination's writer is told
            where each blob ends); else None.
    """

    reader: TierReader
    blobs: Sequence[BlobEntry]
    copied: Sequence[BlobEntry]
    manifest: bytes
    inner: bytes
    plan: Manifest | None = None
    held: list[int] | None = None


def open_copy_source(
    src: Tier, key: CheckpointKey, copy: TierCopy, blobs: Sequence[BlobEntry] | None, *, encodes: bool, background: bool
) -> CopySource:
    """Open ``key``'s ``copy`` on ``src`` as the source of a copy to a tier that stores copies encoded
    (``encodes``) or not (see the module's table).

    Args:
        blobs: the copy's blobs, where the caller knows them (None: from its manifest).
        background: whether the reads are background work, for the source's budget.

    Raises:
        CorruptCheckpointError: the manifest (or its envelope) is damaged, naming the tier and step.
    """
    manifest = copy.read_manifest()
    if encodes and manifest_version(manifest[: HEADER.size]) == FORMAT_V6:
        try:
            head = decode_head(manifest)
            inner = unwrap_manifest(manifest)[0]
        except CorruptCheckpointError as e:
            raise located(e, src, key) from None
        stored = stored_entries(head)
        reader = throttled_reader(src, copy.reader(stored), background=background)
        copied = [BlobEntry(b.name, b.stored) for b in stored]
        return CopySource(reader, head.blobs, copied, manifest, inner, held=[b.size for b in copied])
    plan = load_manifest(src, key, copy=copy) if encodes or blobs is None else None
    if blobs is None:
        assert plan is not None
        blobs = plan.blobs
    reader, inner, blobs = open_source(src, copy, manifest, blobs, background=background)
    return CopySource(reader, blobs, blobs, inner, inner, plan if encodes else None)
