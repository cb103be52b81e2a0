"""Flatten a nested state into (tree bytes, tensors) and back. Pure: no I/O.

The tree is msgpack (docs/format.md, "State tree"). Since format version 3 a tensor reference is a
plain msgpack int (its index in the manifest's tensor table) and an int *value* is ext 5, so that
decoding a tree of 20,000 tensors calls no Python per tensor; versions 1 and 2 wrote the reference
as ext 2 and an int as itself. Other plain values (None, bool, float, str, bytes, list, dict) are
themselves, and everything msgpack cannot tell apart is an ext type:

====  ==================  =========================================================
code  Python value        payload
====  ==================  =========================================================
1     tuple               msgpack array of the items
2     tensor reference    versions 1-2 only: u32 big-endian index into the tensor table
3     pickled value       pickle bytes (only with ``allow_pickle=True``)
4     OrderedDict         msgpack array of ``[key, value]`` pairs
5     int                 decimal ASCII (versions 1-2: only ints outside 64 bits)
6     torch.dtype         name, e.g. ``bfloat16``
7     torch.device        str(device), e.g. ``cuda:0``
8     torch.Size          msgpack array of ints
====  ==================  =========================================================

Dict keys are never tensor references: an int key is a plain msgpack int in every version.
"""

from __future__ import annotations

import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.errors import CorruptCheckpointError, StateError
from tierckpt.format._decode import EXT_CODES, decode_levels
from tierckpt.format._diagnose import _I64_MIN, _U64_MAX, diagnose, format_path
from tierckpt.format._encode import MAX_NESTING, ShardSpec, TensorRef, Walk, encode
from tierckpt.format.manifest import FORMAT_VERSION, READ_VERSIONS, SHARDED
from tierckpt.format.table import ALL_DTYPES

__all__ = [
    "PLAIN_REFS",
    "FlatState",
    "Int",
    "Opaque",
    "Ref",
    "TensorRef",
    "check_ref",
    "decode_tree",
    "flatten",
    "format_path",
    "resolve_tree",
    "unflatten",
]

EXT_TUPLE, EXT_TENSOR, EXT_PICKLE, EXT_ODICT, EXT_INT, EXT_DTYPE, EXT_DEVICE, EXT_SIZE = EXT_CODES
PLAIN_REFS = 3  #: the first format version whose tree references tensors with plain ints


@dataclass(frozen=True)
class FlatState:
    """Result of :func:`flatten`: the msgpack tree and the distinct tensors it references, in order, with
    each one's byte size (read while the walk has the tensor in cache: ~4 ms less for 20,000 tensors
    than a pass over them afterwards)."""

    tree: bytes
    tensors: tuple[TensorRef, ...]
    has_pickle: bool
    nbytes: tuple[int, ...]
    #: rows holding a DTensor's local shard: where it sits (a row not stored here has nbytes 0)
    shards: dict[int, ShardSpec] = field(default_factory=dict)


class Ref(int):
    """Tensor ``int(self)`` of the manifest, as :func:`decode_tree` returns a version 1-2 reference."""

    __slots__ = ()


class Int(int):
    """An int value of a version-3 tree, as :func:`decode_tree` returns it (a plain int there is a
    tensor reference); ``int(v)`` is the value."""

    __slots__ = ()


class Opaque:
    """An unpickled value, as :func:`decode_tree` returns it: a leaf, never walked into (its ints
    are not tensor references, whatever the version)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def flatten(state: Any, *, allow_pickle: bool = False, version: int = FORMAT_VERSION) -> FlatState:
    """Walk ``state`` and split it into a msgpack tree and a list of tensors.

    The same tensor object (or the same view of the same storage) referenced twice is stored once and
    restored as one tensor, so tied weights stay tied. Zero-size tensors are told apart by object only
    (all of them may share address 0): the same one twice is stored once, two distinct ones twice.

    Args:
        state: nested dicts, lists and tuples of tensors and plain values.
        allow_pickle: pickle what is neither (else refuse it), and dicts with keys other than str and
            64-bit ints. Still refused whatever ``allow_pickle`` says: a str (value or key) that is not
            valid UTF-8 (a lone surrogate), a container that holds itself (a cycle), nesting too deep
            to walk, tensors that are sparse, quantized, meta or nested, and tensors whose bytes are not
            all in their storage's memory or whose value is not those bytes (a DTensor or another
            subclass with its own ``__torch_dispatch__``, torch.func wrappers, a freed storage: see
            :mod:`tierckpt.format.memory`). A plain Python subclass of ``torch.Tensor`` is saved as the
            plain tensor it is (its ``__torch_function__`` is not called).
        version: the format version whose tree encoding to write (1 and 2 share one).

    Raises:
        StateError: naming the key path of a value that cannot be saved (unless ``allow_pickle``
            pickles it). Nothing has been written.
        ValueError: ``version`` is not a format version this writer knows.
    """
    if version not in READ_VERSIONS:
        raise ValueError(f"cannot write format version {version} (this writer knows {READ_VERSIONS})")
    walk = Walk(allow_pickle=allow_pickle, plain_refs=version >= PLAIN_REFS, sharded=version >= SHARDED)
    tree, failed = encode(walk, state)
    if failed:
        raise diagnose(state, failed, MAX_NESTING)
    return FlatState(
        tree=tree, tensors=tuple(walk.tensors), has_pickle=walk.has_pickle, nbytes=tuple(walk.nbytes),
        shards=walk.shards,
    )  # fmt: skip


def unflatten(
    tree: bytes,
    tensor_at: Callable[[int], torch.Tensor],
    n_tensors: int,
    *,
    allow_pickle: bool = False,
    version: int = FORMAT_VERSION,
) -> Any:
    """Rebuild the nested state from a tree; ``tensor_at(i)`` returns tensor ``i`` of the manifest.

    The same as :func:`resolve_tree` of :func:`decode_tree`.

    Args:
        tree: the tree's bytes.
        tensor_at: tensor ``i`` of the manifest (called once per reference).
        n_tensors: rows in the manifest's tensor table.
        allow_pickle: accept pickled values.
        version: the format version of the manifest the tree comes from.

    Raises:
        CorruptCheckpointError: the tree is malformed or references a tensor that does not exist.
        StateError: the tree holds pickled values and ``allow_pickle`` is False.
    """
    value, ref = decode_tree(tree, n_tensors, version, allow_pickle=allow_pickle)
    return resolve_tree(value, ref, tensor_at, n_tensors)


def decode_tree(
    tree: bytes, n_tensors: int, version: int, *, allow_pickle: bool = False, unpickle: bool = True
) -> tuple[Any, type[int]]:
    """Decode a tree and leave its tensor references unresolved.

    With ``allow_pickle`` and not ``unpickle``, a pickled value becomes an :class:`Opaque` holding its
    pickle bytes, never loaded (to check a tree's structure without running code from it).

    Returns:
        ``(value, ref)``: the nested value, in which a tensor reference is an instance of exactly
        ``ref``. For versions 1-2 that is :class:`Ref`, checked against ``n_tensors`` here. From
        version 3 it is ``int``, which whoever walks the value checks with :func:`check_ref`, and an
        int value is an :class:`Int`. Containers are dict, list, tuple and OrderedDict (exactly
        those types: a torch.Size is a leaf); an unpickled value is an :class:`Opaque` leaf.

    Raises:
        CorruptCheckpointError: the tree is malformed, nests more than :data:`MAX_NESTING`
            containers, holds a msgpack timestamp or an unknown dtype name, or (versions 1-2) a
            reference is out of range, a row is never referenced, or an int inside 64 bits is ext 5.
        StateError: the tree holds pickled values and ``allow_pickle`` is False.
    """
    ext = _ExtDecoder(version, n_tensors, allow_pickle=allow_pickle, unpickle=unpickle)
    try:
        value = decode_levels(tree, ext.hook, MAX_NESTING)
    except (StateError, CorruptCheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"tree: cannot decode: {e}") from e
    ext.check_all_referenced()
    return value, (int if ext.plain_refs else Ref)


class _ExtDecoder:
    """The msgpack ext hook of one :func:`decode_tree`: what each ext type of the table in this
    module's docstring decodes to, with the checks its version calls for."""

    def __init__(self, version: int, n_tensors: int, *, allow_pickle: bool, unpickle: bool) -> None:
        self.version, self.n_tensors = version, n_tensors
        self.allow_pickle, self.unpickle = allow_pickle, unpickle
        self.plain_refs = version >= PLAIN_REFS
        self.marks = bytearray(0 if self.plain_refs else n_tensors)  # versions 1-2: which rows the tree references
        self.pickles = 0
        self.defer: Callable[[int, bytes], Any]  # set by hook(), before msgpack calls decode()

    def hook(self, defer: Callable[[int, bytes], Any]) -> Callable[[int, bytes], Any]:
        """The ext hook for :func:`~tierckpt.format._decode.decode_levels`, which decodes the payloads
        that ``defer`` sets aside (tuples, OrderedDicts, sizes) one level at a time."""
        self.defer = defer
        return self.decode

    def decode(self, code: int, data: bytes) -> Any:
        """The value of one ext: ``code`` and its payload ``data``."""
        if code == EXT_INT:  # the one ext a version-3 tree holds many of (every int value): inline
            v = int(data.decode("ascii"))
            return Int(v) if self.plain_refs else self.wide_int(v)
        if code == EXT_TENSOR:
            return self.tensor_ref(data)
        if code in (EXT_TUPLE, EXT_ODICT, EXT_SIZE):
            return self.defer(code, data)
        if code == EXT_DTYPE:
            dt = ALL_DTYPES.get(data.decode("ascii"))
            if dt is None:
                raise CorruptCheckpointError(f"tree: unknown dtype {bytes(data[:40])!r}")
            return dt
        if code == EXT_DEVICE:
            return torch.device(data.decode("ascii"))
        if code == EXT_PICKLE:
            return self.pickled(data)
        raise CorruptCheckpointError(f"tree: unknown ext type {code}")

    def wide_int(self, v: int) -> int:
        """An ext-5 int of a version 1-2 tree (which writes only ints outside 64 bits so)."""
        if _I64_MIN <= v <= _U64_MAX:
            raise CorruptCheckpointError(f"tree: ext-5 int {v} in a version-{self.version} tree")
        return v

    def tensor_ref(self, data: bytes) -> Ref:
        if self.plain_refs:
            raise CorruptCheckpointError(f"tree: ext-2 tensor reference in a version-{self.version} tree")
        if len(data) != 4:
            raise CorruptCheckpointError("tree: malformed tensor reference")
        (i,) = struct.unpack(">I", data)
        self.marks[check_ref(i, self.n_tensors)] = 1
        return Ref(i)

    def pickled(self, data: bytes) -> Opaque:
        if not self.allow_pickle:
            raise StateError(
                "checkpoint holds pickled values; pass allow_pickle=True to restore() if you trust its source"
            )
        self.pickles += 1
        return Opaque(pickle.loads(data) if self.unpickle else bytes(data))

    def check_all_referenced(self) -> None:
        """Versions 1-2: raise unless the tree referenced every row of the table.

        Writers reference every row (only a dict pickled whole can orphan the tensors the walk met in
        it first): so a version-3 tree read as version 2 is refused, never misread.
        """
        if not self.pickles and self.marks.count(0):
            raise CorruptCheckpointError(f"tree: tensor {self.marks.index(0)} of the table is not referenced")


def resolve_tree(value: Any, ref: type[int], tensor_at: Callable[[int], torch.Tensor], n_tensors: int) -> Any:
    """``value`` (from :func:`decode_tree`) with each reference replaced by ``tensor_at(i)``, each
    :class:`Int` by its int and each :class:`Opaque` by what it holds; containers are rebuilt with
    their types.

    Raises:
        CorruptCheckpointError: a reference is out of range.
    """

    # the walk gets itself as an argument rather than through its closure: a function whose closure
    # holds itself is a reference cycle, which would keep tensor_at (and what it holds) until a GC pass
    def resolve(v: Any, again: Callable[[Any, Any], Any]) -> Any:
        tv = type(v)
        if tv is ref:
            return tensor_at(check_ref(v, n_tensors))
        if tv is Int:
            return int(v)
        if tv is dict:
            return {k: again(x, again) for k, x in v.items()}
        if tv is list:
            return [again(x, again) for x in v]
        if tv is tuple:
            return tuple(again(x, again) for x in v)
        if tv is OrderedDict:
            return OrderedDict((k, again(x, again)) for k, x in v.items())
        if tv is Opaque:
            return v.value
        return v  # None, bool, int (versions 1-2), float, str, bytes, torch.dtype / device / Size

    return resolve(value, resolve)


def check_ref(i: int, n_tensors: int, *, tier: str | None = None, step: int | None = None) -> int:
    """``i`` if it is a row of a tensor table of ``n_tensors`` rows.

    Raises:
        CorruptCheckpointError: it is not (naming ``tier`` and ``step`` when given).
    """
    if not 0 <= i < n_tensors:
        raise CorruptCheckpointError(
            f"tree: tensor reference {i} out of range (have {n_tensors})", tier=tier, step=step
        )
    return i
