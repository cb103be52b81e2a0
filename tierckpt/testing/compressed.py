"""Compressed copies made by hand, for tests of what readers make of them: a tier's plain copy of a
checkpoint read back and written again with its frames encoded as a test says (zstd, byte planes, raw
frames and planes), through the tier's own writer, its manifest wrapped in a version-6 envelope."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierckpt.format.codec import encode_frame
from tierckpt.format.frames import FrameIndex, IndexBuilder, wrap_manifest
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import BlobEntry, decode_head
from tierckpt.io.buffers import aligned_empty, ptr_mv
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Plan", "encode_blobs", "read_plain", "recompress", "write_encoded"]

#: how to store frame ``k`` of blob ``b``: ``(width, try_planes)`` for
#: :func:`~tierckpt.format.codec.encode_frame` (width 0: raw)
Plan = Callable[[int, int], tuple[int, int]]


def _all_planes(blob: int, k: int) -> tuple[int, int]:
    return 4, 0b1111


def read_plain(tier: Tier, key: CheckpointKey) -> tuple[bytes, list[torch.Tensor]]:
    """``key``'s plain copy on ``tier``: its manifest file and every blob's bytes."""
    with tier.open_copy(key) as copy:
        manifest = copy.read_manifest()
        head = decode_head(manifest)
        if head.frames is not None:
            raise ValueError(f"step {key.step} rank {key.rank} on tier {tier.name!r} is compressed already")
        r = copy.reader(head.blobs)
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


def encode_blobs(blobs: list[torch.Tensor], frame_bytes: int, plan: Plan, level: int) -> tuple[FrameIndex, list[bytes]]:
    """Each blob's stored stream, and the frame index, encoding frame ``k`` of blob ``b`` as ``plan(b, k)``."""
    builder = IndexBuilder([b.numel() for b in blobs], frame_bytes)
    streams = []
    for bi, b in enumerate(blobs):
        parts: list[bytes] = []
        for k, lo in enumerate(range(0, b.numel(), frame_bytes)):
            n = min(frame_bytes, b.numel() - lo)
            width, planes = plan(bi, k)
            enc = encode_frame(ptr_mv(b.data_ptr() + lo, n, writable=False), width, planes, level)
            builder.add(bi, k, enc.width, enc.planes, enc.lengths)
            parts += [bytes(s) for s in enc.streams]
        streams.append(b"".join(parts))
    return builder.build(), streams


def write_encoded(tier: Tier, key: CheckpointKey, manifest: bytes, streams: list[bytes], index: FrameIndex) -> None:
    """Write a copy of ``key`` to ``tier``: blob ``i``'s bytes are ``streams[i]`` then zeros up to the
    copy's alignment; its manifest file ``wrap_manifest(manifest, index)``. An object store's blobs are
    only that long; other tiers' are reserved at their raw sizes (files keep their place)."""
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
        w.commit(wrap_manifest(manifest, index))
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
    write_encoded(tier, key, manifest, streams, index)
    return index
