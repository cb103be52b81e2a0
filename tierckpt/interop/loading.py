"""The way in: a safetensors model on disk (one file, or a directory of them with or without an index, as
Hugging Face writes them) loaded as a job's first state, into fresh tensors or into a model's own tensors
(DTensors included: each rank reads only the box its local shard holds), with a key map for prefix
differences (docs/integrations.md, "Export and import").

Reading uses the ``safetensors`` package (the ``safetensors`` extra), imported on first use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierckpt.errors import StateError
from tierckpt.format.sharding import placement_of, shard_box
from tierckpt.interop.names import KeyMap, KeyMapLike, Leaf, state_leaves
from tierckpt.interop.writers import from_st_dtype

__all__ = ["load_safetensors", "safetensors_files"]

log = logging.getLogger(__name__)
_SHOWN = 10  # names a mismatch error lists (the rest are counted)
EXTRA = "pip install 'tierckpt[safetensors]'"
_PACKED = getattr(torch, "float4_e2m1fn_x2", None)  # two values a byte: safetensors slices it whole only


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(f"reading safetensors files needs the safetensors package: {EXTRA}") from e
    return safe_open


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of ``path``: the file itself; in a directory, the files its
    ``*.safetensors.index.json`` names (``model.safetensors.index.json`` where there are several), else
    every ``*.safetensors`` file in it, sorted.

    Raises:
        FileNotFoundError: ``path`` does not exist, holds no safetensors file, or its index names a file
            that is missing.
        StateError: a directory with several indexes, none of them ``model.safetensors.index.json``, or an
            index that is not one.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or directory")
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        main = p / "model.safetensors.index.json"
        if main not in indexes:
            raise StateError(f"{p}: several indexes ({', '.join(i.name for i in indexes)}): name the files to load")
        indexes = [main]
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(f"{indexes[0]}: not a safetensors index (a 'weight_map' of names to files): {e}") from e
        lost = [n for n in names if not isinstance(n, str) or Path(n).name != n or not (p / n).is_file()]
        if lost:
            raise FileNotFoundError(f"{indexes[0]} names files that are not in {p}: {lost[:_SHOWN]}")
        return [p / n for n in names]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors file")
    return files


@dataclass
class _Stored:
    """One tensor of the files: the open file, its name there, its dtype and shape."""

    handle: Any
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str


def load_safetensors(
    path: str | os.PathLike[str],
    into: Any = None,
    *,
    key_map: KeyMapLike = None,
    strict: bool = True,
    cast: bool = False,
) -> Any:
    """Load safetensors files as a state: the way a job starts from a model it did not save (a Hugging
    Face checkpoint), before its first :meth:`~tierckpt.Hierarchy.save`.

    Names: a tensor of ``into`` is named by its key path joined by ``.`` (``{"model":
    model.state_dict()}`` holds ``model.layers.0.weight``), as :func:`~tierckpt.interop.export` names
    what it writes; the files' names pass through ``key_map`` first. Tensors of ``into`` that are one
    tensor (tied weights) need one of their names in the files.

    Args:
        path: a ``.safetensors`` file, or a directory of them (:func:`safetensors_files`).
        into: a state (nested dicts, lists, tuples; ``model.state_dict()``) whose tensors receive the
            values in place (returned); a DTensor receives its local shard's box, read alone from the
            files. None: a new ``{name: tensor}`` dict of every tensor of the files (CPU).
        key_map: renames the files' names before matching: prefix to replacement (``{"": "model."}``
            adds a prefix, ``{"model.": ""}`` drops one), or a function returning the new name or None
            (ignore that tensor); ``KeyMap.torch_compile()`` renames the state's names too, so a compiled
            model's state takes a plain model's files and the other way round.
        strict: every tensor of ``into`` must be in the files and every tensor of the files must be
            used; ``strict=False`` leaves missing ones as they are and ignores extra ones (a warning).
        cast: convert values to the target's dtype (else a dtype that differs is an error).

    Returns:
        ``into``, or the new dict.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install 'tierckpt[safetensors]'``).
        StateError: the files and ``into`` do not match (every mismatch named; nothing changed), or two
            tensors of the files get one name.
        FileNotFoundError: no such file, or no safetensors file in the directory.
    """
    safe_open = _safe_open()
    rename = KeyMap(key_map)
    with contextlib.ExitStack() as stack:
        stored: dict[str, _Stored] = {}
        for f in safetensors_files(path):
            handle = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                new = rename(name)
                if new is None:
                    continue
                if new in stored:
                    raise StateError(
                        f"{f.name}: {name!r} is named {new!r}, as {stored[new].name!r} of {stored[new].file}"
                    )
                sl = handle.get_slice(name)
                dtype, shape = from_st_dtype(sl.get_dtype(), sl.get_shape(), name)
                stored[new] = _Stored(handle, name, dtype, shape, f.name)
        if into is None:
            return {n: _whole(s) for n, s in stored.items()}
        targets = state_leaves(into)
        if rename.both_sides:  # KeyMap.torch_compile(): the target's names meet the files' renamed alike
            targets = [Leaf(rename(x.name) or x.name, x.path, x.row, x.value) for x in targets]
        plan = _match(targets, stored, strict=strict, cast=cast)
        dtensor = _dtensor_class()
        with torch.no_grad():
            for leaf, s in plan:
                _fill(leaf, s, dtensor)
    return into


def _whole(s: _Stored) -> torch.Tensor:
    t: torch.Tensor = s.handle.get_tensor(s.name)
    return t


def _dtensor_class() -> type | None:
    mod = sys.modules.get("torch.distributed.tensor")  # no DTensor exists where it was never imported
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def _tie(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two targets one tensor (``state_dict()`` returns a new tensor object for each name)."""
    local = t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t
    if not local.numel():
        return (id(t),)
    return (local.device, local.data_ptr(), local.dtype, tuple(local.shape), tuple(local.stride()))


def _match(
    targets: Sequence[Leaf], stored: dict[str, _Stored], *, strict: bool, cast: bool
) -> list[tuple[Leaf, _Stored]]:
    """Each target with the stored tensor it takes, once every name, shape and dtype is checked.

    Raises:
        StateError: naming every missing and unexpected name (``strict``), shape and dtype mismatch.
    """
    groups: dict[tuple[Any, ...], list[Leaf]] = {}
    for x in targets:
        groups.setdefault(_tie(x.value), []).append(x)
    plan, missing = [], []
    for group in groups.values():
        have = [x for x in group if x.name in stored]
        if not have:
            missing += [x.name for x in group]
        plan += [(x, stored[x.name]) for x in have]
    used = {x.name for x, _ in plan}
    extra = [n for n in stored if n not in used]
    if (missing or extra) and strict:
        raise StateError(
            "the safetensors files do not match the state: "
            + "; ".join(_listed(what, names) for what, names in (("missing", missing), ("unexpected", extra)) if names)
            + " (a key_map renames the files' names; strict=False loads what matches)"
        )
    if missing or extra:
        log.warning(
            "load_safetensors: %s",
            "; ".join(_listed(w, n) for w, n in (("left as they are", missing), ("ignored", extra)) if n),
        )
    bad = []
    for x, s in plan:
        t = x.value
        if tuple(t.shape) != s.shape:
            bad.append(f"{x.name}: shape {tuple(s.shape)} in {s.file}, {tuple(t.shape)} in the state")
        elif t.dtype != s.dtype and not cast:
            bad.append(f"{x.name}: dtype {s.dtype} in {s.file}, {t.dtype} in the state (cast=True converts)")
    if bad:
        raise StateError("the safetensors files do not match the state: " + "; ".join(bad[:_SHOWN]) + _more(bad))
    return plan


def _listed(what: str, names: Sequence[str]) -> str:
    return f"{len(names)} {what}: {', '.join(names[:_SHOWN])}" + _more(names)


def _more(names: Sequence[str]) -> str:
    return f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""


def _fill(leaf: Leaf, s: _Stored, dtensor: type | None) -> None:
    """Copy the stored tensor into target ``leaf.value`` (a DTensor: its local shard's box alone)."""
    t = leaf.value
    if dtensor is None or not isinstance(t, dtensor):
        t.copy_(_whole(s))
        return
    dt: Any = t
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    local = dt.to_local()
    if coord is None or not local.numel():  # this rank holds no part of it
        return
    try:
        places = tuple(placement_of(p, leaf.name) for p in dt.placements)
        sizes, offsets = shard_box(tuple(dt.shape), tuple(mesh.shape), tuple(coord), places)
    except ValueError as e:
        raise StateError(f"{leaf.name}: {e}") from None
    local.copy_(_box(s, sizes, offsets))


def _box(s: _Stored, sizes: tuple[int, ...], offsets: tuple[int, ...]) -> torch.Tensor:
    """The box ``sizes`` at ``offsets`` of a stored tensor, read alone where safetensors can slice it."""
    if sizes == s.shape:
        return _whole(s)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    if s.dtype is _PACKED:
        return _whole(s)[index]  # packed values: safetensors slices whole values only
    got: torch.Tensor = s.handle.get_slice(s.name)[index]
    return got
