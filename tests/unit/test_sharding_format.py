"""Format version 5's sharding fields (docs/format.md, "Sharding"): they round-trip, and every damaged or
inconsistent record is refused naming the field, never decoded into a wrong restore."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import xxhash

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import BlobEntry, Manifest, TensorEntry, decode_manifest, encode_manifest
from tierckpt.format.sharding import REPLICATE, SHARD, Mesh, Placement, ShardRow, chunk_span, shard_box

MESH = Mesh((4,), (0, 1, 2, 3))


def sample() -> Manifest:
    """Rank 1 of 4: rows 3-5 of a (10, 6) Shard(0) tensor, a replicated (3, 3) one that rank 0 stores,
    and rows 1024-2047 of a (4096, 4) one (16 KiB: four 4 KiB chunks)."""
    return Manifest(
        step=5, rank=1, world_size=4, align=4096, blobs=(BlobEntry("blob-00000.bin", 20480),),
        tensors=(TensorEntry("state['w']", "float32", (3, 6), 0, 0, 72, 11),
                 TensorEntry("state['r']", "float32", (3, 3), 0, 0, 0, 12),
                 TensorEntry("state['b']", "float32", (1024, 4), 0, 4096, 16384, 13)),
        tree=msgpack.packb({"w": 0, "r": 1, "b": 2}), has_pickle=False, chunk_bytes=4096, meshes=(MESH,),
        sharding={0: ShardRow(0, (10, 6), (Placement(SHARD, 0),), True),
                  1: ShardRow(0, (3, 3), (Placement(REPLICATE),), False),
                  2: ShardRow(0, (4096, 4), (Placement(SHARD, 0),), True, (1, 2, 3, 4))},
    )  # fmt: skip


def reframed(p: dict[str, Any]) -> bytes:
    body = msgpack.packb(p, use_bin_type=True)
    head = struct.pack("<8sHHIQ", b"TIERCKPT", 5, 0, 0, len(body)) + body
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def payload() -> dict[str, Any]:
    data = encode_manifest(sample())
    return msgpack.unpackb(data[24:-8], raw=False)


def test_the_sharding_fields_round_trip() -> None:
    m = decode_manifest(encode_manifest(sample()))
    assert m == sample() and m.sharding[2].chunks == (1, 2, 3, 4) and m.meshes == (MESH,)
    assert decode_manifest(reframed(payload())) == sample()


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda p: p["sharding"].__setitem__(key, value)


def _place(*places: tuple[int, int, int, int]) -> bytes:
    return b"".join(struct.pack("<BBHI", *x) for x in places)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set("placements", _place((1, 2, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0))), "row 0: a placement shards a dim"),
        (_set("placements", _place((3, 0, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0))), "invalid placement"),
        (_set("placements", _place((1, 0, 1, 0), (0, 0, 0, 0), (1, 0, 0, 0))), "invalid placement"),
        (_set("placements", _place((1, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 0))), "invalid placement"),
        (_set("placements", _place((1, 0, 0, 0), (0, 0, 0, 0))), "sharding.placements is not 3 x 8 bytes"),
        (_set("dims", struct.pack("<6Q", 20, 6, 3, 3, 4096, 4)), r"sharding.dims of row 0: global shape \(20, 6\)"),
        (_set("dims", struct.pack("<5Q", 10, 6, 3, 3, 4096)), "sharding.dims is not 6 x 8 bytes"),
        (_set("stored", b"\x01\x01\x01"), r"state\['r'\]: length 0 != 9 x 4"),
        (_set("stored", b"\x00\x00\x01"), r"state\['w'\]: length 72, but its bytes are stored by another rank"),
        (_set("stored", b"\x01\x00\x02"), "sharding.stored is not 3 bytes of 0 or 1"),
        (_set("chunks", struct.pack("<3Q", 1, 2, 3)), "sharding.chunks is not 4 x 8 bytes"),
        (_set("row", struct.pack("<3I", 0, 2, 1)), "sharding.row is not increasing"),
        (_set("row", struct.pack("<3I", 0, 1, 3)), "sharding.row is not increasing rows of the table"),
        (_set("mesh", struct.pack("<3H", 0, 0, 1)), "sharding.mesh does not index the meshes"),
        (_set("count", 2), "sharding.row is not 2 x 4 bytes"),
        (lambda p: p["sharding"].pop("chunks"), "sharding is not a sharding table"),
        (
            lambda p: p.__setitem__("meshes", [[[4], struct.pack("<4I", 0, 2, 3, 5)]]),
            "meshes.0. ranks are not distinct ranks below",
        ),
        (
            lambda p: p.__setitem__("meshes", [[[4], struct.pack("<4I", 0, 2, 3, 2)]]),
            "meshes.0. ranks are not distinct",
        ),
        (
            lambda p: p.__setitem__("meshes", [[[2], struct.pack("<2I", 0, 2)]]),
            "meshes.0. does not hold this copy's rank 1",
        ),
        (lambda p: p.__setitem__("meshes", [[[8], struct.pack("<8I", *range(8))]]), "meshes.0. has 8 ranks, more than"),
        (lambda p: p.__setitem__("meshes", [[[0], b""]]), r"meshes.0. shape \[0\] is invalid"),
        (lambda p: p.__setitem__("meshes", [[[4], struct.pack("<4I", 0, 1, 2, 3)]] * 2), "meshes repeat"),
        (lambda p: p.__setitem__("chunk_bytes", 1000), "chunk_bytes 1000 is not a power of two"),
        (lambda p: p.__setitem__("chunk_bytes", 2048), "chunk_bytes 2048 is not a power of two from 4096"),
        (lambda p: p.pop("meshes"), "payload keys differ from format version 5"),
    ],
)
def test_a_damaged_sharding_record_is_refused_naming_the_field(
    mutate: Callable[[dict[str, Any]], None], message: str
) -> None:
    p = payload()
    mutate(p)
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_manifest(reframed(p))


def test_older_versions_cannot_hold_sharded_rows() -> None:
    import dataclasses

    with pytest.raises(ValueError, match="version 4 cannot hold sharded rows"):
        encode_manifest(dataclasses.replace(sample(), version=4))


def test_boxes_are_torchs_and_a_strided_shard_that_is_no_box_is_refused() -> None:
    from tierckpt.format.sharding import STRIDED

    assert [shard_box((10, 6), (4,), (c,), (Placement(SHARD, 0),)) for c in range(4)] == [
        ((3, 6), (0, 0)), ((3, 6), (3, 0)), ((3, 6), (6, 0)), ((1, 6), (9, 0)),
    ]  # fmt: skip
    # FSDP2 over TP (mesh dp x tp): _StridedShard(0, split_factor=tp) then Shard(0): each shard one block of rows
    fsdp_tp = (Placement(STRIDED, 0, 2), Placement(SHARD, 0))
    boxes = sorted(shard_box((8, 3), (2, 2), (d, t), fsdp_tp)[1][0] for d in range(2) for t in range(2))
    assert boxes == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="not one box"):  # rows 0, 2 of 4: a strided set
        shard_box((8, 3), (2, 2), (0, 0), (Placement(SHARD, 0), Placement(STRIDED, 0, 2)))


def test_a_range_read_covers_whole_chunks() -> None:
    assert chunk_span(5000, 5004, 16384, 4096) == (4096, 8192)
    assert chunk_span(4095, 4097, 16384, 4096) == (0, 8192)
    assert chunk_span(16000, 16384, 16383 + 1, 4096) == (12288, 16384)
    assert chunk_span(10, 20, 4096, 4096) == (0, 4096)  # one chunk: the row's own checksum


def test_boxes_of_shard_and_replicate_are_what_torch_computes() -> None:
    """shard_box computes Shard/Replicate boxes on plain ints: the same as torch's function, uneven and
    empty shards, several mesh dims sharding one tensor dim, included."""
    import random

    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from tierckpt.format.sharding import _torch_placements

    rng = random.Random(1)
    for _ in range(2000):
        g = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        ps = tuple(rng.choice([Placement(REPLICATE), Placement(SHARD, rng.randrange(len(g)))]) for _ in mesh)
        c = tuple(rng.randrange(n) for n in mesh)
        local, offset = _compute_local_shape_and_global_offset(g, mesh, list(c), _torch_placements(ps))
        assert shard_box(g, mesh, c, ps) == (tuple(local), tuple(offset)), (g, mesh, c, ps)


def test_the_fields_are_the_bytes_docs_format_md_gives() -> None:
    """The example of docs/format.md ("Sharding"): rank 1's rows 3-5 of a float32 (10, 6) Shard(0)."""
    p = payload()
    sh = p["sharding"]
    assert p["chunk_bytes"] == 4096
    assert p["meshes"] == [[[4], bytes.fromhex("00000000 01000000 02000000 03000000")]]
    assert sh["count"] == 3 and sh["row"] == bytes.fromhex("00000000 01000000 02000000")
    assert sh["mesh"] == bytes(6) and sh["stored"] == b"\x01\x00\x01"
    assert sh["dims"] == struct.pack("<6Q", 10, 6, 3, 3, 4096, 4)
    assert sh["placements"] == bytes.fromhex("0100 0000 000000000000 0000 000000000100 0000 00000000")
    assert sh["chunks"] == struct.pack("<4Q", 1, 2, 3, 4)
