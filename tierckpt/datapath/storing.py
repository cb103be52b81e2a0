"""Which tiers store their copies compressed, and the writer a copy to a tier writes through (docs/tiers.md,
"Compression"): a tier's ``compress:`` setting and its :class:`~tierckpt.policies.compression.Adaptive`
(one per tier object, starting from what an earlier process measured of the tier where that is kept:
:mod:`~tierckpt.datapath.measured`), and :func:`storing_writer`, which puts a codec writer
(:mod:`~tierckpt.datapath.codecwrite`) in front of the tier's writer where the tier compresses.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierckpt.datapath import codecpool
from tierckpt.datapath.blobcopy import ordered_writer, writer_for
from tierckpt.datapath.codecwrite import CodecWriter, frame_bytes_for
from tierckpt.datapath.cpumeter import busy_cpu_seconds, usable_cpus
from tierckpt.datapath.measured import keeping_writer, start_from_kept
from tierckpt.format.frames import FrameIndex
from tierckpt.format.manifest import BlobEntry, Manifest, ManifestHead
from tierckpt.policies.compressconfig import CompressConfig, tier_compress
from tierckpt.policies.compression import Adaptive, Kind, frame_kinds
from tierckpt.tiers.base import Tier, TierWriter

__all__ = ["compresses", "encodes_raw_frames", "set_compression", "storing_writer"]


def set_compression(tier: Tier, cfg: CompressConfig | None = None, where: str | None = None) -> CompressConfig:
    """Give ``tier`` its compression setting and its :class:`~tierckpt.policies.compression.Adaptive`
    (kept where the setting is unchanged: one per tier object): ``cfg`` (an entry's ``compress:``), else
    what the tier has already, else the default for its capabilities.

    Raises:
        ConfigError: naming ``where`` (default: the tier), for compression asked of a gpu tier.
    """
    caps = tier.capabilities
    got = tier_compress(
        cfg if cfg is not None else tier.compress, caps.device, caps.shared, caps.persistent,
        where or f"tier {tier.name!r}: compress", caps.encoded_copies,
    )  # fmt: skip
    tier.compress = got
    if tier.adaptive is None or tier.adaptive.cfg != got:
        cpus = len(usable_cpus()) if busy_cpu_seconds() is not None else None  # None: the CPUs not counted
        tier.adaptive = Adaptive(got, got.threads or codecpool.default_threads(), cpus)
        start_from_kept(tier)  # what the last process measured of this tier, where kept (datapath.measured)
    return got


def compresses(tier: Tier) -> bool:
    """Whether copies written to ``tier`` go through a codec writer: its setting is not ``none`` (a gpu
    tier never compresses: its copies are device copies)."""
    cfg = tier.compress
    device_copies = tier.capabilities.device == "cuda" or tier.kind == "gpu"  # (a gpu tier on cpu, in tests)
    return cfg is not None and cfg.mode != "none" and tier.adaptive is not None and not device_copies


def _worth_encoding(
    tier: Tier, codec: Manifest | ManifestHead, background: bool, raw_of: FrameIndex | None = None
) -> bool:
    """Whether a copy of ``codec`` to ``tier`` goes through the codec writer: what the tier's
    :meth:`~tierckpt.policies.compression.Adaptive.encode_copy` says of its frames' kinds (``raw_of``: a
    compressed copy's index on the same frame grid, of whose frames only those stored raw count), with
    the budget that paces this writer (a copy ``auto`` knows pays nothing is written plain)."""
    adaptive = tier.adaptive
    if adaptive is None or adaptive.cfg.mode != "auto":
        return True
    table = codec.manifest() if isinstance(codec, ManifestHead) else codec
    kinds = frame_kinds([b.size for b in table.blobs], table.tensors, frame_bytes_for(table))
    asked: set[Kind] = set()
    t = 0  # each blob's first frame (the index's frames are on the same grid: blob-major)
    for blob in kinds:
        asked.update(k for i, k in enumerate(blob) if raw_of is None or not raw_of.width[t + i])
        t += len(blob)
    budget = tier.budget
    paced = budget.bytes_per_sec if budget is not None and budget.paces(background) else None
    return adaptive.encode_copy(asked, paced)


def _encodable(tier: Tier, codec: Manifest | ManifestHead, chunk_bytes: int) -> bool:
    """Whether ``tier`` compresses and a copy of ``codec`` in chunks of ``chunk_bytes`` can be encoded:
    blobs and chunks in whole multiples of the copy's alignment (as layouts make them), so that a stored
    stream padded to it ends inside its blob."""
    return compresses(tier) and chunk_bytes % codec.align == 0 and all(b.size % codec.align == 0 for b in codec.blobs)


def encodes_raw_frames(tier: Tier, head: ManifestHead, *, chunk_bytes: int, background: bool) -> bool:
    """Whether a copy to ``tier`` of the compressed copy ``head`` (its frame index) encodes the frames
    the source stored raw (:mod:`~tierckpt.datapath.copysource`): it has some, and the tier compresses
    and its ``auto`` does not say that none of their kinds pays. Asked once a copy (it counts for
    ``auto``'s rechecks); the copy's writer is then made with ``decided``. Where the copy's frames are
    of another size than the tier's (:func:`~tierckpt.datapath.codecwrite.frame_bytes_for`), every frame
    would be encoded again: every kind counts."""
    index = head.frames
    if index is None or index.compressed_frames() == index.total or not _encodable(tier, head, chunk_bytes):
        return False
    same_grid = frame_bytes_for(head) == index.frame_bytes
    return _worth_encoding(tier, head, background, raw_of=index if same_grid else None)


def storing_writer(
    tier: Tier,
    writer: TierWriter,
    blobs: Sequence[BlobEntry],
    *,
    chunk_bytes: int,
    background: bool,
    codec: Manifest | ManifestHead | None = None,
    held: Sequence[int] | None = None,
    decided: bool = False,
) -> TierWriter:
    """``writer`` (of ``tier``, for ``blobs``) as a copy writes through it: in the order the tier takes
    writes (:func:`~tierckpt.datapath.blobcopy.writer_for`); encoding raw bytes where ``codec`` (the
    copy's manifest, or its plan) is given and the tier :func:`compresses` (under ``auto``, unless what
    it measured says no kind of the copy pays: the copy is then plain); or taking a compressed
    copy's stored streams as they are, blob ``i`` ending at ``held[i]``. ``decided``: whether ``codec``
    is encoded was decided already (:func:`encodes_raw_frames`): ``auto`` is not asked again."""
    encode = (
        codec is not None
        and _encodable(tier, codec, chunk_bytes)
        and (decided or _worth_encoding(tier, codec, background))
    )
    if not encode and held is None:
        return writer_for(tier, writer, blobs)
    ordered, end = ordered_writer(tier, writer, blobs)
    if held is not None:
        for b, n in enumerate(held):
            end(b, n)
        return ordered
    assert codec is not None and tier.adaptive is not None
    kept = keeping_writer(tier, ordered)  # the codec writer's commit, once done, keeps what the tier measured
    try:
        return CodecWriter(tier, kept, end, codec, tier.adaptive, chunk_bytes=chunk_bytes, background=background)
    except BaseException:
        ordered.abort()
        raise
