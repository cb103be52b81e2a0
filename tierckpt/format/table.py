"""The manifest's tensor table: one entry per stored tensor, kept as columns. Pure: no I/O.

Format version 2 stores the table column by column (docs/format.md, "Tensor table, version 2"): the
key paths as one msgpack array of strings, the dtypes as u8 indices into a small name table, the
shapes as one u8 rank per tensor plus one flat u64 array of all dimensions, and blob, offset, length
and checksum as packed little-endian integer arrays. Encoding and decoding are a few C-level calls
whatever the tensor count, and validation runs vectorized (torch ops over the columns) instead of
once per tensor in Python: 20,000 entries decode and validate in a few milliseconds.

:class:`TensorTable` is what :class:`~tierckpt.format.manifest.Manifest` holds for both versions; it
is a sequence of :class:`TensorEntry` rows (built on access) and exposes the columns as lists for
the data paths.
"""

from __future__ import annotations

import itertools
import math
import sys
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import torch

from tierckpt.errors import CorruptCheckpointError

__all__ = [
    "ALL_DTYPES",
    "DTYPES",
    "TensorEntry",
    "TensorTable",
    "blob_spans",
    "check_extents",
    "decode_table",
    "encode_table",
]

MAX_DIMS = 64
_LITTLE = sys.byteorder == "little"
TABLE_KEYS = ("count", "path", "dtype_names", "dtype", "ndim", "dims", "blob", "offset", "length", "checksum")


def _dtype_table() -> dict[str, torch.dtype]:
    # vars(), not dir() + getattr(): torch's module __getattr__ imports submodules on first use
    dtypes = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]
    return {str(dt).removeprefix("torch."): dt for dt in dtypes}


ALL_DTYPES = _dtype_table()
"""Every dtype this torch defines, by canonical name: a fixed table, built once, that readers look names
up in (a name from a file is never passed to ``getattr(torch, …)``)."""
DTYPES = {name: dt for name, dt in ALL_DTYPES.items() if not name.startswith("q")}
"""Manifest dtype name → torch dtype (every dtype this torch knows, quantized ones excepted)."""


class TensorEntry(NamedTuple):
    """One stored tensor: first key path, dtype, shape and extent, and the xxh3_64 of its bytes."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    blob: int
    offset: int
    length: int
    checksum: int


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}")


class TensorTable(Sequence[TensorEntry]):
    """The tensor table as columns (lists of equal length); ``table[i]`` is a :class:`TensorEntry`.

    Args:
        paths: key path of each tensor.
        dtypes: manifest dtype name of each tensor (``float32``, ``bfloat16`` …).
        shapes: shape of each tensor.
        blobs: blob index of each extent.
        offsets: byte offset of each extent in its blob.
        lengths: byte length of each extent.
        checksums: xxh3_64 of each tensor's bytes.

    Raises:
        ValueError: the columns differ in length.
    """

    __slots__ = ("_order", "blobs", "checksums", "dtypes", "lengths", "offsets", "paths", "shapes")

    def __init__(
        self,
        paths: list[str],
        dtypes: list[str],
        shapes: list[tuple[int, ...]],
        blobs: list[int],
        offsets: list[int],
        lengths: list[int],
        checksums: list[int],
    ) -> None:
        n = len(paths)
        if any(len(c) != n for c in (dtypes, shapes, blobs, offsets, lengths, checksums)):
            raise ValueError("tensor table columns differ in length")
        self.paths, self.dtypes, self.shapes = paths, dtypes, shapes
        self.blobs, self.offsets, self.lengths, self.checksums = blobs, offsets, lengths, checksums
        self._order: list[int] | None = None

    @classmethod
    def from_entries(cls, entries: Iterable[TensorEntry]) -> TensorTable:
        """A table from rows (a TensorTable is returned as it is)."""
        if isinstance(entries, TensorTable):
            return entries
        cols: list[Any] = [list(c) for c in zip(*entries)] or [[] for _ in range(7)]
        cols[2] = [tuple(s) for s in cols[2]]
        return cls(*cols)

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, i: int) -> TensorEntry: ...

    @overload
    def __getitem__(self, i: slice) -> list[TensorEntry]: ...

    def __getitem__(self, i: int | slice) -> TensorEntry | list[TensorEntry]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return TensorEntry(
            self.paths[i], self.dtypes[i], self.shapes[i], self.blobs[i], self.offsets[i], self.lengths[i],
            self.checksums[i],
        )  # fmt: skip

    def __iter__(self) -> Iterator[TensorEntry]:
        cols = (self.paths, self.dtypes, self.shapes, self.blobs, self.offsets, self.lengths, self.checksums)
        return itertools.starmap(TensorEntry, zip(*cols))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        """Unhashable, as a list is: ``__eq__`` compares contents."""
        raise TypeError(f"unhashable type: {type(self).__name__!r}")

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors, {sum(self.lengths)} bytes)"

    def order(self) -> list[int]:
        """Indices of the non-empty tensors sorted by (blob, offset): the order of the bytes on disk."""
        if self._order is None:
            offsets, blobs = self.offsets, self.blobs
            ids = [i for i, n in enumerate(self.lengths) if n]
            ids.sort(key=offsets.__getitem__)
            ids.sort(key=blobs.__getitem__)  # stable: by blob, then offset
            self._order = ids
        return self._order


def blob_spans(order: Sequence[int], blob_of: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Where each blob's tensors lie in ``order`` (tensor indices grouped by blob, as
    :meth:`TensorTable.order` gives them): blob -> ``(start, stop)`` positions in ``order``."""
    spans: dict[int, tuple[int, int]] = {}
    start = 0
    for stop in range(1, len(order) + 1):  # cut where the blob changes
        if stop == len(order) or blob_of[order[stop]] != blob_of[order[start]]:
            spans[blob_of[order[start]]] = (start, stop)
            start = stop
    return spans


# -- version 2 codec -------------------------------------------------------------------------------------
def _packed(code: str, values: Iterable[int]) -> bytes:
    a = array(code, values)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def _unpacked(code: str, data: bytes) -> array[int]:
    a = array(code)
    a.frombytes(data)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a


def encode_table(t: TensorTable) -> dict[str, Any]:
    """The version-2 msgpack map of a table (deterministic: the same table gives the same map)."""
    names = list(dict.fromkeys(t.dtypes))
    index = {name: i for i, name in enumerate(names)}
    if len(names) > 255:
        raise ValueError(f"{len(names)} distinct dtypes; the format stores at most 255")
    return {
        "count": len(t),
        "path": t.paths,
        "dtype_names": names,
        "dtype": bytes([index[d] for d in t.dtypes]),
        "ndim": bytes([len(s) for s in t.shapes]),
        "dims": _packed("Q", itertools.chain.from_iterable(t.shapes)),
        "blob": _packed("I", t.blobs),
        "offset": _packed("Q", t.offsets),
        "length": _packed("Q", t.lengths),
        "checksum": _packed("Q", t.checksums),
    }


def _column(d: dict[str, Any], key: str, n: int, width: int) -> bytes:
    v = d[key]
    if not isinstance(v, bytes) or len(v) != n * width:
        raise _bad(f"tensors.{key} is not {n} x {width} bytes")
    return v


def decode_table(d: Any, blob_sizes: Sequence[int], *, unstored: Collection[int] = ()) -> TensorTable:
    """Parse and validate a version-2 tensor table against the blob sizes.

    ``unstored``: rows whose bytes another copy stores (version 5's replicated shards): their length
    must be 0 whatever their shape.

    Checks every column's type and size, that dtypes are known, shapes have at most 64 dimensions,
    each extent's length is elements × itemsize, non-empty extents lie inside an existing blob at an
    offset aligned to their dtype, and non-empty extents of a blob do not overlap.

    Raises:
        CorruptCheckpointError: naming the first offending tensor by its key path.
    """
    n, paths, names = _header(d)
    dt_idx = _column(d, "dtype", n, 1)
    ndim = _column(d, "ndim", n, 1)
    if dt_idx.translate(None, bytes(range(len(names)))):  # an index byte that is not a valid one
        i = next(i for i, k in enumerate(dt_idx) if k >= len(names))
        raise _bad(f"tensor {paths[i]}: dtype index {dt_idx[i]} out of range")
    if ndim.translate(None, bytes(range(MAX_DIMS + 1))):
        i = next(i for i, k in enumerate(ndim) if k > MAX_DIMS)
        raise _bad(f"tensor {paths[i]}: bad shape (rank {ndim[i]})")
    one_d = ndim.count(1) == n  # the common case of small states: vectorized below
    dims = _unpacked("Q", _column(d, "dims", n if one_d else sum(ndim), 8))
    blobs_a = _unpacked("I", _column(d, "blob", n, 4))
    offsets_a = _unpacked("Q", _column(d, "offset", n, 8))
    lengths_a = _unpacked("Q", _column(d, "length", n, 8))
    blobs, offsets, lengths = blobs_a.tolist(), offsets_a.tolist(), lengths_a.tolist()
    checksums = _unpacked("Q", _column(d, "checksum", n, 8)).tolist()
    if dims and _above_i64(dims):
        raise _bad(f"a dimension {max(dims)} is too large")
    for col, arr, what in ((offsets, offsets_a, "offset"), (lengths, lengths_a, "length")):
        if col and _above_i64(arr):
            i = col.index(max(col))
            raise _bad(f"tensor {paths[i]}: bad extent ({what} {col[i]})")
    shapes, numels = _shapes(dims.tolist(), ndim, one_d)
    isz = [DTYPES[s].itemsize for s in names]
    cols = None
    if n:  # the columns as tensors over the decoded arrays: no list-to-tensor conversion of 20,000 items
        isz_t = torch.tensor(isz, dtype=torch.int64)[torch.frombuffer(bytearray(dt_idx), dtype=torch.uint8).long()]
        len_t = torch.frombuffer(lengths_a, dtype=torch.int64)  # below 2**63, checked above
        blob_t = torch.frombuffer(blobs_a, dtype=torch.int32).long() & 0xFFFFFFFF  # the column is unsigned
        cols = (blob_t, torch.frombuffer(offsets_a, dtype=torch.int64), len_t, isz_t)
    # length == prod(shape) x itemsize (0 for an unstored row)
    if unstored:
        _check_unstored(paths, lengths, unstored)
        numels = list(numels)
        for i in unstored:
            numels[i] = 0
        one_d = False  # checked row by row below
    if cols is not None and one_d and max(numels) < 1 << 58:  # 1-d, and dims x itemsize cannot overflow
        bad = _first(torch.frombuffer(dims, dtype=torch.int64) * cols[3] != cols[2])
        if bad is not None:
            raise _bad(f"tensor {paths[bad]}: length {lengths[bad]} != {numels[bad]} x {isz[dt_idx[bad]]} bytes")
    else:
        for i, (k, e, ln) in enumerate(zip(dt_idx, numels, lengths)):
            if e * isz[k] != ln:
                raise _bad(f"tensor {paths[i]}: length {ln} != {e} x {isz[k]} bytes")
    table = TensorTable(paths, list(map(names.__getitem__, dt_idx)), shapes, blobs, offsets, lengths, checksums)
    check_extents(table, blob_sizes, cols=cols)
    return table


def _check_unstored(paths: list[str], lengths: list[int], unstored: Collection[int]) -> None:
    for i in unstored:
        if not 0 <= i < len(paths):
            raise _bad(f"sharding names row {i}, the table has {len(paths)}")
        if lengths[i]:
            raise _bad(f"tensor {paths[i]}: length {lengths[i]}, but its bytes are stored by another rank (0)")


def _header(d: Any) -> tuple[int, list[str], list[str]]:
    """``(count, paths, dtype names)`` of a version-2 table, checked (the columns are checked by the caller)."""
    if not isinstance(d, dict) or set(d) != set(TABLE_KEYS):
        raise _bad("tensors is not a version-2 table (keys differ)")
    n = d["count"]
    if type(n) is not int or not 0 <= n < 1 << 32:
        raise _bad(f"tensors.count {n!r} is invalid")
    paths, names = d["path"], d["dtype_names"]
    # Checks run as C-level calls over whole columns (set/map, bytes.translate, torch ops): a loop in
    # Python over 20,000 entries costs milliseconds, and a restore waits for this table.
    if not (isinstance(paths, list) and len(paths) == n and set(map(type, paths)) <= {str}):
        raise _bad(f"tensors.path is not a list of {n} strings")
    if not (isinstance(names, list) and len(names) <= 255 and all(type(s) is str for s in names)):
        raise _bad("tensors.dtype_names is not a list of strings")
    for name in names:
        if name not in DTYPES:
            raise _bad(f"unknown dtype {name!r}")
    return n, paths, names


def _shapes(dl: list[int], ndim: bytes, one_d: bool) -> tuple[list[tuple[int, ...]], list[int]]:
    """Each tensor's shape and element count from the ``dims`` column ``dl`` (``ndim[i]`` dims each)."""
    if dl and one_d:
        return list(zip(dl)), dl  # 1-tuples, built in C
    it = iter(dl)
    shapes = [tuple(itertools.islice(it, k)) for k in ndim]
    return shapes, [math.prod(s) for s in shapes]


def _above_i64(a: array[int]) -> bool:
    """Whether any value of a non-empty ``Q`` array is 2**63 or more (negative when read as int64)."""
    return bool((torch.frombuffer(a, dtype=torch.int64) < 0).any())


def _first(mask: torch.Tensor) -> int | None:
    hit = mask.nonzero()
    return int(hit[0, 0]) if len(hit) else None


def check_extents(
    t: TensorTable,
    blob_sizes: Sequence[int],
    *,
    cols: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Vectorized checks of every non-empty extent: its blob exists, its offset suits its dtype, it lies
    inside the blob, and it overlaps no other extent of the blob. Records the table's on-disk order.

    Offsets and lengths must already be known to be below 2**63. ``cols``: the blob, offset, length and
    itemsize of every tensor as int64 tensors, where the caller has them (else built from ``t``).

    Raises:
        CorruptCheckpointError: naming the first offending tensor.
    """
    if not len(t):
        t._order = []
        return
    if cols is not None:
        blob, off, ln, itemsize = cols
        itemsize = itemsize.clamp(min=1)
    else:
        sizes = {name: max(1, DTYPES[name].itemsize) for name in set(t.dtypes)}
        itemsize = torch.tensor([sizes[d] for d in t.dtypes], dtype=torch.int64)
        off = torch.tensor(t.offsets, dtype=torch.int64)
        ln = torch.tensor(t.lengths, dtype=torch.int64)
        blob = torch.tensor(t.blobs, dtype=torch.int64)
    used = ln > 0
    nb = len(blob_sizes)
    i = _first(used & (blob >= nb))
    if i is not None:
        raise _bad(f"tensor {t.paths[i]}: blob {t.blobs[i]} does not exist (have {nb})")
    if not bool(used.any()):
        t._order = []
        return
    i = _first(used & (off % itemsize != 0))
    if i is not None:
        raise _bad(f"tensor {t.paths[i]}: offset {t.offsets[i]} is not aligned to its dtype")
    size = torch.tensor(list(blob_sizes), dtype=torch.int64)[blob.clamp(max=nb - 1)]
    i = _first(used & (off > size - ln))
    if i is not None:
        start, end = t.offsets[i], t.offsets[i] + t.lengths[i]
        raise _bad(f"tensor {t.paths[i]}: extent [{start}, {end}) exceeds blob size {blob_sizes[t.blobs[i]]}")
    ids = used.nonzero().flatten()
    b, o = blob[ids], off[ids]
    if not bool(((b[1:] > b[:-1]) | ((b[1:] == b[:-1]) & (o[1:] >= o[:-1]))).all()):  # writers keep disk order
        ids = ids[torch.sort(o, stable=True).indices]
        ids = ids[torch.sort(blob[ids], stable=True).indices]
        b, o = blob[ids], off[ids]
    clash = (b[1:] == b[:-1]) & (o[1:] < o[:-1] + ln[ids][:-1])
    k = _first(clash)
    if k is not None:
        raise _bad(f"extents of {t.paths[int(ids[k])]} and {t.paths[int(ids[k + 1])]} overlap")
    t._order = ids.tolist()
