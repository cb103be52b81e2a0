"""A step's commit record: the proof that every rank's copy of a step is in (docs/format.md, "Commit record").

A step counts as committed on a tier only once the tier holds its record. The record is written once
per tier, after every rank's copy of the step is durable there (by one rank on a shared tier, by each
node on a node-local one, docs/distributed.md), and names, per rank, the checksum trailer of the
manifest that rank committed: a reader checks the manifest it reads against it, so that a copy replaced
by a later save whose commit did not complete is never mixed with the other ranks' copies.

Framing as a manifest's (magic, u16 version, u16 flags, u32 reserved, u64 payload length, msgpack
payload, xxh3-64 of everything before it), with its own magic.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import xxhash

from tierckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from tierckpt.format.envelope import envelope_inner
from tierckpt.format.manifest import ENVELOPE_VERSION, HEADER, manifest_version

__all__ = ["RECORDS_SINCE", "RECORD_MAGIC", "CommitRecord", "decode_record", "encode_record", "manifest_tag"]

RECORD_MAGIC = b"TCKCOMIT"
#: The first manifest format version whose writers publish commit records: a copy of that version or
#: later is committed only once its step's record is there (older copies are committed by themselves).
RECORDS_SINCE = 5
RECORD_VERSION = 1
_HEADER = struct.Struct("<8sHHIQ")
_TRAILER = struct.Struct("<Q")
_MAX_PAYLOAD = 1 << 26  # 64 MiB: 8 bytes a rank, far beyond any job
_KEYS = ("step", "world_size", "manifests")


@dataclass(frozen=True)
class CommitRecord:
    """A step's commit record.

    Attributes:
        step: the step.
        world_size: the number of ranks that saved it.
        manifests: per rank (index = rank), the xxh3-64 trailer of the manifest it committed
            (:func:`manifest_tag`).
    """

    step: int
    world_size: int
    manifests: tuple[int, ...]

    def matches(self, rank: int, manifest: bytes) -> bool:
        """Whether ``manifest`` is the copy rank ``rank`` committed for this record."""
        return 0 <= rank < self.world_size and self.manifests[rank] == manifest_tag(manifest)


def manifest_tag(manifest: bytes) -> int:
    """A manifest file's identity: its trailing xxh3-64 (of header and payload; docs/format.md). A
    compressed copy's file (version 6) has its inner manifest's, the same on every tier."""
    data = envelope_inner(manifest) if manifest_version(manifest[: HEADER.size]) == ENVELOPE_VERSION else manifest
    if len(data) < _TRAILER.size:
        raise CorruptCheckpointError(f"manifest: {len(data)} bytes, too short to have a checksum trailer")
    return int(_TRAILER.unpack_from(data, len(data) - _TRAILER.size)[0])


def encode_record(record: CommitRecord) -> bytes:
    """The record's bytes (deterministic: the same record always gives the same bytes)."""
    if len(record.manifests) != record.world_size:
        raise ValueError(f"commit record: {len(record.manifests)} manifest tags for {record.world_size} ranks")
    tags = struct.pack(f"<{record.world_size}Q", *record.manifests)
    payload: bytes = msgpack.packb({"step": record.step, "world_size": record.world_size, "manifests": tags})
    framed = _HEADER.pack(RECORD_MAGIC, RECORD_VERSION, 0, 0, len(payload)) + payload
    return framed + _TRAILER.pack(xxhash.xxh3_64_intdigest(framed))


def _bad(msg: str, step: int | None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"commit record: {msg}", step=step)


def decode_record(data: bytes, step: int | None = None) -> CommitRecord:
    """Parse and validate a record's bytes (``step``: the step whose record it is stored as).

    Raises:
        CorruptCheckpointError: the bytes are not an intact record (of ``step``).
        UnsupportedFormatError: an intact record of a newer version.
    """
    if len(data) < _HEADER.size + _TRAILER.size:
        raise _bad(f"{len(data)} bytes, shorter than header and trailer", step)
    magic, version, flags, reserved, n = _HEADER.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise _bad(f"magic is {magic!r}, not {RECORD_MAGIC!r}", step)
    if n > _MAX_PAYLOAD or len(data) != _HEADER.size + n + _TRAILER.size:
        raise _bad(f"payload length {n} does not match the file's {len(data)} bytes", step)
    (digest,) = _TRAILER.unpack_from(data, _HEADER.size + n)
    if digest != xxhash.xxh3_64_intdigest(memoryview(data)[: _HEADER.size + n]):
        raise _bad("checksum mismatch", step)
    if version != RECORD_VERSION:
        raise UnsupportedFormatError(
            f"commit record: written in version {version} by a newer tierckpt; this reader knows version "
            f"{RECORD_VERSION}"
        )
    if flags or reserved:
        raise _bad(f"flags {flags} / reserved {reserved} must be 0", step)
    try:
        d = msgpack.unpackb(memoryview(data)[_HEADER.size : _HEADER.size + n], strict_map_key=True)
    except Exception as e:
        raise _bad(f"payload is not msgpack ({e})", step) from None
    if not isinstance(d, dict) or tuple(d) != _KEYS:
        raise _bad(f"payload keys must be {list(_KEYS)}", step)
    s, w, tags = d["step"], d["world_size"], d["manifests"]
    if type(s) is not int or s < 0 or (step is not None and s != step):
        raise _bad(f"step is {s!r}, stored as step {step}", step)
    if type(w) is not int or not 1 <= w <= 1 << 24:
        raise _bad(f"world_size {w!r} is not in [1, 2^24]", step)
    if not isinstance(tags, bytes) or len(tags) != 8 * w:
        raise _bad(f"manifests must be {8 * w} bytes (8 a rank)", step)
    return CommitRecord(s, w, struct.unpack(f"<{w}Q", tags))
