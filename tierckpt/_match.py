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

from dataclasses import dataclass
from typing import Any

import torch

from tierckpt._restore import rebuild
from tierckpt.errors import StateError
from tierckpt.format.manifest import Manifest, dtype_from_name
from tierckpt.format.tree import format_path
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Plan", "materialize", "plan"]


class Ref(int):
    """Tensor ``int(self)`` of the manifest where the tree references it (no memory behind it)."""

    __slots__ = ()


@dataclass
class Plan:
    """What :func:`plan` decided.

    Attributes:
        made: fresh tensors by manifest index (for assigned values, and for what cannot be streamed into).
        later: ``(target tensor, fresh tensor)`` copies to make once everything is verified.
        assigns: ``(container, key, value)`` assignments (values still hold :class:`Ref` leaves).
    """

    made: dict[int, torch.Tensor]
    later: list[tuple[torch.Tensor, torch.Tensor]]
    assigns: list[tuple[Any, Any, Any]]


def plan(m: Manifest, target: Any, addrs: list[int], *, allow_pickle: bool, tier: Tier, key: CheckpointKey) -> Plan:
    """Match ``target`` with the checkpoint and fill ``addrs`` (where each tensor's bytes go).

    Raises:
        StateError: naming the key path of a missing key or a shape/dtype/type mismatch (or pickled
            values without ``allow_pickle``).
        CorruptCheckpointError: the tree is malformed (names the tier).
    """
    t = m.tensors
    n = len(t)
    shapes, lengths = t.shapes, t.lengths
    by_name = {name: dtype_from_name(name) for name in set(t.dtypes)}
    dtypes = [by_name[name] for name in t.dtypes]
    uses = [0] * n  # how often the tree references each tensor

    def ref(i: int) -> Ref:
        uses[i] += 1
        return Ref(i)

    source = rebuild(tier, key, m, ref, allow_pickle=allow_pickle)  # type: ignore[arg-type]
    slow: list[tuple[torch.Tensor, int]] = []  # target tensors that cannot take the bytes straight
    assigns: list[tuple[Any, Any, Any]] = []
    placed = bytearray(n)  # 1: streamed straight into a target tensor
    Tensor = torch.Tensor

    def place(d: torch.Tensor, i: int) -> None:
        if uses[i] == 1 and d.is_cpu and d.is_contiguous():  # one reference, so one target tensor
            addrs[i] = d.data_ptr()
            placed[i] = 1
        else:
            slow.append((d, i))

    def walk(dst: Any, src: Any, path: tuple[Any, ...]) -> None:
        # key paths are formatted only for an error: a walk over 20,000 tensors must not pay for them
        if isinstance(dst, dict):
            if not isinstance(src, dict):
                raise StateError(f"{format_path(path, 'target')}: target is a dict, checkpoint has {_describe(src)}")
            for k in dst:
                if k not in src:
                    raise StateError(f"{format_path((*path, k), 'target')}: key is not in the checkpoint")
            for k, v in src.items():
                d = dst.get(k, None)
                if type(v) is Ref and type(d) is Tensor and d.dtype is dtypes[v] and d.shape == shapes[v]:
                    # the common case, inline: place(d, v)
                    if uses[v] == 1 and d.is_cpu and d.is_contiguous():
                        addrs[v] = d.data_ptr()
                        placed[v] = 1
                    else:
                        slow.append((d, v))
                elif isinstance(d, (dict, list, Tensor)):
                    walk(d, v, (*path, k))
                else:
                    assigns.append((dst, k, v))
        elif isinstance(dst, list):
            if not isinstance(src, list) or len(src) != len(dst):
                raise StateError(
                    f"{format_path(path, 'target')}: target is a list of {len(dst)}, checkpoint has {_describe(src)}"
                )
            for i, (d, s) in enumerate(zip(dst, src)):
                if isinstance(d, (dict, list, Tensor)):
                    walk(d, s, (*path, i))
                else:
                    assigns.append((dst, i, s))
        elif isinstance(dst, Tensor):
            where = format_path(path, "target")
            if type(src) is not Ref:
                raise StateError(f"{where}: target is a tensor, checkpoint has {_describe(src)}")
            if dst.shape != shapes[src] or dst.dtype != dtypes[src]:
                raise StateError(
                    f"{where}: target is {dst.dtype} {tuple(dst.shape)}, checkpoint has {dtypes[src]} {tuple(shapes[src])}"
                )
            place(dst, src)
        else:
            raise StateError(
                f"{format_path(path, 'target')}: cannot restore into a {type(dst).__name__}; pass a dict or a list"
            )

    try:
        walk(target, source, ())
    finally:
        walk = place = None  # type: ignore[assignment]  # walk referred to itself: a cycle holding the target until a GC pass

    made: dict[int, torch.Tensor] = {}
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, i in slow:
        f = made.get(i)
        if f is None:
            f = made[i] = torch.empty(shapes[i], dtype=dtypes[i])  # not touched until the bytes arrive
            addrs[i] = f.data_ptr()
        later.append((d, f))
    for i in range(n):
        if placed[i] or i in made:
            continue
        if uses[i]:  # only in assigned values (a tuple, a key only the checkpoint has)
            f = made[i] = torch.empty(shapes[i], dtype=dtypes[i])
        elif lengths[i]:  # never referenced (only a hand-made manifest): verified into scratch and dropped
            f = made[i] = torch.empty(lengths[i], dtype=torch.uint8)
        else:
            continue
        addrs[i] = f.data_ptr()
    return Plan(made, later, assigns)


def materialize(v: Any, made: dict[int, torch.Tensor]) -> Any:
    """``v`` with every tensor reference replaced by its fresh tensor (containers rebuilt with their types)."""
    if type(v) is Ref:
        return made[v]
    if isinstance(v, dict):
        return type(v)((k, materialize(x, made)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return type(v)(materialize(x, made) for x in v)
    return v


def _describe(v: Any) -> str:
    if type(v) is Ref:
        return "a tensor"
    return f"a list of {len(v)}" if isinstance(v, list) else type(v).__name__
