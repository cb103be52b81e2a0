"""Where a per-node copy's blobs are: the location block a file tier appends to its manifest file.

On a file tier written with ``files: per_node`` (docs/distributed.md, "A per-node data file"), the ranks
of one node keep their blobs in one shared data file of the step directory, each rank's back to back in
its own region. The manifest's bytes cannot say where: they are the same on every tier a copy is demoted
or promoted to, and the step's commit record names each rank's copy by their trailing checksum. So the
``manifest`` file of such a copy holds the manifest bytes, unchanged, followed by this block, which the
tier strips before it hands the manifest on (docs/format.md, "Per-node data files")::

    offset  size  field
    0       8     magic "TCKPLOC1"
    8       2     version, u16: 1
    10      2     flags, u16: 0
    12      4     name length K, u32: 1 to 255
    16      K     the node file's name (UTF-8), matching NODE_FILE_RE whole
    16+K    8     offset, u64: where blob 0 starts in the node file
    24+K    8     xxh3-64 of the block's first 24 + K bytes

Blob *i* is at ``offset`` plus the sizes of blobs 0 … *i*-1, as in ``data.bin``. A reader of an earlier
version takes the whole file for a manifest and refuses it (the file is longer than its header says):
never read wrong. Pure: no I/O.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import xxhash

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import HEADER, MAGIC, TRAILER_BYTES

__all__ = [
    "LOCATION_MAGIC",
    "MAX_LOCATION_BYTES",
    "NODE_FILE_RE",
    "Location",
    "block_start",
    "decode_location",
    "encode_location",
    "split_location",
]

LOCATION_MAGIC = b"TCKPLOC1"
LOCATION_VERSION = 1
#: a node file's name: ``node-`` + the node's first global rank (5 digits) + its creator (host, pid,
#: 8 hex digits) + ``.data``
NODE_FILE_RE = re.compile(r"node-\d{5}-[^/\x00]+\.data")
_FIXED = struct.Struct("<8sHHI")  # magic, version, flags, name length
_OFFSET = struct.Struct("<Q")
_SUM = struct.Struct("<Q")
MAX_NAME_BYTES = 255
#: the largest block there can be (a reader reads no more past a manifest's framing)
MAX_LOCATION_BYTES = _FIXED.size + MAX_NAME_BYTES + _OFFSET.size + _SUM.size


@dataclass(frozen=True)
class Location:
    """A per-node copy's place: the node file's name (in the copy's step directory) and where its blob 0
    starts in it."""

    name: str
    offset: int


def encode_location(loc: Location) -> bytes:
    """The block of ``loc``.

    Raises:
        ValueError: a name that does not match :data:`NODE_FILE_RE` or is longer than 255 bytes, or an
            offset outside ``[0, 2**63)``.
    """
    raw = loc.name.encode()
    if not NODE_FILE_RE.fullmatch(loc.name) or not 1 <= len(raw) <= MAX_NAME_BYTES:
        raise ValueError(f"location: {loc.name!r} is not a node file's name")
    if not 0 <= loc.offset < 1 << 63:
        raise ValueError(f"location: offset {loc.offset!r} is out of range")
    body = _FIXED.pack(LOCATION_MAGIC, LOCATION_VERSION, 0, len(raw)) + raw + _OFFSET.pack(loc.offset)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def block_start(head: bytes) -> int | None:
    """Where a location block would start in a manifest file whose first bytes are ``head`` (at least a
    manifest header's): the length its header gives the manifest (header, payload, trailer); None where
    ``head`` is not a manifest's header."""
    if len(head) < HEADER.size:
        return None
    magic, _, _, _, n = HEADER.unpack_from(head)
    return HEADER.size + n + TRAILER_BYTES if magic == MAGIC else None


def split_location(data: bytes, where: str = "manifest file") -> tuple[bytes, Location | None]:
    """A manifest file's bytes as (the manifest, its location block or None).

    Bytes that do not start with a manifest's header, or hold no more than its framing says, are
    returned as they are, with None: the manifest's decoder judges them. Bytes past the framing must be
    one whole, valid location block (:func:`decode_location`).

    Raises:
        CorruptCheckpointError: naming ``where``: bytes past the manifest that are not a valid block.
    """
    end = block_start(data)
    if end is None or len(data) <= end:
        return data, None
    return data[:end], decode_location(memoryview(data)[end:], where)


def decode_location(block: bytes | memoryview, where: str = "manifest file") -> Location:
    """The location block ``block`` (exactly its bytes), checked whole: magic, version, flags, name length
    and pattern, offset range, checksum.

    Raises:
        CorruptCheckpointError: naming ``where`` and what is wrong (a block cut short or followed by more
            bytes included).
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {len(block)} bytes past the manifest are no location block: {why}")

    if len(block) < _FIXED.size + 1 + _OFFSET.size + _SUM.size:
        raise bad("too short")
    magic, version, flags, k = _FIXED.unpack_from(block)
    if magic != LOCATION_MAGIC:
        raise bad(f"bad magic {bytes(magic)!r}")
    if version != LOCATION_VERSION or flags != 0:
        raise bad(f"version {version}, flags {flags} (this reader knows version 1, flags 0)")
    if not 1 <= k <= MAX_NAME_BYTES or len(block) != _FIXED.size + k + _OFFSET.size + _SUM.size:
        raise bad(f"a name of {k} bytes in a block of {len(block)}")
    body = block[: _FIXED.size + k + _OFFSET.size]
    (digest,) = _SUM.unpack_from(block, len(body))
    if digest != xxhash.xxh3_64_intdigest(body):
        raise bad("checksum mismatch")
    try:
        name = bytes(block[_FIXED.size : _FIXED.size + k]).decode()
    except UnicodeDecodeError:
        raise bad("the name is not UTF-8") from None
    if not NODE_FILE_RE.fullmatch(name):
        raise bad(f"{name!r} is not a node file's name")
    (offset,) = _OFFSET.unpack_from(block, _FIXED.size + k)
    if offset >= 1 << 63:
        raise bad(f"offset {offset} is out of range")
    return Location(name, offset)
