"""The source side of a copy between two tiers, as the two tiers' storing of it says (docs/tiers.md,
"Compression"): which bytes are read, which are written, and which manifest the destination commits.

| source copy | destination compresses | read | written | committed |
| --- | --- | --- | --- | --- |
| plain | no | raw blobs | as they are | the manifest |
| plain | yes | raw blobs | encoded by the codec writer | the manifest, wrapped with the new frame index |
| compressed (version 6) | no | decoded (the codec reader) | raw | the inner manifest |
| compressed (version 6) | yes, and encodes some raw frame | each blob's stored stream | compressed frames as they are, raw ones encoded by the codec writer (:mod:`~tierckpt.datapath.recode`) | the inner manifest, wrapped with the new frame index |
| compressed (version 6) | yes, and encodes no raw frame | each blob's stored stream | as it is: the frames pass through | the version-6 file as it is |

So a copy between two tiers that both compress encodes only what the source left raw: a frame stored
compressed is encoded once, by the first tier that compresses it, and keeps that tier's level; a frame
stored raw (an upper ``auto`` tier where compression did not pay) is planned by the destination as a
plain copy's frame is. Where the destination encodes no raw frame (there is none, or its ``auto`` says
none of their kinds pays: :func:`~tierckpt.datapath.storing.encodes_raw_frames`), the copy is whole
and cheapest: the version-6 file as it is. A source whose frames are of another size than the
destination's (:func:`~tierckpt.datapath.codecwrite.frame_bytes_for`) is decoded and every frame
encoded again, never given a frame index of the wrong grid. Commit records name the inner manifest's
tag on every tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from tierckpt.datapath.blobcopy import copy_blobs
from tierckpt.datapath.codecwrite import frame_bytes_for
from tierckpt.datapath.manifests import load_manifest, located
from tierckpt.datapath.openblobs import open_blobs, open_source, stored_entries
from tierckpt.datapath.recode import FrameWriter, recode_blobs
from tierckpt.datapath.throttle import throttled_reader
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frames import FORMAT_V6, FrameIndex, unwrap_manifest
from tierckpt.format.manifest import HEADER, BlobEntry, Manifest, ManifestHead, decode_head, manifest_version
from tierckpt.io.buffers import StagingPool
from tierckpt.tiers.base import CheckpointKey, Tier, TierCopy, TierReader, TierWriter

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
        frames: where the source's compressed frames pass through and its raw ones are encoded, its
            frame index (``copied`` are then its stored streams, read by
            :func:`~tierckpt.datapath.recode.recode_blobs`); else None.
        decided: whether the destination encodes was decided here (its writer does not ask ``auto``).
    """

    reader: TierReader
    blobs: Sequence[BlobEntry]
    copied: Sequence[BlobEntry]
    manifest: bytes
    inner: bytes
    plan: Manifest | ManifestHead | None = None
    held: list[int] | None = None
    frames: FrameIndex | None = None
    decided: bool = False

    def copy(
        self, src: Tier, dst: Tier, writer: TierWriter, key: CheckpointKey, chunk: int, pool: Callable[[], StagingPool]
    ) -> None:
        """Copy what the source reads to ``writer`` (of ``dst``): :func:`~tierckpt.datapath.blobcopy.copy_blobs`
        (``chunk``: bytes an operation), or where :attr:`frames` is set
        :func:`~tierckpt.datapath.recode.recode_blobs` (``writer`` takes encoded frames then); ``pool``:
        the destination's staging buffers."""
        if self.frames is None or self.plan is None:
            copy_blobs(src, self.reader, dst, writer, key, self.copied, chunk, pool)
            return
        frames = cast(FrameWriter, writer)  # a codec writer, as the copy's ``decided`` made it
        recode_blobs(src, self.reader, frames, key, self.blobs, self.frames, self.plan.align, pool)


def open_copy_source(
    src: Tier,
    key: CheckpointKey,
    copy: TierCopy,
    blobs: Sequence[BlobEntry] | None,
    *,
    encodes: bool,
    background: bool,
    recodes: Callable[[ManifestHead], bool] | None = None,
) -> CopySource:
    """Open ``key``'s ``copy`` on ``src`` as the source of a copy to a tier that stores copies encoded
    (``encodes``) or not (see the module's table).

    Args:
        blobs: the copy's blobs, where the caller knows them (None: from its manifest).
        background: whether the reads are background work, for the source's budget.
        recodes: asked once of a compressed copy, where the destination encodes: whether it encodes the
            frames the copy stored raw (:func:`~tierckpt.datapath.storing.encodes_raw_frames`); None: it
            does not.

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
        index = head.frames
        if index is not None and recodes is not None and recodes(head):
            if frame_bytes_for(head) != index.frame_bytes:  # another grid: decoded, every frame encoded
                reader = open_blobs(src, copy, head, background=background)
                return CopySource(reader, head.blobs, head.blobs, inner, inner, head, decided=True)
            reader = throttled_reader(src, copy.reader(stored), background=background)
            return CopySource(reader, head.blobs, stored, inner, inner, head, frames=index, decided=True)
        reader = throttled_reader(src, copy.reader(stored), background=background)
        copied = [BlobEntry(b.name, b.stored) for b in stored]
        return CopySource(reader, head.blobs, copied, manifest, inner, held=[b.size for b in copied])
    plan = load_manifest(src, key, copy=copy) if encodes or blobs is None else None
    if blobs is None:
        assert plan is not None
        blobs = plan.blobs
    reader, inner, blobs = open_source(src, copy, manifest, blobs, background=background)
    return CopySource(reader, blobs, blobs, inner, inner, plan if encodes else None)
