from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
import xxhash

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import BlobEntry, Manifest, TensorEntry, decode_manifest, encode_manifest


def sample(**kw: object) -> Manifest:
    m = Manifest(
        step=5, rank=0, world_size=1, align=4096,
        blobs=(BlobEntry("blob-00000.bin", 8192),),
        tensors=(TensorEntry("state['a']", "float32", (2, 3), 0, 0, 24, 123),
                 TensorEntry("state['b']", "bfloat16", (0,), 0, 0, 0, 0),
                 TensorEntry("state['c']", "int64", (), 0, 4096, 8, 2**64 - 1)),
        tree=b"\x80", has_pickle=False,
    )  # fmt: skip
    return dataclasses.replace(m, **kw)


def test_round_trip_and_determinism() -> None:
    m = sample()
    data = encode_manifest(m)
    assert data == encode_manifest(sample())
    assert decode_manifest(data) == m
    assert data[:8] == b"TIERCKPT"


def test_large_tree_is_compressed_transparently() -> None:
    tree = msgpack.packb({"params": list(range(50000))})
    m = sample(tree=tree)
    data = encode_manifest(m)
    assert len(data) < len(tree)
    assert decode_manifest(data).tree == tree


def reframe(payload: dict) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return (
        struct.pack("<8sHHIQ", b"TIERCKPT", 1, 0, 0, len(body))
        + body
        + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    )


def payload() -> dict:
    data = encode_manifest(sample())
    n = struct.unpack_from("<Q", data, 16)[0]
    return msgpack.unpackb(data[24 : 24 + n], raw=False)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p["blobs"][0].__setitem__(0, "../../etc/passwd"), "not a plain file name"),
        (lambda p: p["blobs"][0].__setitem__(0, ".hidden"), "not a plain file name"),
        (lambda p: p["tensors"][0].__setitem__(1, "float99"), "unknown dtype"),
        (lambda p: p["tensors"][0].__setitem__(5, 25), "length 25"),
        (lambda p: p["tensors"][2].__setitem__(4, 8192), "exceeds blob size"),
        (lambda p: p["tensors"][2].__setitem__(4, 8), "overlap"),
        (lambda p: p["tensors"][0].__setitem__(3, 4), "does not exist"),
        (lambda p: p["tensors"][0].__setitem__(2, [-1, 3]), "bad shape"),
        (lambda p: p.__setitem__("rank", 3), "rank 3 is invalid"),
        (lambda p: p.__setitem__("align", 1000), "power of two"),
        (lambda p: p.__setitem__("extra", 1), "keys differ"),
        (lambda p: p.__setitem__("tree_codec", "lz4"), "unknown tree codec"),
        (lambda p: p["blobs"].append(["blob-00000.bin", 10]), "repeat"),
    ],
)
def test_validation_names_the_problem(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    p = payload()
    mutate(p)
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_manifest(reframe(p))


def test_framing_errors() -> None:
    data = encode_manifest(sample())
    with pytest.raises(CorruptCheckpointError, match="too short"):
        decode_manifest(b"TIER")
    with pytest.raises(CorruptCheckpointError, match="bad magic"):
        decode_manifest(b"NOTACKPT" + data[8:])
    with pytest.raises(CorruptCheckpointError, match="version 9"):
        decode_manifest(data[:8] + struct.pack("<H", 9) + data[10:])
    with pytest.raises(CorruptCheckpointError, match="header says"):
        decode_manifest(data + b"x")
    flipped = bytearray(data)
    flipped[30] ^= 1
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        decode_manifest(bytes(flipped))
