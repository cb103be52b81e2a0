"""What ``tierckpt inspect`` shows of a manifest: its tensors, its plain values (bounded reprs) and
which keys share one tensor (tied weights); of each tier's copy, the bytes it stores and its compression
ratio (:func:`describe_stored`); and of the hierarchy that reads it: every tier's I/O geometry and what it
knows of its storage (:func:`describe_io`).

The tree is decoded without unpickling anything (a pickled value shows as its size) and walked
iteratively, so a deep or wide tree costs memory in proportion to its own size and no recursion.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tierckpt.config import format_size
from tierckpt.errors import TierckptError
from tierckpt.format.manifest import Manifest, decode_head
from tierckpt.format.sharding import REPLICATE, SHARD, ShardRow
from tierckpt.format.tree import Int, Opaque, check_ref, decode_tree
from tierckpt.io.geometry import CheckpointGeometry
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["describe", "describe_io", "describe_stored", "io_lines", "stored_lines", "text_lines", "value_repr"]

_CONTAINERS = (dict, list, tuple, OrderedDict)


class _Repr(reprlib.Repr):
    """reprlib with every type bounded *before* formatting: ``repr()`` of a 1 GB bytes value or of a
    100,000-digit int is never computed whole."""

    # ``Repr.repr1`` looks these up by type name (``repr_bytes`` for bytes): called by reprlib, not dead code
    def repr_bytes(self, x: bytes, level: int) -> str:
        s = repr(x[: self.maxstring])  # up to 4 characters per byte: cut the repr too
        return (
            s if len(s) <= self.maxstring and len(x) <= self.maxstring else f"{s[: self.maxstring]}... ({len(x)} bytes)"
        )

    def repr_int(self, x: int, level: int) -> str:
        return super().repr_int(x, level) if x.bit_length() <= 128 else f"<an integer of {x.bit_length()} bits>"

    def repr_str(self, x: str, level: int) -> str:
        s = super().repr_str(x, level)
        return s if len(x) <= self.maxstring else f"{s} ({len(x)} characters)"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8


def _plain(v: Any) -> Any:
    """A decoded leaf as the Python value it restores to, for ``repr``."""
    if type(v) is Int:
        return int(v)
    if type(v) is list or type(v) is tuple:
        return type(v)(_plain(x) for x in v)
    return v


def value_repr(v: Any) -> str:
    """A bounded repr (about 60 characters plus counts) of a decoded tree leaf."""
    if type(v) is Opaque:
        return f"<pickled value, {len(v.value)} bytes>"
    r = _REPR.repr(_plain(v))
    if type(v) in (list, tuple) and len(v) > _REPR.maxlist:
        r += f" ({len(v)} items)"
    return r


def _is_leaf_sequence(v: Any, ref: type[int]) -> bool:
    """A list or tuple of scalars only (no tensor, no container): shown as one value, as an optimizer's
    ``params`` list of ints is, not one line per item."""
    return type(v) in (list, tuple) and not any(type(x) is ref or type(x) in _CONTAINERS for x in v)


def _walk(tree: Any, ref: type[int], n_tensors: int) -> tuple[dict[int, list[str]], list[tuple[str, Any]]]:
    """Every tensor reference's key paths (by tensor index) and every plain leaf, in state order."""
    uses: dict[int, list[str]] = {}
    values: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("state", tree)]
    while stack:
        path, v = stack.pop()
        tv = type(v)
        if tv is ref:
            uses.setdefault(check_ref(v, n_tensors), []).append(path)
        elif tv in _CONTAINERS and v and not _is_leaf_sequence(v, ref):
            items = v.items() if tv in (dict, OrderedDict) else enumerate(v)
            stack.extend(reversed([(f"{path}[{k!r}]", x) for k, x in items]))
        else:
            values.append((path, v))
    return uses, values


def describe(m: Manifest, tier: str) -> dict[str, Any]:
    """Everything ``tierckpt inspect --json`` prints about manifest ``m`` read from ``tier``.

    Raises:
        CorruptCheckpointError: the tree does not decode or references a tensor that does not exist.
    """
    tree, ref = decode_tree(m.tree, len(m.tensors), m.version, allow_pickle=True, unpickle=False)
    uses, values = _walk(tree, ref, len(m.tensors))
    tensors: list[dict[str, Any]] = []
    for i, t in enumerate(m.tensors):
        keys = uses.get(i, [t.path])
        tensors.append({
            "key": t.path, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.length,
            "blob": m.blobs[t.blob].name if t.length else None, "offset": t.offset,
            "also_at": [k for k in keys if k != t.path],
        })  # fmt: skip
        if (r := m.sharding.get(i)) is not None:
            tensors[-1]["sharding"] = _sharding(m, r)
    return {
        "step": m.step, "rank": m.rank, "world_size": m.world_size, "format_version": m.version,
        "read_from": tier, "align": m.align, "tensor_bytes": m.tensor_bytes, "blob_bytes": m.blob_bytes,
        "blobs": [{"name": b.name, "bytes": b.size} for b in m.blobs], "has_pickle": m.has_pickle,
        "tensors": tensors,
        "meshes": [{"shape": list(x.shape), "ranks": list(x.ranks)} for x in m.meshes],
        "tied": [{"keys": [t["key"], *t["also_at"]]} for t in tensors if t["also_at"]],
        "values": [{"key": k, "type": _type_name(v), "repr": value_repr(v)} for k, v in values],
    }  # fmt: skip


def _sharding(m: Manifest, r: ShardRow) -> dict[str, Any]:
    """A sharded row's record: global shape, mesh, placements (``S(0)``, ``R``, ``SS(0,2)``), whether
    this copy stores it."""
    names = [
        "R" if p.kind == REPLICATE else f"S({p.dim})" if p.kind == SHARD else f"SS({p.dim},{p.split})"
        for p in r.placements
    ]
    return {"global_shape": list(r.global_shape), "mesh": r.mesh, "placements": names, "stored": r.stored}


def _type_name(v: Any) -> str:
    if type(v) is Opaque:
        return "pickled"
    if type(v) is Int:
        return "int"
    return type(v).__name__


def text_lines(info: dict[str, Any]) -> list[str]:
    """The human-readable form of :func:`describe`'s result."""
    out = [
        f"step {info['step']}  rank {info['rank']}/{info['world_size']}  format v{info['format_version']}  "
        f"(read from tier {info['read_from']!r})",
        f"{len(info['tensors'])} tensors, {format_size(info['tensor_bytes'])} in {len(info['blobs'])} blob(s) of "
        f"{format_size(info['blob_bytes'])}; {len(info['values'])} plain values"
        + (", some pickled" if info["has_pickle"] else ""),
        "tensors:" if info["tensors"] else "tensors: none",
    ]
    for t in info["tensors"]:
        tied = f"  (also at {', '.join(t['also_at'])})" if t["also_at"] else ""
        sh = t.get("sharding")
        if sh is not None:
            where = "" if sh["stored"] else ", stored by another replica"
            tied += f"  shard of {sh['global_shape']} [{', '.join(sh['placements'])}] on mesh {sh['mesh']}{where}"
        out.append(f"  {t['key']}  {t['dtype']}{t['shape']}  {format_size(t['bytes'])}{tied}")
    for k, mesh in enumerate(info.get("meshes", ())):
        out.append(f"mesh {k}: shape {mesh['shape']}, ranks {mesh['ranks']}")
    if info["tied"]:
        out.append("tied tensors (one tensor under several keys; restored as one):")
        out += [f"  {' = '.join(g['keys'])}" for g in info["tied"]]
    out.append("values:" if info["values"] else "values: none")
    out += [f"  {v['key']} = {v['repr']}" for v in info["values"]]
    return out


def describe_io(tiers: Sequence[Tier], geometry: CheckpointGeometry) -> dict[str, Any]:
    """A hierarchy's checkpoint geometry and, per tier, its geometry in it (every
    :class:`~tierckpt.io.geometry.IOGeometry` field) and what it knows of its storage
    (:meth:`~tierckpt.tiers.base.Tier.storage_facts`: a file tier's file-system facts and file layout)."""
    return {
        "align_bytes": geometry.align_bytes,
        "blob_bytes": geometry.blob_bytes,
        "blob_align_bytes": geometry.blob_align_bytes,
        "read_slots": geometry.read_slots,
        "read_slot_bytes": geometry.read_slot_bytes,
        "tiers": [
            {
                "name": t.name,
                "kind": t.kind,
                "geometry": dataclasses.asdict(geometry.tiers[t.name]),
                **t.storage_facts(),
            }
            for t in tiers
        ],
    }


def io_lines(io: dict[str, Any]) -> list[str]:
    """The human-readable form of :func:`describe_io`'s result."""
    out = [
        f"checkpoint geometry: align {format_size(io['align_bytes'])}, blobs of {format_size(io['blob_bytes'])} "
        f"in multiples of {format_size(io['blob_align_bytes'])}"
    ]
    for t in io["tiers"]:
        g, facts = t["geometry"], t.get("facts")
        fs = "" if facts is None else f" on {facts['fs_type'] or facts['family']}"
        stripes = (
            f"stripes {format_size(g['stripe_unit_bytes'])} x {g['stripe_width_bytes'] // g['stripe_unit_bytes']}, "
        )
        out.append(
            f"  {t['name']} ({t['kind']}{fs}): {stripes if facts else ''}chunk {format_size(g['chunk_bytes'])}, "
            f"pieces of {format_size(g['piece_bytes'])}, queue depth {g['queue_depth']}, {g['staging_slots']} "
            f"staging slots, {'O_DIRECT' if g['direct'] else 'buffered'}"
        )
    return out


def describe_stored(tiers: Sequence[Tier], key: CheckpointKey) -> list[dict[str, Any]]:
    """Per tier holding ``key``'s copy: its raw blob bytes, the bytes its blobs store (a compressed copy's
    stored streams, else the raw bytes) and their ratio (raw / stored), from the copy's manifest head; a
    copy whose manifest does not read says why (``error``)."""
    out: list[dict[str, Any]] = []
    for t in tiers:
        try:
            if not t.holds(key):
                continue
            head = decode_head(t.read_manifest(key))
        except (TierckptError, OSError) as e:
            out.append({"tier": t.name, "error": str(e)})
            continue
        raw = sum(b.size for b in head.blobs)
        frames = head.frames
        stored = raw if frames is None else frames.stored_bytes()
        out.append({
            "tier": t.name, "codec": None if frames is None else frames.name, "raw_bytes": raw,
            "stored_bytes": stored, "ratio": round(raw / stored, 3) if stored else 1.0,
        })  # fmt: skip
    return out


def stored_lines(stored: list[dict[str, Any]]) -> list[str]:
    """The human-readable form of :func:`describe_stored`'s result."""
    out = ["stored:" if stored else "stored: on no tier"]
    for s in stored:
        if "error" in s:
            out.append(f"  {s['tier']}: cannot read its manifest ({s['error']})")
        elif s["codec"] is None:
            out.append(f"  {s['tier']}: {format_size(s['stored_bytes'])} (not compressed)")
        else:
            out.append(
                f"  {s['tier']}: {format_size(s['stored_bytes'])} of {format_size(s['raw_bytes'])} "
                f"({s['codec']}, ratio {s['ratio']:.2f})"
            )
    return out
