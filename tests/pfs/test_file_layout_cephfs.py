"""A pfs tier's ``file_layout`` on a real CephFS mount (ceph-fuse): the data files get the layout asked
for (``getxattr ceph.file.layout``), the manifest keeps the directory's, the geometry sizes for the
layout set, and the copy round-trips. Runs with the loopback cluster of tests/pfs/conftest.py."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "tierckpt.testing.clusters", reason="the loopback clusters (tierckpt.testing.clusters) are not here"
)

import tierckpt.tiers._files as files
from tierckpt import Hierarchy
from tierckpt.io.geometry import FsFacts

pytestmark = [pytest.mark.pfs, pytest.mark.remote]
MiB = 1 << 20


def test_the_data_files_get_the_layout_asked_for(cephfs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = files.probe_fs

    def detected(d: Path, **kw: object) -> FsFacts:  # as detected; named CephFS where the probe says unknown
        f = probe(d, **kw)  # type: ignore[arg-type]
        return f if f.family != "unknown" else replace(f, family="cephfs")

    monkeypatch.setattr(files, "probe_fs", detected)
    layout = {"stripe_unit": "1MiB", "stripe_count": 4, "object_size": "4MiB"}
    cfg = {
        "tiers": [{"name": "pfs", "kind": "pfs", "path": str(cephfs_dir), "options": {"file_layout": layout}}],
        "layout": {"blob_size": "4MiB"},
    }
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(700_000 + 13 * i, generator=g) for i in range(6)}
    with Hierarchy.from_config(cfg) as h:
        geo = h.tier("pfs").geometry
        assert (geo.stripe_unit_bytes, geo.stripe_width_bytes, geo.blob_align_bytes) == (MiB, 4 * MiB, 4 * MiB)
        h.save(state, step=1, blocking=True).wait()
        [data] = cephfs_dir.glob("step-*/rank-*/data.bin")
        got, manifest = (layout_of(p) for p in (data, data.parent / "manifest"))
        assert (got["stripe_unit"], got["stripe_count"], got["object_size"]) == ("1048576", "4", "4194304")
        assert (manifest["stripe_unit"], manifest["stripe_count"]) == ("4194304", "1")  # the directory's own
        assert data.stat().st_size % (4 * MiB) == 0
        out = h.restore(tier="pfs")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert not list(cephfs_dir.glob(".tierckpt-layout-*"))  # the probe file is gone


def layout_of(path: Path) -> dict[str, str]:
    """``ceph.file.layout`` of a file: ``{"stripe_unit": ..., "stripe_count": ..., "object_size": ..., "pool": ...}``."""
    return dict(kv.split("=", 1) for kv in os.getxattr(path, "ceph.file.layout").decode().split())
