"""Where each DCP write item goes in its rank's state: the user's nested key path where one exists.

A rank's part of a step is one state saved by ``Hierarchy.save``: the items DCP's planner gave that rank,
each at its original key path (from the planner's flattening mappings, ``planner_data``), so that
``h.restore(step)`` returns a nested state like the one saved, plus one entry :data:`RESERVED` with the
DCP bookkeeping. An item with no usable path (no mappings, a second chunk of one tensor on one rank, a
path that collides with another item's or with :data:`RESERVED`) goes to ``RESERVED["chunks"][n]``
(:data:`CHUNKS`): the entry then holds tensors besides the bookkeeping, which a reader of the bookkeeping
(the metadata record) leaves alone.

The placement is a pure function of a rank's plan (its items in order and its ``planner_data``), so the
coordinator computes every rank's locations from the global plan and each rank the same for its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from torch.distributed.checkpoint.planner import WriteItem

from tierckpt.dcp._record import Location, PathElem

__all__ = ["CHUNKS", "RESERVED", "build_state", "lookup", "place_items"]

RESERVED = "__dcp__"  #: the top-level key of a rank's state that holds the DCP bookkeeping
CHUNKS = "chunks"  #: the key in :data:`RESERVED` of the items with no usable key path of their own


def _mapped_path(item: WriteItem, mappings: Any) -> tuple[PathElem, ...] | None:
    path = mappings.get(item.index.fqn) if isinstance(mappings, Mapping) else (item.index.fqn,)
    if not isinstance(path, tuple) or not path or not isinstance(path[0], str) or path[0] == RESERVED:
        return None
    return path if all(type(e) in (str, int) for e in path) else None


def place_items(items: Sequence[WriteItem], planner_data: Any, rank: int) -> list[Location]:
    """Each item's location in ``rank``'s state, in order (deterministic: the same plan, the same places)."""
    leaves: set[tuple[PathElem, ...]] = set()
    inner: set[tuple[PathElem, ...]] = set()  # every proper prefix of a leaf
    out: list[Location] = []
    spare = 0
    for item in items:
        path = _mapped_path(item, planner_data)
        if path is None or path in leaves or path in inner or any(path[:i] in leaves for i in range(1, len(path))):
            path, spare = (RESERVED, CHUNKS, spare), spare + 1
        leaves.add(path)
        inner.update(path[:i] for i in range(1, len(path)))
        out.append(Location(rank, path))
    return out


class _Node(dict[Any, Any]):
    """A container :func:`build_state` made (the values placed in it are the user's, left as they are)."""


def _finish(node: Any) -> Any:
    """``node`` with each container made by :func:`build_state` as a plain dict, or as a list where its
    keys are exactly 0..n-1 (list indices in DCP's paths: its dict keys are strings)."""
    if type(node) is not _Node:
        return node
    out = {k: _finish(v) for k, v in node.items()}
    keys = list(out)
    if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
        return [out[i] for i in range(len(keys))]
    return out


def build_state(values: Sequence[tuple[tuple[PathElem, ...], Any]], reserved: dict[str, Any]) -> dict[str, Any]:
    """The nested state holding each value at its path (paths from :func:`place_items`: no collisions),
    with ``reserved`` merged into the :data:`RESERVED` entry."""
    root = _Node()
    for path, value in values:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, _Node())
        node[path[-1]] = value
    root[RESERVED] = _Node({**root.get(RESERVED, {}), **reserved})  # last: h.restore shows the user's keys first
    state: dict[str, Any] = _finish(root)  # the root is a dict (its keys are paths' first elements)
    return state


def lookup(state: Any, path: Sequence[PathElem]) -> Any:
    """The value at ``path`` of a restored state; LookupError when there is none."""
    node = state
    for k in path:
        if not (isinstance(node, dict) or (isinstance(node, (list, tuple)) and type(k) is int)):
            raise LookupError(k)
        node = cast(Any, node)[k]
    return node
