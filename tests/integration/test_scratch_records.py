"""A commit record's scratch file (``step-N/.tmp-commit-<host>-<pid>-<hex>``), left by a process killed
between writing it and renaming it into place, is swept like a save's scratch directory: by the next
writable open of the tier on that host, once its pid is dead; a live writer's is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tierckpt import Hierarchy
from tierckpt.tiers import _filescratch


def test_a_dead_writers_record_scratch_file_is_swept(tmp_path: Path) -> None:
    config = {"tiers": [{"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")}]}
    with Hierarchy.from_config(config) as h:
        h.save({"w": torch.ones(4)}, step=1).wait()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free
    step = tmp_path / "pfs" / "step-000000000001"
    gone = step / f".tmp-commit-{_filescratch.HOST}-{dead.pid}-0badc0de"
    live = step / f".tmp-commit-{_filescratch.HOST}-{os.getpid()}-12345678"
    for p in (gone, live):
        p.write_bytes(b"half a record")
    with Hierarchy.from_config(config) as h:
        assert not gone.exists()
        assert live.exists()
        assert [c.step for c in h.checkpoints()] == [1]
        assert torch.equal(h.restore()["w"], torch.ones(4))
