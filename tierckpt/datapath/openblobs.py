"""The one place the data path opens a tier copy's blobs for reading: restores (fresh, ``into=``, resharded),
``verify``, the mover's copies between tiers (its source side) and, through them, prefetch and the DCP
reader.

A copy's blobs are opened as the copy holds them (:func:`stored_entries`: an encoded blob's stored bytes,
else its raw size), its reads paced by the tier's bandwidth budget (:mod:`tierckpt.datapath.throttle`:
stored bytes are what is charged) and, for a copy whose manifest file carries a frame index (version 6),
decoded by :func:`~tierckpt.datapath.codecread.codec_reader`: callers read raw blob offsets whatever the
copy's encoding.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierckpt.datapath.codecread import codec_reader
from tierckpt.datapath.manifests import located
from tierckpt.datapath.throttle import throttled_reader
from tierckpt.datapath.verifier import Where
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frames import FORMAT_V6, unwrap_manifest
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import HEADER, BlobEntry, Manifest, ManifestHead, decode_head, manifest_version
from tierckpt.tiers.base import Tier, TierCopy, TierReader

__all__ = ["open_blobs", "open_source", "stored_entries"]


def stored_entries(head: ManifestHead | Manifest) -> list[BlobEntry]:
    """The blobs of a copy as a tier holds them: the manifest's entries, each with ``held`` (its stored
    stream's length rounded up to the copy's alignment) where the copy has a frame index."""
    frames = head.frames
    if frames is None:
        return list(head.blobs)
    return [BlobEntry(b.name, b.size, round_up(h, head.align)) for b, h in zip(head.blobs, frames.held, strict=True)]


def open_blobs(
    tier: Tier, copy: TierCopy, head: ManifestHead | Manifest, *, background: bool, where: Where | None = None
) -> TierReader:
    """Open the blobs of ``copy`` (of ``tier``, whose manifest's head is ``head``) for raw reads.

    Args:
        tier: the tier.
        copy: the copy, opened (its blobs are opened now, and their sizes checked).
        head: its validated manifest head (or whole manifest).
        background: whether the reads are background work (a demotion or promotion) for the tier's budget.
        where: the copy, as decoding errors name it (default: ``tier`` and the copy's step).

    Returns:
        A reader of raw blob offsets (decoding a compressed copy's frames as they are read); the caller
        closes it.

    Raises:
        CorruptCheckpointError: a blob's file or object is shorter than the copy holds (truncated).
    """
    reader = throttled_reader(tier, copy.reader(stored_entries(head)), background=background)
    frames = head.frames
    if frames is None:
        return reader
    where = where or Where(tier.name, copy.key.step)
    g = tier.geometry
    return codec_reader(
        reader,
        head,
        frames,
        where=where,
        mem_align=g.buffer_alignment(head.align),
        direct_min=g.direct_read_min_bytes,
        staging_bytes=g.read_staging_bytes,
    )


def open_source(
    tier: Tier, copy: TierCopy, manifest: bytes, blobs: Sequence[BlobEntry], *, background: bool
) -> tuple[TierReader, bytes, Sequence[BlobEntry]]:
    """The source side of a copy between tiers (the mover's): ``copy``'s blobs opened for raw reads, the
    manifest the destination commits (a compressed copy's inner manifest: the destination encodes
    as its own settings say, or not at all) and the blobs to copy.

    A copy's manifest is copied as it is, unvalidated (a copy is as good as its source), except that a
    version-6 file's envelope and head are decoded to know how its blobs are stored.

    Args:
        tier: the source tier.
        copy: the copy, opened.
        manifest: its manifest file's bytes (``copy.read_manifest()``).
        blobs: its blobs (the raw entries of its manifest).
        background: whether the reads are background work, for the tier's budget.

    Raises:
        CorruptCheckpointError: the envelope or head is damaged (naming the tier and step).
    """
    if manifest_version(manifest[: HEADER.size]) != FORMAT_V6:
        return throttled_reader(tier, copy.reader(blobs), background=background), manifest, blobs
    try:
        head = decode_head(manifest)
        inner = unwrap_manifest(manifest)[0] if head.frames is not None else manifest
    except CorruptCheckpointError as e:
        raise located(e, tier, copy.key) from None
    return open_blobs(tier, copy, head, background=background), inner, head.blobs
