"""The per-rank checkpoint manifest: msgpack payload in a small framed, checksummed file. Pure: no I/O.

docs/format.md specifies it byte by byte. The reader validates everything (magic, version, sizes,
types, bounds, overlaps, blob names) before any blob byte is read.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import torch
import xxhash
import zstandard

from tierckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from tierckpt.format.envelope import index_from_codec, split_envelope
from tierckpt.format.frameindex import FORMAT_V6, FrameIndex, check_index
from tierckpt.format.sharding import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Mesh,
    ShardRow,
    decode_meshes,
    decode_sharding,
    encode_meshes,
    encode_sharding,
    unstored_rows,
)
from tierckpt.format.table import DTYPES, MAX_DIMS, TensorEntry, TensorTable, check_extents, decode_table, encode_table

__all__ = [
    "ENVELOPE_VERSION",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_TREE_FLOOR",
    "MAX_TREE_RATIO",
    "READ_VERSIONS",
    "BlobEntry",
    "Manifest",
    "ManifestHead",
    "TensorEntry",
    "TensorTable",
    "decode_head",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "inner_head",
    "manifest_version",
    "unframe",
]

MAGIC = b"TIERCKPT"
FORMAT_VERSION = 5
READ_VERSIONS = (1, 2, 3, 4, 5)
#: A tier copy stored compressed: an envelope around a manifest of READ_VERSIONS and its frame index
#: (docs/format.md, "Compressed copies (version 6)"; tierckpt.format.frames).
ENVELOPE_VERSION = FORMAT_V6
_KNOWN = (*READ_VERSIONS, ENVELOPE_VERSION)
#: The first version with sharded rows, meshes and chunk checksums (docs/format.md, "Sharding").
SHARDED = 5
#: The first version whose trailer checksums the header too. From it on the framing is fixed for every
#: future version (docs/format.md, "Framing"), so a reader can tell a newer file from a damaged one.
WHOLE_FILE_CHECKSUM = 4
_HEADER = struct.Struct("<8sHHIQ")  # magic, version, flags, reserved, payload length
_TRAILER = struct.Struct("<Q")  # xxh3_64 of header + payload (versions 1-3: of the payload only)
#: The framing every version keeps (docs/format.md): readers of files check the header's magic and
#: length against the file's size with these before reading the rest.
HEADER = _HEADER
TRAILER_BYTES = _TRAILER.size
MAX_PAYLOAD_BYTES = 1 << 31
_COMPRESS_TREE_ABOVE = 64 << 10
#: A zstd tree may expand to at most this many times its stored size, or to MAX_TREE_FLOOR bytes, whichever
#: is more: the reader refuses a frame that declares more, and the writer stores a tree raw where zstd would
#: compress it further, so no healthy tree is refused. Real trees compress 3-30x; a list of 100,000 equal
#: values 3,000x (the floor keeps such trees of older writers, which had no bound, readable).
MAX_TREE_RATIO = 32
MAX_TREE_FLOOR = 16 << 20
_BLOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")  # with .match: the whole name (no "\n")
_KEYS = ("step", "rank", "world_size", "align", "checksum", "blobs", "tensors", "tree_codec", "tree", "has_pickle")
_KEYS_V5 = (*_KEYS, "chunk_bytes", "meshes", "sharding")
_DEFERRED = ("tensors", "tree", "sharding")  # decoded by ManifestHead.manifest(), after the blobs' reads are submitted
_DTYPES = DTYPES
_NAMES = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dt: torch.dtype) -> str:
    """Canonical name of a dtype in the manifest (``bfloat16``, ``float8_e4m3fn`` …)."""
    name = _NAMES.get(dt)
    return name if name is not None else str(dt).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises KeyError for a name this torch does not know."""
    return _DTYPES[name]


class BlobEntry(NamedTuple):
    """One blob file of this rank: its file name inside the checkpoint directory and its size.

    ``held`` is not part of the manifest (its ``blobs`` are ``[name, size]`` pairs): it is what one tier
    copy holds of the blob where that differs from ``size``, set by the data path for a copy whose blobs
    are stored encoded (docs/format.md): the blob's stored stream and its zero
    padding, ``round_up(held_i, align)`` bytes. A tier reader then checks the blob's file or object
    against it instead of ``size``; layouts (``data.bin``, a node file's region) still place each blob
    after the ``size`` of the blobs before it. None: the copy holds all ``size`` bytes.
    """

    name: str
    size: int
    held: int | None = None

    @property
    def stored(self) -> int:
        """The bytes a tier copy holds of the blob: ``held`` where set, else ``size``."""
        return self.size if self.held is None else self.held


@dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild one rank's state from its blobs.

    ``tensors`` may be given as any sequence of :class:`TensorEntry`; it is always held as a
    :class:`TensorTable`. ``version`` is the format version :func:`encode_manifest` writes (or the one
    :func:`decode_manifest` read); ``tree`` is in that version's encoding
    (:func:`~tierckpt.format.tree.flatten` with ``version=``).
    """

    step: int
    rank: int
    world_size: int
    align: int
    blobs: tuple[BlobEntry, ...]
    tensors: TensorTable
    tree: bytes
    has_pickle: bool
    version: int = FORMAT_VERSION
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    meshes: tuple[Mesh, ...] = ()
    sharding: dict[int, ShardRow] = field(default_factory=dict)
    #: How a compressed tier copy stores the blobs (version-6 files); not part of the manifest's bytes.
    frames: FrameIndex | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, TensorTable):
            object.__setattr__(self, "tensors", TensorTable.from_entries(self.tensors))

    @property
    def tensor_bytes(self) -> int:
        return sum(self.tensors.lengths)

    @property
    def blob_bytes(self) -> int:
        return sum(b.size for b in self.blobs)


def encode_manifest(m: Manifest) -> bytes:
    """Serialize deterministically in format ``m.version``: the same manifest always gives the same bytes.

    Raises:
        ValueError: ``m.version`` is not a version this writer knows (1 to 5).
    """
    if m.version not in READ_VERSIONS:
        raise ValueError(f"cannot write format version {m.version} (this writer knows {READ_VERSIONS})")
    if m.version < SHARDED and (m.sharding or m.meshes):
        raise ValueError(f"format version {m.version} cannot hold sharded rows (version {SHARDED} can)")
    tree, codec = m.tree, "none"
    if len(tree) > _COMPRESS_TREE_ABOVE:
        packed = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False).compress(tree)
        if len(tree) * 0.9 > len(packed) and len(tree) <= _tree_limit(len(packed)):
            tree, codec = packed, "zstd"
    if m.version == 1:
        tensors: Any = [[t.path, t.dtype, list(t.shape), t.blob, t.offset, t.length, t.checksum] for t in m.tensors]
    else:
        tensors = encode_table(m.tensors)
    payload: bytes = msgpack.packb(
        {
            "step": m.step,
            "rank": m.rank,
            "world_size": m.world_size,
            "align": m.align,
            "checksum": "xxh3_64",
            "blobs": [[b.name, b.size] for b in m.blobs],
            "tensors": tensors,
            "tree_codec": codec,
            "tree": tree,
            "has_pickle": m.has_pickle,
            **(_sharding_fields(m) if m.version >= SHARDED else {}),
        },
        use_bin_type=True,
    )
    framed = _HEADER.pack(MAGIC, m.version, 0, 0, len(payload)) + payload
    digest = xxhash.xxh3_64_intdigest(framed if m.version >= WHOLE_FILE_CHECKSUM else payload)
    return framed + _TRAILER.pack(digest)


def _sharding_fields(m: Manifest) -> dict[str, Any]:
    """The fields version 5 adds: chunk size, meshes and the sharding table."""
    if m.version < SHARDED and (m.sharding or m.meshes):
        raise ValueError(f"format version {m.version} cannot hold sharded rows")
    return {
        "chunk_bytes": m.chunk_bytes,
        "meshes": encode_meshes(m.meshes),
        "sharding": encode_sharding(m.sharding, m.meshes),
    }


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}")


def _want(cond: bool, msg: str) -> None:
    if not cond:
        raise _bad(msg)


def _is_int(v: Any, lo: int = 0, hi: int = (1 << 63) - 1) -> bool:
    return type(v) is int and lo <= v <= hi


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate a manifest file's bytes (format version 1 to 6: a version-6 file gives its inner
    manifest, ``frames`` set).

    Checks magic, version, payload length and checksum, every field's type, dtypes, that each extent's
    length matches dtype × shape and lies inside its blob, that extents do not overlap, and that blob
    names are plain file names (no path separators, no leading dot).

    Raises:
        CorruptCheckpointError: saying what is wrong.
        UnsupportedFormatError: the file is intact but written in a newer format version.
    """
    return decode_head(data).manifest()


@dataclass(frozen=True)
class ManifestHead:
    """The part of a manifest that says which blobs to read: validated by :func:`decode_head`, before
    the tensor table and the tree are (:meth:`manifest`), so that a restore can start reading the
    blobs into its own buffers while it validates the rest.
    """

    version: int
    step: int
    rank: int
    world_size: int
    align: int
    blobs: tuple[BlobEntry, ...]
    has_pickle: bool
    chunk_bytes: int
    meshes: tuple[Mesh, ...]
    _payload: dict[str, Any] = field(repr=False, compare=False)
    _spans: dict[str, memoryview] = field(repr=False, compare=False)
    #: How a compressed tier copy stores the blobs (version-6 files, checked against ``blobs``); None else.
    frames: FrameIndex | None = field(default=None, compare=False, repr=False)

    def manifest(self) -> Manifest:
        """Validate the tensor table and the tree, and return the whole manifest.

        Raises:
            CorruptCheckpointError: saying what is wrong.
        """
        d = self._payload
        tree = _unpack_span(self._spans["tree"], "tree")
        _want(isinstance(tree, bytes), "tree is not bytes")
        if d["tree_codec"] == "zstd":
            tree = _decompress_tree(tree)
        sizes = [b.size for b in self.blobs]
        rows = _unpack_span(self._spans["tensors"], "tensors")
        sharding: dict[int, ShardRow] = {}
        if self.version >= SHARDED:
            shard_d = _unpack_span(self._spans["sharding"], "sharding")
            tensors = decode_table(rows, sizes, unstored=unstored_rows(shard_d))
            sharding = decode_sharding(
                shard_d, self.meshes, tensors.shapes, tensors.lengths, self.rank, self.chunk_bytes
            )
        else:
            tensors = decode_table(rows, sizes) if self.version >= 2 else _decode_rows_v1(rows, sizes)
        return Manifest(
            step=self.step,
            rank=self.rank,
            world_size=self.world_size,
            align=self.align,
            blobs=self.blobs,
            tensors=tensors,
            tree=tree,
            has_pickle=self.has_pickle,
            version=self.version,
            chunk_bytes=self.chunk_bytes,
            meshes=self.meshes,
            sharding=sharding,
            frames=self.frames,
        )


def manifest_version(head: bytes) -> int | None:
    """The format version a manifest file's header says (``head``: its first :data:`HEADER` ``.size``
    bytes at least); None when they are not a manifest's header (too short, another magic). Nothing
    else is checked: enough to tell a copy written before commit records existed (docs/format.md). A
    compressed copy's file (an envelope) says :data:`ENVELOPE_VERSION`."""
    if len(head) < _HEADER.size:
        return None
    magic, version = _HEADER.unpack_from(head)[:2]
    return int(version) if magic == MAGIC else None


def decode_head(data: bytes) -> ManifestHead:
    """Check a manifest file's framing (magic, version, length, checksum) and its header fields
    (step, rank, world size, alignment, blob names and sizes); the tensor table and the tree are
    validated by :meth:`ManifestHead.manifest`. A version-6 file (a compressed copy) gives its inner
    manifest's head, ``frames`` set and checked against the blobs.

    Raises:
        CorruptCheckpointError: saying what is wrong.
        UnsupportedFormatError: the file is intact but written in a newer format version.
    """
    version, payload = unframe(data)
    if version == ENVELOPE_VERSION:
        inner, codec = split_envelope(payload)
        head = inner_head(inner)
        index = index_from_codec(codec, tuple(b.size for b in head.blobs))
        check_index(index, index.sizes)
        return dataclasses.replace(head, frames=index)
    d, spans = _unpack_head(payload, version)
    _want(_is_int(d["step"]), f"step {d['step']!r} is not a non-negative integer")
    _want(_is_int(d["world_size"], 1, 1 << 24), f"world_size {d['world_size']!r} is invalid")
    _want(
        _is_int(d["rank"], 0, d["world_size"] - 1),
        f"rank {d['rank']!r} is invalid for world size {d['world_size']}",
    )
    align = d["align"]
    _want(_is_int(align, 1, 1 << 30) and align & (align - 1) == 0, f"align {align!r} is not a power of two")
    _want(d["checksum"] == "xxh3_64", f"unknown checksum algorithm {d['checksum']!r}")
    _want(d["tree_codec"] in ("none", "zstd"), f"unknown tree codec {d['tree_codec']!r}")
    _want(type(d["has_pickle"]) is bool, "has_pickle is not a bool")
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
    chunk_bytes = DEFAULT_CHUNK_BYTES
    meshes: tuple[Mesh, ...] = ()
    if version >= SHARDED:
        chunk_bytes = d["chunk_bytes"]
        _want(
            _is_int(chunk_bytes, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES) and chunk_bytes & (chunk_bytes - 1) == 0,
            f"chunk_bytes {chunk_bytes!r} is not a power of two from {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}",
        )
        meshes = decode_meshes(d["meshes"], d["rank"], d["world_size"])
    return ManifestHead(
        version=version,
        step=d["step"],
        rank=d["rank"],
        world_size=d["world_size"],
        align=align,
        blobs=tuple(blobs),
        has_pickle=d["has_pickle"],
        chunk_bytes=chunk_bytes,
        meshes=meshes,
        _payload=d,
        _spans=spans,
    )


def inner_head(inner: bytes) -> ManifestHead:
    """The head of a version-6 file's inner manifest: a manifest of versions 1-5 (never another envelope).

    Raises:
        CorruptCheckpointError: saying what is wrong.
    """
    version = manifest_version(inner[: _HEADER.size])
    if version not in READ_VERSIONS:
        raise _bad(f"envelope.manifest is {'not a manifest' if version is None else f'of version {version}'}")
    return decode_head(inner)


def unframe(data: bytes) -> tuple[int, memoryview]:
    """The version and the payload of a manifest file, once its framing and checksum hold.

    Every version keeps magic, version and payload length where version 1 put them, and from version 4
    the trailer checksums the header and the payload: a file of a version this reader does not know is
    told apart by that checksum, intact (written by a newer tierckpt) or damaged.
    """
    _want(len(data) >= _HEADER.size + _TRAILER.size, f"file too short ({len(data)} bytes)")
    magic, version, flags, reserved, n = _HEADER.unpack_from(data)
    _want(magic == MAGIC, f"bad magic {magic!r} (not a tierckpt manifest)")
    _want(n <= MAX_PAYLOAD_BYTES, f"payload length {n} is too large")
    _want(len(data) == _HEADER.size + n + _TRAILER.size, f"file is {len(data)} bytes, header says {n} + framing")
    end = _HEADER.size + n
    (digest,) = _TRAILER.unpack_from(data, end)
    whole = xxhash.xxh3_64_intdigest(memoryview(data)[:end]) == digest
    known = ", ".join(map(str, _KNOWN))
    if version not in _KNOWN:
        if version > _KNOWN[-1] and whole:
            raise UnsupportedFormatError(
                f"manifest: written in format version {version} by a newer tierckpt; this reader knows "
                f"versions {known} (upgrade tierckpt to read it)"
            )
        raise _bad(f"format version {version} is unknown (this reader knows {known}) and the checksum does not match")
    payload = memoryview(data)[_HEADER.size : end]
    if version >= WHOLE_FILE_CHECKSUM:
        _want(whole, "checksum mismatch (header and payload)")
        _want(reserved == 0, f"reserved field is {reserved:#x}, not 0")
    else:
        _want(xxhash.xxh3_64_intdigest(payload) == digest, "payload checksum mismatch")
    _want(flags == 0, f"unknown flags {flags:#x}")
    return version, payload


def _tree_limit(stored: int) -> int:
    """The most bytes a zstd tree of ``stored`` bytes may expand to."""
    return max(stored * MAX_TREE_RATIO, MAX_TREE_FLOOR)


def _decompress_tree(packed: bytes) -> bytes:
    """A zstd tree, decompressed: one frame whose declared content size is within :func:`_tree_limit`
    of its stored size, checked before anything is allocated."""
    try:
        size = zstandard.frame_content_size(packed)
    except zstandard.ZstdError as e:
        raise _bad(f"tree is not a zstd frame: {e}") from e
    _want(size >= 0, "tree's zstd frame does not declare its size")
    _want(
        size <= _tree_limit(len(packed)),
        f"tree's zstd frame declares {size} bytes from {len(packed)}: more than {MAX_TREE_RATIO} times its "
        f"stored size and {MAX_TREE_FLOOR} bytes, the most a reader accepts",
    )
    try:
        tree = zstandard.ZstdDecompressor().decompress(packed, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _bad(f"tree does not decompress: {e}") from e
    _want(len(tree) == size, f"tree decompresses to {len(tree)} bytes, its frame declares {size}")
    return tree


def _unpack_head(payload: memoryview, version: int) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """The payload map's fields, except the tensor table and the tree: those are skipped over (no
    objects built; 20,000 key paths take a few milliseconds to build) and returned as the spans of
    payload that hold them, for :meth:`ManifestHead.manifest` to decode.
    """
    differ = f"payload keys differ from format version {version}"
    keys = _KEYS_V5 if version >= SHARDED else _KEYS
    u = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True, max_buffer_size=max(1, len(payload)))
    u.feed(payload)
    d: dict[str, Any] = {}
    spans: dict[str, memoryview] = {}
    try:
        count = u.read_map_header()
        _want(count == len(keys), differ)
        for _ in range(count):
            k = u.unpack()
            _want(k in keys and k not in d and k not in spans, differ)
            if k in _DEFERRED:
                start = u.tell()
                u.skip()
                spans[k] = payload[start : u.tell()]
            else:
                d[k] = u.unpack()
        end = u.tell()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # not a map, ends early, bad bytes, a key that is no string
        raise _bad(f"payload is not msgpack: {e}") from e
    _want(end == len(payload), f"payload is not msgpack: {len(payload) - end} bytes after the map")
    return d, spans


def _unpack_span(span: memoryview, what: str) -> Any:
    try:
        return msgpack.unpackb(span, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # the head's pass checked its framing, not its strings or map keys
        raise _bad(f"{what} is not msgpack: {e}") from e


def _decode_rows_v1(rows: Any, blob_sizes: list[int]) -> TensorTable:
    """Version 1's tensor table: one msgpack array per tensor, type-checked row by row."""
    _want(isinstance(rows, list), "tensors is not a list")
    tensors = []
    for i, t in enumerate(rows):
        # Messages are built only on failure: this loop runs once per tensor (20,000 in small states).
        if not (isinstance(t, list) and len(t) == 7 and isinstance(t[0], str)):
            raise _bad(f"tensors[{i}] is malformed")
        path, dt, shape, blob, off, length, checksum = t
        dtype = _DTYPES.get(dt) if isinstance(dt, str) else None
        if dtype is None:
            raise _bad(f"tensor {path}: unknown dtype {dt!r}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(s) for s in shape)):
            raise _bad(f"tensor {path}: bad shape {shape!r}")
        if not (_is_int(blob) and _is_int(off) and _is_int(length)):
            raise _bad(f"tensor {path}: bad extent")
        if not _is_int(checksum, 0, (1 << 64) - 1):
            raise _bad(f"tensor {path}: bad checksum")
        if math.prod(shape) * dtype.itemsize != length:
            raise _bad(f"tensor {path}: length {length} != {math.prod(shape)} x {dtype.itemsize} bytes")
        tensors.append(TensorEntry(path, dt, tuple(shape), blob, off, length, checksum))
    table = TensorTable.from_entries(tensors)
    check_extents(table, blob_sizes)
    return table
