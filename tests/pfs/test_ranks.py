"""Two spawned gloo ranks (tests/multiproc/harness.py) of one job save to the shared mount: each step is
committed once for the job (one commit record beside the two ranks' copies), both ranks list it, and each
restores its own state bit-exactly, in a restarted job too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc.harness import spawn
from tests.pfs.steps import config, same, state

pytestmark = [pytest.mark.pfs, pytest.mark.remote]

WORLD = 2


def rank_state(rank: int, step: int) -> dict[str, Any]:
    s = state(step)
    s["model"] = {k: v + 1_000_000 * rank for k, v in s["model"].items()}
    return s


def job(rank: int, world_size: int, pfs: str, restart: bool) -> dict[str, Any]:
    from tierckpt import Hierarchy

    os.environ["TIERCKPT_JOB"] = "pfs-ranks"
    with Hierarchy.from_config(config(Path(pfs))) as h:
        if restart:
            return {"restored": same(h.restore(), rank_state(rank, 2)), "from": list(h.last_restore)}
        for step in (1, 2):
            h.save(rank_state(rank, step), step=step).wait()
        assert h.flush(timeout=60)
        return {"listed": {c.step: list(c.tiers) for c in h.checkpoints()}}


def test_two_ranks_commit_each_step_once_on_the_mount(pfs_dir: Path, tmp_path: Path) -> None:
    pfs = pfs_dir / "pfs"
    saved = spawn(job, WORLD, tmp_path, str(pfs), False, limit=60)
    assert saved == [{"ok": {"listed": {"1": ["host", "pfs"], "2": ["host", "pfs"]}}}] * WORLD, saved
    for step in (1, 2):
        d = pfs / f"step-{step:012d}"
        assert sorted(p.name for p in d.iterdir()) == ["commit", "rank-00000", "rank-00001"], list(d.iterdir())
    restored = spawn(job, WORLD, tmp_path, str(pfs), True, limit=60)
    assert restored == [{"ok": {"restored": True, "from": [2, "pfs"]}}] * WORLD, restored
