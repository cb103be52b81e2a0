"""A read-only hierarchy writes nothing (issue 27, finding 8): a checkpoint on a read-only file system is
listed, inspected, verified and restored (also with ``io: {direct: false}``), and a writable hierarchy
there is a clear error naming the directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy, TierIOError
from tierckpt.cli import main


def cfg(root: Path, **io: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(root / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(root / "pfs")},
        ],
        "io": {"engine": "threads", **io},
    }


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(50_000, dtype=torch.float32) * step, "b": torch.ones(7) * step, "step": step}


def same(a: dict[str, Any], step: int) -> bool:
    b = state(step)
    return a["step"] == step and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


def save(root: Path) -> None:
    with Hierarchy.from_config(cfg(root)) as h:
        for step in (1, 2):
            h.save(state(step), step=step).wait()


def use_readonly(root: Path, capsys: pytest.CaptureFixture[str], **io: Any) -> None:
    """Everything a reader does, through the API and the command line; all of it must work."""
    config = cfg(root, **io)
    with Hierarchy.from_config(config, readonly=True) as h:
        assert [c.step for c in h.checkpoints()] == [1, 2]
        assert same(h.restore(), 2) and same(h.restore(step=1, tier="pfs"), 1)
        assert same(h.restore(into=state(0)), 2)
        assert [(s, t, e) for s, t, e in h.verify()] == [(1, "ssd", None), (1, "pfs", None), (2, "ssd", None),
                                                         (2, "pfs", None)]  # fmt: skip
        assert h.inspect()[0] == "ssd"
    yml = root.parent / f"ro-{len(io)}.json"  # JSON is YAML; beside the tiers, not in them
    yml.write_text(json.dumps(config))
    capsys.readouterr()
    for argv in (["ls"], ["verify"], ["inspect", "--step", "1"]):
        assert main([argv[0], str(yml), *argv[1:], "--json"]) == 0, capsys.readouterr()
        assert json.loads(capsys.readouterr().out)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``root`` with its (mtime, size): a directory's mtime changes when an entry is
    created or removed in it."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [".", *dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.join(dirpath, n)] = (st.st_mtime_ns, st.st_size)
    return out


def test_a_read_only_hierarchy_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not even a probe file created and removed again (the tier directories' mtimes stay put)."""
    root = tmp_path / "tiers"
    save(root)
    before = snapshot(root)
    use_readonly(root, capsys)
    use_readonly(root, capsys, direct=False)
    assert snapshot(root) == before


def test_a_checkpoint_on_a_read_only_mount_is_listed_inspected_verified_and_restored(
    tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(tmpfs)
    r = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip()}")
    use_readonly(tmpfs, capsys)
    use_readonly(tmpfs, capsys, direct=False)
    with pytest.raises(TierIOError, match="read-only file system") as e:
        Hierarchy.from_config(cfg(tmpfs))
    assert str(tmpfs / "ssd") in str(e.value) and "readonly=True" in str(e.value)
