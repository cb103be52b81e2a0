"""``tierckpt probe PATH``: the facts of the directory's file system, where each came from, and the geometry
a tier of the kind there would use, as text and as JSON; it writes nothing but its own probe file (and
with --no-write, nothing at all)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path

import pytest

from tierckpt.cli import main
from tierckpt.config import default_io
from tierckpt.io import fsutil
from tierckpt.io.fsdetect import FUSE_MAGIC, place
from tierckpt.io.fsutil import probe_fs
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier
from tierckpt.tiers.probe import planned_geometry

KEYS = ["path", "kind", "kind_from", "wrote_probe_file", "facts", "sources", "details", "geometry"]
FACTS = [
    "block_bytes", "io_block_bytes", "direct", "dio_mem_align", "dio_offset_align", "readonly", "fs_type", "family",
    "mount_point", "stripe_unit_bytes", "stripe_count", "object_bytes", "layout_settable", "direct_alignment_bytes",
]  # fmt: skip


def probe_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["probe", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _unchanged(path: Path) -> tuple[list[str], int]:
    return sorted(os.listdir(path)), os.stat(path).st_mtime_ns


def test_json_has_every_fact_its_source_and_the_geometry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(os.listdir(tmp_path))
    out = probe_json(capsys, str(tmp_path))
    assert list(out) == KEYS and list(out["facts"]) == FACTS
    facts = probe_fs(tmp_path, writable=True)
    assert {k: out["facts"][k] for k in asdict(facts)} == asdict(facts)
    assert out["path"] == str(tmp_path.resolve()) and out["wrote_probe_file"] is True
    assert out["kind"] == "local" and out["kind_from"] == f"the family {facts.family!r}"  # a disk or tmpfs here
    geometry = planned_geometry(LocalTier, facts, default_io())
    assert out["geometry"] == {**asdict(geometry), "read_staging_bytes": geometry.read_staging_bytes}
    assert set(out["sources"]) >= {k for k in FACTS if not k.startswith("dio_")} | {"dio_align"}
    assert out["details"]["statfs_magic"].startswith("0x")
    assert sorted(os.listdir(tmp_path)) == before  # its probe file is gone


def test_the_kind_can_be_chosen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = probe_json(capsys, str(tmp_path), "--kind", "pfs")
    assert (out["kind"], out["kind_from"]) == ("pfs", "--kind")
    assert out["geometry"]["one_file"] is True and out["geometry"]["blob_bytes"] == PfsTier.preferred_blob_bytes
    assert out["geometry"]["steady_reads"] == out["geometry"]["read_slots"]  # a shared tier's


def test_no_write_touches_nothing_and_tries_o_direct_on_a_file_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step-000000000001" / "rank-00000").mkdir(parents=True)
    (tmp_path / "step-000000000001" / "rank-00000" / "manifest").write_bytes(b"m" * 4096)
    (tmp_path / "link").symlink_to("/etc/hostname")  # never followed
    outer, inner = _unchanged(tmp_path), _unchanged(tmp_path / "step-000000000001" / "rank-00000")
    out = probe_json(capsys, str(tmp_path), "--no-write")
    assert _unchanged(tmp_path) == outer and _unchanged(tmp_path / "step-000000000001" / "rank-00000") == inner
    assert out["wrote_probe_file"] is False
    assert "rank-00000/manifest" in out["sources"]["direct"]
    assert out["facts"]["direct"] == probe_fs(tmp_path, writable=True).direct


def test_no_write_in_an_empty_directory_does_not_try_o_direct(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _unchanged(tmp_path)
    out = probe_json(capsys, str(tmp_path), "--no-write")
    assert _unchanged(tmp_path) == before
    assert out["facts"]["direct"] is False and out["sources"]["direct"].startswith("not tried")
    assert out["geometry"]["direct"] is False


def test_text_shows_facts_sources_and_geometry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    facts = probe_fs(tmp_path, writable=True)
    assert text.startswith(f"{tmp_path.resolve()}: {facts.family} ({facts.fs_type}) at {facts.mount_point}\n")
    for line in ("statvfs f_bsize", "st_blksize of the directory", "geometry of a local tier here", "blob_bytes"):
        assert line in text
    assert f"  {'block_bytes':<24} {facts.block_bytes}" in text


def test_a_missing_directory_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["probe", str(tmp_path / "f"), "--json"]) == 2
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        main(["probe", str(tmp_path), "--kind", "s3"])
    assert e.value.code == 2


def test_a_directory_it_may_not_write_says_to_use_no_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing(path: object, flags: int, *a: object, **kw: object) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing)
    assert main(["probe", str(tmp_path)]) == 2
    assert "--no-write" in capsys.readouterr().err


def test_on_a_shared_file_system_the_kind_is_pfs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ceph-fuse mount, as this machine's answered (the directory's xattrs are its own: none here)."""
    line = f"42 27 0:39 / {tmp_path} rw,relatime - fuse.ceph-fuse ceph-fuse rw,user_id=0,group_id=0,allow_other"
    monkeypatch.setattr(fsutil, "locate", lambda d: place(str(tmp_path), line, FUSE_MAGIC))
    out = probe_json(capsys, str(tmp_path))
    assert (out["kind"], out["kind_from"]) == ("pfs", "the family 'cephfs'")
    assert out["facts"]["fs_type"] == "fuse.ceph-fuse" and out["facts"]["mount_point"] == str(tmp_path)
    assert out["geometry"]["one_file"] is True


def test_a_tmpfs_is_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mount_tmpfs: Callable[[Path, int], AbstractContextManager[Path]]
) -> None:
    with mount_tmpfs(tmp_path / "mnt", 16 << 20) as mnt:
        out = probe_json(capsys, str(mnt))
    facts = out["facts"]
    assert (facts["fs_type"], facts["family"], facts["mount_point"]) == ("tmpfs", "memory", str(mnt))
    assert out["details"]["statfs_magic"] == "0x1021994 (tmpfs)" and out["kind"] == "local"
    assert (facts["stripe_unit_bytes"], facts["layout_settable"]) == (None, False)


def test_a_read_only_mount_is_probed_on_a_file_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mount_tmpfs: Callable[[Path, int], AbstractContextManager[Path]]
) -> None:
    with mount_tmpfs(tmp_path / "mnt", 16 << 20) as mnt:
        (mnt / "data.bin").write_bytes(b"x" * 4096)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True, timeout=30)
        out = probe_json(capsys, str(mnt))
    assert out["facts"]["readonly"] is True and out["wrote_probe_file"] is False
    assert out["sources"]["direct"].startswith(f"the file {mnt}/data.bin")
