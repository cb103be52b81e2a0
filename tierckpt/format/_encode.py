"""The state tree's msgpack, encoded: the writer's half of the tree codec (docs/format.md, "State
tree"), the walk over a state that :func:`~tierckpt.format.tree.flatten` runs once per save.

A save of 20,000 tensors spends most of its Python time here, so the walk is written for the common
case: a plain leaf costs a type lookup, a tensor a few attribute reads, and nothing is formatted for
an error until one happens (:mod:`tierckpt.format._diagnose` finds out why a walk failed).
"""

from __future__ import annotations

import pickle
import struct
from collections import OrderedDict
from typing import Any, NamedTuple

import msgpack
import torch

from tierckpt.errors import StateError
from tierckpt.format._decode import EXT_CODES
from tierckpt.format._diagnose import _I64_MIN, _U64_MAX
from tierckpt.format.memory import as_plain, dtensor_type, in_storage, unreadable
from tierckpt.format.sharding import Mesh, Placement, placement_of, shard_box, writer_of

__all__ = ["MAX_NESTING", "ShardSpec", "TensorRef", "TooDeep", "Walk", "encode"]

EXT_TUPLE, EXT_TENSOR, EXT_PICKLE, EXT_ODICT, EXT_INT, EXT_DTYPE, EXT_DEVICE, EXT_SIZE = EXT_CODES
_PLAIN = frozenset((type(None), bool, int, float, str, bytes))
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_PLAIN_SMALL = frozenset((type(None), bool, float, str, bytes))  # stored as themselves, whatever the value
#: Containers (dict, list, tuple) nested deeper than this are refused: msgpack stops at 511, and
#: rebuilding the state takes two Python frames per level (the default limit is 1000 in all).
MAX_NESTING = 256


class TensorRef(NamedTuple):
    """A tensor found in the state: its first key path and the tensor itself (detached, CPU or device)."""

    path: str
    tensor: torch.Tensor


_new_ref = tuple.__new__


class ShardSpec(NamedTuple):
    """Where a row's DTensor shard sits: its mesh, placements, global shape, and whether this rank
    writes its bytes."""

    mesh: Mesh
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...]
    stored: bool


class TooDeep(Exception):
    """The walk went past :data:`MAX_NESTING` (caught by :func:`encode`, whose caller finds out why)."""


def encode(walk: Walk, state: Any) -> tuple[bytes, str]:
    """``(tree, "")``, or ``(b"", why)`` where msgpack or the stack refused the state: ``"utf8"`` (a str
    that is not UTF-8) or ``"depth"`` (a cycle, or nesting too deep).

    Those failures are caught here and only then diagnosed, by the caller, with a slow walk, so the
    common path pays nothing for them; the diagnosis runs outside these except clauses so that the
    error does not hold the failed walk's frames.
    """
    try:
        return _pack(walk.value(state, "state")), ""
    except UnicodeEncodeError:
        return b"", "utf8"
    except (RecursionError, TooDeep):
        return b"", "depth"
    except ValueError as e:
        if "recursion limit" not in str(e):  # msgpack's own nesting limit
            raise
        return b"", "depth"


class Walk:
    """One :func:`~tierckpt.format.tree.flatten`: turns each value of the state into what msgpack packs, collecting tensors.

    Key paths travel down the walk as formatted strings (``state['a'][0]``), extended only where a
    container or a tensor is found: plain leaves, most of a state, never pay for a repr.
    """

    __slots__ = (
        "allow_pickle",
        "depth",
        "has_pickle",
        "meshes",
        "nbytes",
        "originals",
        "plain_refs",
        "seen",
        "sharded",
        "shards",
        "tensors",
    )  # fmt: skip

    def __init__(self, *, allow_pickle: bool, plain_refs: bool, sharded: bool = False) -> None:
        self.allow_pickle, self.plain_refs, self.sharded = allow_pickle, plain_refs, sharded
        self.shards: dict[int, ShardSpec] = {}  # row -> where the DTensor shard it holds sits
        self.meshes: dict[Any, Mesh] = {}  # DeviceMesh -> its stored form
        self.tensors: list[TensorRef] = []
        self.nbytes: list[int] = []  # of each tensor, read while the walk has it in cache
        # tensor i before detach / resolve, and as found in the state
        self.originals: list[tuple[torch.Tensor, Any]] = []
        self.seen: dict[int, int | dict[tuple[Any, ...], int]] = {}  # data_ptr -> index, or identity -> index
        self.depth = 0  # containers open on the walk's path
        self.has_pickle = False

    def value(self, v: Any, path: str) -> Any:
        """What msgpack packs for ``v``, found at ``path``."""
        tv = type(v)
        if tv in _PLAIN:
            if tv is int and (self.plain_refs or not _I64_MIN <= v <= _U64_MAX):
                return _SMALL_INTS[v] if 0 <= v < _N_SMALL_INTS else msgpack.ExtType(EXT_INT, str(v).encode())
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if tv is list or tv is tuple or tv is dict or tv is OrderedDict:
            if self.depth >= MAX_NESTING:
                raise TooDeep  # a cycle, or a state that a restore could not rebuild: diagnose() says which
            self.depth += 1
            out = self.container(v, tv, path)
            self.depth -= 1
            return out
        if tv is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, str(v).removeprefix("torch.").encode())
        if tv is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(v).encode())
        if tv is torch.Size:
            return msgpack.ExtType(EXT_SIZE, _pack(list(v)))
        what = f"a value of type {tv.__module__}.{tv.__qualname__}"
        if tv.__module__ == "numpy":  # a numpy scalar or array: there is a route without pickle
            what += " (save x.item() for a numpy scalar, torch.from_numpy(x) for an array; tierckpt.TrainState does the first, docs/resume.md)"
        return self.pickled(v, path, what)

    def container(self, v: Any, tv: type, path: str) -> Any:
        """A list, tuple, dict or OrderedDict ``v`` (of type ``tv``) with its items walked."""
        value = self.value
        if tv is list:
            return [x if type(x) in _PLAIN_SMALL else value(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if tv is tuple:
            return msgpack.ExtType(EXT_TUPLE, _pack([value(x, f"{path}[{i}]") for i, x in enumerate(v)]))
        items: list[tuple[Any, Any]] = []
        append, tensor = items.append, self.tensor
        for k, x in v.items():
            tk = type(k)
            if tk is not str and (tk is not int or not _I64_MIN <= k <= _U64_MAX):
                if tk is int:
                    return self.pickled(v, path, f"a dict with an int key {k} (outside 64 bits)")
                return self.pickled(v, path, f"a dict with a {tk.__name__} key {k!r}")
            tx = type(x)
            if tx is _TENSOR or tx is _PARAMETER:  # most of a state: straight to tensor(), no dispatch
                append((k, tensor(x, f"{path}[{k!r}]")))
            else:
                append((k, x if tx in _PLAIN_SMALL else value(x, f"{path}[{k!r}]")))
        if tv is dict:
            return dict(items)
        return msgpack.ExtType(EXT_ODICT, _pack([list(kv) for kv in items]))

    def pickled(self, v: Any, path: str, what: str) -> msgpack.ExtType:
        """``v`` pickled, if ``allow_pickle``; else the :class:`StateError` saying ``what`` it is."""
        if not self.allow_pickle:
            raise _refuse(path, what)
        try:
            data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise StateError(f"{path}: cannot pickle {what}: {e}") from e
        self.has_pickle = True
        return msgpack.ExtType(EXT_PICKLE, data)

    def tensor(self, obj: torch.Tensor, path: str) -> int | msgpack.ExtType:
        """The reference to tensor ``obj`` (as found in the state), added to :attr:`tensors` unless the
        same tensor was met before.

        Deduplicates by the address of the first element: only tensors that share it (the same object
        twice, tied weights, views starting at the same byte) pay for the full identity (:meth:`known`).
        """
        tt = type(obj)
        if tt is _TENSOR or tt is _PARAMETER:
            t, p, nb = _plain_readable(obj, path)
        elif tt is dtensor_type():
            return self.dtensor(obj, path)
        else:
            t, p, nb = _readable(obj, path)
        tensors = self.tensors
        idx = len(tensors)
        seen = self.seen
        hit = seen.get(p)
        if hit is None:
            seen[p] = idx
        else:
            first = self.known(hit, t, obj, p, idx)
            if first is not None:
                return first if self.plain_refs else _tensor_ref(first)
        self.originals.append((t, obj))
        if t.requires_grad:
            t = t.detach()
        if t.is_neg() or t.is_conj():
            t = _resolved(t, path)
        tensors.append(_new_ref(TensorRef, (path, t)))  # TensorRef(path, t) without its Python __new__
        self.nbytes.append(nb)
        return idx if self.plain_refs else _tensor_ref(idx)

    def dtensor(self, obj: Any, path: str) -> int:
        """The reference to a DTensor's local shard, recorded with where it sits (:attr:`shards`); a
        shard this rank is not the writing replica of keeps its row but no bytes (docs/distributed.md)."""
        if not self.sharded:
            raise StateError(f"{path}: cannot save a DTensor in a format version before 5")
        mesh = obj.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            raise StateError(f"{path}: cannot save a DTensor whose mesh does not hold this rank")
        try:
            places = tuple(placement_of(p, path) for p in obj.placements)
            local_shape, _ = shard_box(tuple(obj.shape), tuple(mesh.shape), tuple(coord), places)
        except ValueError as e:
            raise StateError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
        with torch.no_grad():
            local = obj.to_local()
        if tuple(local.shape) != local_shape:
            raise StateError(
                f"{path}: the DTensor's local shard is {tuple(local.shape)}, torch's sharding of "
                f"{tuple(obj.shape)} gives this rank {local_shape} (uneven shards made by hand are not supported)"
            )
        saved = self.meshes.get(mesh)
        if saved is None:
            saved = self.meshes[mesh] = Mesh(tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))
        n = len(self.tensors)
        idx = self.tensor(local, path)
        assert type(idx) is int  # sharded implies plain references (version 5)
        spec = ShardSpec(saved, places, tuple(obj.shape), writer_of(coord, places) == tuple(coord))
        if idx < n and self.shards.get(idx) != spec:
            raise StateError(f"{path}: the DTensor's local shard is also saved elsewhere in the state as another value")
        self.shards[idx] = spec
        if not spec.stored:
            self.nbytes[idx] = 0  # the replica at 0 on every Replicate mesh dim writes it
        return idx

    def known(
        self, hit: int | dict[tuple[Any, ...], int], t: torch.Tensor, obj: torch.Tensor, p: int, idx: int
    ) -> int | None:
        """Of the tensors met before at address ``p`` (``hit``: the index of the one, or their indices
        by identity), the index of the one that ``t`` (``obj`` in the state) is; else None, having
        recorded ``t`` there under ``idx``.

        A zero-size tensor owns no byte at its address (empty ones all sit at 0), so it is keyed by
        the object alone: ``originals`` keeps each alive, so its id is not reused meanwhile.
        """
        if isinstance(hit, int):  # the second tensor at this address: key the first one by identity too
            first, first_obj = self.originals[hit]
            hit = self.seen[p] = {(id(first_obj),) if first.numel() == 0 else _identity(first): hit}
        ident = (id(obj),) if t.numel() == 0 else _identity(t)
        found = hit.get(ident)
        if found is None:
            hit[ident] = idx
        return found


def _pack(v: Any) -> bytes:
    out: bytes = msgpack.packb(v, use_bin_type=True, strict_types=True)
    return out


def _refuse(path: str, what: str) -> StateError:
    return StateError(
        f"{path}: cannot save {what}; tierckpt stores tensors and plain values "
        "(None, bool, int, float, str, bytes, list, tuple, dict); pass allow_pickle=True to pickle it"
    )


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
    storage's memory: format/memory.py); a subclass becomes the plain tensor it is, if it is one.

    Raises:
        StateError: naming ``path`` and what the tensor is.
    """
    tt = type(t)
    if tt is not torch.Tensor and tt is not torch.nn.Parameter:
        plain = as_plain(t)
        if isinstance(plain, str):
            raise StateError(f"{path}: cannot save {plain}")
        t = plain  # the plain tensor replaces the subclass for the rest of the walk
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


def _plain_readable(t: torch.Tensor, path: str) -> tuple[torch.Tensor, int, int]:
    """:func:`_readable` of a ``torch.Tensor`` or ``nn.Parameter`` (no subclass to resolve): the checks
    of the common case, a contiguous tensor within its storage, in the fewest torch calls (~40 ns each
    over a Python call: a third of the walk's time for 20,000 tensors); anything else goes the long way."""
    try:
        if t.layout is _STRIDED and not (t.is_quantized or t.is_meta or t.is_nested):
            nb = t.nbytes
            if nb and t.is_contiguous():
                p = t.data_ptr()
                st = t.untyped_storage()
                base = st.data_ptr()
                if base and base <= p and p + nb <= base + st.nbytes():
                    return t, p, nb
    except (RuntimeError, TypeError):
        pass
    return _readable(t, path)


_STRIDED = torch.strided


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
