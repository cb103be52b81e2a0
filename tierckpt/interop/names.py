"""Names of a state's leaves as export and import use them: each tensor and plain value under its key path
joined by ``.`` (``{"model": {"layers.0.weight": w}}`` → ``model.layers.0.weight``), what to keep
(:func:`select`) and how to rename (:class:`~tierckpt.datapath.keymap.KeyMap`, the one key map of restores,
exports and loads). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.datapath.keymap import KeyMap, KeyMapLike, dotted
from tierckpt.errors import StateError
from tierckpt.format.tree import Int, Opaque, check_ref

__all__ = ["KeyMap", "KeyMapLike", "Leaf", "dotted", "leaves", "plain", "select", "state_leaves"]


@dataclass(frozen=True)
class Leaf:
    """One leaf of a state: its dotted ``name``, its key ``path``, and the tensor table row it references
    (``row``; None for a plain value, which is ``value``)."""

    name: str
    path: tuple[Any, ...]
    row: int | None = None
    value: Any = None


def _children(v: Any) -> Iterable[tuple[Any, Any]] | None:
    """The (key, child) pairs of a container of a decoded tree or a live state; None for a leaf."""
    if isinstance(v, Mapping):
        return v.items()
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return enumerate(v)
    return None


def _walk(root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every leaf of ``root`` with its key path, depth first in the containers' order (an empty container
    is a leaf: it holds nothing to name)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), root)]
    while stack:
        path, v = stack.pop()
        kids = _children(v)
        if kids is None:
            yield path, v
            continue
        items = list(kids)
        if not items:
            yield path, v
            continue
        stack.extend(((*path, k), x) for k, x in reversed(items))


def leaves(tree: Any, ref: type[int], n_tensors: int) -> list[Leaf]:
    """The leaves of a decoded state tree (:func:`~tierckpt.format.tree.decode_tree`'s value): tensor
    references as rows, :class:`~tierckpt.format.tree.Int` as ints, a pickled value as the
    :class:`~tierckpt.format.tree.Opaque` it is (never unpickled here), anything else as itself.

    Raises:
        CorruptCheckpointError: a reference is out of range.
    """
    out = []
    for path, v in _walk(tree):
        tv = type(v)
        if tv is ref:
            out.append(Leaf(dotted(path), path, row=check_ref(int(v), n_tensors)))
        else:
            out.append(Leaf(dotted(path), path, value=int(v) if tv is Int else v))
    return out


def state_leaves(state: Any) -> list[Leaf]:
    """The tensor leaves of a live state (``row`` is the leaf's position; ``value`` the tensor)."""
    return [
        Leaf(dotted(path), path, row=i, value=v)
        for i, (path, v) in enumerate(_walk(state))
        if isinstance(v, torch.Tensor)
    ]


def select(found: Sequence[Leaf], only: Sequence[str] = (), key_map: KeyMapLike = None) -> list[Leaf]:
    """The leaves under one of ``only`` (dotted prefixes: ``model`` keeps ``model`` and ``model.*``; none:
    every leaf), renamed by ``key_map``.

    Raises:
        StateError: a leaf's name is empty (the state is a single tensor or value), ``only`` selects
            nothing (naming the top-level keys), or two leaves end up with one name (naming both key
            paths).
    """
    if not only:
        kept = list(found)
    else:
        kept = [x for x in found if any(x.name == p or x.name.startswith(p + ".") for p in only)]
        if not kept:
            top = sorted({str(x.path[0]) for x in found if x.path})
            raise StateError(f"nothing under {', '.join(map(repr, only))} (the state's top-level keys: {top})")
    rename = KeyMap(key_map)
    out: list[Leaf] = []
    seen: dict[str, Leaf] = {}
    for x in kept:
        if not x.path:
            raise StateError("the state is a single value, not a dict: it has no key path to name it by")
        name = rename(x.name)
        if name is None:
            continue
        if not name:
            raise StateError(f"{_where(x)}: renamed to an empty name")
        if name in seen:
            raise StateError(f"{_where(seen[name])} and {_where(x)} would both be named {name!r}")
        seen[name] = x
        out.append(Leaf(name, x.path, x.row, x.value))
    return out


def _where(x: Leaf) -> str:
    return "state" + "".join(f"[{k!r}]" for k in x.path)


def plain(value: Any, name: str) -> Any:
    """A plain value of a decoded tree as the value to export; a pickled one is refused.

    Raises:
        StateError: ``value`` was pickled (export writes no pickle).
    """
    if isinstance(value, Opaque):
        raise StateError(
            f"{name}: a pickled value; export writes no pickle (leave it out with only= / --only, or a key map)"
        )
    return value
