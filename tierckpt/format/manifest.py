"""The per-rank checkpoint manifest: msgpack payload in a small framed, checksummed file. Pure: no I/O.

docs/format.md specifies it byte by byte. The reader validates everything (magic, version, sizes,
types, bounds, overlaps, blob names) before any blob byte is read.
"""

from __future__ import annotations

import itertools
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import torch
import xxhash
import zstandard

from tierckpt.errors import CorruptCheckpointError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "BlobEntry",
    "Manifest",
    "TensorEntry",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
]

MAGIC = b"TIERCKPT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHIQ")  # magic, version, flags, reserved, payload length
_TRAILER = struct.Struct("<Q")  # xxh3_64 of the payload
MAX_PAYLOAD_BYTES = 1 << 31
_COMPRESS_TREE_ABOVE = 64 << 10
_BLOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MAX_DIMS = 64


def _dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for name in dir(torch):
        dt = getattr(torch, name)
        if isinstance(dt, torch.dtype) and not str(dt).startswith("torch.q"):
            table.setdefault(str(dt).removeprefix("torch."), dt)
    return table


_DTYPES = _dtype_table()


_NAMES = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dt: torch.dtype) -> str:
    """Canonical name of a dtype in the manifest (``bfloat16``, ``float8_e4m3fn`` …)."""
    name = _NAMES.get(dt)
    return name if name is not None else str(dt).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises KeyError for a name this torch does not know."""
    return _DTYPES[name]


class BlobEntry(NamedTuple):
    """One blob file of this rank: its file name inside the checkpoint directory and its size."""

    name: str
    size: int


class TensorEntry(NamedTuple):
    """One stored tensor: first key path, dtype, shape and extent, and the xxh3_64 of its bytes."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    blob: int
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild one rank's state from its blobs."""

    step: int
    rank: int
    world_size: int
    align: int
    blobs: tuple[BlobEntry, ...]
    tensors: tuple[TensorEntry, ...]
    tree: bytes
    has_pickle: bool
    version: int = FORMAT_VERSION

    @property
    def tensor_bytes(self) -> int:
        return sum(t.length for t in self.tensors)

    @property
    def blob_bytes(self) -> int:
        return sum(b.size for b in self.blobs)


def encode_manifest(m: Manifest) -> bytes:
    """Serialize deterministically: the same manifest always gives the same bytes."""
    tree, codec = m.tree, "none"
    if len(tree) > _COMPRESS_TREE_ABOVE:
        packed = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False).compress(tree)
        if len(packed) < len(tree) * 0.9:
            tree, codec = packed, "zstd"
    payload = msgpack.packb(
        {
            "step": m.step,
            "rank": m.rank,
            "world_size": m.world_size,
            "align": m.align,
            "checksum": "xxh3_64",
            "blobs": [[b.name, b.size] for b in m.blobs],
            "tensors": [[t.path, t.dtype, list(t.shape), t.blob, t.offset, t.length, t.checksum] for t in m.tensors],
            "tree_codec": codec,
            "tree": tree,
            "has_pickle": m.has_pickle,
        },
        use_bin_type=True,
    )
    header = _HEADER.pack(MAGIC, m.version, 0, 0, len(payload))
    return header + payload + _TRAILER.pack(xxhash.xxh3_64_intdigest(payload))


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}")


def _want(cond: bool, msg: str) -> None:
    if not cond:
        raise _bad(msg)


def _is_int(v: Any, lo: int = 0, hi: int = (1 << 63) - 1) -> bool:
    return type(v) is int and lo <= v <= hi


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate a manifest file's bytes.

    Checks magic, version, payload length and checksum, every field's type, dtypes, that each extent's
    length matches dtype × shape and lies inside its blob, that extents do not overlap, and that blob
    names are plain file names (no path separators, no leading dot).

    Raises:
        CorruptCheckpointError: saying what is wrong.
    """
    _want(len(data) >= _HEADER.size + _TRAILER.size, f"file too short ({len(data)} bytes)")
    magic, version, flags, _reserved, n = _HEADER.unpack_from(data)
    _want(magic == MAGIC, f"bad magic {magic!r} (not a tierckpt manifest)")
    _want(
        version == FORMAT_VERSION,
        f"format version {version} is not supported (this reader knows {FORMAT_VERSION})",
    )
    _want(flags == 0, f"unknown flags {flags:#x}")
    _want(n <= MAX_PAYLOAD_BYTES, f"payload length {n} is too large")
    _want(len(data) == _HEADER.size + n + _TRAILER.size, f"file is {len(data)} bytes, header says {n} + framing")
    payload = data[_HEADER.size : _HEADER.size + n]
    (digest,) = _TRAILER.unpack_from(data, _HEADER.size + n)
    _want(xxhash.xxh3_64_intdigest(payload) == digest, "payload checksum mismatch")
    try:
        d = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:
        raise _bad(f"payload is not msgpack: {e}") from e
    keys = {
        "step",
        "rank",
        "world_size",
        "align",
        "checksum",
        "blobs",
        "tensors",
        "tree_codec",
        "tree",
        "has_pickle",
    }
    _want(isinstance(d, dict) and set(d) == keys, "payload keys differ from format version 1")
    _want(_is_int(d["step"]), f"step {d['step']!r} is not a non-negative integer")
    _want(_is_int(d["world_size"], 1, 1 << 24), f"world_size {d['world_size']!r} is invalid")
    _want(
        _is_int(d["rank"], 0, d["world_size"] - 1),
        f"rank {d['rank']!r} is invalid for world size {d['world_size']}",
    )
    align = d["align"]
    _want(_is_int(align, 1, 1 << 30) and align & (align - 1) == 0, f"align {align!r} is not a power of two")
    _want(d["checksum"] == "xxh3_64", f"unknown checksum algorithm {d['checksum']!r}")
    _want(type(d["has_pickle"]) is bool, "has_pickle is not a bool")
    _want(isinstance(d["tree"], bytes), "tree is not bytes")
    tree = d["tree"]
    if d["tree_codec"] == "zstd":
        try:
            tree = zstandard.ZstdDecompressor().decompress(tree, max_output_size=MAX_PAYLOAD_BYTES)
        except zstandard.ZstdError as e:
            raise _bad(f"tree does not decompress: {e}") from e
    else:
        _want(d["tree_codec"] == "none", f"unknown tree codec {d['tree_codec']!r}")

    _want(isinstance(d["blobs"], list), "blobs is not a list")
    blobs = []
    for i, b in enumerate(d["blobs"]):
        _want(isinstance(b, list) and len(b) == 2, f"blobs[{i}] is malformed")
        name, size = b
        _want(
            isinstance(name, str) and bool(_BLOB_NAME_RE.match(name)),
            f"blobs[{i}] name {name!r} is not a plain file name",
        )
        _want(_is_int(size), f"blobs[{i}] size {size!r} is invalid")
        blobs.append(BlobEntry(name, size))
    _want(len({b.name for b in blobs}) == len(blobs), "blob names repeat")

    _want(isinstance(d["tensors"], list), "tensors is not a list")
    tensors = []
    n_blobs, u64 = len(blobs), (1 << 64) - 1
    for i, t in enumerate(d["tensors"]):
        # Messages are built only on failure: this loop runs once per tensor (20,000 in small states).
        if not (isinstance(t, list) and len(t) == 7 and isinstance(t[0], str)):
            raise _bad(f"tensors[{i}] is malformed")
        path, dt, shape, blob, off, length, checksum = t
        dtype = _DTYPES.get(dt) if isinstance(dt, str) else None
        if dtype is None:
            raise _bad(f"tensor {path}: unknown dtype {dt!r}")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_is_int(s) for s in shape)):
            raise _bad(f"tensor {path}: bad shape {shape!r}")
        if not (_is_int(blob) and _is_int(off) and _is_int(length)):
            raise _bad(f"tensor {path}: bad extent")
        if not _is_int(checksum, 0, u64):
            raise _bad(f"tensor {path}: bad checksum")
        itemsize = dtype.itemsize
        if math.prod(shape) * itemsize != length:
            raise _bad(f"tensor {path}: length {length} != {math.prod(shape)} x {itemsize} bytes")
        if length:
            if blob >= n_blobs:
                raise _bad(f"tensor {path}: blob {blob} does not exist (have {n_blobs})")
            if itemsize and off % itemsize:
                raise _bad(f"tensor {path}: offset {off} is not aligned to its dtype")
            if off + length > blobs[blob].size:
                raise _bad(f"tensor {path}: extent [{off}, {off + length}) exceeds blob size {blobs[blob].size}")
        tensors.append(TensorEntry(path, dt, tuple(shape), blob, off, length, checksum))
    spans = sorted((t.blob, t.offset, t.offset + t.length, t.path) for t in tensors if t.length)
    for a, b in itertools.pairwise(spans):
        _want(not (a[0] == b[0] and b[1] < a[2]), f"extents of {a[3]} and {b[3]} overlap")
    return Manifest(
        step=d["step"],
        rank=d["rank"],
        world_size=d["world_size"],
        align=align,
        blobs=tuple(blobs),
        tensors=tuple(tensors),
        tree=tree,
        has_pickle=d["has_pickle"],
        version=version,
    )
