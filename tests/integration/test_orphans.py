"""Copies without a commit record (docs/distributed.md, "Failures"): an orphan is judged when it is
about to be evicted, from its record and its state as they are then, so a step saved again after its
orphan was listed keeps its new copy."""

from __future__ import annotations

from pathlib import Path

import torch

from tierckpt import Hierarchy
from tierckpt.io.engine import make_engine
from tierckpt.tiers.local import LocalTier


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
