"""Pointer files (tierckpt/integrations/_pointers.py): what a framework finds at a checkpoint's path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierckpt.integrations._pointers import Pointer, new_id, read_pointer, referenced_steps, write_pointer


def test_a_pointer_round_trips_and_replaces_the_old_one_whole(tmp_path: Path) -> None:
    p = tmp_path / "ckpts" / "last.ckpt"
    write_pointer(p, Pointer(7, "a" * 32, 300))
    assert read_pointer(p) == Pointer(7, "a" * 32, 300)
    write_pointer(p, Pointer(9, "b" * 32, None))
    assert read_pointer(p) == Pointer(9, "b" * 32, None)
    assert [q.name for q in p.parent.iterdir()] == ["last.ckpt"]  # no temporary file left
    assert new_id() != new_id()


def test_a_torch_file_is_no_pointer_and_a_damaged_pointer_is_named(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "t.ckpt")
    assert read_pointer(tmp_path / "t.ckpt") is None
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    assert read_pointer(tmp_path / "other.json") is None
    (tmp_path / "bad.ckpt").write_text('{"format": "tierckpt-pointer", "version": 1, "step": "x", "id": "i"}')
    with pytest.raises(ValueError, match="bad.ckpt"):
        read_pointer(tmp_path / "bad.ckpt")
    (tmp_path / "cut.ckpt").write_text('{"format": "tierckpt-pointer", "vers')
    with pytest.raises(ValueError, match="damaged"):
        read_pointer(tmp_path / "cut.ckpt")
    with pytest.raises(FileNotFoundError):
        read_pointer(tmp_path / "none.ckpt")


def test_referenced_steps_reads_pointers_and_links_and_skips_the_rest(tmp_path: Path) -> None:
    write_pointer(tmp_path / "a.ckpt", Pointer(1, "x", 1))
    write_pointer(tmp_path / "b.ckpt", Pointer(2, "y", 2))
    os.symlink("b.ckpt", tmp_path / "last.ckpt")
    os.symlink("gone.ckpt", tmp_path / "dangling.ckpt")
    torch.save({}, tmp_path / "t.ckpt")
    (tmp_path / "sub").mkdir()
    write_pointer(tmp_path / "sub" / "c.ckpt", Pointer(3, "z", 3))
    assert referenced_steps([tmp_path, tmp_path / "missing"]) == {1, 2}
    os.remove(tmp_path / "b.ckpt")
    assert referenced_steps([tmp_path]) == {1}
