"""DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` as plain data, without pickle.

:func:`encode_metadata` turns the metadata of one checkpoint (what ``dcp.save`` hands the storage
writer's ``finish``) into dicts, lists, strings, ints, bools and None: dtypes by name, sizes and offsets
as lists of ints, dataclasses as maps. :func:`decode_metadata` rebuilds it and checks every field on the
way; a record that does not decode raises :class:`~tierckpt.errors.CorruptCheckpointError` naming the
field (``DCP metadata: state_dict['w'].chunks[1].sizes: expected a list of ints, got 'x'``).

The record (format 2; format 1 is the same)::

    {"format": 2,
     "version": str | None,                       # Metadata.version
     "state_dict": {fqn: {"bytes": True}          # BytesStorageMetadata
                    | {"dtype": "bfloat16", "size": [..], "chunks": [[offsets], [sizes]], ...],
                       "layout": "strided", "memory_format": "contiguous",
                       "requires_grad": bool, "pin_memory": bool}},
     "planner_data": None | {"mappings": {fqn: [path element, ...]}} | {"plain": value},
     "storage_meta": None | {"checkpoint_id": str | None, "save_id": .., "load_id": .., "modules": [str]},
     "storage_data": [[fqn, offset list | None, rank, [path element, ...]], ...]}

``storage_data`` is where each item is: the rank whose copy holds it, and its key path in that rank's
state (:class:`Location`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierckpt.errors import CorruptCheckpointError, StateError, TierckptError, UnsupportedFormatError
from tierckpt.format.manifest import dtype_from_name, dtype_name
from tierckpt.format.tree import flatten

__all__ = [
    "READ_FORMATS",
    "RECORD_FORMAT",
    "Location",
    "PathElem",
    "check_format",
    "decode_metadata",
    "encode_metadata",
]

#: the format this writer gives its entries and records. 2: every part's entry says the world size, the
#: coordinator's its ``scope``, the others' ``record_rank`` (docs/distributed.md, "What each rank writes");
#: the record itself is format 1's
RECORD_FORMAT = 2
#: the formats this reader reads (1: the record in rank 0's part, the job's)
READ_FORMATS = (1, 2)
PathElem = str | int
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve": torch.preserve_format,
}


@dataclass(frozen=True)
class Location:
    """Where one DCP item is stored: in ``rank``'s copy of the step, at key path ``path`` of its state."""

    rank: int
    path: tuple[PathElem, ...]


def _name_of(table: Mapping[str, Any], value: Any, what: str) -> str:
    for name, v in table.items():
        if v == value:
            return name
    raise TierckptError(f"DCP metadata: {what}: {value!r} cannot be stored (known: {', '.join(table)})")


def _plain(value: Any, what: str) -> Any:
    """``value`` if it is plain data a state tree stores without pickle and without tensors."""
    try:
        flat = flatten(value)
    except StateError as e:
        raise TierckptError(f"DCP metadata: {what} cannot be stored without pickle: {e}") from None
    if flat.tensors:
        raise TierckptError(f"DCP metadata: {what} holds tensors; only plain data can be stored")
    return value


def _encode_item(md: Any, fqn: str) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"bytes": True}
    if not isinstance(md, TensorStorageMetadata):
        raise TierckptError(f"DCP metadata: state_dict[{fqn!r}]: unknown storage metadata {type(md).__name__}")
    p = md.properties
    return {
        "dtype": dtype_name(p.dtype),
        "size": [int(s) for s in md.size],
        "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in md.chunks],
        "layout": _name_of(_LAYOUTS, p.layout, f"state_dict[{fqn!r}].layout"),
        "memory_format": _name_of(_MEMORY_FORMATS, p.memory_format, f"state_dict[{fqn!r}].memory_format"),
        "requires_grad": bool(p.requires_grad),
        "pin_memory": bool(p.pin_memory),
    }


def _encode_planner_data(pd: Any) -> Any:
    if pd is None:
        return None
    if isinstance(pd, Mapping) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(type(e) in (str, int) for e in v) for k, v in pd.items()
    ):
        return {"mappings": {k: list(v) for k, v in pd.items()}}
    return {"plain": _plain(pd, "planner_data")}


def _encode_storage_meta(sm: StorageMeta | None) -> dict[str, Any] | None:
    if sm is None:
        return None
    cid = sm.checkpoint_id
    return {
        "checkpoint_id": os.fspath(cid) if cid is not None else None,
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": [str(m) for m in sm.modules],
    }


def encode_metadata(md: Metadata, locations: Mapping[MetadataIndex, Location]) -> dict[str, Any]:
    """The record of ``md``, with ``locations`` (every item's place) as its storage data.

    Raises:
        TierckptError: a field holds something that cannot be stored without pickle (naming it).
    """
    return {
        "format": RECORD_FORMAT,
        "version": _plain(md.version, "version"),
        "state_dict": {fqn: _encode_item(v, fqn) for fqn, v in md.state_dict_metadata.items()},
        "planner_data": _encode_planner_data(md.planner_data),
        "storage_meta": _encode_storage_meta(md.storage_meta),
        "storage_data": [
            [i.fqn, None if i.offset is None else [int(o) for o in i.offset], loc.rank, list(loc.path)]
            for i, loc in locations.items()
        ],
    }


# -- decoding ----------------------------------------------------------------------------------------------
class _Fields:
    """Typed reads of a decoded record; a mismatch raises CorruptCheckpointError naming the field."""

    def __init__(self, tier: str | None, step: int | None) -> None:
        self.tier, self.step = tier, step

    def bad(self, field: str, want: str, got: Any) -> CorruptCheckpointError:
        shown = repr(got) if len(repr(got)) <= 80 else f"a {type(got).__name__}"
        return CorruptCheckpointError(
            f"DCP metadata: {field}: expected {want}, got {shown}", tier=self.tier, step=self.step
        )

    def get(self, d: Mapping[str, Any], key: str, field: str) -> Any:
        if key not in d:
            raise CorruptCheckpointError(f"DCP metadata: {field}: missing", tier=self.tier, step=self.step)
        return d[key]

    def check(self, v: Any, ok: Callable[[Any], bool], field: str, want: str) -> Any:
        if not ok(v):
            raise self.bad(field, want, v)
        return v

    def map(self, v: Any, field: str) -> dict[Any, Any]:
        out: dict[Any, Any] = self.check(v, lambda x: isinstance(x, dict), field, "a map")
        return out

    def ints(self, v: Any, field: str) -> list[int]:
        ok = lambda x: isinstance(x, list) and all(type(e) is int and e >= 0 for e in x)  # noqa: E731
        out: list[int] = self.check(v, ok, field, "a list of ints >= 0")
        return out

    def opt_str(self, v: Any, field: str) -> str | None:
        out: str | None = self.check(v, lambda x: x is None or isinstance(x, str), field, "a str or None")
        return out

    def path(self, v: Any, field: str) -> tuple[PathElem, ...]:
        ok = lambda x: isinstance(x, list) and len(x) > 0 and all(type(e) in (str, int) for e in x)  # noqa: E731
        return tuple(self.check(v, ok, field, "a non-empty list of str and int keys"))

    def name(self, v: Any, table: Mapping[str, Any], field: str) -> Any:
        return table[self.check(v, lambda x: x in table, field, f"one of {', '.join(table)}")]


def _decode_item(f: _Fields, v: Any, field: str) -> TensorStorageMetadata | BytesStorageMetadata:
    v = f.map(v, field)
    if v.get("bytes") is True:
        return BytesStorageMetadata()
    name = f.get(v, "dtype", f"{field}.dtype")
    try:
        dtype = dtype_from_name(name)
    except (KeyError, TypeError):
        raise f.bad(f"{field}.dtype", "a dtype name this torch knows", name) from None
    size = f.ints(f.get(v, "size", f"{field}.size"), f"{field}.size")
    chunks = []
    raw = f.check(f.get(v, "chunks", f"{field}.chunks"), lambda x: isinstance(x, list), f"{field}.chunks", "a list")
    for i, c in enumerate(raw):
        where = f"{field}.chunks[{i}]"
        c = f.check(c, lambda x: isinstance(x, list) and len(x) == 2, where, "[offsets, sizes]")
        offsets, sizes = f.ints(c[0], f"{where}.offsets"), f.ints(c[1], f"{where}.sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise f.bad(where, f"{len(size)} offsets and sizes", c)
        if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
            raise f.bad(where, f"a box inside the tensor's size {size}", c)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    flag = lambda k: f.check(f.get(v, k, f"{field}.{k}"), lambda x: type(x) is bool, f"{field}.{k}", "a bool")  # noqa: E731
    props = TensorProperties(
        dtype=dtype,
        layout=f.name(f.get(v, "layout", f"{field}.layout"), _LAYOUTS, f"{field}.layout"),
        requires_grad=flag("requires_grad"),
        memory_format=f.name(f.get(v, "memory_format", f"{field}.memory_format"), _MEMORY_FORMATS, field),
        pin_memory=flag("pin_memory"),
    )
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _decode_planner_data(f: _Fields, v: Any) -> Any:
    if v is None:
        return None
    v = f.map(v, "planner_data")
    if "mappings" in v:
        m = f.map(v["mappings"], "planner_data.mappings")
        return {
            f.check(k, lambda x: isinstance(x, str), "planner_data.mappings", "str keys"): f.path(
                p, f"planner_data.mappings[{k!r}]"
            )
            for k, p in m.items()
        }
    return f.get(v, "plain", "planner_data.plain")


def _decode_storage_meta(f: _Fields, v: Any) -> StorageMeta | None:
    if v is None:
        return None
    v = f.map(v, "storage_meta")
    mods = f.get(v, "modules", "storage_meta.modules")
    f.check(mods, lambda x: isinstance(x, list) and all(isinstance(e, str) for e in x), "storage_meta.modules", "strs")
    return StorageMeta(
        checkpoint_id=f.opt_str(v.get("checkpoint_id"), "storage_meta.checkpoint_id"),
        save_id=f.opt_str(v.get("save_id"), "storage_meta.save_id"),
        load_id=f.opt_str(v.get("load_id"), "storage_meta.load_id"),
        modules=list(mods),
    )


def _decode_locations(f: _Fields, v: Any, world_size: int) -> dict[MetadataIndex, Location]:
    rows = f.check(v, lambda x: isinstance(x, list), "storage_data", "a list")
    out: dict[MetadataIndex, Location] = {}
    for i, row in enumerate(rows):
        where = f"storage_data[{i}]"
        fqn, offset, rank, path = f.check(row, lambda x: isinstance(x, list) and len(x) == 4, where, "4 fields")
        f.check(fqn, lambda x: isinstance(x, str), f"{where}.fqn", "a str")
        if offset is not None:
            offset = f.ints(offset, f"{where}.offset")
        f.check(rank, lambda x: type(x) is int and 0 <= x < world_size, f"{where}.rank", f"a rank < {world_size}")
        out[MetadataIndex(fqn, offset)] = Location(rank, f.path(path, f"{where}.path"))
    return out


def _check_located(
    f: _Fields, items: Mapping[str, TensorStorageMetadata | BytesStorageMetadata], locs: Mapping[MetadataIndex, Any]
) -> None:
    """Every item (each chunk of a tensor) has a location, and every location an item."""
    want = {
        MetadataIndex(fqn, c.offsets)
        for fqn, md in items.items()
        if isinstance(md, TensorStorageMetadata)
        for c in md.chunks
    } | {MetadataIndex(fqn) for fqn, md in items.items() if isinstance(md, BytesStorageMetadata)}
    if want != set(locs):
        missing, extra = sorted(str(i) for i in want - set(locs)), sorted(str(i) for i in set(locs) - want)
        raise CorruptCheckpointError(
            f"DCP metadata: storage_data: does not match state_dict (no location for {missing[:3]}, "
            f"a location for no item: {extra[:3]})",
            tier=f.tier,
            step=f.step,
        )


def decode_metadata(record: Any, world_size: int, *, tier: str | None = None, step: int | None = None) -> Metadata:
    """The Metadata a record holds; its ``storage_data`` maps each item's index to its :class:`Location`.

    Args:
        record: what :func:`encode_metadata` returned, as read back.
        world_size: the ranks that saved the step (every location's rank must be below it).
        tier: the tier it was read from (named in errors).
        step: its step (named in errors).

    Raises:
        CorruptCheckpointError: a field is missing or malformed, naming it.
    """
    f = _Fields(tier, step)
    rec = f.map(record, "record")
    check_format(f.get(rec, "format", "format"), "DCP metadata", tier, step)
    sd = f.map(f.get(rec, "state_dict", "state_dict"), "state_dict")
    items = {}
    for fqn, v in sd.items():
        f.check(fqn, lambda x: isinstance(x, str), "state_dict", "str keys")
        items[fqn] = _decode_item(f, v, f"state_dict[{fqn!r}]")
    locations = _decode_locations(f, f.get(rec, "storage_data", "storage_data"), world_size)
    _check_located(f, items, locations)
    return Metadata(
        state_dict_metadata=items,
        planner_data=_decode_planner_data(f, f.get(rec, "planner_data", "planner_data")),
        storage_data=locations,
        storage_meta=_decode_storage_meta(f, f.get(rec, "storage_meta", "storage_meta")),
        version=f.opt_str(f.get(rec, "version", "version"), "version"),
    )


def check_format(fmt: Any, what: str, tier: str | None, step: int | None) -> None:
    """Refuse a format this reader does not read: a newer one as :class:`UnsupportedFormatError` (the
    copy is intact; upgrade tierckpt), anything else as damage.

    Raises:
        UnsupportedFormatError: ``fmt`` is an int above :data:`RECORD_FORMAT`.
        CorruptCheckpointError: ``fmt`` is not one of :data:`READ_FORMATS`.
    """
    if fmt in READ_FORMATS and type(fmt) is int:
        return
    if type(fmt) is int and fmt > RECORD_FORMAT:
        raise UnsupportedFormatError(
            f"{what}: format {fmt} is newer than this reader's ({RECORD_FORMAT}): upgrade tierckpt"
            + (f" (tier {tier!r}, step {step})" if tier is not None else "")
        )
    raise CorruptCheckpointError(
        f"{what}: format: expected one of {', '.join(map(str, READ_FORMATS))}, got {fmt!r}", tier=tier, step=step
    )
