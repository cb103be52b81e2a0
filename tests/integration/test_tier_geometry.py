"""Each tier's I/O geometry is fixed by the hierarchy it joins, whatever the tier's ``use_io`` does, and
the sizes the data path uses are that geometry's (docs/tiers.md, "I/O geometry")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.tiers._fileread as fileread
from tierckpt import Hierarchy, IOConfig, LayoutConfig
from tierckpt.config import default_io
from tierckpt.io.threadpool import ThreadEngine
from tierckpt.tiers.base import EngineSource
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier

KiB, MiB = 1 << 10, 1 << 20


class OwnHost(HostTier):
    """A third-party memory tier that takes nothing from the hierarchy's io and does not call super()."""

    def use_io(self, engines: EngineSource, io: IOConfig) -> None:
        self.joined = io


class OwnLocal(LocalTier):
    """A third-party file tier, given its engine, whose use_io does not call super() either."""

    def use_io(self, engines: EngineSource, io: IOConfig) -> None:
        self.joined = io


def state() -> dict[str, Any]:
    return {f"t{i}": torch.arange(i * 1000, i * 1000 + 70_000, dtype=torch.float32) for i in range(6)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tier_whose_use_io_skips_super_gets_the_geometry_of_the_hierarchys_io(tmp_path: Path) -> None:
    engine = ThreadEngine(4)
    io = IOConfig(engine="threads", direct=False, chunk_bytes=MiB, queue_depth=5)
    assert default_io().chunk_bytes != io.chunk_bytes and default_io().queue_depth != io.queue_depth
    host, ssd = OwnHost("host", 64 * MiB), OwnLocal("ssd", tmp_path / "ssd", engine)
    try:
        with Hierarchy([host, ssd], io=io, layout=LayoutConfig(blob_bytes=MiB)) as h:
            assert host.joined is io and ssd.joined is io  # the hierarchy did call it
            assert host.geometry.staging_slot_bytes == MiB  # a memory tier stages in the hierarchy's chunk
            g = ssd.geometry
            assert (g.chunk_bytes, g.staging_slot_bytes, g.queue_depth, g.direct) == (MiB, MiB, 5, False)
            assert (ssd.chunk_bytes, ssd.direct) == (MiB, False)  # a file tier's are its geometry's
            ssd.chunk_bytes = 2 * MiB  # a chunk of its own: planned again for the hierarchy's io
            assert (ssd.geometry.chunk_bytes, ssd.geometry.queue_depth, ssd.direct) == (2 * MiB, 5, False)
            h.save(state(), step=1, blocking=True).wait()
            assert same(h.restore(tier="ssd"), state())
    finally:
        engine.close()


def test_a_file_tiers_own_chunk_is_an_input_of_its_geometry(tmp_path: Path) -> None:
    ssd = LocalTier("ssd", tmp_path / "ssd", chunk_bytes=2 * MiB, direct=False)
    try:
        with Hierarchy([ssd], io=IOConfig(engine="threads", chunk_bytes=8 * MiB)):
            assert ssd.geometry.chunk_bytes == ssd.chunk_bytes == 2 * MiB and not ssd.direct
            ssd.chunk_bytes = 3 * MiB + 1  # a chunk of its own, in its alignment
            assert ssd.geometry.chunk_bytes == ssd.chunk_bytes == 3 * MiB
    finally:
        ssd.close()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(blob, offset in it, length) of every read a file tier makes."""
    seen: list[tuple[int, int, int]] = []
    inner = fileread.FileReader.read

    def read(self: Any, blob: int, offset: int, addr: int, nbytes: int) -> Any:
        seen.append((blob, offset, nbytes))
        return inner(self, blob, offset, addr, nbytes)

    monkeypatch.setattr(fileread.FileReader, "read", read)
    return seen


def test_a_restore_into_new_tensors_reads_in_the_tiers_chunks(
    tmp_path: Path, reads: list[tuple[int, int, int]]
) -> None:
    """The first chunk in quarters (the disk starts once a quarter's pages are in), then whole chunks."""
    with Hierarchy(
        [LocalTier("ssd", tmp_path / "ssd", chunk_bytes=256 * KiB)],
        io=IOConfig(engine="threads"),
        layout=LayoutConfig(blob_bytes=MiB),
    ) as h:
        g = h.tier("ssd").geometry
        assert (g.read_chunk(4096), g.first_read(4096)) == (256 * KiB, 64 * KiB)
        h.save(state(), step=1, blocking=True).wait()
        reads.clear()
        assert same(h.restore(), state())
    first = sorted(r[1:] for r in reads if r[0] == 0)[:5]  # blob 0's (submitted by helper threads: any order)
    assert first == [
        (0, 64 * KiB),
        (64 * KiB, 64 * KiB),
        (128 * KiB, 64 * KiB),
        (192 * KiB, 64 * KiB),
        (256 * KiB, 256 * KiB),
    ]
    assert max(n for _, _, n in reads) == 256 * KiB
