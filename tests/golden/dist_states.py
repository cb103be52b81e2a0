"""The states stored in the many-rank golden fixtures (``dist-v5/``, ``dcp-v5/``): one module builds them,
for the fixture writer (``make_dist_fixture.py``) and for the tests, which rebuild the expected values.

Imports torch only, never tierckpt (as ``fixture_states.py``). Every value is deterministic (``arange``).
The global tensors are the same on every rank; :func:`dtensors` places them on a mesh of any world size;
:func:`saved_box` is the part rank ``r`` of the saving job held, by the arithmetic of ``torch.chunk``
(docs/format.md, "A box"), written out here so that the tests do not take it from the code under test.
Changing a state invalidates the fixtures that hold it: add a new fixture instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = [
    "DCP_STEP",
    "DCP_TENSORS",
    "DIST_STEP",
    "DIST_TENSORS",
    "SAVED_WORLD",
    "Sharded",
    "dcp_plain",
    "dcp_state",
    "dist_plain",
    "dist_state",
    "dtensors",
    "full",
    "saved_box",
]

SAVED_WORLD = 2  #: the ranks that wrote both fixtures
DIST_STEP = 3  #: the step of ``dist-v5/``
DCP_STEP = 5  #: the step of ``dcp-v5/``


class Sharded(NamedTuple):
    """One global tensor and how it is laid out: on a mesh of ``mesh`` (the saving job's shape) with
    ``placements`` (one per mesh dim: ``S<dim>`` for ``Shard(dim)``, ``R`` for ``Replicate()``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: tuple[int, ...]
    placements: tuple[str, ...]


#: ``dist-v5/``: the DTensors of the state, as saved by 2 ranks.
DIST_TENSORS: dict[str, Sharded] = {
    "s0": Sharded((5, 3), torch.float32, (2,), ("S0",)),  # rows 3 + 2
    "s1": Sharded((4, 5), torch.bfloat16, (2,), ("S1",)),  # columns 3 + 2
    "rep": Sharded((3, 2), torch.int64, (2,), ("R",)),  # stored by rank 0 only
    "big": Sharded((18, 128), torch.float32, (2,), ("S0",)),  # 4608 B a rank: two 4 KiB checksum chunks
    "one": Sharded((1, 3), torch.int32, (2,), ("S0",)),  # rank 1's shard is empty
    "m2": Sharded((5, 3), torch.float64, (2, 1), ("S1", "S0")),  # a 2-D mesh: columns 2 + 1
}

#: ``dcp-v5/``: the DTensors of the state saved through ``dcp.save``, under ``model``.
DCP_TENSORS: dict[str, Sharded] = {
    "w": Sharded((5, 3), torch.float32, (2,), ("S0",)),
    "v": Sharded((4, 5), torch.bfloat16, (2,), ("S1",)),
    "rep": Sharded((3, 2), torch.int64, (2,), ("R",)),
}


def full(name: str, spec: Sharded) -> torch.Tensor:
    """The global tensor ``name``: ``arange`` values offset by the name, so no two tensors are equal."""
    n = 1
    for d in spec.shape:
        n *= d
    start = sum(map(ord, name)) % 97
    return (torch.arange(n, dtype=torch.float64) * 0.5 + start).reshape(spec.shape).to(spec.dtype)


def _span(size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``size`` split into ``parts``: (start, length); an empty piece
    sits at the end."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(step, size - start)


def saved_box(name: str, spec: Sharded, rank: int) -> torch.Tensor:
    """The part of tensor ``name`` that rank ``rank`` of the saving job held (its local shard)."""
    coords, rest = [], rank
    for d in reversed(spec.mesh):  # row-major mesh coordinates of the rank
        coords.insert(0, rest % d)
        rest //= d
    t = full(name, spec)
    for mesh_dim, p in enumerate(spec.placements):
        if p != "R":
            dim = int(p[1:])
            start, length = _span(t.shape[dim], spec.mesh[mesh_dim], coords[mesh_dim])
            t = t.narrow(dim, start, length)
    return t.contiguous()


def _placements(spec: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def dtensors(layout: dict[str, tuple[Any, tuple[str, ...]]], table: dict[str, Sharded], zero: bool) -> dict[str, Any]:
    """``{name: DTensor}``, each global tensor of ``table`` (or zeros of its shape and dtype, with
    ``zero``) distributed on the mesh and placements ``layout[name]`` gives (every rank calls this)."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, (mesh, placements) in layout.items():
        spec = table[name]
        value = torch.zeros(spec.shape, dtype=spec.dtype) if zero else full(name, spec)
        out[name] = distribute_tensor(value, mesh, _placements(placements))
    return out


def dist_plain(rank: int) -> dict[str, Any]:
    """The plain tensors and values rank ``rank`` saves beside its shards (each rank its own)."""
    return {
        "rank": rank,
        "note": f"rank {rank} of {SAVED_WORLD}",
        "rng": torch.arange(8, dtype=torch.uint8) * (rank + 3),  # a per-rank plain tensor
        "shared": torch.arange(6, dtype=torch.float16).reshape(2, 3),  # the same plain tensor on every rank
        "sched": {"lr": 0.25 / (rank + 1), "betas": (0.9, 0.999), "milestones": [rank, 10]},
    }


def dist_state(rank: int, meshes: dict[tuple[int, ...], Any]) -> dict[str, Any]:
    """What rank ``rank`` of the 2 saving ranks saves in ``dist-v5/``: ``meshes`` maps each saving mesh
    shape of :data:`DIST_TENSORS` to its ``DeviceMesh``."""
    layout = {name: (meshes[s.mesh], s.placements) for name, s in DIST_TENSORS.items()}
    return {"model": dtensors(layout, DIST_TENSORS, zero=False), **dist_plain(rank)}


def dcp_plain() -> dict[str, Any]:
    """The plain values of ``dcp-v5/`` (the same on every rank: DCP keeps one copy of each)."""
    return {"step": DCP_STEP, "note": "saved through dcp.save", "pair": (1, "two"), "extra": torch.arange(4.0)}


def dcp_state(mesh: Any) -> dict[str, Any]:
    """What every rank of the 2 saving ranks passes to ``dcp.save`` for ``dcp-v5/``."""
    layout = {name: (mesh, s.placements) for name, s in DCP_TENSORS.items()}
    return {"model": dtensors(layout, DCP_TENSORS, zero=False), **dcp_plain()}
