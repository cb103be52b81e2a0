"""The commit record's encoding (docs/format.md, "Commit record")."""

from __future__ import annotations

import struct

import pytest
import xxhash

from tierckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from tierckpt.format.record import CommitRecord, decode_record, encode_record, manifest_tag


def test_a_record_round_trips_and_is_deterministic() -> None:
    r = CommitRecord(100, 3, (1, 2**64 - 1, 0))
    data = encode_record(r)
    assert data == encode_record(r) and decode_record(data, 100) == r
    manifest = b"x" * 40 + struct.pack("<Q", 2**64 - 1)
    assert manifest_tag(manifest) == 2**64 - 1 and r.matches(1, manifest) and not r.matches(0, manifest)
    assert not r.matches(3, manifest)  # a rank beyond the record's ranks
    with pytest.raises(ValueError, match="2 manifest tags for 3 ranks"):
        encode_record(CommitRecord(1, 3, (1, 2)))


def test_every_damage_is_refused_naming_what() -> None:
    data = encode_record(CommitRecord(5, 2, (7, 8)))
    for i in range(len(data)):  # every byte, flipped
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises((CorruptCheckpointError, UnsupportedFormatError)):
            decode_record(bytes(bad), 5)
    with pytest.raises(CorruptCheckpointError, match="stored as step 6"):
        decode_record(data, 6)
    with pytest.raises(CorruptCheckpointError, match="shorter"):
        decode_record(data[:20])
    newer = bytearray(data)
    newer[8] = 2  # an intact record of a newer version
    newer[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(newer[:-8])))
    with pytest.raises(UnsupportedFormatError, match="version 2"):
        decode_record(bytes(newer))
