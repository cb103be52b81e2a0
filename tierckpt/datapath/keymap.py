"""Key maps (:class:`KeyMap`): key paths renamed, for a restore (``restore(key_map=...)``), an export and
a load of safetensors files.

A model restored under other parameter names than it was saved with (a ``torch.compile``d model's
``_orig_mod.`` prefix added or removed, parameters renamed) needs the saved names mapped to the target's
before the saved tree is matched with the target (``into=``, resharded or not) or rebuilt (a plain
restore). A key path is a value's keys joined by ``.`` (``model._orig_mod.fc.weight``,
``optim.state.0.exp_avg``), as ``tierckpt export`` names tensors; a restore's map applies to every
*leaf* of the saved state: every value reached through dicts alone that is not a non-empty dict (a
tensor, a list or tuple, a plain value, an empty dict). :func:`remap` rebuilds the decoded tree under
the mapped paths; nothing else in the data path knows of key maps.

Where a mapped path goes: with a target (``into=``), to the target's value whose key path it is (with
``both_sides``, whose key path it is once the map has renamed it too); else, the saved path's nesting
where the map left its start and its end unchanged, the part it changed becoming one dict key
(``model._orig_mod.fc.weight`` → ``model.fc.weight`` is ``state['model']['fc.weight']``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Union

from tierckpt.errors import StateError
from tierckpt.format.tree import format_path

__all__ = ["KeyMap", "KeyMapLike", "dotted", "leaves", "remap"]

Path = tuple[Any, ...]


#: what a key map may be given as: prefix → replacement, or a function of a name (None: leave it out)
KeyMapLike = Union["KeyMap", Mapping[str, str], Callable[[str], "str | None"], None]


class KeyMap:
    """Renames key paths (``model.layers.0.weight``): by prefix, ``KeyMap({"model.": ""})`` drops a
    leading ``model.``, ``KeyMap({"": "model."})`` adds one, the longest prefix that matches a name is
    applied (a name no prefix matches is kept); a function ``name -> new name`` (None: leave the value
    out) does anything else. The one key map of ``restore(key_map=)``, ``tierckpt.export`` and
    ``tierckpt.load_safetensors``.

    Args:
        spec: a mapping of prefix to replacement, a function, a KeyMap, or None (names as they are).
        both_sides: where names are matched with a target's (a restore, a load into a state), the map
            renames the target's names too, and the two meet where they agree
            (:meth:`torch_compile`: whichever side had the prefix).

    Raises:
        TypeError: ``spec`` is none of these.
    """

    def __init__(self, spec: KeyMapLike = None, *, both_sides: bool = False) -> None:
        self.both_sides = both_sides
        if isinstance(spec, KeyMap):
            self._fn: Callable[[str], str | None] | None = spec._fn
            self._prefixes: list[tuple[str, str]] = spec._prefixes
            self.both_sides = both_sides or spec.both_sides
            return
        self._fn, self._prefixes = None, []
        if spec is None:
            return
        if isinstance(spec, Mapping):
            bad = [k for k, v in spec.items() if not isinstance(k, str) or not isinstance(v, str)]
            if bad:
                raise TypeError(f"key map: prefixes and replacements must be str (got {bad[0]!r})")
            self._prefixes = sorted(spec.items(), key=lambda kv: -len(kv[0]))
        elif callable(spec):
            self._fn = spec
        else:
            raise TypeError(f"key map: expected a mapping of prefixes or a function, got {type(spec).__name__}")

    def __call__(self, name: str) -> str | None:
        if self._fn is not None:
            got = self._fn(name)
            if got is not None and not isinstance(got, str):
                raise TypeError(f"key map: {name!r} mapped to {got!r}, not a str or None")
            return got
        for old, new in self._prefixes:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    @classmethod
    def torch_compile(cls) -> KeyMap:
        """Match a ``torch.compile``d model's names (``model._orig_mod.fc.weight``) with a plain model's
        (``model.fc.weight``), whichever side was compiled: ``_orig_mod.`` is removed wherever a key
        starts with it, on both sides; a restore into new tensors returns the plain names."""
        return cls(_uncompiled, both_sides=True)


_ORIG_MOD = re.compile(r"(^|\.)_orig_mod\.")


def _uncompiled(name: str) -> str:
    return _ORIG_MOD.sub(r"\1", name)


def dotted(path: Path) -> str:
    """``('model', 'layers.0.weight')`` → ``model.layers.0.weight`` (an int key as its decimal digits): a
    key path as key maps and export name it."""
    return ".".join(str(k) for k in path)


def leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Each leaf of ``tree`` (see the module docstring) with its path, in order."""
    if isinstance(tree, dict) and (tree or not path):
        for k, v in tree.items():
            yield from leaves(v, (*path, k))
    else:
        yield path, tree


def remap(tree: Any, key_map: KeyMap, target: Any = None) -> tuple[Any, dict[Path, str]]:
    """``tree`` (a decoded state tree) with every leaf moved to the path ``key_map`` maps its key path to
    (one it maps to None left out), matched against ``target``'s key paths where it is given; and, per
    new path, the saved key path it came from. A state that is not a dict is returned as it is.

    Raises:
        StateError: the map sends two saved values to one path, puts a value inside another, makes an
            empty key, or sends a value to a path two of the target's values have.
        TypeError: a function of the map returned something that is not a str or None.
    """
    if not isinstance(tree, dict):
        return tree, {}
    index: dict[str, list[Path]] = {}
    for p, _ in leaves(target) if isinstance(target, dict) else ():
        name = key_map(dotted(p)) if key_map.both_sides else dotted(p)
        if name is not None:
            index.setdefault(name, []).append(p)
    kinds = {p: type(v) for p, v in _containers(tree)}
    out: dict[Any, Any] = type(tree)()
    origins: dict[Path, str] = {}
    for p, v in leaves(tree):
        old = dotted(p)
        new = key_map(old)
        if new is None:
            continue
        hits = index.get(new, [])
        if len(hits) > 1:
            raise StateError(
                f"key_map: saved key path {old!r} maps to {new!r}, the key path of {len(hits)} of the target's "
                f"values: {' and '.join(_shown(h) for h in hits[:2])}"
            )
        where = hits[0] if hits else p if new == old else _split(new, p)
        if where in origins:
            raise StateError(
                f"key_map: saved key paths {origins[where]!r} and {old!r} both map to {_shown(where)}: a key "
                "map must send each saved value to a place of its own"
            )
        origins[where] = old
        _put(out, where, v, kinds, old)
    return out, origins


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
        raise StateError(f"key_map: maps {dotted(saved)!r} to {new!r}, which has an empty key")
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
            raise StateError(f"key_map: maps {old!r} inside {_shown(path[: i + 1])}, which holds a value")
        node = nxt
    if path[-1] in node:
        raise StateError(f"key_map: maps {old!r} to {_shown(path)}, which holds other values")
    node[path[-1]] = value


def _shown(path: Path) -> str:
    return format_path(path)
