"""A pfs tier sized for a wide stripe (4 MiB units over 8 targets, 8 MiB objects, given in its YAML
``io:`` entry over what the local disk reports): saves and demotions write whole stripe units at stripe
unit offsets, the data file is whole stripes, the copy round-trips bit-exact (fresh tensors and
``into=``), and ``tierckpt inspect --json`` shows the geometry and the facts."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.cli import main
from tierckpt.io.threadpool import ThreadEngine

MiB = 1 << 20
UNIT, COUNT, OBJECT = 4 * MiB, 8, 8 * MiB
WIDTH = UNIT * COUNT

YAML = """\
tiers:
  - {name: host, kind: host, capacity: 1GiB}
  - {name: pfs, kind: pfs, path: pfs, io: {stripe_unit: 4MiB, stripe_count: 8, object_size: 8MiB, chunk: 16MiB}}
io: {engine: threads}
layout: {blob_size: 40MiB}
"""


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    small = {f"s{i}": torch.randint(0, 1 << 30, (100 + 37 * i,), generator=g, dtype=torch.int32) for i in range(300)}
    large = {f"w{i}": torch.randn(2_500_000 + 4099 * i, generator=g) for i in range(7)}  # ~70 MB, several blobs
    return {"small": small, "large": large, "step": 3}


def flat(s: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": t for k in ("small", "large") for n, t in s[k].items()}


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every (path, offset, length) the thread engine is asked to write."""
    seen: list[tuple[str, int, int]] = []
    lock = threading.Lock()
    real = ThreadEngine.pwrite

    def pwrite(
        self: ThreadEngine, fd: int, addr: int, nbytes: int, offset: int, *, path: str | None = None
    ) -> Future[int]:
        with lock:
            seen.append((path or "", offset, nbytes))
        return real(self, fd, addr, nbytes, offset, path=path)

    monkeypatch.setattr(ThreadEngine, "pwrite", pwrite)
    return seen


@pytest.mark.parametrize("top", ["host", "pfs"])  # a demotion's copies, or a save packed for the pfs tier
def test_a_wide_stripe_round_trips_in_whole_stripes(
    tmp_path: Path, writes: list[tuple[str, int, int]], top: str
) -> None:
    cfg = tmp_path / "h.yaml"
    cfg.write_text(YAML if top == "host" else YAML.replace("  - {name: host, kind: host, capacity: 1GiB}\n", ""))
    want = state()
    with Hierarchy.from_yaml(cfg) as h:
        g = h.geometry.tiers["pfs"]
        assert (g.stripe_unit_bytes, g.stripe_width_bytes, g.blob_align_bytes) == (UNIT, WIDTH, WIDTH)
        assert g.chunk_bytes == WIDTH  # the asked 16 MiB raised to one whole stripe
        assert h.geometry.blob_align_bytes == WIDTH and h.geometry.blob_bytes == 64 * MiB
        h.save(want, step=1, blocking=True).wait()
        h.flush()
        assert [i.tiers for i in h.checkpoints()] == [("host", "pfs") if top == "host" else ("pfs",)]
    data = [w for w in writes if w[0].endswith("data.bin")]
    assert data and all(off % UNIT == 0 and n % UNIT == 0 for _, off, n in data)
    [file] = (tmp_path / "pfs").glob("step-*/rank-*/data.bin")
    assert file.stat().st_size % WIDTH == 0 and file.stat().st_size > 2 * WIDTH

    with Hierarchy.from_yaml(cfg) as h:  # a new hierarchy: the host tier is empty, the copy is the pfs's
        out = h.restore()
        assert h.last_restore == (1, "pfs")
        blobs = [b.size for b in h.inspect(1)[1].blobs]
        assert len(blobs) > 1 and all(size % WIDTH == 0 for size in blobs)  # each blob starts on a stripe
        into = state()
        for t in flat(into).values():
            t.zero_()
        h.restore(step=1, into=into)
    for got in (out, into):
        assert got["step"] == 3
        assert all(torch.equal(flat(got)[k], v) for k, v in flat(want).items())


def test_inspect_shows_every_tiers_geometry_and_facts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "h.yaml"
    cfg.write_text(YAML)
    with Hierarchy.from_yaml(cfg) as h:
        h.save({"x": torch.arange(10)}, step=5, blocking=True).wait()
    assert main(["inspect", str(cfg), "--json"]) == 0
    io = json.loads(capsys.readouterr().out)["io"]
    assert io["blob_align_bytes"] == WIDTH
    host, pfs = io["tiers"]
    assert (host["name"], "facts" in host) == ("host", False)
    assert pfs["geometry"]["stripe_width_bytes"] == WIDTH and pfs["geometry"]["one_file"] is True
    assert pfs["file_layout"] is None and pfs["facts"]["block_bytes"] > 0  # what the disk says, unchanged
    assert main(["inspect", str(cfg)]) == 0
    assert "pfs (pfs on " in capsys.readouterr().out
