"""The state tree's msgpack, decoded level by level: the reader's half of the tree codec that has to
hold against any bytes (docs/format.md, "State tree"), kept apart from what the tree's values mean
(:func:`~tierckpt.format.tree.decode_tree` says that).

A tuple, an OrderedDict and a torch.Size are ext types whose payload is msgpack again. Decoding that
payload inside msgpack's ext hook would nest one ``unpackb`` (and its large C context) per level: a
state of tuples nested 200 deep overflowed the C stack. Here the hook only sets such a payload aside;
the payloads are decoded after the outer call returns, one level of the tree at a time, so the C and
Python stacks stay as deep as one ``unpackb`` whatever the nesting. The same pass bounds the depth
(deeper trees are refused before anything walks them recursively) and refuses the values msgpack makes
on its own (its timestamp, ext -1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from tierckpt.errors import CorruptCheckpointError

__all__ = ["EXT_CODES", "decode_levels"]

EXT_TUPLE, EXT_TENSOR, EXT_PICKLE, EXT_ODICT, EXT_INT, EXT_DTYPE, EXT_DEVICE, EXT_SIZE = range(1, 9)
EXT_CODES = (EXT_TUPLE, EXT_TENSOR, EXT_PICKLE, EXT_ODICT, EXT_INT, EXT_DTYPE, EXT_DEVICE, EXT_SIZE)
_NESTED = frozenset((EXT_TUPLE, EXT_ODICT, EXT_SIZE))
#: How msgpack frames its timestamp ext (-1) of 4, 8 or 12 bytes: a tree without any of these byte
#: strings holds no timestamp, so only a tree with one pays for looking at every value.
_TIMESTAMP_MARKS = (b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff", b"\xc8\x00\x0c\xff", b"\xc9\x00\x00\x00\x0c\xff")


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tree: {msg}")


class _Nested:
    """A tuple, OrderedDict or torch.Size as the ext hook found it: its payload, not decoded yet."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


_WALKED = frozenset((list, dict, _Nested))  # what the level pass descends into


class _Levels:
    """One decode: the ext payloads set aside, and the containers still to build from them."""

    def __init__(self, make_hook: Callable[[Callable[[int, bytes], Any]], Callable[[int, bytes], Any]]) -> None:
        self.hook: Callable[[int, bytes], Any] | None = make_hook(self.defer)
        self.made = self.opened = 0
        self.build: list[tuple[Any, Any, int, list[Any], list[Any]]] = []  # (parent, key, code, keys, values)

    def defer(self, code: int, data: bytes) -> _Nested:
        if code not in _NESTED:
            raise _bad(f"ext {code} is not a tuple, OrderedDict or torch.Size")  # pragma: no cover - caller's bug
        self.made += 1
        return _Nested(code, data)

    def unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(data, raw=False, ext_hook=self.hook, strict_map_key=False, use_list=True)

    def open(self, parent: Any, key: Any, x: _Nested) -> list[Any] | None:
        """Decode ``x``'s payload; return the list to walk next as the container it becomes (None for a
        torch.Size, a leaf, which replaces ``x`` at once)."""
        self.opened += 1
        items, x.data = self.unpack(x.data), b""  # the payload's bytes are not needed any more
        if type(items) is not list:
            raise _bad(f"ext {x.code} does not hold an array")
        if x.code == EXT_SIZE:
            if not all(type(d) is int for d in items):
                raise _bad("a torch.Size holds something other than ints")
            parent[key] = torch.Size(items)
            return None
        if x.code == EXT_TUPLE:
            self.build.append((parent, key, EXT_TUPLE, items, items))
            return items
        if not all(type(p) is list and len(p) == 2 for p in items):
            raise _bad("an OrderedDict is not an array of [key, value] pairs")
        keys, values = [p[0] for p in items], [p[1] for p in items]
        if not all(type(k) is str or type(k) is int for k in keys):
            raise _bad("an OrderedDict key is neither a str nor an int")
        self.build.append((parent, key, EXT_ODICT, keys, values))
        return values

    def open_all(self, c: Any) -> list[list[Any]]:
        """:meth:`open` every ext of container ``c`` that is not decoded yet: the lists to walk next."""
        todo = [(k, x) for k, x in (c.items() if type(c) is dict else enumerate(c)) if type(x) is _Nested]
        return [got for k, x in todo if (got := self.open(c, k, x)) is not None]

    def finish(self) -> None:
        """Build the tuples and OrderedDicts, innermost first (each replaces its ext in its parent)."""
        if self.opened != self.made:
            raise _bad("a tuple, OrderedDict or torch.Size in a map key")
        for parent, key, code, keys, values in reversed(self.build):
            if code == EXT_TUPLE:
                parent[key] = tuple(values)
            else:
                od = OrderedDict(zip(keys, values))
                if len(od) != len(keys):
                    raise _bad("an OrderedDict repeats a key")
                parent[key] = od


def _no_timestamp(level: list[Any]) -> None:
    for c in level:
        seen = set(map(type, c.values() if type(c) is dict else c))
        if type(c) is dict:
            seen.update(map(type, c))
        if msgpack.Timestamp in seen:
            raise _bad("holds a msgpack timestamp (ext -1), which no writer stores")


def decode_levels(
    tree: bytes, make_hook: Callable[[Callable[[int, bytes], Any]], Callable[[int, bytes], Any]], max_depth: int
) -> Any:
    """Decode ``tree``. ``make_hook(defer)`` returns msgpack's ext hook, which must return
    ``defer(code, data)`` for ext types 1 (tuple), 4 (OrderedDict) and 8 (torch.Size): those are
    decoded here, level by level (one Python call per ext, not two, in the hook: 20,000 ints are ext 5).

    Containers are dict, list, tuple and OrderedDict. Time and memory are proportional to the tree's
    bytes (an ext payload is copied once per level it is nested in).

    Raises:
        CorruptCheckpointError: the tree nests more than ``max_depth`` containers, holds a timestamp
            or an ext type where none may be (a map key), or an ext payload is malformed.
        Exception: what the hook or msgpack raise (the caller words them).
    """
    st = _Levels(make_hook)
    try:
        return _decode(st, tree, max_depth)
    finally:
        st.hook = None  # the hook holds st.defer: a cycle until a GC pass


def _decode(st: _Levels, tree: bytes, max_depth: int) -> Any:
    box = [st.unpack(tree)]
    stamps = any(m in tree for m in _TIMESTAMP_MARKS)
    level: list[tuple[Any, Any]] = [(box, None)]  # (container, the container that holds it)
    depth = 0  # of the containers in ``level`` (the box is 0, the root 1)
    while level:
        if depth > max_depth:
            raise _bad(f"nested deeper than {max_depth} containers (the most a writer stores)")
        if stamps:
            _no_timestamp([c for c, _ in level])
        nxt = [(x, c) for c, _ in level for x in (c.values() if type(c) is dict else c) if type(x) in _WALKED]
        if st.opened < st.made:
            holders = {id(c): c for x, c in nxt if type(x) is _Nested}
            if holders:
                nxt = [p for p in nxt if type(p[0]) is not _Nested]
                for c in holders.values():  # walked with their keys: the few that hold an ext
                    nxt.extend((got, c) for got in st.open_all(c))
        level = nxt
        depth += 1
    st.finish()
    return box[0]
