"""The tier directory is a closed world (issue 19, item 4): links are not followed inside a tier, only
regular files are opened (never blocking in open(2)), names match exactly, and every size a reader uses
is checked against the files' real sizes before anything is read or allocated.

Cases that hang or allocate on a bad reader run in a child process with a time limit, and report its
peak RSS growth."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointNotFoundError, CorruptCheckpointError, Hierarchy
from tierckpt.format.manifest import BlobEntry, decode_manifest, encode_manifest
from tierckpt.testing.tamper import rewrite_manifest
from tierckpt.tiers.base import CheckpointKey

STEP_DIR = "step-{:012d}"


def cfg(tmp_path: Path, *tiers: str) -> dict[str, Any]:
    kinds = {
        "ssd": {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
        "pfs": {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
    }
    return {"tiers": [kinds[t] for t in tiers], "io": {"engine": "threads"}}


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "b": torch.arange(10) + step, "step": step}


def rank_dir(tmp_path: Path, tier: str, step: int) -> Path:
    return tmp_path / tier / STEP_DIR.format(step) / "rank-00000"


def saved(tmp_path: Path, *tiers: str, steps: tuple[int, ...] = (1,)) -> None:
    with Hierarchy.from_config(cfg(tmp_path, *tiers)) as h:
        for s in steps:
            h.save(state(s), step=s).wait()


def same(a: dict[str, Any], step: int) -> bool:
    b = state(step)
    return a["step"] == step and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


def move_out(p: Path, outside: Path) -> Path:
    """Move ``p`` out of the tier and leave a link to it in its place."""
    outside.mkdir(exist_ok=True)
    target = outside / p.name
    os.rename(p, target)
    os.symlink(target, p)
    return target


# -- links ------------------------------------------------------------------------------------------------
def test_a_linked_blob_is_refused_and_the_other_tier_is_read(tmp_path: Path) -> None:
    saved(tmp_path, "ssd", "pfs")
    move_out(rank_dir(tmp_path, "ssd", 1) / "blob-00000.bin", tmp_path / "outside")
    with Hierarchy.from_config(cfg(tmp_path, "ssd", "pfs"), readonly=True) as h:
        assert same(h.restore(), 1) and h.last_restore == (1, "pfs")
        assert same(h.restore(into=state(0)), 1) and h.last_restore == (1, "pfs")
        [(_, _, bad), (_, _, ok)] = h.verify()
        assert isinstance(bad, CorruptCheckpointError) and ok is None and bad.tier == "ssd"
        assert "blob-00000.bin is not a regular file (a symbolic link: links inside a tier are not" in str(bad)
    with Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h, pytest.raises(CorruptCheckpointError):
        h.restore()


def test_a_copy_whose_manifest_is_a_link_is_no_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved(tmp_path, "ssd", "pfs")
    move_out(rank_dir(tmp_path, "ssd", 1) / "manifest", tmp_path / "outside")
    with caplog.at_level(logging.WARNING), Hierarchy.from_config(cfg(tmp_path, "ssd", "pfs"), readonly=True) as h:
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("pfs",))]
        assert same(h.restore(), 1) and h.last_restore == (1, "pfs")
        assert h.verify() == [(1, "pfs", None)]
        with pytest.raises(CorruptCheckpointError, match="manifest is not a regular file"):
            h.tier("ssd").read_manifest(CheckpointKey(1))
    assert any("holds no manifest file" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("level", ["rank", "step"])
def test_a_linked_directory_is_skipped_with_one_warning(
    tmp_path: Path, level: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved(tmp_path, "ssd", steps=(1, 2))
    d = rank_dir(tmp_path, "ssd", 2)
    move_out(d if level == "rank" else d.parent, tmp_path / "outside")
    with caplog.at_level(logging.WARNING), Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h:
        assert [c.step for c in h.checkpoints()] == [1]
        assert same(h.restore(), 1) and h.checkpoints()[-1].step == 1
        with pytest.raises(CheckpointNotFoundError):
            h.restore(step=2)
        with pytest.raises(CorruptCheckpointError, match="is not a checkpoint directory .a symbolic link"):
            h.tier("ssd").read_manifest(CheckpointKey(2))
        assert not h.tier("ssd").holds(CheckpointKey(2))
    warned = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert len(warned) == 1 and "not a checkpoint" in warned[0]


def test_the_tier_path_itself_may_be_a_link(tmp_path: Path) -> None:
    saved(tmp_path, "ssd")
    (tmp_path / "real").mkdir()
    os.rename(tmp_path / "ssd", tmp_path / "real" / "ssd")
    os.symlink(tmp_path / "real" / "ssd", tmp_path / "ssd")
    with Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h:
        assert same(h.restore(), 1) and h.verify() == [(1, "ssd", None)]


# -- names ------------------------------------------------------------------------------------------------
def test_names_with_a_trailing_newline_are_not_steps(tmp_path: Path) -> None:
    saved(tmp_path, "ssd", steps=(1, 2))
    import shutil

    shutil.copytree(tmp_path / "ssd" / STEP_DIR.format(2), tmp_path / "ssd" / (STEP_DIR.format(9) + "\n"))
    shutil.copytree(rank_dir(tmp_path, "ssd", 2), rank_dir(tmp_path, "ssd", 2).parent / "rank-00001\n")
    with Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h:
        assert [(k.step, k.rank) for k in h.tier("ssd").list_committed()] == [(1, 0), (2, 0)]
        assert same(h.restore(), 2) and h.last_restore == (2, "ssd")


def test_a_blob_name_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    saved(tmp_path, "ssd")
    d = rank_dir(tmp_path, "ssd", 1)
    m = decode_manifest((d / "manifest").read_bytes())
    name = m.blobs[0].name + "\n"
    os.rename(d / m.blobs[0].name, d / name)
    blobs = (BlobEntry(name, m.blobs[0].size), *m.blobs[1:])
    rewrite_manifest(d / "manifest", encode_manifest(dataclasses.replace(m, blobs=blobs)))
    with (
        Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h,
        pytest.raises(CorruptCheckpointError, match="is not a plain file name"),
    ):
        h.restore()


# -- sizes ------------------------------------------------------------------------------------------------
def test_a_blob_shorter_than_declared_is_named_before_any_read(tmp_path: Path) -> None:
    saved(tmp_path, "ssd")
    d = rank_dir(tmp_path, "ssd", 1)
    m = decode_manifest((d / "manifest").read_bytes())
    os.truncate(d / m.blobs[0].name, m.blobs[0].size - 4096)
    with Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h:
        for op in (h.restore, lambda: h.restore(into=state(0))):
            with pytest.raises(
                CorruptCheckpointError, match=r"blob-00000.bin is truncated: \d+ bytes, its manifest declares"
            ):
                op()


def test_memory_that_cannot_be_had_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import tierckpt.datapath.restore as r

    saved(tmp_path, "ssd", "pfs")

    def no_memory(nbytes: int) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(r, "MappedBuffer", no_memory)
    with (
        Hierarchy.from_config(cfg(tmp_path, "ssd", "pfs"), readonly=True) as h,
        pytest.raises(MemoryError, match=r"restoring step 1 from tier 'ssd': cannot allocate \d+ bytes for blob-00000"),
    ):
        h.restore()


# -- in a child process: hangs and allocations --------------------------------------------------------------
PROBE = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from tierckpt import Hierarchy
    from tierckpt.tiers.base import CheckpointKey

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10

    cfg = json.loads(sys.argv[1])
    out = []
    with Hierarchy.from_config(cfg, readonly=True) as h:
        for op in sys.argv[2:]:
            base, t0 = hwm(), time.monotonic()
            try:
                if op == "restore":
                    h.restore()
                elif op.startswith("manifest:"):  # the tier asked directly for one copy's manifest
                    h.tier("ssd").read_manifest(CheckpointKey(int(op[9:])))
                elif op == "into":
                    h.restore(into={"w": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.int64), "step": 0})
                else:
                    bad = [e for _, _, e in h.verify() if e is not None]
                    if bad:
                        raise bad[0]
                err = None
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            out.append({"op": op, "error": err, "secs": time.monotonic() - t0, "rss_growth": hwm() - base})
    print(json.dumps(out))
    """
)


def probe(
    tmp_path: Path, ops: tuple[str, ...] = ("restore", "into", "verify"), timeout: float = 60
) -> list[dict[str, Any]]:
    """Run ``ops`` on the ssd tier in a new process; a hang fails the test after ``timeout``."""
    p = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cfg(tmp_path, "ssd")), *ops],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def cli_verify(tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    yml = tmp_path / "tiers.json"  # JSON is YAML
    yml.write_text(json.dumps(cfg(tmp_path, "ssd")))
    return subprocess.run(
        [sys.executable, "-m", "tierckpt.cli", "verify", str(yml)], capture_output=True, text=True, timeout=timeout
    )


def put_fifo(p: Path, linked: bool) -> None:
    p.unlink()
    if linked:
        os.mkfifo(p.parent.parent / "fifo")
        os.symlink(p.parent.parent / "fifo", p)
    else:
        os.mkfifo(p)


def test_a_fifo_in_place_of_a_blob_never_blocks(tmp_path: Path) -> None:
    """Step 2's blob is a link to a FIFO, step 1's a FIFO: restore() tries both, verify names both."""
    saved(tmp_path, "ssd", steps=(1, 2))
    put_fifo(rank_dir(tmp_path, "ssd", 1) / "blob-00000.bin", linked=False)
    put_fifo(rank_dir(tmp_path, "ssd", 2) / "blob-00000.bin", linked=True)
    for r in probe(tmp_path):
        assert r["error"].startswith("CorruptCheckpointError") and r["secs"] < 10, r
        assert "blob-00000.bin is not a regular file (a FIFO)" in r["error"]
        if r["op"] != "verify":  # the probe's verify raises the first bad copy (step 1's)
            assert "blob-00000.bin is not a regular file (a symbolic link" in r["error"]
    p = cli_verify(tmp_path)
    assert p.returncode == 1 and p.stdout.count("blob-00000.bin is not a regular file") == 2, p.stdout


def test_a_fifo_in_place_of_a_manifest_never_blocks(tmp_path: Path) -> None:
    """A copy without a regular manifest file is no checkpoint (skipped when listed, with a warning);
    opened by name, it is refused."""
    saved(tmp_path, "ssd", steps=(1, 2))
    put_fifo(rank_dir(tmp_path, "ssd", 1) / "manifest", linked=False)
    put_fifo(rank_dir(tmp_path, "ssd", 2) / "manifest", linked=True)
    restore, verify, first, second = probe(tmp_path, ("restore", "verify", "manifest:1", "manifest:2"))
    assert restore["error"].startswith("CheckpointNotFoundError") and verify["error"] is None
    for r, kind in ((first, "a FIFO"), (second, "a symbolic link")):
        assert r["error"].startswith("CorruptCheckpointError") and r["secs"] < 10, r
        assert f"manifest is not a regular file ({kind}" in r["error"]


def test_sockets_devices_and_directories_in_place_of_blobs_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved(tmp_path, "ssd")
    what = "blob-00000.bin"
    p = rank_dir(tmp_path, "ssd", 1) / what
    monkeypatch.chdir(p.parent)  # a socket's path must be short
    kinds = {"a socket": lambda: socket.socket(socket.AF_UNIX).bind(what), "a directory": p.mkdir}
    if os.geteuid() == 0:
        kinds["a character device"] = lambda: os.mknod(p, 0o600 | 0o020000, os.makedev(1, 3))  # like /dev/null
    for kind, make in kinds.items():
        p.unlink() if not p.is_dir() else p.rmdir()
        make()
        with Hierarchy.from_config(cfg(tmp_path, "ssd"), readonly=True) as h:
            with pytest.raises(CorruptCheckpointError, match=rf"{what} is not a regular file \({kind}\)"):
                h.restore()
            [(_, _, err)] = h.verify()
            assert f"{what} is not a regular file ({kind})" in str(err)


def test_a_huge_sparse_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Step 2's manifest is 2.5 GiB (more than a manifest can be), step 1's 1 GiB and not what its
    header says: both refused after reading at most its header."""
    saved(tmp_path, "ssd", steps=(1, 2))
    for step, size in ((2, 5 << 29), (1, 1 << 30)):
        with open(rank_dir(tmp_path, "ssd", step) / "manifest", "r+b") as f:
            f.truncate(size)
    [r] = probe(tmp_path, ("restore",))
    assert "more than a manifest can be" in r["error"] and "its header says" in r["error"], r
    assert r["rss_growth"] < 64 << 20 and r["secs"] < 10, r


def test_a_declared_blob_size_of_2_to_the_50_is_refused_without_allocating(tmp_path: Path) -> None:
    saved(tmp_path, "ssd")
    mpath = rank_dir(tmp_path, "ssd", 1) / "manifest"
    m = decode_manifest(mpath.read_bytes())
    blobs = (BlobEntry(m.blobs[0].name, 1 << 50), *m.blobs[1:])
    rewrite_manifest(mpath, encode_manifest(dataclasses.replace(m, blobs=blobs)))
    for r in probe(tmp_path):
        assert r["error"].startswith("CorruptCheckpointError") and "is truncated" in r["error"], r
        assert r["rss_growth"] < 64 << 20 and r["secs"] < 10, r


LISTING = textwrap.dedent(
    """
    import json, sys
    from tierckpt import Hierarchy
    from tierckpt.cli import main

    cfg, yml = json.loads(sys.argv[1]), sys.argv[2]
    with Hierarchy.from_config(cfg, readonly=sys.argv[3] == "ro") as h:
        listed = [c.step for c in h.checkpoints()]
        restored = h.restore()["step"]
        verified = [(s, t, e is None) for s, t, e in h.verify()]
        try:
            h.tier("ssd").read_record(2)
            record = None
        except Exception as e:
            record = f"{type(e).__name__}: {e}"
    codes = [main([cmd, yml, "--json"]) for cmd in ("ls", "verify")]
    print(json.dumps({"listed": listed, "restored": restored, "verified": verified, "record": record, "codes": codes}))
    """
)


@pytest.mark.parametrize("mode", ["ro", "rw"])
@pytest.mark.parametrize("kind", ["a FIFO", "a symbolic link"])
def test_a_fifo_in_place_of_a_commit_record_never_blocks(tmp_path: Path, mode: str, kind: str) -> None:
    """Step 2's commit record is a FIFO (or a link to one): the step is not listed (nor its copy removed
    as an orphan), step 1 is restored and verified, the record read by name is refused naming it, and
    the command line lists and verifies; nothing blocks in open(2)."""
    saved(tmp_path, "ssd", steps=(1, 2))
    put_fifo(tmp_path / "ssd" / STEP_DIR.format(2) / "commit", linked=kind != "a FIFO")
    yml = tmp_path / "tiers.json"  # JSON is YAML
    yml.write_text(json.dumps(cfg(tmp_path, "ssd")))
    p = subprocess.run(
        [sys.executable, "-c", LISTING, json.dumps(cfg(tmp_path, "ssd")), str(yml), mode],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["listed"] == [1] and out["restored"] == 1 and out["verified"] == [[1, "ssd", True]], out
    assert (
        out["record"].startswith("CorruptCheckpointError") and f"commit is not a regular file ({kind}" in out["record"]
    )
    assert out["codes"] == [0, 0], p.stdout
    assert (rank_dir(tmp_path, "ssd", 2) / "manifest").is_file()  # the copy is left alone
