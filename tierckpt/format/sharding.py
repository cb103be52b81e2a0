"""Sharded rows of a manifest (format version 5): where each DTensor shard sits in its global tensor.

A row of the tensor table that holds one rank's local shard of a ``DTensor`` carries a *sharding
record*: the mesh it lives on (shape and global ranks, stored once per manifest in ``meshes``), its
global shape, its placements, whether this copy stores its bytes (a shard replicated over mesh dims is
stored by one replica only) and, for stored shards longer than ``chunk_bytes``, one xxh3-64 per chunk
of its bytes so that a range read can be verified without reading the whole shard
(docs/format.md, "Sharding, version 5").

Any reader computes every saved rank's box (local shape and global offset) from one manifest with
torch's own arithmetic (:func:`shard_box`). Pure: no I/O; ``torch.distributed`` is imported only when
a box is computed.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from tierckpt.errors import CorruptCheckpointError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "REPLICATE",
    "SHARD",
    "STRIDED",
    "Mesh",
    "Placement",
    "ShardRow",
    "chunk_checksums",
    "chunk_span",
    "decode_sharding",
    "encode_sharding",
    "n_chunks",
    "shard_box",
    "writer_of",
]

DEFAULT_CHUNK_BYTES = 4 << 20  #: the chunk of a sharded row's bytes that one checksum covers
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4096, 1 << 30
MAX_MESH_DIMS = 16
REPLICATE, SHARD, STRIDED = 0, 1, 2  #: placement kinds as stored
SHARDING_KEYS = ("count", "row", "mesh", "stored", "dims", "placements", "chunks")
_LITTLE = sys.byteorder == "little"


class Placement(NamedTuple):
    """One mesh dim's placement: ``kind`` (:data:`REPLICATE`, :data:`SHARD`, :data:`STRIDED`), the
    tensor dim it shards (0 for Replicate) and ``_StridedShard``'s split factor (0 otherwise)."""

    kind: int
    dim: int = 0
    split: int = 0


@dataclass(frozen=True)
class Mesh:
    """A device mesh as saved: its shape and the global rank at each coordinate (row-major)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate of global ``rank`` in this mesh, or None if it is not in it."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            return None
        return _unravel(flat, self.shape)

    def coordinates(self) -> list[tuple[int, ...]]:
        """Every coordinate, row-major (``ranks[i]`` sits at ``coordinates()[i]``)."""
        return list(itertools.product(*(range(n) for n in self.shape)))


@dataclass(frozen=True)
class ShardRow:
    """The sharding record of one row of the tensor table.

    Attributes:
        mesh: index into the manifest's meshes.
        global_shape: the DTensor's global shape.
        placements: one per mesh dim.
        stored: this copy holds the shard's bytes; False: the replica at the same coordinate with 0 on
            every Replicate mesh dim holds them (:func:`writer_of`), and the row's length is 0.
        chunks: xxh3-64 of each ``chunk_bytes`` chunk of the shard's bytes (stored rows longer than
            ``chunk_bytes``; otherwise empty: the row's checksum covers its one chunk).
    """

    mesh: int
    global_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    stored: bool
    chunks: tuple[int, ...] = ()


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}")


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        flat, c = divmod(flat, n)
        out.append(c)
    return tuple(reversed(out))


def writer_of(coord: Sequence[int], placements: Sequence[Placement]) -> tuple[int, ...]:
    """The coordinate of the replica that stores the shard held at ``coord``: 0 on every Replicate dim."""
    return tuple(0 if p.kind == REPLICATE else c for c, p in zip(coord, placements))


def n_chunks(length: int, chunk_bytes: int) -> int:
    """Chunk checksums a stored row of ``length`` bytes carries (0 when its checksum is its one chunk's)."""
    return -(-length // chunk_bytes) if length > chunk_bytes else 0


def chunk_checksums(data: memoryview, chunk_bytes: int) -> tuple[int, ...]:
    """The chunk checksums of a shard's bytes (empty for at most ``chunk_bytes`` bytes)."""
    if len(data) <= chunk_bytes:
        return ()
    h = xxhash.xxh3_64_intdigest
    return tuple(h(data[o : o + chunk_bytes]) for o in range(0, len(data), chunk_bytes))


def chunk_span(start: int, stop: int, length: int, chunk_bytes: int) -> tuple[int, int]:
    """The whole chunks of a row of ``length`` bytes that cover its bytes ``[start, stop)``: the bytes
    a verified range read must read (the whole row when it has a single chunk)."""
    if length <= chunk_bytes:
        return 0, length
    return start // chunk_bytes * chunk_bytes, min(length, -(-stop // chunk_bytes) * chunk_bytes)


# -- the torch side: placements and boxes --------------------------------------------------------------------
def placement_of(p: Any, key: str) -> Placement:
    """The stored form of a torch placement (``Shard``, ``_StridedShard``, ``Replicate``).

    Raises:
        ValueError: ``Partial`` or any other placement (the message names ``key``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return Placement(STRIDED, p.dim, int(p.split_factor))
    if isinstance(p, Shard):
        return Placement(SHARD, p.dim)
    if isinstance(p, Replicate):
        return Placement(REPLICATE)
    raise ValueError(
        f"{key}: cannot save a DTensor with placement {p} (a Partial value is not the sum yet: "
        "call .redistribute() to Shard or Replicate first, or save .full_tensor())"
    )


def _torch_placements(ps: Sequence[Placement]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in ps:
        if p.kind == REPLICATE:
            out.append(Replicate())
        elif p.kind == SHARD:
            out.append(Shard(p.dim))
        else:
            out.append(_StridedShard(p.dim, split_factor=p.split))
    return out


@functools.lru_cache(maxsize=4096)
def shard_box(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of the shard at ``coord``: torch's
    ``_compute_local_shape_and_global_offset``, after checking the shard is one box of the global
    tensor (a ``_StridedShard`` can make it a strided set of rows, which is refused).

    Raises:
        ValueError: the shard is not one contiguous box.
    """
    if all(p.kind != STRIDED for p in placements):
        # Shard and Replicate only: torch's arithmetic (Shard.local_shard_size_and_offset, torch.chunk's
        # split) on plain ints, composed as _compute_local_shape_and_global_offset composes it, without
        # the index tensors and symbolic-int guards it goes through (~100 us a box; a manifest holds
        # thousands). tests/unit/test_sharding_format.py checks it against torch's function.
        local, offset = list(global_shape), [0] * len(global_shape)
        for d, p in enumerate(placements):
            if p.kind == SHARD:
                n, k, c = local[p.dim], mesh_shape[d], coord[d]
                full = -(-n // k)
                start = min(n, full * c)
                local[p.dim], offset[p.dim] = max(0, min(n, full * c + full) - full * c), offset[p.dim] + start
        for dim, n in enumerate(local):  # torch puts an empty shard at the end of its dim
            if n == 0 and any(p.kind == SHARD and p.dim == dim for p in placements):
                offset[dim] = global_shape[dim]
        return tuple(local), tuple(offset)
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset, _get_shard_size_and_offsets

    tps = _torch_placements(placements)
    # a _StridedShard: torch's own function, once the shard is known to be one box (torch returns
    # only the first global index of each dim)
    shape = list(global_shape)
    done: dict[int, Any] = {}  # dim -> the global indices of this shard's rows along it
    for d, (p, tp) in enumerate(zip(placements, tps)):
        if p.kind == REPLICATE:
            continue
        size, idx = _get_shard_size_and_offsets(
            shape[p.dim], mesh_shape[d], coord[d], tp, done.get(p.dim), global_shape[p.dim], False
        )
        shape[p.dim], done[p.dim] = size, idx
    for dim, idx in done.items():
        got = idx.tolist() if shape[dim] and idx is not None else []
        if got and got != list(range(got[0], got[0] + len(got))):
            raise ValueError(f"the shard at mesh coordinate {coord} is not one box of dim {dim}")
    got_local, got_offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord), tps)
    return tuple(int(x) for x in got_local), tuple(int(x) for x in got_offset)


# -- codec ---------------------------------------------------------------------------------------------------
def _packed(code: str, values: Any) -> bytes:
    a = array(code, values)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def _unpacked(d: dict[str, Any], key: str, code: str, n: int) -> list[int]:
    v = d[key]
    a = array(code)
    if not isinstance(v, bytes) or len(v) != n * a.itemsize:
        raise _bad(f"sharding.{key} is not {n} x {a.itemsize} bytes")
    a.frombytes(v)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tolist()


def encode_meshes(meshes: Sequence[Mesh]) -> list[Any]:
    """The ``meshes`` field: ``[shape, ranks as packed u32]`` per mesh."""
    return [[list(m.shape), _packed("I", m.ranks)] for m in meshes]


def encode_sharding(rows: dict[int, ShardRow], meshes: Sequence[Mesh]) -> dict[str, Any]:
    """The ``sharding`` field (deterministic): columns over the sharded rows in row order."""
    ids = sorted(rows)
    recs = [rows[i] for i in ids]
    places = [(p.kind, p.dim, 0, p.split) for r in recs for p in r.placements]
    return {
        "count": len(ids),
        "row": _packed("I", ids),
        "mesh": _packed("H", [r.mesh for r in recs]),
        "stored": bytes(int(r.stored) for r in recs),
        "dims": _packed("Q", itertools.chain.from_iterable(r.global_shape for r in recs)),
        "placements": b"".join(_PLACEMENT.pack(*p) for p in places),
        "chunks": _packed("Q", itertools.chain.from_iterable(r.chunks for r in recs)),
    }


_PLACEMENT = struct.Struct("<BBHI")  # kind, dim, reserved (0), split factor


def decode_meshes(v: Any, rank: int, world_size: int) -> tuple[Mesh, ...]:
    """The ``meshes`` field, validated: shapes of 1 to 16 positive dims, ranks distinct and below
    ``world_size``, and this copy's ``rank`` in every mesh (a rank saves only shards of meshes it is on).

    Raises:
        CorruptCheckpointError: naming the mesh and what is wrong.
    """
    if not isinstance(v, list) or len(v) > 1 << 16:
        raise _bad("meshes is not a list")
    out = []
    for k, m in enumerate(v):
        if not (isinstance(m, list) and len(m) == 2 and isinstance(m[0], list) and isinstance(m[1], bytes)):
            raise _bad(f"meshes[{k}] is malformed")
        shape = m[0]
        if not (1 <= len(shape) <= MAX_MESH_DIMS and all(type(n) is int and 1 <= n <= 1 << 24 for n in shape)):
            raise _bad(f"meshes[{k}] shape {shape!r} is invalid")
        size = math.prod(shape)
        if size > world_size:
            raise _bad(f"meshes[{k}] has {size} ranks, more than world_size {world_size}")
        ranks = _unpacked({"ranks": m[1]}, "ranks", "I", size)
        if len(set(ranks)) != size or max(ranks) >= world_size:
            raise _bad(f"meshes[{k}] ranks are not distinct ranks below world_size {world_size}")
        if rank not in ranks:
            raise _bad(f"meshes[{k}] does not hold this copy's rank {rank}")
        out.append(Mesh(tuple(shape), tuple(ranks)))
    if len(set(out)) != len(out):
        raise _bad("meshes repeat")
    return tuple(out)


def unstored_rows(d: Any) -> set[int]:
    """The rows whose bytes this copy does not store (their length must be 0), from the ``row`` and
    ``stored`` columns (checked in full by :func:`decode_sharding`); the table is validated with them.

    Raises:
        CorruptCheckpointError: the sharding table's keys, count or those columns are malformed.
    """
    if not isinstance(d, dict) or set(d) != set(SHARDING_KEYS):
        raise _bad("sharding is not a sharding table (keys differ)")
    n = d["count"]
    if type(n) is not int or not 0 <= n < 1 << 32:
        raise _bad(f"sharding.count {n!r} is invalid")
    ids = _unpacked(d, "row", "I", n)
    if any(b <= a for a, b in itertools.pairwise(ids)):
        raise _bad("sharding.row is not increasing rows of the table")
    stored = d["stored"]
    if not isinstance(stored, bytes) or len(stored) != n:
        raise _bad(f"sharding.stored is not {n} bytes of 0 or 1")
    return {i for i, s in zip(ids, stored) if not s}


def decode_sharding(
    d: Any,
    meshes: Sequence[Mesh],
    shapes: Sequence[tuple[int, ...]],
    lengths: Sequence[int],
    rank: int,
    chunk_bytes: int,
) -> dict[int, ShardRow]:
    """The ``sharding`` field, validated against the meshes and the table's local ``shapes``.

    Checks every column's size, rows strictly increasing and in the table, mesh indices valid and every
    mesh used, placements well formed (Replicate/Shard/_StridedShard, a tensor dim in range, reserved
    bytes 0, a split factor for _StridedShard only), the global dims, that this rank's box (torch's
    arithmetic) is the row's local shape, that ``stored`` is set exactly on the replica that stores, and
    the number of chunk checksums. The row's length (0 unless stored) is checked by the table.

    Raises:
        CorruptCheckpointError: naming the field (and the row) that is wrong.
    """
    if not isinstance(d, dict) or set(d) != set(SHARDING_KEYS):
        raise _bad("sharding is not a sharding table (keys differ)")
    n = d["count"]
    if type(n) is not int or not 0 <= n <= len(shapes):
        raise _bad(f"sharding.count {n!r} is invalid")
    ids = _unpacked(d, "row", "I", n)
    if any(b <= a for a, b in itertools.pairwise(ids)) or (ids and ids[-1] >= len(shapes)):
        raise _bad("sharding.row is not increasing rows of the table")
    mesh_ids = _unpacked(d, "mesh", "H", n)
    if any(k >= len(meshes) for k in mesh_ids) or set(mesh_ids) != set(range(len(meshes))):
        raise _bad("sharding.mesh does not index the meshes (each used)")
    stored = d["stored"]
    if not isinstance(stored, bytes) or len(stored) != n or stored.translate(None, b"\x00\x01"):
        raise _bad(f"sharding.stored is not {n} bytes of 0 or 1")
    ndims = [len(shapes[i]) for i in ids]
    dims = _unpacked(d, "dims", "Q", sum(ndims))
    if dims and max(dims) >= 1 << 63:
        raise _bad("sharding.dims: a dimension is too large")
    raw = d["placements"]
    n_places = sum(len(meshes[k].shape) for k in mesh_ids)
    if not isinstance(raw, bytes) or len(raw) != n_places * _PLACEMENT.size:
        raise _bad(f"sharding.placements is not {n_places} x {_PLACEMENT.size} bytes")
    places = [Placement(kind, dim, split) for kind, dim, _, split in _check_places(raw)]
    coords = [m.coordinate(rank) for m in meshes]  # decode_meshes checked that each holds this rank
    per = [len(meshes[k].shape) for k in mesh_ids]
    counts = [n_chunks(lengths[i], chunk_bytes) if s else 0 for i, s in zip(ids, stored)]
    sums = _unpacked(d, "chunks", "Q", sum(counts))
    # what the rows share (few meshes and placement patterns, per dtype a few shapes) is checked once
    layouts: dict[tuple[int, int, tuple[Placement, ...]], tuple[tuple[Placement, ...], bool]] = {}
    rows, dim_it, place_at, at = {}, iter(dims), 0, 0
    for i, k, nd, s, c, np_ in zip(ids, mesh_ids, ndims, stored, counts, per):
        key = (k, nd, tuple(places[place_at : place_at + np_]))
        place_at += np_
        got = layouts.get(key)
        if got is None:
            coord, ps = coords[k], key[2]
            assert coord is not None
            if any(p.kind != REPLICATE and p.dim >= nd for p in ps):
                raise _bad(f"sharding.placements of row {i}: a placement shards a dim the tensor lacks")
            got = layouts[key] = (ps, writer_of(coord, ps) == coord)
        ps, writes = got
        g = tuple(itertools.islice(dim_it, nd))
        try:
            local, _ = shard_box(g, meshes[k].shape, coords[k], ps)
        except (ValueError, AssertionError, RuntimeError) as e:
            raise _bad(f"sharding of row {i}: {e}") from None
        if local != shapes[i]:
            raise _bad(
                f"sharding.dims of row {i}: global shape {g} gives this rank {local}, the table says {shapes[i]}"
            )
        if bool(s) != writes:
            raise _bad(f"sharding.stored of row {i} is {s}, but this rank {'is' if not s else 'is not'} its writer")
        rows[i] = ShardRow(k, g, ps, bool(s), tuple(sums[at : at + c]) if c else ())
        at += c
    return rows


def _check_places(raw: bytes) -> list[tuple[int, int, int, int]]:
    out = list(_PLACEMENT.iter_unpack(raw))
    for kind, dim, reserved, split in out:
        ok = reserved == 0 and (
            (kind == REPLICATE and dim == 0 and split == 0)
            or (kind == SHARD and split == 0)
            or (kind == STRIDED and split >= 1)
        )
        if not ok:
            raise _bad(f"sharding.placements holds an invalid placement {(kind, dim, reserved, split)}")
    return out
