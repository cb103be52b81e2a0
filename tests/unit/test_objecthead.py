"""The head object of a copy on an object store (tierckpt.format.objecthead): round trip, and every
damaged or hostile head refused with a CorruptCheckpointError, never misread."""

from __future__ import annotations

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.objecthead import HEAD_MAGIC, decode_head, encode_head

BLOBS = [("blob-00000.bin", 123), ("blob-00001.bin", 0)]


def test_round_trip() -> None:
    head = decode_head(encode_head("18a-00ff", "7f", BLOBS, b"\x00manifest"), "here")
    assert (
        head.version == "18a-00ff"
        and head.spread == "7f"
        and head.blobs == tuple(BLOBS)
        and head.manifest == b"\x00manifest"
    )


@given(st.integers(0, 200), st.integers(0, 7))
def test_any_bit_flip_is_refused(pos: int, bit: int) -> None:
    data = bytearray(encode_head("18a-00ff", "", BLOBS, b"manifest bytes"))
    data[pos % len(data)] ^= 1 << bit
    with pytest.raises(CorruptCheckpointError, match="where: not a copy's head object"):
        decode_head(bytes(data), "where")


def _framed(fields: object) -> bytes:
    body = HEAD_MAGIC + msgpack.packb(fields, use_bin_type=True)
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


@pytest.mark.parametrize(
    "fields",
    [
        {"v": 2, "version": "a", "spread": "", "blobs": [], "manifest": b""},
        {"v": 1, "version": "../x", "spread": "", "blobs": [], "manifest": b""},
        {"v": 1, "version": "a", "spread": "", "blobs": [["../../etc/passwd", 1]], "manifest": b""},
        {"v": 1, "version": "a", "spread": "", "blobs": [["b", -1]], "manifest": b""},
        {"v": 1, "version": "a", "spread": "", "blobs": [["b", 1], ["b", 2]], "manifest": b""},
        {"v": 1, "version": "a", "spread": "", "blobs": [["b", 1]], "manifest": "text"},
        {"v": 1, "version": "a", "spread": "", "blobs": [["b", 1]]},
        {"v": 1, "version": "a", "spread": "../", "blobs": [], "manifest": b""},
        {"v": 1, "version": "a", "spread": "abcde", "blobs": [], "manifest": b""},
        [1, 2, 3],
    ],
)
def test_hostile_fields_are_refused(fields: object) -> None:
    with pytest.raises(CorruptCheckpointError, match="not a copy's head object"):
        decode_head(_framed(fields), "where")


def test_encode_refuses_bad_names() -> None:
    with pytest.raises(ValueError, match="bad blob"):
        encode_head("a", "", [("a/b", 1)], b"")
    with pytest.raises(ValueError, match="bad version"):
        encode_head("A B", "", [], b"")
    with pytest.raises(ValueError, match="bad spread"):
        encode_head("a", "x/", [], b"")
