"""A key map on restore (``restore(keys=...)``): the saved state's key paths renamed to the target's.

A model restored under other parameter names than it was saved with (a ``torch.compile``d model's
``_orig_mod.`` prefix added or removed, parameters renamed) needs the saved names mapped to the target's
before the saved tree is matched with the target (``into=``, resharded or not) or rebuilt (a plain
restore). A key path is a value's keys joined by ``.`` (``model._orig_mod.fc.weight``,
``optim.state.0.exp_avg``), as ``tierckpt export`` names tensors; the map applies to every *leaf* of
the saved state: every value reached through dicts alone that is not a non-empty dict (a tensor, a
list or tuple, a plain value, an empty dict). :func:`remap` rebuilds the decoded tree under the mapped
paths; nothing else in the data path knows of key maps.

Where a mapped path goes: with a target (``into=``), to the target's value whose key path it is (with
:meth:`KeyMap.torch_compile`, whose key path it is once the map has been applied to it too); else, the
saved path's nesting where the map left its start and its end unchanged, the part it changed becoming
one dict key (``model._orig_mod.fc.weight`` → ``model.fc.weight`` is ``state['model']['fc.weight']``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import StateError
from tierckpt.format.tree import format_path

__all__ = ["KeyMap", "remap"]

Path = tuple[Any, ...]


@dataclass(frozen=True)
class KeyMap:
    """How a restore maps the saved state's key paths to the target's (see the module docstring).

    Build one with :meth:`of` from what ``restore(keys=...)`` takes: a callable from a saved key path to
    the target's, a mapping of saved key paths to the target's (the paths it does not name stay), or a
    KeyMap; or take :meth:`torch_compile`.

    Attributes:
        rename: a saved key path to the target's.
        both_sides: the map applies to the target's key paths too, and a saved value goes where the two
            agree (a prefix removed from both: whichever side had it, they match).
        names: a mapping's entries: each must name a key path of the checkpoint.
    """

    rename: Callable[[str], str]
    both_sides: bool = False
    names: Mapping[str, str] | None = None

    @classmethod
    def of(cls, keys: KeyMap | Callable[[str], str] | Mapping[str, str]) -> KeyMap:
        """``keys`` as a KeyMap.

        Raises:
            TypeError: ``keys`` is none of those, or a mapping holds a key or value that is not a str.
        """
        if isinstance(keys, KeyMap):
            return keys
        if isinstance(keys, Mapping):
            bad = [(k, v) for k, v in keys.items() if not isinstance(k, str) or not isinstance(v, str)]
            if bad:
                raise TypeError(f"keys: a mapping of saved key paths to the target's, str to str; got {bad[0]!r}")
            names = dict(keys)
            return cls(lambda p: names.get(p, p), names=names)
        if callable(keys):
            return cls(keys)
        raise TypeError(f"keys: expected a callable, a mapping of str to str or a KeyMap, got {type(keys).__name__}")

    @classmethod
    def strip_prefix(cls, prefix: str) -> KeyMap:
        """Remove ``prefix`` wherever a key path's key starts with it, on both sides: a saved key path and
        a target's match whichever of them had it (``prefix`` ends with ``.``)."""
        if not prefix.endswith(".") or prefix == ".":
            raise ValueError(f"strip_prefix: a prefix of keys, ending with '.', got {prefix!r}")
        pattern = re.compile(r"(^|\.)" + re.escape(prefix))
        return cls(lambda p: pattern.sub(r"\1", p), both_sides=True)

    @classmethod
    def torch_compile(cls) -> KeyMap:
        """Match a ``torch.compile``d model's key paths (``model._orig_mod.fc.weight``) with a plain
        model's (``model.fc.weight``), whichever side was compiled; a plain restore drops the prefix."""
        return cls.strip_prefix("_orig_mod.")


def dotted(path: Path) -> str:
    """A key path as ``restore(keys=)`` names it: the keys joined by ``.``."""
    return ".".join(str(k) for k in path)


def leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Each leaf of ``tree`` (see the module docstring) with its path, in order."""
    if isinstance(tree, dict) and (tree or not path):
        for k, v in tree.items():
            yield from leaves(v, (*path, k))
    else:
        yield path, tree


def remap(tree: Any, keys: KeyMap, target: Any = None) -> tuple[Any, dict[Path, str]]:
    """``tree`` (a decoded state tree) with every leaf moved to the path ``keys`` maps its key path to,
    matched against ``target``'s key paths where it is given; and, per new path, the saved key path it
    came from. A state that is not a dict is returned as it is.

    Raises:
        StateError: the map sends two saved values to one path, puts a value inside another, gives a
            path that is not a str or an empty key, sends a value to a path two of the target's key
            paths have, or names (as a mapping) a key path the checkpoint does not have.
    """
    if not isinstance(tree, dict):
        return tree, {}
    index: dict[str, list[Path]] = {}
    for p, _ in leaves(target) if isinstance(target, dict) else ():
        index.setdefault(_renamed(keys, dotted(p)) if keys.both_sides else dotted(p), []).append(p)
    kinds = {p: type(v) for p, v in _containers(tree)}
    out: dict[Any, Any] = type(tree)()
    origins: dict[Path, str] = {}
    for p, v in leaves(tree):
        old = dotted(p)
        new = _renamed(keys, old)
        hits = index.get(new, [])
        if len(hits) > 1:
            raise StateError(
                f"keys: saved key path {old!r} maps to {new!r}, the key path of {len(hits)} of the target's "
                f"values: {' and '.join(_shown(h) for h in hits[:2])}"
            )
        where = hits[0] if hits else p if new == old else _split(new, p)
        if where in origins:
            raise StateError(
                f"keys: saved key paths {origins[where]!r} and {old!r} both map to {_shown(where)}: a key map "
                "must send each saved value to a place of its own"
            )
        origins[where] = old
        _put(out, where, v, kinds, old)
    unused = sorted(set(keys.names or ()) - {dotted(p) for p, _ in leaves(tree)})
    if unused:
        raise StateError(f"keys: {unused[:5]} {'is' if len(unused) == 1 else 'are'} not a key path of the checkpoint")
    return out, origins


def _renamed(keys: KeyMap, path: str) -> str:
    new = keys.rename(path)
    if not isinstance(new, str):
        raise StateError(f"keys: maps {path!r} to {new!r}, not a key path (a str)")
    return new


def _split(new: str, saved: Path) -> Path:
    """Where ``new``, the mapped key path of the leaf at ``saved``, goes without a target: ``saved``'s keys
    that ``new`` starts and ends with stay, and what is between them becomes one key."""
    parts = [str(k) for k in saved]
    n = len(parts)
    k = 0
    while k < n - 1 and new.startswith(".".join(parts[: k + 1]) + "."):
        k += 1
    rest = new[len(".".join(parts[:k])) + 1 :] if k else new
    j = 0
    while j < n - k - 1 and rest.endswith("." + ".".join(parts[n - j - 1 :])):
        j += 1
    middle = rest[: len(rest) - len(".".join(parts[n - j :])) - 1] if j else rest
    if not middle:
        raise StateError(f"keys: maps {dotted(saved)!r} to {new!r}, which has an empty key")
    return (*saved[:k], middle, *saved[n - j :])


def _containers(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every non-empty dict of ``tree`` with its path (their types are kept where the map keeps them)."""
    if isinstance(tree, dict) and (tree or not path):
        yield path, tree
        for k, v in tree.items():
            yield from _containers(v, (*path, k))


def _put(out: dict[Any, Any], path: Path, value: Any, kinds: Mapping[Path, type], old: str) -> None:
    """Set ``out`` at ``path`` to ``value``, making the dicts on the way (of the saved tree's type there)."""
    node = out
    for i, k in enumerate(path[:-1]):
        nxt = node.get(k)
        if nxt is None and k not in node:
            nxt = node[k] = kinds.get(path[: i + 1], dict)()
        if not isinstance(nxt, dict):
            raise StateError(f"keys: maps {old!r} inside {_shown(path[: i + 1])}, which holds a value")
        node = nxt
    if path[-1] in node:
        raise StateError(f"keys: maps {old!r} to {_shown(path)}, which holds other values")
    node[path[-1]] = value


def _shown(path: Path) -> str:
    return format_path(path)
