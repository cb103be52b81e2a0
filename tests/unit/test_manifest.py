from __future__ import annotations

import dataclasses
import math
import struct

import msgpack
import pytest
import xxhash
import zstandard

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import BlobEntry, Manifest, TensorEntry, TensorTable, decode_manifest, encode_manifest


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


def reframe(payload: dict, version: int = 1) -> bytes:
    return reframe_body(msgpack.packb(payload, use_bin_type=True), version)


def reframe_body(body: bytes, version: int = 3) -> bytes:
    return (
        struct.pack("<8sHHIQ", b"TIERCKPT", version, 0, 0, len(body))
        + body
        + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    )


def payload(version: int = 1) -> dict:
    data = encode_manifest(sample(version=version))
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
    p = payload()  # the row-per-tensor table of format version 1
    mutate(p)
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_manifest(reframe(p))


def u64s(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.__setitem__("dtype_names", ["float99", "bfloat16", "int64"]), "unknown dtype 'float99'"),
        (lambda t: t.__setitem__("dtype", b"\x00\x01\x07"), "state\\['c'\\]: dtype index 7"),
        (lambda t: t.__setitem__("ndim", b"\x02\x01\x41"), "state\\['c'\\]: bad shape \\(rank 65\\)"),
        (lambda t: t.__setitem__("length", u64s(25, 0, 8)), "state\\['a'\\]: length 25 != 6 x 4"),
        (lambda t: t.__setitem__("offset", u64s(0, 0, 8192)), "state\\['c'\\]: extent \\[8192, 8200\\) exceeds"),
        (lambda t: t.__setitem__("offset", u64s(0, 0, 8)), "extents of state\\['a'\\] and state\\['c'\\] overlap"),
        (lambda t: t.__setitem__("offset", u64s(0, 0, 4100)), "state\\['c'\\]: offset 4100 is not aligned"),
        (lambda t: t.__setitem__("offset", u64s(1 << 63, 0, 4096)), "state\\['a'\\]: bad extent"),
        (lambda t: t.__setitem__("blob", struct.pack("<3I", 4, 0, 0)), "state\\['a'\\]: blob 4 does not exist"),
        (lambda t: t.__setitem__("dims", u64s(2, 3)), "tensors.dims is not 3 x 8 bytes"),
        (lambda t: t.__setitem__("checksum", b"\x00" * 23), "tensors.checksum is not 3 x 8 bytes"),
        (lambda t: t.__setitem__("count", 4), "tensors.path is not a list of 4 strings"),
        (lambda t: t.__setitem__("path", ["a", 1, "c"]), "tensors.path is not a list of 3 strings"),
        (lambda t: t.pop("ndim"), "not a version-2 table"),
    ],
)
def test_v2_table_validation_names_the_problem(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    p = payload(version=2)
    mutate(p["tensors"])
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_manifest(reframe(p, version=2))


def sample_1d() -> Manifest:
    """Only 1-d tensors: the table's vectorized length check."""
    return sample(
        tensors=(TensorEntry("state['a']", "float32", (6,), 0, 0, 24, 1),
                 TensorEntry("state['b']", "bfloat16", (0,), 0, 0, 0, 0),
                 TensorEntry("state['c']", "int64", (1,), 0, 4096, 8, 2)),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.__setitem__("length", u64s(24, 0, 16)), "state\\['c'\\]: length 16 != 1 x 8"),
        (lambda t: t.__setitem__("dims", u64s(6, 0, 1 << 62)), "state\\['c'\\]: length 8 != 4611686018427387904 x 8"),
        (
            lambda t: t.__setitem__("blob", struct.pack("<3I", 0, 0, 1 << 31)),
            "state\\['c'\\]: blob 2147483648 does not",
        ),
        (lambda t: t.__setitem__("offset", u64s(0, 0, 4098)), "state\\['c'\\]: offset 4098 is not aligned"),
    ],
)
def test_v2_table_validation_of_1d_tensors(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = encode_manifest(dataclasses.replace(sample_1d(), version=2))
    assert decode_manifest(data).tensors.shapes == [(6,), (0,), (1,)]
    p = msgpack.unpackb(data[24 : 24 + struct.unpack_from("<Q", data, 16)[0]], raw=False)
    mutate(p["tensors"])
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_manifest(reframe(p, version=2))


def test_v5_is_written_by_default_and_v1_to_v4_stay_readable() -> None:
    m = sample()
    assert m.version == 5
    assert struct.unpack_from("<H", encode_manifest(m), 8)[0] == 5
    v5 = payload(version=5)
    assert {k: v5.pop(k) for k in ("chunk_bytes", "meshes", "sharding")} == {
        "chunk_bytes": 4 << 20, "meshes": [],
        "sharding": {"count": 0, "row": b"", "mesh": b"", "stored": b"", "dims": b"", "placements": b"", "chunks": b""},
    }  # fmt: skip
    assert v5 == payload(version=4)  # v5 added the sharding fields (and commit records, outside the manifest)
    assert isinstance(payload(version=3)["tensors"], dict)
    assert payload(version=3)["tensors"] == payload(version=2)["tensors"]  # v3 changed the tree only
    assert payload(version=4) == payload(version=3)  # v4 changed the checksum only
    for v in (1, 2, 3, 4):
        old = sample(version=v)
        data = encode_manifest(old)
        assert struct.unpack_from("<H", data, 8)[0] == v
        back = decode_manifest(data)
        assert back == old and back.version == v
        assert list(back.tensors) == list(decode_manifest(encode_manifest(m)).tensors)
    with pytest.raises(ValueError, match="version 6"):
        encode_manifest(sample(version=6))


def test_table_columns_and_rows_agree() -> None:
    m = decode_manifest(encode_manifest(sample()))
    t = m.tensors
    assert isinstance(t, TensorTable) and len(t) == 3
    assert t[2] == TensorEntry("state['c']", "int64", (), 0, 4096, 8, 2**64 - 1)
    assert t[-1] == t[2] and t[1:] == [t[1], t[2]]
    assert t.shapes == [(2, 3), (0,), ()] and t.checksums[2] == 2**64 - 1
    assert t.order() == [0, 2]  # non-empty tensors in (blob, offset) order
    assert m.tensor_bytes == 32


def test_many_tensors_round_trip_both_versions() -> None:
    n = 3000
    rows = [
        TensorEntry(f"state['t{i}']", ("float32", "bfloat16", "uint8")[i % 3], (i % 7 + 1, 2)[: 1 + i % 2],
                    i % 2, 0, 0, i * 7919)
        for i in range(n)
    ]  # fmt: skip
    ends = [0, 0]
    for i, r in enumerate(rows):
        size = {"float32": 4, "bfloat16": 2, "uint8": 1}[r.dtype] * math.prod(r.shape)
        rows[i] = r._replace(offset=ends[r.blob], length=size)
        ends[r.blob] += 64
    m = sample(tensors=rows, blobs=(BlobEntry("b0", ends[0]), BlobEntry("b1", ends[1])))
    for v in (1, 2):
        back = decode_manifest(encode_manifest(dataclasses.replace(m, version=v)))
        assert list(back.tensors) == rows
        assert back.tensors.order() == sorted(range(n), key=lambda i: (rows[i].blob, rows[i].offset))


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


def test_extents_out_of_disk_order_are_sorted_and_checked() -> None:
    """The table's rows need not be in disk order: order() sorts by (blob, offset), overlaps are found."""
    from tierckpt.format.table import check_extents

    def table(blobs: list[int], offsets: list[int]) -> TensorTable:
        return TensorTable(["a", "b", "c"], ["uint8"] * 3, [(4,)] * 3, blobs, offsets, [4] * 3, [0] * 3)

    t = table([0, 0, 0], [8, 0, 4])
    check_extents(t, [12])
    assert t.order() == [1, 2, 0]
    t = table([1, 0, 0], [0, 4, 0])
    check_extents(t, [8, 8])
    assert t.order() == [2, 1, 0]
    with pytest.raises(CorruptCheckpointError, match="extents of c and a overlap"):
        check_extents(table([0, 0, 0], [6, 0, 4]), [12])


def test_head_is_validated_before_the_table() -> None:
    """decode_head checks framing and blobs alone; the table's problems surface in manifest()."""
    from tierckpt.format.manifest import decode_head

    p = payload(version=2)
    p["tensors"]["offset"] = b"\x00" * 5  # a broken column
    head = decode_head(reframe(p, version=2))
    assert [b.name for b in head.blobs] == [b.name for b in sample().blobs]
    with pytest.raises(CorruptCheckpointError, match="tensors.offset"):
        head.manifest()
    p = payload(version=2)
    p["blobs"][0][0] = "../escape"
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        decode_head(reframe(p, version=2))


def test_payload_shape_errors() -> None:
    """The head's pass walks the payload map key by key (skipping the table and the tree): a key given
    twice, a key missing, bytes after the map, a map cut short or no map at all are each refused."""
    p = payload(version=3)
    body = msgpack.packb(p, use_bin_type=True)
    assert decode_manifest(reframe_body(body)).tensors.paths == sample().tensors.paths
    missing = dict(p)
    del missing["tree"]
    nine = msgpack.packb(missing, use_bin_type=True)
    assert nine[0] == 0x89
    # ten entries with "step" twice and no tree (unpackb would have kept one "step" silently)
    twice = b"\x8a" + nine[1:] + msgpack.packb("step") + msgpack.packb(5)
    cases = [
        (twice, "keys differ"),
        (msgpack.packb(missing, use_bin_type=True), "keys differ"),
        (body + b"\xc0", "1 bytes after the map"),
        (body[:-1], "not msgpack"),
        (msgpack.packb(list(p.values()), use_bin_type=True), "not msgpack"),
        (b"\xc1" + body[1:], "not msgpack"),
    ]
    for bad, message in cases:
        with pytest.raises(CorruptCheckpointError, match=message):
            decode_manifest(reframe_body(bad))


def test_head_leaves_the_table_and_tree_undecoded_until_asked() -> None:
    """A broken tree (not msgpack bytes) does not stop the head; manifest() names it."""
    from tierckpt.format.manifest import decode_head

    p = payload(version=3)
    p["tree"] = ["not", "bytes"]
    head = decode_head(reframe_body(msgpack.packb(p, use_bin_type=True)))
    assert head.step == 5
    with pytest.raises(CorruptCheckpointError, match="tree is not bytes"):
        head.manifest()
    # bytes the head's pass only skips over: a path that is not UTF-8, a map key that is no string
    p = payload(version=3)
    body = msgpack.packb(p, use_bin_type=True)
    path = msgpack.packb("state['a']")
    assert body.count(path) == 1
    head = decode_head(reframe_body(body.replace(path, path[:1] + b"\xff" + path[2:])))
    with pytest.raises(CorruptCheckpointError, match="tensors is not msgpack"):
        head.manifest()
    p["tensors"][7] = 1
    head = decode_head(reframe_body(msgpack.packb(p, use_bin_type=True)))
    with pytest.raises(CorruptCheckpointError, match="tensors is not msgpack"):
        head.manifest()


def test_the_writer_compresses_a_tree_only_within_what_readers_accept() -> None:
    """zstd shrinks a list of equal values 3,000x: within the floor it is compressed, above it stored raw,
    and both read back; a frame that declares more than the bound is refused before it is expanded."""
    from tierckpt.format.manifest import MAX_TREE_FLOOR, MAX_TREE_RATIO

    for n, codec in ((1 << 20, "zstd"), (MAX_TREE_FLOOR + 100, "none")):
        tree = msgpack.packb([None] * n)
        data = encode_manifest(sample(tree=tree))
        assert payload_of(data)["tree_codec"] == codec
        assert decode_manifest(data).tree == tree
    p = payload_of(encode_manifest(sample(tree=msgpack.packb([None] * (1 << 20)))))
    packed = p["tree"]
    assert zstandard.frame_content_size(packed) > len(packed) * MAX_TREE_RATIO
    big = zstandard.ZstdCompressor(write_content_size=True).compress(b"\xc0" * (MAX_TREE_FLOOR + 1))
    for bad, message in ((big, "more than 32 times"), (packed + b"x", "unused data"), (packed[:-3], "decompress"),
                         (b"\x28\xb5\x2f\xfd\x00\x00", "does not declare"), (b"nope", "zstd")):  # fmt: skip
        p["tree"] = bad
        with pytest.raises(CorruptCheckpointError, match=message):
            decode_manifest(reframe_v4(p))


def payload_of(data: bytes) -> dict:
    n = struct.unpack_from("<Q", data, 16)[0]
    return msgpack.unpackb(data[24 : 24 + n], raw=False)


def reframe_v4(payload: dict, version: int = 5) -> bytes:
    body = struct.pack("<8sHHIQ", b"TIERCKPT", version, 0, 0, 0)
    body = body[:16] + struct.pack("<Q", len(msgpack.packb(payload, use_bin_type=True)))
    body += msgpack.packb(payload, use_bin_type=True)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def test_v4_checksums_the_header_and_tells_newer_from_damaged() -> None:
    from tierckpt.errors import UnsupportedFormatError

    data = encode_manifest(sample())
    for bit in range(24 * 8):  # every header bit: magic, version, flags, reserved, length
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << bit % 8
        with pytest.raises(CorruptCheckpointError):
            decode_manifest(bytes(flipped))
    p = payload_of(data)
    assert decode_manifest(reframe_v4(p, version=5)) == sample()
    with pytest.raises(
        UnsupportedFormatError,
        match="format version 7 by a newer tierckpt; this reader knows versions 1, 2, 3, 4, 5, 6",
    ):
        decode_manifest(reframe_v4(p, version=7))
    damaged = bytearray(reframe_v4(p, version=7))
    damaged[30] ^= 1
    with pytest.raises(CorruptCheckpointError, match="version 7 is unknown"):
        decode_manifest(bytes(damaged))
    with pytest.raises(CorruptCheckpointError, match="version 0 is unknown"):
        decode_manifest(reframe_v4(p, version=0))
    reserved = bytearray(reframe_v4(p))
    reserved[12] = 1
    reserved[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(reserved[:-8])))
    with pytest.raises(CorruptCheckpointError, match="reserved"):
        decode_manifest(bytes(reserved))
