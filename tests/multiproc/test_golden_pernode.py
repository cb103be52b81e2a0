"""The per-node golden fixture (tests/golden/README.md): ``tests/golden/dist-v5-pernode`` holds the
``dist`` step saved by 2 gloo ranks of one node into a ``pfs`` tier with ``files: per_node``: one node
file, both ranks' manifests each ending in a location block. Read with the current code: in one process
(whole tensors from both ranks' regions), on 2 spawned ranks (restore() of each rank's part), verify, and
a flipped byte in rank 1's region found."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc.harness import spawn
from tierckpt import CorruptCheckpointError, Hierarchy, SoloCoordinator
from tierckpt.format.location import split_location
from tierckpt.format.manifest import decode_manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
FIXTURE = GOLDEN / "dist-v5-pernode"
sys.path.insert(0, str(GOLDEN))
import dist_states as ds  # noqa: E402  (tests/golden is not a package)
import make_dist_fixture as mdf  # noqa: E402

from tests.multiproc.test_golden_dist import diff, fresh_part, target_of, whole_state  # noqa: E402

STEP = f"step-{ds.DIST_STEP:012d}"


def _copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / FIXTURE.name))


def _open(root: Path, rank: int) -> Hierarchy:
    config = mdf.config(root, mdf.PERNODE, 0)
    return Hierarchy.from_config(config, readonly=True, coordinator=SoloCoordinator(rank, 2, node=0))


def test_the_fixture_is_one_node_file_and_two_located_manifests() -> None:
    step = FIXTURE / "pfs" / STEP
    names = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file())
    (node,) = [n for n in names if n.startswith("node-00000-") and n.endswith(".data")]
    assert names == sorted(["commit", node, "rank-00000/manifest", "rank-00001/manifest"])
    offsets = []
    for rank in (0, 1):
        raw = (step / f"rank-{rank:05d}" / "manifest").read_bytes()
        with pytest.raises(CorruptCheckpointError, match="header says"):
            decode_manifest(raw)  # a reader before per-node files refuses it, never misreads it
        manifest, loc = split_location(raw)
        m = decode_manifest(manifest)
        assert loc is not None and loc.name == node and (m.rank, m.world_size, m.step) == (rank, 2, ds.DIST_STEP)
        offsets.append((loc.offset, sum(b.size for b in m.blobs)))
    assert offsets[0][0] == 0 and offsets[1][0] >= offsets[0][1]  # rank 1's region after rank 0's
    assert os.path.getsize(step / node) >= offsets[1][0] + offsets[1][1]


def test_one_process_reads_both_regions_and_verifies(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    for rank in (0, 1):
        with _open(root, rank) as h:
            assert [c.step for c in h.checkpoints()] == [ds.DIST_STEP]
            assert diff(h.restore(ds.DIST_STEP, into=target_of(whole_state(rank))), whole_state(rank)) == []
            assert diff(h.restore(ds.DIST_STEP), fresh_part(rank)) == []
            assert h.verify() == [(ds.DIST_STEP, "pfs", None)] * 2


def read_part(rank: int, world: int, root: str) -> list[str]:
    """On a spawned rank: restore() of its own part, compared with what it saved."""
    os.environ["TIERCKPT_NODE"] = "0"
    with Hierarchy.from_config(mdf.config(Path(root), mdf.PERNODE, 0), job="golden-pernode") as h:
        return diff(h.restore(ds.DIST_STEP), fresh_part(rank))


def test_two_ranks_of_the_node_restore_their_parts(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    assert spawn(read_part, 2, tmp_path, str(root), limit=120) == [{"ok": []}, {"ok": []}]


def test_a_flipped_byte_in_rank_1s_region_is_found(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    step = root / "pfs" / STEP
    (node,) = [n for n in os.listdir(step) if n.startswith("node-")]
    _, loc = split_location((step / "rank-00001" / "manifest").read_bytes())
    assert loc is not None
    with open(step / node, "r+b") as f:
        f.seek(loc.offset + 5)
        b = f.read(1)
        f.seek(loc.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with _open(root, 0) as h:
        checks: list[Any] = h.verify()
    assert [(s, t, type(e)) for s, t, e in checks] == [
        (ds.DIST_STEP, "pfs", type(None)),
        (ds.DIST_STEP, "pfs", CorruptCheckpointError),
    ]
    assert checks[1][2].rank == 1
