"""Compressed tier copies: the frame index and the version-6 manifest file that carries it.

docs/format.md ("Compressed copies (version 6)") specifies it byte by byte. A tier copy whose blobs are
stored encoded keeps, in its ``manifest`` file, an *envelope*: the unchanged manifest (versions 1-5) and
a :class:`FrameIndex` saying how each blob's frames are stored. :func:`wrap_manifest` makes that file,
:func:`unwrap_manifest` takes it apart, and :func:`~tierckpt.format.manifest.decode_head` reads it like
any manifest file (its head's ``frames`` set). The index itself is in
:mod:`tierckpt.format.frameindex` (the envelope's payload: :mod:`tierckpt.format.envelope`), whose names this
module exports too. Pure: no I/O.
"""

from __future__ import annotations

import struct

import msgpack
import xxhash

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.envelope import codec_map, envelope_inner, index_from_codec, split_envelope
from tierckpt.format.frameindex import (
    FORMAT_V6,
    Frame,
    FrameIndex,
    IndexBuilder,
    check_index,
    frame_count,
)
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import (
    HEADER,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    READ_VERSIONS,
    decode_head,
    inner_head,
    manifest_version,
    unframe,
)

__all__ = [
    "FORMAT_V6",
    "Frame",
    "FrameIndex",
    "IndexBuilder",
    "check_index",
    "envelope_inner",
    "frame_count",
    "held_sizes",
    "unwrap_manifest",
    "wrap_manifest",
]

_TRAILER = struct.Struct("<Q")


def wrap_manifest(manifest: bytes, index: FrameIndex) -> bytes:
    """The version-6 manifest file of a copy stored as ``index`` says: ``manifest`` (versions 1-5) and the
    index, framed as docs/format.md says. Deterministic.

    Raises:
        ValueError: ``manifest`` is not a manifest file of versions 1-5, or ``index`` does not fit it.
    """
    version = manifest_version(manifest[: HEADER.size])
    if version not in READ_VERSIONS:
        raise ValueError(f"wrap_manifest: the manifest's version is {version}, not one of {READ_VERSIONS}")
    try:
        check_index(index, [b.size for b in decode_head(manifest).blobs])
    except CorruptCheckpointError as e:
        raise ValueError(f"wrap_manifest: the index does not fit the manifest: {e}") from None
    payload: bytes = msgpack.packb({"manifest": manifest, "codec": codec_map(index)}, use_bin_type=True)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"wrap_manifest: the envelope's payload is {len(payload)} bytes, more than a reader accepts")
    framed = HEADER.pack(MAGIC, FORMAT_V6, 0, 0, len(payload)) + payload
    return framed + _TRAILER.pack(xxhash.xxh3_64_intdigest(framed))


def unwrap_manifest(data: bytes) -> tuple[bytes, FrameIndex | None]:
    """A manifest file's inner manifest and frame index: ``(data, None)`` for a file that is not version 6.

    Checks the envelope (framing, checksum, keys, types, column lengths) and the inner manifest's head;
    not the index's rules against the blobs (:func:`check_index`).

    Raises:
        CorruptCheckpointError: saying what is wrong.
    """
    if manifest_version(data[: HEADER.size]) != FORMAT_V6:
        return data, None
    _, payload = unframe(data)
    inner, codec = split_envelope(payload)
    head = inner_head(inner)
    return inner, index_from_codec(codec, tuple(b.size for b in head.blobs))


def held_sizes(manifest_file: bytes) -> list[int] | None:
    """The bytes each blob of a copy holds (its stored stream, rounded up to the manifest's ``align``), or
    None for a manifest file that is not version 6 (its blobs hold their whole size).

    Raises:
        CorruptCheckpointError: a damaged version-6 file.
    """
    if manifest_version(manifest_file[: HEADER.size]) != FORMAT_V6:
        return None
    head = decode_head(manifest_file)
    assert head.frames is not None
    return [round_up(h, head.align) for h in head.frames.held]
