"""A saved rank's part read for ``HierarchyReader.read_data`` with each read item's bytes streamed straight
into DCP's target tensor where it can be.

An item that DCP asks for whole (its stored chunk, not a box inside it) into a plain tensor of its stored
shape and dtype is streamed into that tensor by the in-place restore (datapath/restore_into.py: a few
reused staging buffers, every checksum verified as the bytes go by; a non-contiguous target is copied
once verified). Everything else in the part (the DCP bookkeeping, byte items, boxes of a stored chunk for a
resharded load, targets of another dtype, items another rank of this load asks for) is read into fresh
tensors, as ``restore()`` reads, for the reader to copy from. A fresh process's first load so skips both
the page faults of fresh memory for the whole part and one copy of every byte it streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from tierckpt.datapath.manifests import load_manifest, load_tree
from tierckpt.datapath.restore import read_checkpoint
from tierckpt.datapath.restore_into import RestoreStaging
from tierckpt.dcp._layout import lookup
from tierckpt.dcp._record import Location, PathElem
from tierckpt.format.manifest import dtype_from_name
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["read_part"]

Path = tuple[PathElem, ...]


def read_part(
    tier: Tier,
    key: CheckpointKey,
    items: Sequence[tuple[ReadItem, Location]],
    target: Callable[[int], torch.Tensor],
    staging: RestoreStaging,
) -> tuple[Any, dict[int, torch.Tensor]]:
    """Read ``key`` from ``tier``, every byte verified: the part's state and, by index in ``items``, the
    target tensor (``target(i)``: DCP's, resolved once) each item streamed into holds the item's bytes.

    The state holds each streamed item's target tensor at its path, and fresh values elsewhere.

    Raises:
        CorruptCheckpointError, CheckpointNotFoundError, OSError: as ``restore()`` (a damaged copy, a
            missing one). Targets streamed before the damage may hold this copy's bytes then.
    """
    m = load_manifest(tier, key, allow_pickle=False)
    tree, ref = load_tree(tier, key, m, allow_pickle=False)
    t = m.tensors
    targets: dict[Path, torch.Tensor] = {}
    streamed: dict[int, torch.Tensor] = {}
    for i, (req, loc) in enumerate(items):
        if req.type != LoadItemType.TENSOR or loc.path in targets or any(req.storage_offsets):
            continue
        try:
            v = lookup(tree, loc.path)
        except (LookupError, TypeError):  # the reader says what is missing
            continue
        if type(v) is not ref or not 0 <= v < len(t) or tuple(req.lengths) != tuple(t.shapes[v]):
            continue  # not a stored tensor, or a box of one: read whole, then copied from
        dst = target(i)
        if type(dst) is not torch.Tensor or dst.shape != t.shapes[v] or not dst.numel():
            continue  # a subclass, or nothing to read
        if dst.dtype == dtype_from_name(t.dtypes[v]):  # else cast when copied from a fresh tensor
            targets[loc.path] = streamed[i] = dst
    if not targets:
        return read_checkpoint(tier, key)[0], {}
    into = _mirror(tree, (), targets, {p[:n] for p in targets for n in range(len(p))})
    state = staging.restore(tier, key, into, allow_pickle=False)
    return state, streamed


def _mirror(src: Any, path: Path, targets: dict[Path, torch.Tensor], inner: set[Path]) -> Any:
    """The target ``restore_into`` fills: ``src``'s containers down to each target tensor at its path,
    None (the checkpoint's value, assigned) everywhere else."""
    if path in targets:
        return targets[path]
    if path not in inner:
        return None
    if isinstance(src, dict):
        return {k: _mirror(v, (*path, k), targets, inner) for k, v in src.items()}
    if isinstance(src, list):
        return [_mirror(v, (*path, i), targets, inner) for i, v in enumerate(src)]
    return None
