"""Audit finding 2: a copy that the step's commit record does not name (docs/distributed.md, "The global
commit, step by step", "Reading"): a restarted job finds it where a save of the step was killed after its
copy was renamed into place and before its record came (a re-save), or where another step's copy lies in
its place. It is not being evicted or replaced (this job holds the tiers' leases: no other process saves
there), so it is an unusable copy: the documented behaviour is the next tier's copy, else (no step given)
the newest older step; ``verify()`` and ``tierckpt verify`` report it as damage rather than leaving it out.

On 8c32cc0 every read of such a copy raises CheckpointEvictedError from the record check, which the copy
choice takes for "went away while being opened": 50 fresh listings (~9 s), then CheckpointEvictedError;
``verify()`` leaves the copy out (three tries) and the CLI exits 0 while ``checkpoints()`` lists the step.

Only the public API and file manipulation: the copies are arranged on disk as the killed save leaves them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, Hierarchy
from tierckpt.facade.verify import STALE_WAIT

ROOT = Path(__file__).resolve().parents[2]


def cfg(root: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(root / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(root / "pfs")},
        ],
        "io": {"engine": "threads", "chunk": "1MiB"},
    }


def state(step: int, salt: float = 0.0) -> dict[str, Any]:
    return {"w": torch.arange(1000, dtype=torch.float32) * step + salt, "step": step}


def rank_dir(root: Path, tier: str, step: int) -> Path:
    return root / tier / f"step-{step:012d}" / "rank-00000"


def place_unnamed_copy(root: Path, tier: str, how: str) -> None:
    """Put in step 2's place on ``tier`` a copy its record does not name: step 1's copy (``step1``), or a
    save of step 2 with other values whose commit never came (``resaved``, written by a job elsewhere:
    the bytes such a killed re-save leaves renamed into place)."""
    target = rank_dir(root, tier, 2)
    if how == "step1":
        source = rank_dir(root, tier, 1)
    else:
        other = root / "elsewhere"
        with Hierarchy.from_config(cfg(other)) as h:
            h.save(state(2, salt=0.5), step=2).wait()
        source = rank_dir(other, tier, 2)
    shutil.rmtree(target)
    shutil.copytree(source, target)


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    root = tmp_path / "job"
    with Hierarchy.from_config(cfg(root)) as h:
        for s in (1, 2):
            h.save(state(s), step=s).wait()
    return root


@pytest.mark.parametrize("how", ["step1", "resaved"])
def test_restore_falls_back_to_the_older_step_when_every_tier_holds_an_unnamed_copy(two_steps: Path, how: str) -> None:
    for tier in ("ssd", "pfs"):
        place_unnamed_copy(two_steps, tier, how)
    with Hierarchy.from_config(cfg(two_steps)) as h:  # the restarted job (it holds the leases)
        assert [c.step for c in h.checkpoints()] == [1, 2]
        got = h.restore()
        assert got["step"] == 1 and torch.equal(got["w"], state(1)["w"]) and h.last_restore == (1, "ssd")
        into = {"w": torch.zeros(1000), "step": -1}
        h.restore(into=into)
        assert into["step"] == 1 and torch.equal(into["w"], state(1)["w"]) and h.last_restore == (1, "ssd")


@pytest.mark.parametrize("how", ["step1", "resaved"])
def test_restore_reads_the_next_tier_when_one_tier_holds_an_unnamed_copy(two_steps: Path, how: str) -> None:
    place_unnamed_copy(two_steps, "ssd", how)
    with Hierarchy.from_config(cfg(two_steps)) as h:
        got = h.restore()
        assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"]) and h.last_restore == (2, "pfs")
        into = {"w": torch.zeros(1000), "step": -1}
        h.restore(into=into)
        assert into["step"] == 2 and torch.equal(into["w"], state(2)["w"]) and h.last_restore == (2, "pfs")


def test_restore_of_that_step_names_the_copy_the_record_does_not_name(two_steps: Path) -> None:
    """Asked for by number, the step is refused as not committed there (a CheckpointNotFoundError naming
    the rank's copy), not as an eviction, and not as damage: the copy is whole, only not the one the
    record names (docs/distributed.md, "Reading")."""
    for tier in ("ssd", "pfs"):
        place_unnamed_copy(two_steps, tier, "resaved")
    with Hierarchy.from_config(cfg(two_steps)) as h, pytest.raises(CheckpointNotFoundError) as ei:
        h.restore(step=2)
    assert "rank 0's copy is not the one the step's commit record names" in str(ei.value)
    assert "tier 'ssd'" in str(ei.value) and "tier 'pfs'" in str(ei.value)
    assert not isinstance(ei.value, (CheckpointEvictedError, CorruptCheckpointError))


def test_verify_reports_the_unnamed_copy(two_steps: Path) -> None:
    place_unnamed_copy(two_steps, "ssd", "step1")
    with Hierarchy.from_config(cfg(two_steps)) as h:
        got = {(s, t): e for s, t, e in h.verify()}
    assert set(got) == {(1, "ssd"), (1, "pfs"), (2, "ssd"), (2, "pfs")}, got  # step 2 on ssd is not left out
    assert got[(2, "ssd")] is not None and all(e is None for k, e in got.items() if k != (2, "ssd")), got


def test_the_verify_command_exits_1_on_the_unnamed_copy(two_steps: Path) -> None:
    place_unnamed_copy(two_steps, "pfs", "step1")
    yml = two_steps / "h.yaml"
    yml.write_text(
        "tiers:\n  - {name: ssd, kind: local, path: ssd}\n  - {name: pfs, kind: pfs, path: pfs}\n"
        "io: {engine: threads}\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "tierckpt", "verify", str(yml)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "2" in run.stdout and "pfs" in run.stdout, run.stdout


def test_a_reader_waits_once_for_every_unnamed_copy_not_once_each(tmp_path: Path) -> None:
    """A read-only verify looks again at a copy its record does not name (a save of the step again may be
    about to commit) within one budget shared by every such copy: on 987543a each copy waited its own
    ~3 s, one after another (N ranks × 3 s a tier)."""
    root = tmp_path / "job"
    steps = (1, 2, 3, 4)
    with Hierarchy.from_config(cfg(root)) as h:
        for s in steps:
            h.save(state(s), step=s).wait()
    for tier in ("ssd", "pfs"):
        for s in steps[1:]:  # 6 copies in all that their records do not name
            shutil.rmtree(rank_dir(root, tier, s))
            shutil.copytree(rank_dir(root, tier, 1), rank_dir(root, tier, s))
    with Hierarchy.from_config(cfg(root), readonly=True) as h:  # another process may be saving: it waits
        t0 = time.monotonic()
        got = {(s, t): e for s, t, e in h.verify()}
        took = time.monotonic() - t0
    assert sorted(k for k, e in got.items() if e is not None) == [(s, t) for s in steps[1:] for t in ("pfs", "ssd")]
    assert all(not isinstance(e, CorruptCheckpointError) for e in got.values())
    assert took < 2 * STALE_WAIT  # about one budget (6 of them on 987543a), with a generous margin
