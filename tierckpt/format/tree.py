"""Flatten a nested state into (tree bytes, tensors) and back. Pure: no I/O.

The tree is msgpack. Plain values (None, bool, int, float, str, bytes, list, dict) are stored as
themselves; everything msgpack cannot tell apart is an ext type (docs/format.md, "Tree"):

====  ==================  =========================================================
code  Python value        payload
====  ==================  =========================================================
1     tuple               msgpack array of the items
2     tensor reference    u32 big-endian index into the manifest's tensor table
3     pickled value       pickle bytes (only with ``allow_pickle=True``)
4     OrderedDict         msgpack array of ``[key, value]`` pairs
5     int outside 64 bit  decimal ASCII
6     torch.dtype         name, e.g. ``bfloat16``
7     torch.device        str(device), e.g. ``cuda:0``
8     torch.Size          msgpack array of ints
====  ==================  =========================================================
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

__all__ = ["FlatState", "TensorRef", "flatten", "format_path", "unflatten"]

EXT_TUPLE, EXT_TENSOR, EXT_PICKLE, EXT_ODICT, EXT_BIGINT, EXT_DTYPE, EXT_DEVICE, EXT_SIZE = range(1, 9)
_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1
_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_SMALL = frozenset((type(None), bool, float, str, bytes))  # stored as themselves, whatever the value


def format_path(path: tuple[Any, ...], root: str = "state") -> str:
    """``('optim', 'param_groups', 0)`` → ``state['optim']['param_groups'][0]``."""
    return root + "".join(f"[{p!r}]" for p in path)


class TensorRef(NamedTuple):
    """A tensor found in the state: its first key path and the tensor itself (detached, CPU or device)."""

    path: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class FlatState:
    """Result of :func:`flatten`: the msgpack tree and the distinct tensors it references, in order."""

    tree: bytes
    tensors: tuple[TensorRef, ...]
    has_pickle: bool


_TENSOR_REFS: list[msgpack.ExtType] = []  # ext-2 references by index, built once (ExtType() costs ~1 us)


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


def flatten(state: Any, *, allow_pickle: bool = False) -> FlatState:
    """Walk ``state`` and split it into a msgpack tree and a list of tensors.

    The same tensor object (or the same view of the same storage) referenced twice is stored once and
    restored as one tensor, so tied weights stay tied.

    Raises:
        StateError: naming the key path of a value that cannot be saved (unless ``allow_pickle``).
    """
    tensors: list[TensorRef] = []
    originals: list[torch.Tensor] = []  # tensor i as found in the state (before detach / resolve)
    seen: dict[int, int | dict[tuple[Any, ...], int]] = {}  # data_ptr -> index, or identity -> index
    has_pickle = False
    Tensor, strided = torch.Tensor, torch.strided

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
            if tv is int and not _I64_MIN <= v <= _U64_MAX:
                return msgpack.ExtType(EXT_BIGINT, str(v).encode())
            return v
        if isinstance(v, Tensor):
            return tensor_ref(v, path)
        if tv is list:
            return [x if type(x) in _PLAIN_SMALL else walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if tv is tuple:
            return msgpack.ExtType(EXT_TUPLE, pack([walk(x, f"{path}[{i}]") for i, x in enumerate(v)]))
        if tv is dict or tv is OrderedDict:
            items = []
            for k, x in v.items():
                tk = type(k)
                if tk is not str and tk is not int:
                    return pickled(v, path, f"a dict with a {tk.__name__} key {k!r}")
                items.append((k, x if type(x) in _PLAIN_SMALL else walk(x, f"{path}[{k!r}]")))
            if tv is dict:
                return dict(items)
            return msgpack.ExtType(EXT_ODICT, pack([list(kv) for kv in items]))
        if tv is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, str(v).removeprefix("torch.").encode())
        if tv is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(v).encode())
        if tv is torch.Size:
            return msgpack.ExtType(EXT_SIZE, pack(list(v)))
        return pickled(v, path, f"a value of type {tv.__module__}.{tv.__qualname__}")

    def tensor_ref(t: torch.Tensor, path: str) -> msgpack.ExtType:
        if t.layout is not strided or t.is_quantized or t.is_meta or t.is_nested:
            raise StateError(f"{path}: cannot save a {t.layout} / quantized / meta / nested tensor")
        # Deduplicate by the address of the first element; only tensors that share it (the same
        # object twice, tied weights, views starting at the same byte) pay for the full identity.
        p = t.data_ptr()
        hit = seen.get(p)
        if hit is not None:
            if type(hit) is int:  # the second tensor at this address: key the first one by identity too
                hit = seen[p] = {_identity(originals[hit]): hit}
            ident = _identity(t)
            idx = hit.get(ident)
            if idx is not None:
                return _tensor_ref(idx)
            hit[ident] = len(tensors)
        else:
            seen[p] = len(tensors)
        idx = len(tensors)
        originals.append(t)
        if t.requires_grad:
            t = t.detach()
        if t.is_neg() or t.is_conj():
            t = t.resolve_conj().resolve_neg()
        tensors.append(TensorRef(path, t))
        return _tensor_ref(idx)

    try:
        tree = pack(walk(state, "state"))
    finally:
        walk = None  # type: ignore[assignment]  # it referred to itself: that cycle kept all it holds until a GC pass
    return FlatState(tree=tree, tensors=tuple(tensors), has_pickle=has_pickle)


def unflatten(
    tree: bytes,
    tensor_at: Callable[[int], torch.Tensor],
    n_tensors: int,
    *,
    allow_pickle: bool = False,
) -> Any:
    """Rebuild the nested state from a tree; ``tensor_at(i)`` returns tensor ``i`` of the manifest.

    Raises:
        CorruptCheckpointError: the tree is malformed or references a tensor that does not exist.
        StateError: the tree holds pickled values and ``allow_pickle`` is False.
    """

    def hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            if len(data) != 4:
                raise CorruptCheckpointError("tree: malformed tensor reference")
            (i,) = struct.unpack(">I", data)
            if i >= n_tensors:
                raise CorruptCheckpointError(f"tree: tensor reference {i} out of range (have {n_tensors})")
            return tensor_at(i)
        if code == EXT_TUPLE:
            return tuple(unpack(data))
        if code == EXT_ODICT:
            return OrderedDict((k, v) for k, v in unpack(data))
        if code == EXT_BIGINT:
            return int(data.decode("ascii"))
        if code == EXT_DTYPE:
            dt = getattr(torch, data.decode("ascii"), None)
            if not isinstance(dt, torch.dtype):
                raise CorruptCheckpointError(f"tree: unknown dtype {data!r}")
            return dt
        if code == EXT_DEVICE:
            return torch.device(data.decode("ascii"))
        if code == EXT_SIZE:
            return torch.Size(unpack(data))
        if code == EXT_PICKLE:
            if not allow_pickle:
                raise StateError(
                    "checkpoint holds pickled values; pass allow_pickle=True to restore() if you trust its source"
                )
            return pickle.loads(data)
        raise CorruptCheckpointError(f"tree: unknown ext type {code}")

    def unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, raw=False, ext_hook=hook, strict_map_key=False, use_list=True)

    try:
        return unpack(tree)
    except (StateError, CorruptCheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"tree: cannot decode: {e}") from e
    finally:
        unpack = None  # type: ignore[assignment]  # hook and unpack referred to each other: a cycle holding tensor_at
