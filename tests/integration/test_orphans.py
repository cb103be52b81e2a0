"""Copies without a commit record (docs/distributed.md, "Failures"): an orphan is judged when it is
about to be evicted, from its record and its state as they are then, so a step saved again after its
orphan was listed keeps its new copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tierckpt import Hierarchy
from tierckpt.io.engine import make_engine
from tierckpt.tiers.local import LocalTier

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_a_step_saved_again_after_its_orphan_was_listed_keeps_its_new_copy(tmp_path: Path) -> None:
    """A job killed between a copy and its record leaves an orphan of step 2; the restarted job lists
    (restores step 1: the orphan is seen), then saves step 2 again. Its new copy is committed; the
    retention pass after that commit must not take it for the orphan it listed before (the step was
    lost: its record said committed, its copy was gone)."""
    eng = make_engine("threads", 2)
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd", eng)]) as h:
        for step in (1, 2):
            h.save({"w": torch.full((4,), float(step))}, step=step).wait()
    (tmp_path / "ssd" / "step-000000000002" / "commit").unlink()  # killed before its record: an orphan
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd", eng)]) as h:  # the restarted job
        assert torch.equal(h.restore()["w"], torch.full((4,), 1.0))
        h.save({"w": torch.full((4,), 22.0)}, step=2).wait()  # saved again, committed
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, 2]
        assert torch.equal(h.restore()["w"], torch.full((4,), 22.0))
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd", eng)], readonly=True) as h:
        assert torch.equal(h.restore()["w"], torch.full((4,), 22.0))
    eng.close()


def test_the_stray_sweep_keeps_legacy_copies_of_ranks_beyond_the_job(tmp_path: Path) -> None:
    """B1 (the audit's f4legacy): a 2-rank directory of format 4 (no commit records: each copy committed
    by itself), opened writable by a job of 1 rank that saves once. Rank 1's legacy copies are not strays:
    every one stays. A record-less step of format 5 beside them (a 2-rank job killed before its commit)
    is: rank 1's copy goes as a stray, rank 0's as an orphan. (On 987543a every rank-00001 went.)"""
    pfs = tmp_path / "pfs"
    shutil.copytree(GOLDEN / "v4", pfs)
    shutil.copytree(GOLDEN / "v5" / "step-000000000001", pfs / "step-000000000005")
    (pfs / "step-000000000005" / "commit").unlink()
    for step in pfs.glob("step-*"):
        shutil.copytree(step / "rank-00000", step / "rank-00001")
    cfg = {"tiers": [{"name": "pfs", "kind": "pfs", "path": str(pfs)}], "io": {"engine": "threads"}}
    with Hierarchy.from_config(cfg) as h:
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, 2, 3, 4]
        h.save({"w": torch.ones(10)}, step=10).wait()
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, 2, 3, 4, 10]
    left = sorted(str(p.relative_to(pfs)) for p in pfs.glob("step-*/rank-*"))
    assert left == [f"step-{s:012d}/rank-{r:05d}" for s in (1, 2, 3, 4) for r in (0, 1)] + [
        "step-000000000010/rank-00000"
    ]
