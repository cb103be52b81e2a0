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
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import torch

from tierckpt.errors import CorruptCheckpointError, StateError
from tierckpt.format._decode import EXT_CODES, decode_levels
from tierckpt.format._diagnose import _I64_MIN, _U64_MAX, diagnose, format_path
from tierckpt.format._memory import as_plain, in_storage, unreadable
from tierckpt.format.manifest import FORMAT_VERSION, READ_VERSIONS
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
_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_SMALL = frozenset((type(None), bool, float, str, bytes))  # stored as themselves, whatever the value
#: Containers (dict, list, tuple) nested deeper than this are refused: msgpack stops at 511, and
#: rebuilding the state takes two Python frames per level (the default limit is 1000 in all).
MAX_NESTING = 256


class _TooDeep(Exception):
    """The walk went past :data:`MAX_NESTING` (caught by :func:`flatten`, which finds out why)."""


class TensorRef(NamedTuple):
    """A tensor found in the state: its first key path and the tensor itself (detached, CPU or device)."""

    path: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class FlatState:
    """Result of :func:`flatten`: the msgpack tree and the distinct tensors it references, in order, with
    each one's byte size (read while the walk has the tensor in cache: ~4 ms less for 20,000 tensors
    than a pass over them afterwards)."""

    tree: bytes
    tensors: tuple[TensorRef, ...]
    has_pickle: bool
    nbytes: tuple[int, ...]


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


_TENSOR_REFS: list[msgpack.ExtType] = []  # ext-2 references by index, built once (ExtType() costs ~1 us)


_N_SMALL_INTS = 1024  # ext-5 ints built once: ids, counters and sizes are mostly small
_SMALL_INTS = [msgpack.ExtType(EXT_INT, str(i).encode()) for i in range(_N_SMALL_INTS)]


def _tensor_ref(i: int) -> msgpack.ExtType:
    if i >= len(_TENSOR_REFS):
        _TENSOR_REFS.extend(
            msgpack.ExtType(EXT_TENSOR, struct.pack(">I", k)) for k in range(len(_TENSOR_REFS), max(i + 1, 1024, 2 * i))
        )
    return _TENSOR_REFS[i]


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors at the same address the same tensor (a conjugate or negative view of
    the same bytes is a different value)."""
    return (t.device, t.dtype, t.storage_offset(), t.shape, t.stride(), t.is_conj(), t.is_neg())


def _readable(t: torch.Tensor, path: str) -> tuple[torch.Tensor, int, int]:
    """``(t, t.data_ptr(), t.nbytes)`` for a tensor whose bytes :func:`flatten` may read (all in its
    storage's memory: format/_memory.py); a subclass becomes the plain tensor it is, if it is one.

    Raises:
        StateError: naming ``path`` and what the tensor is.
    """
    tt = type(t)
    if tt is not torch.Tensor and tt is not torch.nn.Parameter:
        plain = as_plain(t)
        if type(plain) is str:
            raise StateError(f"{path}: cannot save {plain}")
        t = plain  # type: ignore[assignment]
    try:
        if t.layout is torch.strided and not (t.is_quantized or t.is_meta or t.is_nested):
            nb, p = t.nbytes, t.data_ptr()
            if not nb:
                return t, p, nb
            # in_storage(t, p, nb), inline for the common case: ~1 us per tensor, a third of the walk's
            st = t.untyped_storage()
            base = st.data_ptr()
            if base and base <= p and (p + nb <= base + st.nbytes() if t.is_contiguous() else in_storage(t, p, nb)):
                return t, p, nb
    except (RuntimeError, TypeError):  # data_ptr() or untyped_storage() of a tensor that has no storage
        pass
    raise StateError(f"{path}: cannot save {unreadable(t) or 'a tensor whose memory cannot be read'}")


def _resolved(t: torch.Tensor, path: str) -> torch.Tensor:
    """The value of a conjugate or negative view (a copy), as torch computes it.

    Raises:
        StateError: torch cannot compute it for this dtype (e.g. no negation for ``torch.bits16``).
    """
    try:
        return t.resolve_conj().resolve_neg()
    except (RuntimeError, TypeError) as e:  # NotImplementedError is a RuntimeError
        kind = "negative" if t.is_neg() else "conjugate"
        raise StateError(
            f"{path}: cannot save a {kind} view of a {t.dtype} tensor: torch cannot compute its value ({e})"
        ) from e


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
            :mod:`tierckpt.format._memory`). A plain Python subclass of ``torch.Tensor`` is saved as the
            plain tensor it is (its ``__torch_function__`` is not called).
        version: the format version whose tree encoding to write (1 and 2 share one).

    Raises:
        StateError: naming the key path of a value that cannot be saved (unless ``allow_pickle``
            pickles it). Nothing has been written.
        ValueError: ``version`` is not a format version this writer knows.
    """
    if version not in READ_VERSIONS:
        raise ValueError(f"cannot write format version {version} (this writer knows {READ_VERSIONS})")
    plain_refs = version >= PLAIN_REFS
    tensors: list[TensorRef] = []
    originals: list[tuple[torch.Tensor, Any]] = []  # tensor i before detach / resolve, and as found in the state
    nbytes: list[int] = []
    depth = 0  # containers open on the walk's path
    seen: dict[int, int | dict[tuple[Any, ...], int]] = {}  # data_ptr -> index, or identity -> index
    has_pickle = False
    Tensor = torch.Tensor

    # Key paths travel down the walk as formatted strings (``state['a'][0]``), extended only where a
    # container or a tensor is found: plain leaves, most of a state, never pay for a repr.
    def refuse(path: str, what: str) -> StateError:
        return StateError(
            f"{path}: cannot save {what}; tierckpt stores tensors and plain values "
            "(None, bool, int, float, str, bytes, list, tuple, dict); pass allow_pickle=True to pickle it"
        )

    def pickled(v: Any, path: str, what: str) -> msgpack.ExtType:
        nonlocal has_pickle
        if not allow_pickle:
            raise refuse(path, what)
        try:
            data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise StateError(f"{path}: cannot pickle {what}: {e}") from e
        has_pickle = True
        return msgpack.ExtType(EXT_PICKLE, data)

    def pack(v: Any) -> bytes:
        return msgpack.packb(v, use_bin_type=True, strict_types=True)

    def walk(v: Any, path: str) -> Any:
        tv = type(v)
        if tv in _PLAIN:
            if tv is int and (plain_refs or not _I64_MIN <= v <= _U64_MAX):
                return _SMALL_INTS[v] if 0 <= v < _N_SMALL_INTS else msgpack.ExtType(EXT_INT, str(v).encode())
            return v
        if isinstance(v, Tensor):
            return tensor_ref(v, path)
        if tv is list or tv is tuple or tv is dict or tv is OrderedDict:
            nonlocal depth
            if depth >= MAX_NESTING:
                raise _TooDeep  # a cycle, or a state that a restore could not rebuild: diagnose() says which
            depth += 1
            out = container(v, tv, path)
            depth -= 1
            return out
        if tv is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, str(v).removeprefix("torch.").encode())
        if tv is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(v).encode())
        if tv is torch.Size:
            return msgpack.ExtType(EXT_SIZE, pack(list(v)))
        what = f"a value of type {tv.__module__}.{tv.__qualname__}"
        if tv.__module__ == "numpy":  # a numpy scalar or array: there is a route without pickle
            what += " (save x.item() for a numpy scalar, torch.from_numpy(x) for an array; tierckpt.TrainState does the first, docs/resume.md)"
        return pickled(v, path, what)

    def container(v: Any, tv: type, path: str) -> Any:
        if tv is list:
            return [x if type(x) in _PLAIN_SMALL else walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if tv is tuple:
            return msgpack.ExtType(EXT_TUPLE, pack([walk(x, f"{path}[{i}]") for i, x in enumerate(v)]))
        items = []
        for k, x in v.items():
            tk = type(k)
            if tk is not str and (tk is not int or not _I64_MIN <= k <= _U64_MAX):
                if tk is int:
                    return pickled(v, path, f"a dict with an int key {k} (outside 64 bits)")
                return pickled(v, path, f"a dict with a {tk.__name__} key {k!r}")
            items.append((k, x if type(x) in _PLAIN_SMALL else walk(x, f"{path}[{k!r}]")))
        if tv is dict:
            return dict(items)
        return msgpack.ExtType(EXT_ODICT, pack([list(kv) for kv in items]))

    def tensor_ref(t: torch.Tensor, path: str) -> int | msgpack.ExtType:
        obj = t  # as found in the state
        t, p, nb = _readable(t, path)
        # Deduplicate by the address of the first element; only tensors that share it (the same
        # object twice, tied weights, views starting at the same byte) pay for the full identity.
        # A zero-size tensor owns no byte at its address (empty ones all sit at 0), so it is keyed
        # by the object alone: ``originals`` keeps each alive, so its id is not reused meanwhile.
        hit = seen.get(p)
        if hit is not None:
            if type(hit) is int:  # the second tensor at this address: key the first one by identity too
                first, first_obj = originals[hit]
                hit = seen[p] = {(id(first_obj),) if first.numel() == 0 else _identity(first): hit}
            ident = (id(obj),) if t.numel() == 0 else _identity(t)
            idx = hit.get(ident)
            if idx is not None:
                return idx if plain_refs else _tensor_ref(idx)
            hit[ident] = len(tensors)
        else:
            seen[p] = len(tensors)
        idx = len(tensors)
        originals.append((t, obj))
        if t.requires_grad:
            t = t.detach()
        if t.is_neg() or t.is_conj():
            t = _resolved(t, path)
        tensors.append(TensorRef(path, t))
        nbytes.append(nb)
        return idx if plain_refs else _tensor_ref(idx)

    # What msgpack or the stack refuses (a str that is not UTF-8, a cycle, deep nesting) is caught here
    # and only then diagnosed by a slow walk, so the common path pays nothing for it. The diagnosis runs
    # outside the except clauses so that the error does not hold the failed walk's frames.
    failed = ""
    try:
        tree = pack(walk(state, "state"))
    except UnicodeEncodeError:
        failed = "utf8"
    except (RecursionError, _TooDeep):
        failed = "depth"
    except ValueError as e:
        if "recursion limit" not in str(e):  # msgpack's own nesting limit
            raise
        failed = "depth"
    finally:
        walk = None  # type: ignore[assignment]  # it referred to itself: that cycle kept all it holds until a GC pass
    if failed:
        raise diagnose(state, failed, MAX_NESTING)
    return FlatState(tree=tree, tensors=tuple(tensors), has_pickle=has_pickle, nbytes=tuple(nbytes))


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
    plain_refs = version >= PLAIN_REFS
    marks = bytearray(0 if plain_refs else n_tensors)  # versions 1-2: which rows the tree references
    pickles = 0

    def make_hook(defer: Callable[[int, bytes], Any]) -> Callable[[int, bytes], Any]:
        def hook(code: int, data: bytes) -> Any:
            nonlocal pickles
            if code == EXT_INT:
                v = int(data.decode("ascii"))
                if plain_refs:
                    return Int(v)
                if _I64_MIN <= v <= _U64_MAX:  # versions 1-2 wrote ext 5 only for ints outside 64 bits
                    raise CorruptCheckpointError(f"tree: ext-5 int {v} in a version-{version} tree")
                return v
            if code == EXT_TENSOR:
                if plain_refs:
                    raise CorruptCheckpointError(f"tree: ext-2 tensor reference in a version-{version} tree")
                if len(data) != 4:
                    raise CorruptCheckpointError("tree: malformed tensor reference")
                (i,) = struct.unpack(">I", data)
                marks[check_ref(i, n_tensors)] = 1
                return Ref(i)
            if code in (EXT_TUPLE, EXT_ODICT, EXT_SIZE):
                return defer(code, data)
            if code == EXT_DTYPE:
                dt = ALL_DTYPES.get(data.decode("ascii"))
                if dt is None:
                    raise CorruptCheckpointError(f"tree: unknown dtype {bytes(data[:40])!r}")
                return dt
            if code == EXT_DEVICE:
                return torch.device(data.decode("ascii"))
            if code == EXT_PICKLE:
                if not allow_pickle:
                    raise StateError(
                        "checkpoint holds pickled values; pass allow_pickle=True to restore() if you trust its source"
                    )
                pickles += 1
                return Opaque(pickle.loads(data) if unpickle else bytes(data))
            raise CorruptCheckpointError(f"tree: unknown ext type {code}")

        return hook

    try:
        value = decode_levels(tree, make_hook, MAX_NESTING)
    except (StateError, CorruptCheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"tree: cannot decode: {e}") from e
    if not pickles and marks.count(0):
        # Writers reference every row of the table (only a dict pickled whole can orphan the tensors
        # the walk met in it first): so a version-3 tree read as version 2 is refused, never misread.
        raise CorruptCheckpointError(f"tree: tensor {marks.index(0)} of the table is not referenced")
    return value, (int if plain_refs else Ref)


def resolve_tree(value: Any, ref: type[int], tensor_at: Callable[[int], torch.Tensor], n_tensors: int) -> Any:
    """``value`` (from :func:`decode_tree`) with each reference replaced by ``tensor_at(i)``, each
    :class:`Int` by its int and each :class:`Opaque` by what it holds; containers are rebuilt with
    their types.

    Raises:
        CorruptCheckpointError: a reference is out of range.
    """

    def resolve(v: Any) -> Any:
        tv = type(v)
        if tv is ref:
            return tensor_at(check_ref(v, n_tensors))
        if tv is Int:
            return int(v)
        if tv is dict:
            return {k: resolve(x) for k, x in v.items()}
        if tv is list:
            return [resolve(x) for x in v]
        if tv is tuple:
            return tuple(resolve(x) for x in v)
        if tv is OrderedDict:
            return OrderedDict((k, resolve(x)) for k, x in v.items())
        if tv is Opaque:
            return v.value
        return v  # None, bool, int (versions 1-2), float, str, bytes, torch.dtype / device / Size

    try:
        return resolve(value)
    finally:
        resolve = None  # type: ignore[assignment]  # it referred to itself: a cycle holding tensor_at


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
