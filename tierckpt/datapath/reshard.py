"""Resharding restore: fill each rank's tensors from the byte ranges of the saved ranks' copies that
overlap them, every byte verified (docs/distributed.md, "Sharded states and resharding").

A format-5 manifest says, for each row holding a DTensor shard, the mesh (shape and global ranks),
the global shape and the placements, so one manifest gives every saved rank's box with torch's own
arithmetic (:func:`~tierckpt.format.sharding.shard_box`). For each target tensor (a DTensor sharded
for this run, a plain tensor taking the whole global tensor, or a saved rank's own box), this module
finds the saved boxes that overlap it (DCP's ``_check_shard_metadata_pair_overlap`` and
``_shards_get_overlap_region_wrt_saved_tensor``), opens only those ranks' copies, reads for each
overlap the whole checksum chunks that hold it, verifies them, and copies the overlap into place.
Plain (non-DTensor) rows come from the *base* copy: this rank's own, or rank 0's where this rank did
not save (a larger world size).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.datapath.keymap import KeyMap, remap
from tierckpt.datapath.manifests import load_tree
from tierckpt.datapath.matching import Match, match_target
from tierckpt.datapath.shardread import Box, Copies, Dest, Filler
from tierckpt.errors import StateError
from tierckpt.format.manifest import Manifest, dtype_from_name
from tierckpt.format.sharding import placement_of, shard_box, writer_of
from tierckpt.format.tree import resolve_tree
from tierckpt.tiers.base import CheckpointKey, Tier

if TYPE_CHECKING:
    from tierckpt.datapath.replicas import ReplicaExchange

__all__ = ["read_box", "read_sharded", "restore_sharded"]


def restore_sharded(
    tier: Tier,
    key: CheckpointKey,
    target: Any,
    *,
    allow_pickle: bool,
    strict: bool = True,
    others: Sequence[Tier] = (),
    replicas: ReplicaExchange | None = None,
    key_map: KeyMap | None = None,
) -> Any:
    """Restore ``key`` from ``tier`` into ``target`` (which may hold DTensors sharded for this run);
    returns ``target``. Works for any saved and restoring world size and mesh.

    A DTensor of the target receives the part of the global tensor its local shard holds; a plain
    tensor matched with a sharded row receives the whole global tensor; plain rows come from the base
    copy (this rank's, else rank 0's). The target is matched (structure, global shapes, dtypes)
    before any byte of it changes.

    ``others``: tiers to take another rank's copy from where ``tier`` lacks it (fastest first).
    ``replicas``: in a job, the exchange that splits the reads of replicated DTensor targets among
    their replicas (datapath/replicas.py): this call reads this rank's pieces only, and the
    caller runs the exchange (:meth:`~tierckpt.datapath.replicas.ReplicaExchange.settle`).
    ``key_map``: the checkpoint's key paths mapped to the target's (datapath/keymap.py).

    Raises:
        StateError: ``target`` does not match (nothing changed), or a DTensor target is ``Partial``.
        CorruptCheckpointError: a copy's manifest, a sharding record, or a byte used fails validation.
            Tensors filled before the damaged bytes were found hold the checkpoint's values then.
        CheckpointNotFoundError: a copy that holds needed bytes is missing on this tier.
    """
    copies = Copies(tier, key.step, allow_pickle, others)
    if replicas is not None:
        replicas.reset()
    try:
        base = copies.base(key.rank)
        m = base.m
        shapes = [r.global_shape if (r := m.sharding.get(i)) else s for i, s in enumerate(m.tensors.shapes)]
        addrs = [0] * len(m.tensors)
        bkey = CheckpointKey(key.step, base.rank)
        todo = match_target(
            m,
            target,
            addrs,
            allow_pickle=allow_pickle,
            tier=tier,
            key=bkey,
            strict=strict,
            shapes=shapes,
            key_map=key_map,
        )
        dests = _destinations(m, todo, shapes, replicas)
        Filler(copies, base).fill(dests)
    finally:
        copies.close()
    _apply(todo, len(m.tensors))
    return target


def read_sharded(
    tier: Tier, key: CheckpointKey, *, allow_pickle: bool, others: Sequence[Tier] = (), key_map: KeyMap | None = None
) -> tuple[Any, Manifest]:
    """The state of rank ``key.rank``'s copy as fresh CPU tensors, each DTensor shard as the plain
    tensor of the box that rank saved (a replicated shard it did not store is read from the replica
    that did, from ``tier`` or else the first of ``others`` that holds its copy); rank 0's where
    ``key.rank`` is beyond the ranks that saved. Returns the state (its key paths mapped by ``key_map``)
    and the manifest it was read by."""
    copies = Copies(tier, key.step, allow_pickle, others)
    try:
        base = copies.base(key.rank)
        m = base.m
        tree, ref = load_tree(tier, key, m, allow_pickle=allow_pickle)
        if key_map is not None:
            tree = remap(tree, key_map)[0]
        t = m.tensors
        made = [torch.empty(s, dtype=dtype_from_name(d)) for s, d in zip(t.shapes, t.dtypes)]
        dests = []
        for i, out in enumerate(made):
            r = m.sharding.get(i)
            if r is None:
                dests.append(Dest(i, out, (tuple(out.shape), (0,) * out.dim())))
            else:
                mesh = m.meshes[r.mesh]
                coord = mesh.coordinate(base.rank)
                assert coord is not None  # the manifest's validation checked it
                dests.append(Dest(i, out, shard_box(r.global_shape, mesh.shape, coord, r.placements)))
        Filler(copies, base).fill(dests)
    finally:
        copies.close()
    return resolve_tree(tree, ref, made.__getitem__, len(made)), m


def read_box(
    tier: Tier,
    key: CheckpointKey,
    path: str,
    sizes: tuple[int, ...],
    offsets: tuple[int, ...],
    *,
    allow_pickle: bool = False,
) -> torch.Tensor:
    """The box ``sizes`` at global ``offsets`` of the tensor saved at key path ``path`` (as the table
    names it, e.g. ``state['w']``), read from the copies that hold it: only the checksum chunks
    overlapping the box are read and verified.

    Raises:
        KeyError: no tensor was saved at ``path``.
        ValueError: ``path`` is a plain tensor and the box is not the whole of it.
        CorruptCheckpointError: a byte read fails verification.
    """
    copies = Copies(tier, key.step, allow_pickle)
    try:
        base = copies.base(key.rank)
        i = base.row(path)
        if i is None:
            raise KeyError(f"step {key.step} holds no tensor at {path}")
        spec = base.m.sharding.get(i)
        shape = spec.global_shape if spec is not None else base.m.tensors.shapes[i]
        if spec is None and (tuple(sizes), tuple(offsets)) != (tuple(shape), (0,) * len(shape)):
            raise ValueError(f"{path} is not sharded: only its whole {shape} can be read")
        if len(sizes) != len(shape) or any(o < 0 or o + n > g for o, n, g in zip(offsets, sizes, shape)):
            raise ValueError(f"box {tuple(sizes)} at {tuple(offsets)} is not inside {path}'s {tuple(shape)}")
        out = torch.empty(sizes, dtype=dtype_from_name(base.m.tensors.dtypes[i]))
        Filler(copies, base).fill([Dest(i, out, (tuple(sizes), tuple(offsets)))])
    finally:
        copies.close()
    return out


def _destinations(
    m: Manifest, todo: Match, shapes: list[tuple[int, ...]], replicas: ReplicaExchange | None = None
) -> list[Dest]:
    """What to fill: each directly matched target, each fresh tensor, each DTensor's local shard (of a
    replicated one matched with a sharded row, this rank's piece where ``replicas`` splits it)."""
    out: list[Dest] = []
    whole = lambda t: (tuple(t.shape), (0,) * t.dim())  # noqa: E731
    for i, d in enumerate(todo.direct):
        if d is not None:
            out.append(Dest(i, d, whole(d)))
    for i, f in todo.made.items():
        if tuple(f.shape) == tuple(shapes[i]):  # else: scratch of a row nothing references
            out.append(Dest(i, f, whole(f)))
    for dt, i in todo.sharded:
        dtensor: Any = dt
        with torch.no_grad():
            local = dtensor.to_local()
        mesh = dtensor.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:  # this rank holds no part of it
            continue
        try:
            places = tuple(placement_of(p, m.tensors.paths[i]) for p in dtensor.placements)
            box = shard_box(tuple(dtensor.shape), tuple(mesh.shape), tuple(coord), places)
        except ValueError as e:
            raise StateError(f"target {m.tensors.paths[i]}: {e}") from None
        piece = None
        if replicas is not None and i in m.sharding:
            piece = replicas.plan(m.tensors.paths[i], dtensor, local, box, partial(_stored_box, m, i))
        out.append(Dest(i, *piece) if piece else Dest(i, local, box))
    return out


def _stored_box(m: Manifest, i: int, rank: int) -> Box | None:
    """The box of sharded row ``i`` that saved rank ``rank`` stored, or None (it stored none)."""
    spec = m.sharding[i]
    mesh = m.meshes[spec.mesh]
    coord = mesh.coordinate(rank)
    if coord is None or writer_of(coord, spec.placements) != coord:
        return None
    try:
        return shard_box(spec.global_shape, mesh.shape, coord, spec.placements)
    except ValueError:  # the reads name the problem
        return None


def _apply(todo: Match, n_tensors: int) -> None:
    """The copies into targets that were filled through fresh tensors, and the assignments."""
    with torch.no_grad():
        for dst, fresh in todo.later:
            if dst.numel():
                dst.copy_(fresh)
    for container, k, v in todo.assigns:
        container[k] = resolve_tree(v, todo.ref, todo.made.__getitem__, n_tensors)
