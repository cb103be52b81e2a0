"""Compressed copies made by hand, for tests of what readers make of them: a tier's plain copy of a
checkpoint read back and written again with its frames encoded as a test says (zstd, byte planes, raw
frames and planes), through the tier's own writer, its manifest wrapped in a version-6 envelope."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierckpt.datapath.openblobs import open_blobs
from tierckpt.format.codec import encode_frame
from tierckpt.format.frames import FrameIndex, IndexBuilder, envelope_inner, wrap_manifest
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import BlobEntry, decode_head
from tierckpt.io.buffers import aligned_empty, ptr_mv
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Plan", "Stored", "encode_blobs", "encode_frames", "index_of", "read_plain", "recompress", "write_encoded"]

#: how to store frame ``k`` of blob ``b``: ``(width, try_planes)`` for
#: :func:`~tierckpt.format.codec.encode_frame` (width 0: raw)
Plan = Callable[[int, int], tuple[int, int]]


def _all_planes(blob: int, k: int) -> tuple[int, int]:
    return 4, 0b1111


def read_plain(tier: Tier, key: CheckpointKey) -> tuple[bytes, list[torch.Tensor]]:
    """``key``'s copy on ``tier`` as a plain copy: its (inner) manifest file and every blob's raw bytes
    (a compressed copy's frames decoded)."""
    with tier.open_copy(key) as copy:
        manifest = copy.read_manifest()
        head = decode_head(manifest)
        if head.frames is not None:
            manifest = bytes(envelope_inner(manifest))
        r = open_blobs(tier, copy, head, background=False)
        try:
            blobs = []
            for i, b in enumerate(head.blobs):
                buf = aligned_empty(max(b.size, 1), tier.geometry.buffer_alignment(head.align))[: b.size]
                if b.size:
                    assert r.read(i, 0, buf.data_ptr(), b.size).result() == b.size
                blobs.append(buf)
        finally:
            r.close()
    return manifest, blobs


@dataclass
class Stored:
    """One frame as a copy stores it (what :func:`~tierckpt.format.codec.encode_frame` made of it, or what a
    test puts in its place)."""

    width: int
    planes: int
    streams: list[bytes]


def encode_frames(blobs: list[torch.Tensor], frame_bytes: int, plan: Plan, level: int = 1) -> list[list[Stored]]:
    """Each blob's frames, frame ``k`` of blob ``b`` encoded as ``plan(b, k)`` says."""
    out: list[list[Stored]] = []
    for bi, b in enumerate(blobs):
        frames = []
        for k, lo in enumerate(range(0, b.numel(), frame_bytes)):
            n = min(frame_bytes, b.numel() - lo)
            width, planes = plan(bi, k)
            enc = encode_frame(ptr_mv(b.data_ptr() + lo, n, writable=False), width, planes, level)
            frames.append(Stored(enc.width, enc.planes, [bytes(x) for x in enc.streams]))
        out.append(frames)
    return out


def index_of(frames: list[list[Stored]], sizes: list[int], frame_bytes: int) -> tuple[FrameIndex, list[bytes]]:
    """The frame index of ``frames`` (of blobs of raw ``sizes``) and each blob's stored stream."""
    builder = IndexBuilder(sizes, frame_bytes)
    for bi, blob in enumerate(frames):
        for k, f in enumerate(blob):
            builder.add(bi, k, f.width, f.planes, [len(x) for x in f.streams] if f.width else [])
    return builder.build(), [b"".join(x for f in blob for x in f.streams) for blob in frames]


def encode_blobs(
    blobs: list[torch.Tensor], frame_bytes: int, plan: Plan, level: int = 1
) -> tuple[FrameIndex, list[bytes]]:
    """Each blob's stored stream, and the frame index, encoding frame ``k`` of blob ``b`` as ``plan(b, k)``."""
    return index_of(encode_frames(blobs, frame_bytes, plan, level), [b.numel() for b in blobs], frame_bytes)


def write_encoded(tier: Tier, key: CheckpointKey, manifest: bytes, streams: list[bytes], envelope: bytes) -> None:
    """Write a copy of ``key`` to ``tier``: blob ``i``'s bytes are ``streams[i]`` then zeros up to the
    copy's alignment; its manifest file ``envelope`` (``wrap_manifest(manifest, index)``, or what a test
    makes instead); ``manifest`` is the inner manifest. An object store's blobs are only that long; other
    tiers' are reserved at their raw sizes (files keep their place)."""
    head = decode_head(manifest)
    align = head.align
    padded = [round_up(len(s), align) for s in streams]
    obj = tier.capabilities.device == "object"
    entries = [BlobEntry(b.name, p if obj else b.size) for b, p in zip(head.blobs, padded)]
    step = tier.capabilities.max_part_bytes or tier.geometry.read_chunk(align)
    bufs = []
    w = tier.reserve(key, entries)
    try:
        futs = []
        for i, (s, p) in enumerate(zip(streams, padded)):
            buf = aligned_empty(max(p, 1), tier.geometry.buffer_alignment(align))
            buf.zero_()
            if s:
                buf[: len(s)].copy_(torch.frombuffer(bytearray(s), dtype=torch.uint8))
            bufs.append(buf)
            futs += [w.write(i, o, buf.data_ptr() + o, min(step, p - o)) for o in range(0, p, step)]
        for f in futs:
            f.result()
        w.commit(envelope)
    except BaseException:
        w.abort()
        raise


def recompress(
    tier: Tier, key: CheckpointKey, *, frame_bytes: int = 64 << 10, plan: Plan = _all_planes, level: int = 1
) -> FrameIndex:
    """Replace ``key``'s plain copy on ``tier`` by the same checkpoint stored compressed, each frame as
    ``plan(blob, k)`` says (default: 4 byte planes, each tried with zstd); its frame index. The copy's
    manifest, and so the step's commit record, stay valid (a version-6 file's tag is its inner manifest's)."""
    manifest, blobs = read_plain(tier, key)
    index, streams = encode_blobs(blobs, frame_bytes, plan, level)
    write_encoded(tier, key, manifest, streams, wrap_manifest(manifest, index))
    return index
