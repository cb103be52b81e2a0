"""When the newest step is damaged on every tier (issue 19, item 8): restore() without a step falls back
to the newest step that restores, saying which step it skipped and why; an explicit step names every
tier's failure and the older steps that exist."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CorruptCheckpointError, Hierarchy
from tierckpt.testing.tamper import blob_file


def cfg(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs"), "compress": "none"},  # plain bytes flipped
        ],
        "io": {"engine": "threads"},
    }


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def damage(tmp_path: Path, step: int, *tiers: str) -> None:
    """Flip one byte of the first tensor in blob 0 of ``step`` on each of ``tiers``."""
    for t in tiers:
        blob, base = blob_file(tmp_path / t / f"step-{step:012d}" / "rank-00000")
        with open(blob, "r+b") as f:
            f.seek(base)
            b = f.read(1)
            f.seek(base)
            f.write(bytes([b[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())


@pytest.fixture
def three_steps(tmp_path: Path) -> Path:
    with Hierarchy.from_config(cfg(tmp_path)) as h:
        for s in (1, 2, 3):
            h.save(state(s), step=s).wait()
    return tmp_path


def test_restore_falls_back_to_the_newest_step_that_restores(
    three_steps: Path, caplog: pytest.LogCaptureFixture
) -> None:
    damage(three_steps, 3, "ssd", "pfs")
    with caplog.at_level(logging.WARNING), Hierarchy.from_config(cfg(three_steps), readonly=True) as h:
        got = h.restore()
        assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"]) and h.last_restore == (2, "ssd")
        into = h.restore(into=state(0))
        assert into["step"] == 2 and torch.equal(into["w"], state(2)["w"])
        assert h.restore(tier="pfs")["step"] == 2 and h.last_restore == (2, "pfs")
    skipped = [r.getMessage() for r in caplog.records if "unusable on every tier" in r.getMessage()]
    assert skipped and "step 3" in skipped[0] and "trying step 2" in skipped[0]
    assert "tier 'ssd': checksum mismatch" in skipped[0] and "tier 'pfs': checksum mismatch" in skipped[0]


def test_an_explicit_step_names_every_tier_and_the_older_steps(three_steps: Path) -> None:
    damage(three_steps, 3, "ssd", "pfs")
    with Hierarchy.from_config(cfg(three_steps), readonly=True) as h:
        for op in (lambda: h.restore(step=3), lambda: h.restore(step=3, into=state(0))):
            with pytest.raises(CorruptCheckpointError) as ei:
                op()
            msg = str(ei.value)
            assert msg.startswith("step 3 is unusable on every tier that holds it: tier 'ssd': checksum mismatch")
            assert "tier 'pfs': checksum mismatch" in msg and "older committed steps: [1, 2]" in msg
            assert ei.value.step == 3 and ei.value.tier == "ssd" and ei.value.key == "state['w']"
            assert isinstance(ei.value.__cause__, CorruptCheckpointError)


def test_when_every_step_is_damaged_the_error_names_them(three_steps: Path) -> None:
    for s in (1, 2, 3):
        damage(three_steps, s, "ssd", "pfs")
    with Hierarchy.from_config(cfg(three_steps), readonly=True) as h, pytest.raises(CorruptCheckpointError) as ei:
        h.restore()
    msg = str(ei.value)
    assert msg.startswith("step 3 is unusable on every tier that holds it: tier 'ssd'")
    assert "older steps are unusable too: step 2: tier 'ssd'" in msg and "step 1: tier 'ssd'" in msg


def test_a_good_copy_on_a_lower_tier_is_still_preferred_to_an_older_step(three_steps: Path) -> None:
    damage(three_steps, 3, "ssd")
    with Hierarchy.from_config(cfg(three_steps), readonly=True) as h:
        assert h.restore()["step"] == 3 and h.last_restore == (3, "pfs")
