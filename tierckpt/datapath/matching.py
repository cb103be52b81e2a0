"""Pair a target state with a checkpoint for an in-place restore (``restore(into=)``); changes nothing.

One walk over the target and the checkpoint's tree checks the target's structure, shapes and dtypes
and decides, for each checkpoint tensor, where its bytes go: straight into the target tensor's memory
where that is possible, else into a fresh CPU tensor that is copied or assigned once every checksum
has been verified. For 20,000 small tensors this walk is most of the Python work between reading the
manifest and copying the first bytes, while the first reads are in flight (docs/restore.md), so the
common case (a CPU, contiguous target tensor of the right shape and dtype, referenced once) costs a
few torch attribute reads and no call.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.datapath.keymap import KeyMap, dotted, remap
from tierckpt.datapath.manifests import load_tree
from tierckpt.errors import StateError
from tierckpt.format.manifest import Manifest, dtype_from_name
from tierckpt.format.memory import copies, dtensor_type, in_storage, unreadable
from tierckpt.format.tree import Int, Opaque, check_ref, format_path
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Match", "holds_dtensor", "match_target"]

log = logging.getLogger(__name__)

_ABSENT: Any = object()  # a key the target's dict lacks
_SHOWN = 20  # mismatches a StateError lists (the rest are counted)


def holds_dtensor(state: Any) -> bool:
    """Whether ``state`` (nested dicts, lists, tuples) holds a DTensor (False at once where
    ``torch.distributed.tensor`` was never imported: no DTensor can exist then)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    if cls is None:
        return False
    todo, seen = [state], set()
    while todo:
        v = todo.pop()
        if isinstance(v, cls):
            return True
        if isinstance(v, (dict, list, tuple)) and id(v) not in seen:  # a container met twice (or in itself): once
            seen.add(id(v))
            todo.extend(v.values() if isinstance(v, dict) else v)
    return False


@dataclass
class Match:
    """How a checkpoint's tensors reach the target, as :func:`match_target` decided.

    Attributes:
        made: fresh tensors by manifest index (for assigned values, and for what cannot be streamed into).
        later: ``(target tensor, fresh tensor)`` copies to make once everything is verified.
        assigns: ``(container, key, value)`` assignments (values as the tree decoded them: pass them
            through :func:`~tierckpt.format.tree.resolve_tree` with ``made``).
        ref: the type of a tensor reference in ``assigns``' values.
        direct: the target tensor each tensor's bytes go straight into (or None).
        device: by manifest index, the flat byte view of the CUDA target tensor that each verified
            piece of the tensor's bytes is copied into (only where :func:`match_target` was given
            ``devices=True``; the reader's staging memory is the copy's source).
        sharded: ``(DTensor, manifest index)`` of each DTensor of the target (matched by global
            shape and dtype), for the resharding restore (datapath/reshard.py) to fill.
    """

    made: dict[int, torch.Tensor]
    later: list[tuple[torch.Tensor, torch.Tensor]]
    assigns: list[tuple[Any, Any, Any]]
    ref: type[int]
    direct: list[torch.Tensor | None] = field(default_factory=list)
    device: dict[int, torch.Tensor] = field(default_factory=dict)
    sharded: list[tuple[torch.Tensor, int]] = field(default_factory=list)


def match_target(
    m: Manifest,
    target: Any,
    addrs: list[int],
    *,
    allow_pickle: bool,
    tier: Tier,
    key: CheckpointKey,
    strict: bool = True,
    shapes: Sequence[tuple[int, ...]] | None = None,
    devices: bool = False,
    key_map: KeyMap | None = None,
) -> Match:
    """Match ``target`` with the checkpoint and fill ``addrs`` (where each tensor's bytes go).

    A checkpoint tensor is streamed straight into the target tensor it matches when it is referenced
    once (a CPU, contiguous tensor of its shape and dtype); one referenced twice (tied weights, or a
    tensor also inside an assigned tuple) goes to a fresh tensor that every user is copied or
    assigned from once its checksum is verified.

    ``shapes``: the shape each tensor is matched by, where not the table's (a sharded row's global shape).

    ``devices``: a contiguous CUDA target tensor referenced once is filled piece by piece from the
    verified bytes (:attr:`Match.device`) instead of from a fresh CPU tensor copied in at the end.

    With ``strict``, every dict of the target must have exactly the keys of the checkpoint's dict at
    the same path. Without it, a key only the target has is left as it is and a key only the
    checkpoint has is added to the target's dict (both logged as a warning).

    ``key_map``: the checkpoint's key paths are mapped to the target's first (:mod:`tierckpt.datapath.keymap`);
    mismatches name the saved key path a value came from.

    Raises:
        StateError: listing every key path that does not match (bounded): keys missing from either
            side (with ``strict``), shape/dtype/type mismatches, pickled values without ``allow_pickle``.
        CorruptCheckpointError: the tree is malformed or references a tensor the table lacks (names
            the tier).
    """
    source, ref = load_tree(tier, key, m, allow_pickle=allow_pickle)
    walk = _Walk(m, ref, addrs, strict=strict, tier=tier.name, step=key.step)
    if key_map is not None:
        source, walk.origins = remap(source, key_map, target)
    walk.devices = devices
    if shapes is not None:  # a sharded checkpoint: a target is matched by the global shape
        walk.shapes = list(shapes)
    walk.walk(target, source, ())
    walk.check(source)
    return walk.allocate()


class _Walk:
    """One :func:`match_target`: the walk over the target and the checkpoint's tree side by side, and
    what it found. Key paths are tuples, formatted only for an error: a walk over 20,000 tensors must
    not pay for them."""

    def __init__(self, m: Manifest, ref: type[int], addrs: list[int], *, strict: bool, tier: str, step: int) -> None:
        t = m.tensors
        self.n, self.shapes, self.lengths = len(t), t.shapes, t.lengths
        by_name = {name: dtype_from_name(name) for name in set(t.dtypes)}
        self.dtypes = [by_name[name] for name in t.dtypes]
        self.ref, self.addrs, self.strict, self.tier, self.step = ref, addrs, strict, tier, step
        # the target tensor each tensor's bytes go straight into
        self.direct: list[torch.Tensor | None] = [None] * self.n
        # CUDA target tensors filled piece by piece from the verified bytes (with ``devices``)
        self.devices = False
        self.device: dict[int, torch.Tensor] = {}
        # target tensors (and their key paths) that take the bytes from a fresh tensor
        self.slow: list[tuple[torch.Tensor, int, tuple[Any, ...]]] = []
        self.assigns: list[tuple[Any, Any, Any]] = []
        self.problems: list[str] = []  # every mismatch, raised together once the walk is done
        self.only_target: list[tuple[Any, ...]] = []  # key paths only the target has
        self.only_source: list[tuple[Any, ...]] = []  # key paths only the checkpoint has
        self.skipped: list[tuple[Any, ...]] = []  # checkpoint values under an empty target dict (strict)
        self.in_assigns: set[int] = set()  # tensors referenced inside assigned values (set by check())
        self.dtensors: list[tuple[torch.Tensor, int]] = []  # DTensor targets, filled by the resharding restore
        self.origins: dict[tuple[Any, ...], str] | None = None  # with a key map: each value's saved key path

    def walk(self, dst: Any, src: Any, path: tuple[Any, ...]) -> None:
        """Match target value ``dst`` with checkpoint value ``src``, found at ``path``."""
        if isinstance(dst, dict):
            self.match_dict(dst, src, path)
        elif isinstance(dst, list):
            self.match_list(dst, src, path)
        elif isinstance(dst, torch.Tensor):
            self.match_tensor(dst, src, path)
        else:
            self.problems.append(
                f"{format_path(path, 'target')}: cannot restore into a {type(dst).__name__}; pass a dict or a list"
            )

    def match_dict(self, dst: dict[Any, Any], src: Any, path: tuple[Any, ...]) -> None:
        """Match a target dict key by key; a tensor of the right shape and dtype costs no call."""
        if not isinstance(src, dict):
            self.problems.append(
                f"{format_path(path, 'target')}: target is a dict, checkpoint has {_describe(src, self.ref)}"
            )
            return
        if self.strict and not dst and src:
            self.problems.append(_empty_dict(path, len(src)))
            self.skipped.append(path)
            return
        for k in dst:
            if k not in src:
                self.only_target.append((*path, k))
        R, n, dtypes, shapes, Tensor = self.ref, self.n, self.dtypes, self.shapes, torch.Tensor
        direct, addrs, slow = self.direct, self.addrs, self.slow
        for k, v in src.items():
            d = dst.get(k, _ABSENT)
            if type(v) is R and type(d) is Tensor and 0 <= v < n and d.dtype is dtypes[v] and d.shape == shapes[v]:
                # the common case, inline (match_tensor does the same for a tensor in a list)
                if direct[v] is None and d.is_cpu and d.is_contiguous() and in_storage(d, d.data_ptr(), d.nbytes):
                    if v not in self.device:
                        addrs[v] = d.data_ptr()
                        direct[v] = d
                    else:
                        slow.append((d, v, (*path, k)))
                else:
                    self.other(d, v, (*path, k))
            elif _descend(d, v):
                self.walk(d, v, (*path, k))
            elif d is _ABSENT:
                self.only_source.append((*path, k))
                if not self.strict:
                    self.assigns.append((dst, k, v))
            else:
                self.assigns.append((dst, k, v))

    def match_list(self, dst: list[Any], src: Any, path: tuple[Any, ...]) -> None:
        """Match a target list item by item (the checkpoint's must be a list as long)."""
        if not isinstance(src, list) or len(src) != len(dst):
            self.problems.append(
                f"{format_path(path, 'target')}: target is a list of {len(dst)}, checkpoint has {_describe(src, self.ref)}"
            )
            return
        for i, (d, s) in enumerate(zip(dst, src)):
            if _descend(d, s):
                self.walk(d, s, (*path, i))
            else:
                self.assigns.append((dst, i, s))

    def match_tensor(self, dst: torch.Tensor, src: Any, path: tuple[Any, ...]) -> None:
        """Match a target tensor with a checkpoint tensor of its shape and dtype; stream into it if it
        is CPU, contiguous, readable memory that no other reference took already."""
        where = format_path(path, "target")
        if type(src) is not self.ref:
            self.problems.append(f"{where}: target is a tensor, checkpoint has {_describe(src, self.ref)}")
            return
        check_ref(src, self.n, tier=self.tier, step=self.step)
        shape, dtype = self.shapes[src], self.dtypes[src]
        if dst.shape != shape or dst.dtype != dtype:
            self.problems.append(
                f"{where}: target is {dst.dtype} {tuple(dst.shape)}, checkpoint has {dtype} {tuple(shape)}"
            )
            return
        if type(dst) is not torch.Tensor and type(dst) is dtensor_type():  # shape: the global one
            self.dtensors.append((dst, src))
            return
        if (
            self.direct[src] is None and src not in self.device
            and dst.is_cpu and dst.is_contiguous() and unreadable(dst) is None
        ):  # fmt: skip
            self.addrs[src] = dst.data_ptr()
            self.direct[src] = dst
        else:
            self.other(dst, src, path)

    def other(self, dst: torch.Tensor, src: int, path: tuple[Any, ...]) -> None:
        """A target tensor the bytes cannot be streamed straight into: a CUDA one referenced once is
        filled piece by piece (with ``devices``); anything else is copied from a fresh tensor."""
        if (
            self.devices and dst.is_cuda and dst.is_contiguous() and type(dst) is torch.Tensor
            and self.direct[src] is None and src not in self.device
        ):  # fmt: skip
            self.device[src] = dst
        else:
            self.slow.append((dst, src, path))

    def check(self, source: Any) -> None:
        """Raise what the walk found wrong: a tensor reference out of range in a value to assign (or,
        with ``strict``, one left out), mismatches and unmatched keys (:func:`_check_keys`), a target
        tensor that cannot be filled by a copy."""
        R = self.ref
        for _, _, v in self.assigns:
            _refs(v, R, self.in_assigns)
        unused: set[int] = set()  # and inside values not assigned (a bad reference there is damage too)
        for p in [*self.only_source, *self.skipped] if self.strict else ():
            _refs(_at(source, p), R, unused)
        for i in self.in_assigns | unused:
            check_ref(i, self.n, tier=self.tier, step=self.step)
        _check_keys(
            self.problems, self.only_target, self.only_source, strict=self.strict, step=self.step, origins=self.origins
        )
        for d, _, p in self.slow:  # the few that are not plain CPU memory: copy_() must be able to fill them later
            why = _unwritable(d)
            if why is not None:
                raise StateError(f"{format_path(p, 'target')}: cannot restore into {why}")

    def allocate(self) -> Match:
        """Fresh tensors for what is not streamed straight into the target (pointing ``addrs`` at them),
        and the copies to make from them once everything is verified."""
        shapes, dtypes, direct, addrs = self.shapes, self.dtypes, self.direct, self.addrs
        # a tensor referenced twice (two target tensors, or one and an assigned value) is not streamed into
        shared = self.in_assigns.union(i for _, i, _ in self.slow)
        slow = self.slow + [(d, i, ()) for i in shared if (d := direct[i]) is not None]
        # a CUDA target of a tensor referenced twice takes its bytes from the fresh tensor too
        slow += [(self.device.pop(i), i, ()) for i in shared.intersection(self.device)]
        made: dict[int, torch.Tensor] = {}
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for d, i, _ in slow:
            f = made.get(i)
            if f is None:
                f = made[i] = torch.empty(shapes[i], dtype=dtypes[i])  # not touched until the bytes arrive
                addrs[i] = f.data_ptr()
            later.append((d, f))
        for i in self.in_assigns.difference(made):
            f = made[i] = torch.empty(shapes[i], dtype=dtypes[i])
            addrs[i] = f.data_ptr()
        for i in range(self.n):
            if direct[i] is None and self.lengths[i] and i not in made and i not in self.device:
                # never referenced (only a hand-made manifest): verified into scratch and dropped
                f = made[i] = torch.empty(self.lengths[i], dtype=torch.uint8)
                addrs[i] = f.data_ptr()
        device = {i: d.reshape(-1).view(torch.uint8) for i, d in self.device.items() if d.numel()}
        return Match(made, later, self.assigns, self.ref, direct, device, self.dtensors)


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _empty_dict(path: tuple[Any, ...], n: int) -> str:
    where = format_path(path, "target")
    hint = ""
    if path and path[-1] == "state":
        hint = (
            " (a fresh optimizer's state_dict()['state'] is empty: restoring into it cannot change the optimizer;"
            " restore it through tierckpt.TrainState, or pass the restored value to load_state_dict: docs/resume.md)"
        )
    return f"{where}: target is an empty dict, checkpoint has {n} key{'s' * (n != 1)} there{hint}"


def _check_keys(
    problems: list[str],
    only_target: list[tuple[Any, ...]],
    only_source: list[tuple[Any, ...]],
    *,
    strict: bool,
    step: int,
    origins: dict[tuple[Any, ...], str] | None = None,
) -> None:
    """Raise one :class:`StateError` listing ``problems`` and (with ``strict``) the unmatched keys, at most
    :data:`_SHOWN` of them (the rest counted); without ``strict``, log the unmatched keys as a warning.
    ``origins``: with a key map, each checkpoint value's saved key path (named where it was renamed)."""
    n_keys = len(only_target) + len(only_source)
    n_source = min(len(only_source), max(_SHOWN // 2, _SHOWN - len(only_target)))  # both sides get room
    missing = "key is not in the checkpoint" + ("" if origins is None else " (no saved key path maps to it)")
    keys = [f"{format_path(p, 'target')}: {missing}" for p in only_target[: _SHOWN - n_source]]
    keys += [
        f"{format_path(p, 'target')}: key is only in the checkpoint{_saved_as(p, origins)}"
        for p in only_source[:n_source]
    ]
    if not strict and n_keys:
        log.warning(
            "restore(into=, strict=False) of step %d: %d key(s) only in the target were left as they are, "
            "%d only in the checkpoint were added to the target: %s%s",
            step, len(only_target), len(only_source), "; ".join(keys), "; ..." if n_keys > len(keys) else "",
        )  # fmt: skip
    total = len(problems) + (n_keys if strict else 0)
    if not total:
        return
    shown = (problems + keys if strict else problems)[:_SHOWN]
    hint = ""
    if strict and n_keys:
        hint = "strict=False leaves keys only in the target as they are and adds those only in the checkpoint to the target"
        if origins is None and any("_orig_mod." in str(k) for p in (*only_target, *only_source) for k in p):
            hint = (
                "one side is a torch.compile'd model's: restore(..., key_map=tierckpt.KeyMap.torch_compile()); " + hint
            )
    if total == 1:
        raise StateError(shown[0] + (f" ({hint})" if hint else ""))
    lines = shown + ([f"... and {total - len(shown)} more"] if total > len(shown) else [])
    if hint:
        lines.append(f"({len(only_target)} key(s) not in the checkpoint, {len(only_source)} only in it; {hint})")
    raise StateError(f"target does not match step {step}'s checkpoint in {total} place(s):\n  " + "\n  ".join(lines))


def _saved_as(path: tuple[Any, ...], origins: dict[tuple[Any, ...], str] | None) -> str:
    """`` (saved as 'x.y')`` for a value a key map moved, else nothing."""
    old = None if origins is None else origins.get(path)
    return "" if old is None or old == dotted(path) else f" (saved as {old!r})"


def _unwritable(d: torch.Tensor) -> str | None:
    """Why ``copy_()`` cannot fill target tensor ``d`` with a checkpoint's values, or None."""
    if d.layout is not torch.strided:
        return f"a {d.layout} tensor"
    if d.is_meta:
        return "a meta tensor (it has no memory to fill)"
    if (why := unreadable(d)) is not None:  # a DTensor or other dispatch subclass, a freed storage ...
        return why
    if d.numel() and not copies(d.dtype):
        return f"a {d.dtype} tensor that must be filled by a copy, which torch cannot make for this dtype (pass contiguous CPU tensors, each once)"
    if d.numel() and _may_overlap(d.shape, d.stride()):
        return "a tensor whose elements may share memory (an expanded or as_strided view)"
    return None


def _may_overlap(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """False when no two elements of a strided view can share memory: taken by increasing stride, each
    dimension's stride exceeds the farthest offset the dimensions before it reach (a sufficient test:
    it holds for every slice, transpose and permutation of a dense tensor; an expanded dimension,
    stride 0, fails it)."""
    reach = 0
    for st, n in sorted((st, n) for st, n in zip(stride, shape) if n > 1):
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def _refs(v: Any, ref: type[int], out: set[int]) -> None:
    """Add the tensor references inside the decoded value ``v`` to ``out``."""
    tv = type(v)
    if tv is ref:
        out.add(v)
    elif tv is dict or tv is OrderedDict:
        for x in v.values():
            _refs(x, ref, out)
    elif tv is list or tv is tuple:
        for x in v:
            _refs(x, ref, out)


def _descend(d: Any, s: Any) -> bool:
    """Whether the walk goes into target value ``d`` with checkpoint value ``s`` (else ``s`` is
    assigned): always for a tensor (which must match), for a dict or list unless ``s`` is a pickled
    value (assigned whole: its contents are not tree values)."""
    return isinstance(d, torch.Tensor) or (isinstance(d, (dict, list)) and type(s) is not Opaque)


def _describe(v: Any, ref: type[int]) -> str:
    if type(v) is ref:
        return "a tensor"
    if type(v) is Opaque:
        return "a pickled value"
    if type(v) is Int:
        return "int"
    return f"a list of {len(v)}" if isinstance(v, list) else type(v).__name__
