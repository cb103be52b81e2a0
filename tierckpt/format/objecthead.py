"""The head object of a copy on an object store: its manifest, and which objects hold its blobs.

An object-store tier (``kind: s3``) cannot rename a directory into place: a copy's blobs are uploaded
under a key prefix of their own (its *version*), and the copy is published by one PUT of its head
object, written last, at a fixed key per step and rank (docs/format.md, "Copies on an object store"). A
PUT replaces an object whole, so a reader sees the previous head or the new one, never a mix; one GET of
the head gives the manifest and the blobs' keys, so neither a restore nor an eviction lists anything::

    offset  size  field
    0       8     magic "TCKPOBJ1"
    8       N     msgpack map: {"v": 1, "version": str, "spread": str, "blobs": [[name, size], ...],
                  "manifest": bin}
    8+N     8     xxh3-64 of bytes 0 … 8+N-1, little-endian

``version`` names the key prefix of the copy's blobs (``[0-9a-z-]``, at most 64 characters) and
``spread`` the hashed prefix in front of it ("" or 1 to 4 hex digits: the tier's ``hashed_prefixes`` when
the copy was written, so that a copy is found whatever the option is now); each blob
``name`` is the manifest's (``[A-Za-z0-9._-]``, at most 128 characters); a blob of size 0 has no object.
The manifest's bytes are the tier-independent manifest, unchanged. Pure: no I/O.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import MAX_PAYLOAD_BYTES

__all__ = [
    "BLOB_NAME_RE",
    "HEAD_MAGIC",
    "MAX_HEAD_BYTES",
    "SPREAD_RE",
    "VERSION_RE",
    "ObjectHead",
    "decode_head",
    "encode_head",
]

HEAD_MAGIC = b"TCKPOBJ1"
HEAD_VERSION = 1
#: a copy's version: the key prefix of its blobs (time-ordered, then random)
VERSION_RE = re.compile(r"[0-9a-z][0-9a-z-]{0,63}")
#: the hashed prefix of a copy's blobs: none, or 1 to 4 hex digits
SPREAD_RE = re.compile(r"[0-9a-f]{0,4}")
#: a blob's name as the head keeps it (and as its object key ends)
BLOB_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
#: the largest head a reader takes: the largest manifest, and room for its blobs' names
MAX_HEAD_BYTES = MAX_PAYLOAD_BYTES + (256 << 20)
MAX_BLOBS = 1 << 20
_SUM = struct.Struct("<Q")


@dataclass(frozen=True)
class ObjectHead:
    """What a copy's head object says.

    Attributes:
        version: the key prefix of the copy's blobs.
        spread: the hashed prefix in front of it ("": none).
        blobs: (name, size) of each blob, in the manifest's order.
        manifest: the manifest's bytes.
    """

    version: str
    spread: str
    blobs: tuple[tuple[str, int], ...]
    manifest: bytes


def encode_head(version: str, spread: str, blobs: Sequence[tuple[str, int]], manifest: bytes) -> bytes:
    """The head object's bytes.

    Raises:
        ValueError: a version or blob name outside the patterns above.
    """
    if not VERSION_RE.fullmatch(version):
        raise ValueError(f"object head: bad version {version!r}")
    if not SPREAD_RE.fullmatch(spread):
        raise ValueError(f"object head: bad spread {spread!r}")
    for name, size in blobs:
        if not BLOB_NAME_RE.fullmatch(name) or size < 0:
            raise ValueError(f"object head: bad blob {name!r} of {size} bytes")
    body: bytes = HEAD_MAGIC + msgpack.packb(
        {
            "v": HEAD_VERSION,
            "version": version,
            "spread": spread,
            "blobs": [[n, s] for n, s in blobs],
            "manifest": bytes(manifest),
        },
        use_bin_type=True,
    )
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_head(data: bytes, what: str) -> ObjectHead:
    """Read a head object, every field checked before it is used.

    Args:
        data: the object's bytes.
        what: where it came from, for errors (e.g. ``s3://bucket/prefix/manifests/step-…/rank-…``).

    Raises:
        CorruptCheckpointError: naming ``what`` and what is wrong (magic, checksum, a field).
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{what}: not a copy's head object: {why}")

    if len(data) < len(HEAD_MAGIC) + _SUM.size or len(data) > MAX_HEAD_BYTES:
        raise bad(f"{len(data)} bytes")
    if data[: len(HEAD_MAGIC)] != HEAD_MAGIC:
        raise bad(f"magic {data[: len(HEAD_MAGIC)]!r}")
    body, (want,) = data[: -_SUM.size], _SUM.unpack(data[-_SUM.size :])
    if xxhash.xxh3_64_intdigest(body) != want:
        raise bad("checksum mismatch")
    try:
        m: Any = msgpack.unpackb(body[len(HEAD_MAGIC) :], raw=False, strict_map_key=True, max_bin_len=MAX_HEAD_BYTES)
    except (ValueError, msgpack.UnpackException) as e:
        raise bad(f"msgpack: {e}") from None
    if not isinstance(m, dict) or set(m) != {"v", "version", "spread", "blobs", "manifest"}:
        raise bad("fields")
    if m["v"] != HEAD_VERSION:
        raise bad(f"head version {m['v']!r} (this tierckpt reads {HEAD_VERSION}: upgrade it)")
    version, blobs, manifest = m["version"], m["blobs"], m["manifest"]
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise bad(f"version {version!r}")
    if not isinstance(m["spread"], str) or not SPREAD_RE.fullmatch(m["spread"]):
        raise bad(f"spread {m['spread']!r}")
    if not isinstance(manifest, bytes):
        raise bad("manifest")
    if not isinstance(blobs, list) or len(blobs) > MAX_BLOBS:
        raise bad("blobs")
    out = []
    for b in blobs:
        ok = isinstance(b, list) and len(b) == 2 and isinstance(b[0], str) and isinstance(b[1], int)
        if not ok or not BLOB_NAME_RE.fullmatch(b[0]) or not 0 <= b[1] < 1 << 63:
            raise bad(f"blob {b!r}")
        out.append((b[0], b[1]))
    if len({n for n, _ in out}) != len(out):
        raise bad("a blob name twice")
    return ObjectHead(version, m["spread"], tuple(out), manifest)
