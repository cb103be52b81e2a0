"""Why :func:`~tierckpt.format.tree.flatten` refused a state, found after the fact: the cold path
behind its errors, kept out of the walk so that the walk pays nothing for it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from tierckpt.errors import StateError

__all__ = ["diagnose", "format_path"]

_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1  # the ints a msgpack int holds (tree.py uses them too)


def format_path(path: tuple[Any, ...], root: str = "state") -> str:
    """``('optim', 'param_groups', 0)`` → ``state['optim']['param_groups'][0]`` (exported by
    :mod:`tierckpt.format.tree`)."""
    return root + "".join(f"[{p!r}]" for p in path)


def _key_ok(k: Any) -> bool:
    """Whether the walk keeps ``k`` as a dict key (else it pickles or refuses the whole dict)."""
    return type(k) is str or (type(k) is int and _I64_MIN <= k <= _U64_MAX)


def _children(v: Any) -> Iterator[tuple[Any, Any]] | None:
    """The ``(key, child)`` pairs :func:`~tierckpt.format.tree.flatten` walks into from ``v``, in its order; None for a leaf.
    A dict's pairs stop at the first key for which the walk pickles or refuses the whole dict."""
    tv = type(v)
    if tv is list or tv is tuple:
        return enumerate(v)
    if tv is dict or tv is OrderedDict:
        return _dict_children(v)
    return None


def _dict_children(d: dict[Any, Any]) -> Iterator[tuple[Any, Any]]:
    for k, x in d.items():
        if not _key_ok(k):
            return
        yield k, x


def _not_utf8(s: str) -> UnicodeEncodeError | None:
    try:
        s.encode()
    except UnicodeEncodeError as e:
        return e
    return None


def diagnose(state: Any, failure: str, limit: int) -> StateError:
    """Why ``flatten`` failed, found slowly after the fact, as a :class:`StateError` naming the path.

    ``failure`` is ``"utf8"`` (msgpack could not encode a str: find the first str value or dict key
    that is not valid UTF-8) or ``"depth"`` (the walk went past ``limit`` containers, or ran out of
    stack: find the first container that holds one of its ancestors, else name the deepest nesting).
    Walks in the walk's order and only where it descends, with a stack of its own (so never too deep
    itself).
    """
    utf8 = failure == "utf8"
    if utf8 and type(state) is str and (e := _not_utf8(state)) is not None:
        return StateError(f"state: cannot save a str that is not valid UTF-8 ({e})")
    top = _children(state)
    if top is None:
        return StateError(f"state: cannot save it ({failure})")
    keys: list[Any] = []  # key path of the container on top of ``stack``
    ids = [id(state)]  # ids of the containers on the path, root first
    on_path = {id(state)}
    deepest: tuple[Any, ...] = ()
    stack = [top]
    while stack:
        for k, x in stack[-1]:
            if utf8:
                if type(k) is str and (e := _not_utf8(k)) is not None:
                    return StateError(
                        f"{format_path(tuple(keys))}: cannot save the dict key {k!r}: not valid UTF-8 ({e})"
                    )
                if type(x) is str and (e := _not_utf8(x)) is not None:
                    return StateError(f"{format_path((*keys, k))}: cannot save a str that is not valid UTF-8 ({e})")
            it = _children(x)
            if it is None:
                continue
            if id(x) in on_path:
                if utf8:
                    continue
                return StateError(
                    f"{format_path((*keys, k))}: refers to a container that holds it (a cycle); "
                    "tierckpt saves trees of values"
                )
            keys.append(k)
            ids.append(id(x))
            on_path.add(id(x))
            stack.append(it)
            if len(keys) > len(deepest):
                deepest = tuple(keys)
                if len(deepest) >= limit:
                    stack.clear()
            break
        else:
            stack.pop()
            on_path.discard(ids.pop())
            if keys:
                keys.pop()
    if utf8 or not deepest:
        return StateError(f"state: cannot save it ({failure})")  # not reached: the walk failed somewhere
    shown = format_path(deepest[:8]) + ("..." if len(deepest) > 8 else "")
    levels = f"more than {limit}" if len(deepest) >= limit else str(len(deepest))
    return StateError(f"{shown}: the state is nested too deep to save ({levels} levels of containers)")
