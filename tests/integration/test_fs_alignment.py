"""A file system's alignment reaches the writes of a tier inside a hierarchy (issue 27, "One I/O geometry").

A pfs tier aligns its I/O to the larger of its file system's block size and its directory's
``st_blksize`` (docs/tiers.md); here the file system reports 64 KiB blocks (``statvfs`` answers for the
tier's directory as a parallel file system would), and every write the I/O engine is handed for that
tier, whether the save packs into it or the mover copies to it, starts and ends on a 64 KiB boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy, IOConfig, LayoutConfig
from tierckpt.io.threadpool import ThreadEngine
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.pfs import PfsTier

FS_BLOCK = 64 << 10


@pytest.fixture
def writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(offset, length) of every pwrite of a file under ``tmp_path/pfs``, whose file system reports
    64 KiB blocks."""
    pfs = tmp_path / "pfs"
    pfs.mkdir()
    real_statvfs, real_pwrite = os.statvfs, ThreadEngine.pwrite
    seen: list[tuple[int, int]] = []

    def statvfs(p: Any) -> os.statvfs_result:
        got = real_statvfs(p)
        if Path(p).resolve() == pfs.resolve():
            return os.statvfs_result((FS_BLOCK, *tuple(got)[1:]))
        return got

    def pwrite(self: ThreadEngine, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None) -> Any:
        if path is not None and Path(path).resolve().is_relative_to(pfs.resolve()):
            seen.append((offset, nbytes))
        return real_pwrite(self, fd, addr, nbytes, offset, path=path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(ThreadEngine, "pwrite", pwrite)
    yield seen


def state() -> dict[str, Any]:
    """Tensors whose sizes are multiples of 4 KiB but not of 64 KiB: 3 blobs of 1 MiB and a bit."""
    return {f"t{i}": torch.arange(i * 1000, i * 1000 + 70_000 + 1024 * i, dtype=torch.float32) for i in range(12)}


def check(seen: list[tuple[int, int]]) -> None:
    assert seen, "nothing was written to the pfs tier"
    off = sorted({(o, n) for o, n in seen if o % FS_BLOCK or n % FS_BLOCK})
    assert not off, f"writes not on the file system's 64 KiB blocks (offset, length): {off[:8]}"


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_file_systems_block_reaches_the_writes_of_a_tier_built_in_python(
    tmp_path: Path, writes: list[tuple[int, int]]
) -> None:
    """The tier joins a hierarchy with a small io chunk and a small blob size: its chunks, its blobs and
    their offsets in its data file are all whole 64 KiB blocks."""
    engine = ThreadEngine(4)
    try:
        pfs = PfsTier("pfs", tmp_path / "pfs", engine)
        io = IOConfig(engine="threads", chunk_bytes=12 << 10)
        with Hierarchy([pfs], io=io, layout=LayoutConfig(blob_bytes=1 << 20)) as h:
            h.save(state(), step=1, blocking=True).wait()
            assert same(h.restore(), state())
    finally:
        engine.close()
    check(writes)
    assert len(writes) > 3


def test_the_file_systems_block_reaches_the_mover_copies_to_a_tier_built_from_a_config(
    tmp_path: Path, writes: list[tuple[int, int]]
) -> None:
    """host -> pfs: the copy the mover makes writes whole blocks too."""
    config = {
        "tiers": [{"name": "host", "kind": "host", "capacity": "64MiB"}, {"name": "pfs", "kind": "pfs", "path": "pfs"}],
        "io": {"engine": "threads", "chunk": "12KiB"},
        "layout": {"blob_size": "1MiB"},
    }
    with Hierarchy.from_config(config, base_dir=tmp_path) as h:
        h.save(state(), step=1, blocking=True).wait()
        assert same(h.restore(tier="pfs"), state())
    check(writes)


def test_a_local_tier_keeps_its_own_alignment(tmp_path: Path, writes: list[tuple[int, int]]) -> None:
    """Only a pfs tier rounds its I/O up to the file system's blocks: a checkpoint on ``local`` and host
    keeps 4 KiB (its sizes stay as they were)."""
    from tierckpt.tiers.local import LocalTier

    with Hierarchy(
        [HostTier("host", 64 << 20), LocalTier("ssd", tmp_path / "pfs")], io=IOConfig(engine="threads")
    ) as h:
        assert h.align == 4096
