"""A pfs tier's ``file_layout``: the layout it sets on each new data file where the file system lets a
client choose one (CephFS: ``ceph.file.layout`` on the new empty file; Lustre: a ``lov_user_md_v1`` in
``lustre.lov`` on the scratch directory the files are created in). Neither file system runs here: the
tier's facts say CephFS or Lustre and a recorder stands in for ``setxattr``, checking what it is given
and when; the bytes are checked field by field. The geometry sizes for the layout set, and a refusal
is an error naming the tier, the file and the layout."""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.tiers._files as files
from tierckpt import Hierarchy
from tierckpt.errors import ConfigError, TierckptError, TierIOError
from tierckpt.io.fslayout import FileLayout, layout_xattr, lov_user_md_v1, with_layout
from tierckpt.io.geometry import FsFacts

KiB, MiB = 1 << 10, 1 << 20


class Recorder:
    """Stands in for ``os.setxattr``: records (what, name, value, size or entries at the time); refuses
    with ``refuse`` (an errno) from call ``refuse_from`` on."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bytes, Any]] = []
        self.refuse: int | None = None
        self.refuse_from = 0

    def __call__(self, target: int | str, name: str, value: bytes) -> None:
        if self.refuse is not None and len(self.calls) >= self.refuse_from:
            raise OSError(self.refuse, os.strerror(self.refuse))
        if isinstance(target, int):  # a new file's descriptor: how many bytes it holds yet
            st = os.fstat(target)
            self.calls.append(("file", name, value, (st.st_size, st.st_blocks, os.readlink(f"/proc/self/fd/{target}"))))
        else:
            assert stat.S_ISDIR(os.stat(target).st_mode)
            self.calls.append(("dir", name, value, (target, sorted(os.listdir(target)))))


@pytest.fixture
def fs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Recorder]]:
    """``fs(family)``: from now on, tiers are built on a file system of that family (their facts say so),
    and ``os.setxattr`` is a :class:`Recorder`."""

    def use(family: str) -> Recorder:
        probe = files.probe_fs
        monkeypatch.setattr(files, "probe_fs", lambda d, **kw: replace(probe(d, **kw), family=family))
        rec = Recorder()
        monkeypatch.setattr(os, "setxattr", rec)
        return rec

    yield use


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(300_000 + 17 * i, generator=g) for i in range(8)}


def config(tmp_path: Path, layout: dict[str, Any] | None) -> dict[str, Any]:
    pfs: dict[str, Any] = {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")}
    if layout is not None:
        pfs["options"] = {"file_layout": layout}
    return {"tiers": [pfs], "io": {"engine": "threads"}, "layout": {"blob_size": "4MiB"}}


def test_the_bytes_that_set_a_layout() -> None:
    md = lov_user_md_v1(FileLayout(MiB, 4))
    assert md == bytes.fromhex("d00bd10b01000000" + "00" * 16 + "000010000400ffff")
    assert struct.unpack("<IIQQIHH", lov_user_md_v1(FileLayout(4 * MiB, 2000))) == (
        0x0BD10BD0, 1, 0, 0, 4 * MiB, 2000, 0xFFFF,
    )  # fmt: skip  # magic, RAID0, no object id, stripe size, count, any first OST
    assert layout_xattr("cephfs", FileLayout(MiB, 4, 4 * MiB)) == (
        "ceph.file.layout", b"stripe_unit=1048576 stripe_count=4 object_size=4194304",
    )  # fmt: skip
    assert layout_xattr("cephfs", FileLayout(3 * MiB))[1].endswith(b"object_size=6291456")  # >= 4 MiB, whole units
    with pytest.raises(ValueError, match="Lustre file has no object size"):
        layout_xattr("lustre", FileLayout(MiB, 4, 4 * MiB))
    with pytest.raises(ValueError, match="a nfs file system takes no file layout"):
        layout_xattr("nfs", FileLayout(MiB))
    facts = with_layout(FsFacts(family="cephfs", stripe_unit_bytes=4 * MiB), FileLayout(MiB, 4))
    assert (facts.stripe_unit_bytes, facts.stripe_count, facts.object_bytes) == (MiB, 4, 4 * MiB)


def test_cephfs_data_files_get_the_layout_while_empty_and_the_geometry_follows_it(
    tmp_path: Path, fs: Callable[[str], Recorder]
) -> None:
    rec = fs("cephfs")
    layout = {"stripe_unit": "1MiB", "stripe_count": 4, "object_size": "8MiB"}
    with Hierarchy.from_config(config(tmp_path, layout)) as h:
        g = h.tier("pfs").geometry
        assert (g.stripe_unit_bytes, g.stripe_width_bytes, g.blob_align_bytes) == (MiB, 4 * MiB, 8 * MiB)
        assert h.tier("pfs").storage_facts()["file_layout"] == {
            "stripe_unit_bytes": MiB, "stripe_count": 4, "object_bytes": 8 * MiB,
        }  # fmt: skip
        probe = rec.calls.pop()  # the one set when the tier was built, on a probe file since removed
        assert probe[:2] == ("file", "ceph.file.layout") and not os.path.exists(probe[3][2])
        h.save(state(), step=1, blocking=True).wait()
        value = b"stripe_unit=1048576 stripe_count=4 object_size=8388608"
        [(what, name, got, (size, blocks, path))] = rec.calls
        assert (what, name, got, size, blocks) == ("file", "ceph.file.layout", value, 0, 0)  # before any byte
        assert Path(path).name == "data.bin" and ".tmp-" in path
        data = next((tmp_path / "pfs").glob("step-*/rank-*/data.bin"))
        assert data.stat().st_size % (8 * MiB) == 0
        out = h.restore(tier="pfs")
    assert all(torch.equal(out[k], v) for k, v in state().items())


def test_lustre_sets_the_scratch_directorys_striping_before_the_data_file_is_made(
    tmp_path: Path, fs: Callable[[str], Recorder]
) -> None:
    rec = fs("lustre")
    with Hierarchy.from_config(config(tmp_path, {"stripe_unit": "2MiB", "stripe_count": 3})) as h:
        g = h.tier("pfs").geometry
        assert (g.stripe_width_bytes, g.chunk_bytes, g.blob_align_bytes) == (6 * MiB, 30 * MiB, 6 * MiB)
        assert rec.calls.pop()[0] == "dir"  # the probe directory, removed
        h.save(state(), step=1, blocking=True).wait()
        [(what, name, value, (target, entries))] = rec.calls
        assert (what, name, entries) == ("dir", "lustre.lov", [])  # empty: no file made before it
        assert Path(target).name.startswith(".tmp-") and not os.path.exists(target)  # renamed into place
        assert struct.unpack("<IIQQIHH", value)[4:6] == (2 * MiB, 3)
        assert next((tmp_path / "pfs").glob("step-*/rank-*/data.bin")).stat().st_size % (6 * MiB) == 0
        assert all(torch.equal(a, b) for a, b in zip(h.restore(tier="pfs").values(), state().values()))


def test_a_file_system_that_takes_no_layout_is_refused_when_the_tier_is_built(
    tmp_path: Path, fs: Callable[[str], Recorder]
) -> None:
    fs("glusterfs")
    with pytest.raises(ConfigError, match=r"tier 'pfs': file_layout \(stripe unit 1048576, stripe count 2\): .*"
                       r"takes no file layout from a client \(CephFS and Lustre do\)"):  # fmt: skip
        Hierarchy.from_config(config(tmp_path, {"stripe_unit": "1MiB", "stripe_count": 2}))
    fs("lustre")
    with pytest.raises(ConfigError, match="a Lustre file has no object size"):
        Hierarchy.from_config(config(tmp_path, {"stripe_unit": "1MiB", "object_size": "4MiB"}))


def test_a_layout_refused_on_the_probe_fails_the_build_and_leaves_nothing(
    tmp_path: Path, fs: Callable[[str], Recorder]
) -> None:
    rec = fs("cephfs")
    rec.refuse = errno.EOPNOTSUPP
    with pytest.raises(TierIOError, match=r"tier 'pfs': file_layout \(stripe unit 4194304, stripe count 2\): "
                       r"the file system of .*pfs refused it on a probe file") as e:  # fmt: skip
        Hierarchy.from_config(config(tmp_path, {"stripe_unit": "4MiB", "stripe_count": 2}))
    assert e.value.errno == errno.EOPNOTSUPP
    assert not [p for p in (tmp_path / "pfs").iterdir() if p.name.startswith(".tierckpt-layout")]


def test_a_layout_refused_when_a_copy_starts_fails_that_copy_naming_the_file(
    tmp_path: Path, fs: Callable[[str], Recorder]
) -> None:
    rec = fs("cephfs")
    with Hierarchy.from_config(config(tmp_path, {"stripe_unit": "4MiB"})) as h:
        rec.refuse, rec.refuse_from = errno.EINVAL, len(rec.calls)  # the probe passed; the first file is refused
        with pytest.raises(TierckptError) as e:
            h.save(state(), step=1, blocking=True).wait()
        msg = str(e.value) + str(e.value.__cause__)
        assert "tier 'pfs'" in msg and "data.bin" in msg and "stripe unit 4194304, stripe count 1" in msg
        assert h.tier("pfs").list_committed() == []


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"stripe_count": 2}, r"file_layout\.stripe_unit: required field"),
        ({"stripe_unit": "4KiB"}, r"file_layout\.stripe_unit: expected a multiple of 64KiB"),
        ({"stripe_unit": "1MiB", "stripe_count": 0}, r"file_layout\.stripe_count: expected an integer in \[1, 2000\]"),
        ({"stripe_unit": "1MiB", "object_size": "1536KiB"}, r"file_layout\.object_size: expected a multiple of the stripe unit"),
        ({"stripe_unit": "1MiB", "pool": "fast"}, r"file_layout\.pool: unknown field \(a file layout takes: stripe_unit"),
        ("4MiB", r"file_layout: expected a mapping"),
    ],
)  # fmt: skip
def test_a_bad_file_layout_is_named(tmp_path: Path, layout: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.options\." + message):
        Hierarchy.from_config(config(tmp_path, layout))


def test_a_local_tier_takes_no_file_layout(tmp_path: Path) -> None:
    entry = {"name": "ssd", "kind": "local", "path": str(tmp_path), "options": {"file_layout": {"stripe_unit": "1MiB"}}}
    with pytest.raises(
        ConfigError, match=r"options\.file_layout: unknown option \(a local tier takes: files, one_file\)"
    ):
        Hierarchy.from_config({"tiers": [entry]})


def test_a_real_refusal_names_the_tier_the_directory_and_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local disk's file system refuses a ``ceph.`` attribute for real (EOPNOTSUPP): facts that
    wrongly say CephFS fail the tier's build, not its first save."""
    probe = files.probe_fs
    monkeypatch.setattr(files, "probe_fs", lambda d, **kw: replace(probe(d, **kw), family="cephfs"))
    with pytest.raises(TierIOError, match=r"tier 'pfs': file_layout \(stripe unit 1048576, stripe count 4, "
                       r"object size 4194304\): the file system of .* refused it on a probe file") as e:  # fmt: skip
        Hierarchy.from_config(config(tmp_path, {"stripe_unit": "1MiB", "stripe_count": 4, "object_size": "4MiB"}))
    assert e.value.errno in (errno.EOPNOTSUPP, errno.ENOTSUP)
