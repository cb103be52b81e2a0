"""The envelope of a compressed tier copy's manifest file (version 6): its payload taken apart into the
inner manifest file and the frame index's columns, and put together from an index.

docs/format.md ("Compressed copies (version 6)", "Envelope") specifies it byte by byte; the index is
:mod:`tierckpt.format.frameindex`. Pure: no I/O. Every column's type and length is checked before a value
is made of its entries.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frameindex import U32, FrameIndex, check_frame_bytes, held_message, index_error

__all__ = ["codec_map", "envelope_inner", "index_from_codec", "split_envelope"]

_ENVELOPE_KEYS = ("manifest", "codec")
_CODEC_KEYS = ("name", "frame_bytes", "held", "width", "planes", "lengths")
_TRAILER_BYTES = 8
_HEADER_BYTES = 24  # a manifest file's framing (docs/format.md, "Framing"): the payload starts here
#: How wrap_manifest's msgpack starts: a map of 2, the key "manifest", then the inner file as bin.
_ENVELOPE_START = b"\x82\xa8manifest"


def codec_map(index: FrameIndex) -> dict[str, Any]:
    """The ``codec`` map of an envelope's payload (what msgpack packs)."""
    return {
        "name": index.name,
        "frame_bytes": index.frame_bytes,
        "held": struct.pack(f"<{len(index.held)}Q", *index.held),
        "width": index.width,
        "planes": index.planes,
        "lengths": index.lengths.astype(U32).tobytes(),
    }


def _read_map(u: msgpack.Unpacker, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    """The next value of ``u``: a map with exactly ``keys``, in that order."""
    if u.read_map_header() != len(keys):
        raise index_error(f"{what} keys are not {', '.join(keys)}")
    d = {}
    for key in keys:
        if u.unpack() != key:
            raise index_error(f"{what} keys are not {', '.join(keys)}")
        d[key] = _read_map(u, _CODEC_KEYS, "codec") if key == "codec" else u.unpack()
    return d


def split_envelope(payload: memoryview) -> tuple[bytes, dict[str, Any]]:
    """A version-6 file's inner manifest file and its ``codec`` map (keys and types checked; ``payload``:
    the file's payload, its framing checked).

    Raises:
        CorruptCheckpointError: naming the key or field.
    """
    u = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True, max_buffer_size=max(1, len(payload)))
    u.feed(payload)
    try:
        d = _read_map(u, _ENVELOPE_KEYS, "envelope")
        end = u.tell()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # not a map, ends early, bad bytes
        raise index_error(f"envelope is not msgpack: {e}") from e
    if end != len(payload):
        raise index_error(f"envelope is not msgpack: {len(payload) - end} bytes after the map")
    codec = d["codec"]
    if not isinstance(d["manifest"], bytes):
        raise index_error("envelope.manifest is not bytes")
    if not isinstance(codec["name"], str):
        raise index_error(f"codec.name {codec['name']!r} is not a string")
    check_frame_bytes(codec["frame_bytes"])
    for col in ("held", "width", "planes", "lengths"):
        if not isinstance(codec[col], bytes):
            raise index_error(f"codec.{col} is not bytes")
    for col, size in (("held", 8), ("lengths", 4)):
        if len(codec[col]) % size:
            raise index_error(f"codec.{col}: {len(codec[col])} bytes, not a whole number of {size}-byte entries")
    return d["manifest"], codec


def index_from_codec(codec: dict[str, Any], sizes: tuple[int, ...]) -> FrameIndex:
    """The index a ``codec`` map (from :func:`split_envelope`) stores, for blobs of raw ``sizes``: its
    columns' lengths checked, not its rules (:func:`check_index`)."""
    held = codec["held"]
    if len(held) != 8 * len(sizes):  # before a number is made of each entry
        raise index_error(held_message(len(held), len(sizes)))
    return FrameIndex(
        name=codec["name"],
        frame_bytes=codec["frame_bytes"],
        held=struct.unpack(f"<{len(held) // 8}Q", held),
        width=codec["width"],
        planes=codec["planes"],
        lengths=np.frombuffer(codec["lengths"], U32),
        sizes=sizes,
    )


def envelope_inner(data: bytes) -> memoryview:
    """Where a version-6 file holds its inner manifest file (located, not checked: its commit record's tag
    is the inner's trailer, docs/format.md).

    Raises:
        CorruptCheckpointError: the file is not laid out as a version-6 writer lays it out.
    """
    p = _HEADER_BYTES
    start = p + len(_ENVELOPE_START)
    if bytes(data[p:start]) != _ENVELOPE_START or len(data) < start + 1:
        raise index_error("version-6 file does not start with its inner manifest")
    tag, sizes = data[start], {0xC4: 1, 0xC5: 2, 0xC6: 4}
    if tag not in sizes:
        raise index_error("version-6 file's inner manifest is not bytes")
    body = start + 1 + sizes[tag]
    n = int.from_bytes(data[start + 1 : body], "big")
    if body + n > len(data) - _TRAILER_BYTES:
        raise index_error("version-6 file's inner manifest runs past the file")
    return memoryview(data)[body : body + n]
