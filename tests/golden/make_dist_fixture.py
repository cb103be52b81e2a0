"""Write a many-rank golden fixture: the states of ``dist_states.py`` saved by 2 gloo ranks on CPU.

Usage, from the repository root (tests/golden/README.md says when)::

    PYTHONPATH=$PWD python tests/golden/make_dist_fixture.py dist tests/golden/dist-v5
    PYTHONPATH=$PWD python tests/golden/make_dist_fixture.py dcp tests/golden/dcp-v5
    PYTHONPATH=$PWD python tests/golden/make_dist_fixture.py pernode tests/golden/dist-v5-pernode

``dist``: step :data:`~dist_states.DIST_STEP` of :func:`~dist_states.dist_state` saved with
``Hierarchy.save`` through the tiers of :func:`config`: ``ssd``, a ``local`` tier per simulated node
(``node{node}/ssd``, rank ``r`` on node ``r``), and ``pfs``, a ``pfs`` tier shared by both (one
``data.bin`` a rank); the sharded rows' checksum chunks are 4 KiB, so that a small shard has several.
``dcp``: step :data:`~dist_states.DCP_STEP` of :func:`~dist_states.dcp_state` saved with ``dcp.save``
through ``tierckpt.dcp.HierarchyWriter`` into a ``pfs`` tier alone. ``pernode``: the ``dist`` step saved
by 2 ranks of one node into a ``pfs`` tier alone with ``files: per_node`` (one node file for both ranks'
copies; its name holds the writing host and process, so it is not written again byte for byte).

The committed files (each copy's ``manifest`` and blobs, each step's ``commit``; no lease, no scratch)
are copied into the given directory, which must not exist yet: a fixture is never rewritten.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_states as ds  # siblings: tests/golden is not a package
from make_fixture import copy_committed

from tierckpt import Hierarchy
from tierckpt.format.manifest import FORMAT_VERSION

__all__ = ["CHUNK", "KINDS", "PERNODE", "TIER_DIRS", "config", "copy_fixture", "save_fixture", "write"]

CHUNK = 4096  #: checksum chunk of the sharded rows (the writers' default, 4 MiB, exceeds every shard here)
KINDS = ("dist", "dcp")  #: the fixtures the current writer writes again byte for byte
PERNODE = "pernode"
#: per kind, the tier directories of the fixture, relative to it
TIER_DIRS = {"dist": ("node0/ssd", "node1/ssd", "pfs"), "dcp": ("pfs",), PERNODE: ("pfs",)}


def config(root: Path, kind: str, node: int, timeout: float = 30.0) -> dict[str, Any]:
    """The hierarchy of a fixture rooted at ``root`` (its writer's, and its readers'), for a rank on ``node``
    (``timeout``: of the ranks' coordination)."""
    # plain copies: the version-5 fixtures hold raw blobs (a pfs tier compresses by default)
    pfs: dict[str, Any] = {"name": "pfs", "kind": "pfs", "path": str(root / "pfs"), "compress": "none"}
    ssd = {"name": "ssd", "kind": "local", "path": str(root / "node{node}" / "ssd")}
    tiers = [ssd, pfs] if kind == "dist" else [pfs]
    if kind == PERNODE:  # the ranks of one node share one data file a step
        pfs["options"] = {"files": "per_node"}
        node = 0
    return {"tiers": tiers, "distributed": {"timeout": timeout, "node": node}}


def _set_chunk_bytes() -> None:
    """Small checksum chunks (no public knob: the writer's module constant, as tests/multiproc sets it)."""
    try:
        from tierckpt.datapath import packing
    except ImportError as e:
        raise RuntimeError("the packer's module moved: point make_dist_fixture.py at its CHUNK_BYTES") from e
    if not hasattr(packing, "CHUNK_BYTES"):
        raise RuntimeError("tierckpt.datapath.packing has no CHUNK_BYTES: update make_dist_fixture.py")
    packing.CHUNK_BYTES = CHUNK


def _meshes() -> dict[tuple[int, ...], Any]:
    from torch.distributed.device_mesh import init_device_mesh

    shapes = {s.mesh for s in (*ds.DIST_TENSORS.values(), *ds.DCP_TENSORS.values())}
    return {shape: init_device_mesh("cpu", shape) for shape in sorted(shapes)}


def save_fixture(rank: int, kind: str, root: Path) -> None:
    """Save the step of fixture ``kind`` as rank ``rank`` of the 2 saving ranks into the tiers under
    ``root`` (torch.distributed is initialized: gloo, 2 ranks)."""
    _set_chunk_bytes()
    meshes = _meshes()
    with Hierarchy.from_config(config(root, kind, node=rank), job=f"golden-{kind}") as h:
        if kind in ("dist", PERNODE):
            h.save(ds.dist_state(rank, meshes), step=ds.DIST_STEP, blocking=True)
        else:
            import types
            import uuid
            from unittest import mock

            import torch.distributed.checkpoint as dcp

            from tierckpt.dcp import HierarchyWriter, _writer

            # DCP's storage_meta holds the save's random id: a fixed one (the writer's alone), so that the
            # bytes are the same each time
            fixed = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=ds.DCP_STEP))
            with mock.patch.object(_writer, "uuid", fixed):
                state = ds.dcp_state(meshes[(ds.SAVED_WORLD,)])
                dcp.save(state, storage_writer=HierarchyWriter(h, step=ds.DCP_STEP))


def copy_fixture(kind: str, root: Path, dest: Path) -> list[Path]:
    """Copy the committed files of fixture ``kind`` saved under ``root`` to ``dest``; the files copied."""
    return [f for rel in TIER_DIRS[kind] for f in copy_committed(root / rel, dest / rel)]


def _rank(rank: int, world: int, root: str, kind: str) -> None:
    """One saving rank, spawned by :func:`write`."""
    warnings.simplefilter("ignore")  # DCP warns about its own deprecations
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world, timeout=timeout)
    save_fixture(rank, kind, Path(root))
    dist.destroy_process_group()


def write(kind: str, dest: Path) -> list[Path]:
    """Save the fixture ``kind`` with 2 spawned ranks and copy its committed files to ``dest``; the files."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(ds.SAVED_WORLD, tmp, kind), nprocs=ds.SAVED_WORLD, start_method="spawn")
        return copy_fixture(kind, Path(tmp), dest)


def main() -> int:
    """Write the fixture named on the command line into the directory given there."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "kind",
        choices=(*KINDS, PERNODE),
        help="dist: Hierarchy.save of DTensors; dcp: dcp.save; pernode: dist, files: per_node",
    )
    p.add_argument("dest", type=Path, help="fixture directory to create, e.g. tests/golden/dist-v5")
    args = p.parse_args()
    if args.dest.exists():
        p.error(f"{args.dest} exists: a fixture is never rewritten (tests/golden/README.md)")
    files = write(args.kind, args.dest)
    total = sum(f.stat().st_size for f in files)
    print(f"format version {FORMAT_VERSION}: {len(files)} files, {total} bytes in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
