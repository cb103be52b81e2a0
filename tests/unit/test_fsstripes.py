"""The layout of new files (tierckpt.io.fsstripes): CephFS's virtual xattrs as a ceph-fuse client answered
them here (Ceph 16.2.15), Lustre's ``lustre.lov`` (lov_user_md v1, v3, PFL; built field by field after
lustre_user.h, as Lustre cannot run here), GPFS's block size, GlusterFS's pathinfo as a GlusterFS 10.3
client answered it here, NFS's mount options; and odd or hostile values, which are ignored."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierckpt.io import fsutil
from tierckpt.io.fsdetect import FUSE_MAGIC, Mount, parse_mountinfo, place
from tierckpt.io.fsstripes import (
    Candidate,
    Striping,
    ceph_striping,
    gluster_details,
    lustre_striping,
    nfs_details,
    striping_for,
)

MiB = 1 << 20

# --- CephFS: what ceph-fuse answered on this machine --------------------------------------------------
# the mount's root (a layout of its own: the file system's default)
CEPH_ROOT = {
    "ceph.dir.layout.json": b'{"stripe_unit": 4194304, "stripe_count": 1, "object_size": 4194304, "pool_name": '
    b'"cephfs_data", "pool_id": 1, "pool_namespace": "", "inheritance": "@default"}',
    "ceph.dir.layout": b"stripe_unit=4194304 stripe_count=1 object_size=4194304 pool=cephfs_data",
    "ceph.dir.layout.stripe_unit": b"4194304",
    "ceph.dir.layout.stripe_count": b"1",
    "ceph.dir.layout.object_size": b"4194304",
    "ceph.dir.layout.pool": b"cephfs_data",
    "ceph.dir.layout.pool_namespace": b"",
}
# a directory under a parent whose layout was set to 4 stripes (setfattr -n ceph.dir.layout.stripe_count
# -v 4): only the JSON form answers (ENODATA for ceph.dir.layout and its fields)
CEPH_INHERITED = {
    "ceph.dir.layout.json": b'{"stripe_unit": 4194304, "stripe_count": 4, "object_size": 4194304, "pool_name": '
    b'"cephfs_data", "pool_id": 1, "pool_namespace": "", "inheritance": "@inherited"}',
}
# a file whose layout was set (setfattr -n ceph.file.layout.stripe_unit -v 1048576) in that parent
CEPH_FILE = {
    "ceph.file.layout": b"stripe_unit=1048576 stripe_count=4 object_size=4194304 pool=cephfs_data",
    "ceph.file.layout.stripe_unit": b"1048576",
    "ceph.file.layout.stripe_count": b"4",
    "ceph.file.layout.object_size": b"4194304",
    "ceph.file.layout.pool": b"cephfs_data",
}
# what the kernel client answers for a directory with a layout of its own (no JSON form)
CEPH_KERNEL_DIR = {
    "ceph.dir.layout": b"stripe_unit=1048576 stripe_count=8 object_size=8388608 pool=fast pool_namespace=ns1",
}
NOTHING: dict[str, bytes] = {}


def _dir(answers: dict[str, bytes], label: str = "directory /c") -> Candidate:
    return Candidate(label, True, answers.get)


def _file(answers: dict[str, bytes], label: str = "the probe file") -> Candidate:
    return Candidate(label, False, answers.get)


def _striping(
    family: str, *asked: Candidate, block: int = 4096, io_block: int = 4096, mount: Mount | None = None
) -> Striping:
    return striping_for(family, asked, block_bytes=block, io_block_bytes=io_block, mount=mount)


def test_a_ceph_directory_with_a_layout() -> None:
    got = _striping("cephfs", _dir(CEPH_ROOT))
    assert (got.stripe_unit_bytes, got.stripe_count, got.object_bytes) == (4 * MiB, 1, 4 * MiB)
    assert got.source == "ceph.dir.layout.json of directory /c"
    assert dict(got.details) == {"pool": "cephfs_data", "inheritance": "@default"}


def test_a_ceph_directory_that_inherits_its_layout_answers_in_json() -> None:
    got = _striping("cephfs", _dir(CEPH_INHERITED))
    assert (got.stripe_unit_bytes, got.stripe_count, got.object_bytes) == (4 * MiB, 4, 4 * MiB)
    assert dict(got.details)["inheritance"] == "@inherited"


def test_the_text_form_and_the_fields_one_by_one() -> None:
    got = _striping("cephfs", _dir(CEPH_KERNEL_DIR))
    assert (got.stripe_unit_bytes, got.stripe_count, got.object_bytes) == (MiB, 8, 8 * MiB)
    assert got.source == "ceph.dir.layout of directory /c" and dict(got.details)["pool"] == "fast"
    fields = {k: v for k, v in CEPH_ROOT.items() if k not in ("ceph.dir.layout", "ceph.dir.layout.json")}
    got = _striping("cephfs", _dir(fields))
    assert (got.stripe_unit_bytes, got.stripe_count, got.source) == (4 * MiB, 1, "ceph.dir.layout.* of directory /c")


def test_a_ceph_directory_without_an_answer_takes_the_files_layout() -> None:
    """ceph-fuse before Ceph 15 and the kernel client answer nothing for a directory that inherits its layout."""
    got = _striping("cephfs", _dir(NOTHING), _file(CEPH_FILE), _dir(CEPH_ROOT, "parent /"))
    assert (got.stripe_unit_bytes, got.stripe_count, got.object_bytes) == (MiB, 4, 4 * MiB)
    assert got.source == "ceph.file.layout of the probe file"


def test_then_the_nearest_parent_with_a_layout() -> None:
    got = _striping(
        "cephfs", _dir(NOTHING), _file(NOTHING), _dir(NOTHING, "parent /c/a"), _dir(CEPH_KERNEL_DIR, "parent /c")
    )
    assert (got.stripe_unit_bytes, got.source) == (MiB, "ceph.dir.layout of parent /c")
    assert _striping("cephfs", _dir(NOTHING)) == Striping()


def test_the_candidates_are_asked_lazily_and_stop_at_the_first_answer() -> None:
    asked: list[str] = []

    def candidates() -> Iterator[Candidate]:
        for label, answers in (("directory /c", CEPH_ROOT), ("parent /", CEPH_ROOT)):
            asked.append(label)
            yield _dir(answers, label)

    striping_for("cephfs", candidates(), block_bytes=4096, io_block_bytes=4096)
    assert asked == ["directory /c"]


@pytest.mark.parametrize(
    "answers",
    [
        {"ceph.dir.layout.json": b"{not json"},
        {"ceph.dir.layout.json": b"[1, 2]"},
        {"ceph.dir.layout.json": b"[" * 3000},  # deeper than the parser's recursion
        {
            "ceph.dir.layout.json": b'{"stripe_unit": 4194304, "stripe_count": 1, "object_size": 4194304, "x": "'
            + b"y" * 5000
            + b'"}'
        },  # longer than any layout's
        {"ceph.dir.layout.json": b'{"stripe_unit": "4194304", "stripe_count": 1, "object_size": 4194304}'},
        {"ceph.dir.layout.json": b'{"stripe_unit": true, "stripe_count": 1, "object_size": 4194304}'},
        {"ceph.dir.layout.json": b'{"stripe_unit": 0, "stripe_count": 1, "object_size": 4194304}'},
        {"ceph.dir.layout.json": b'{"stripe_unit": 4194304, "stripe_count": -1, "object_size": 4194304}'},
        {"ceph.dir.layout.json": b'{"stripe_unit": 3000000, "stripe_count": 1, "object_size": 4194304}'},  # no divisor
        {"ceph.dir.layout.json": b'{"stripe_unit": 8589934592, "stripe_count": 1, "object_size": 8589934592}'},
        {"ceph.dir.layout": b"stripe_unit=4194304 stripe_count=1"},  # no object size
        {"ceph.dir.layout": b"stripe_unit=4MiB stripe_count=1 object_size=4194304"},
        {"ceph.dir.layout": b"=== \xff\xfe stripe_unit==1"},
        {"ceph.dir.layout.stripe_unit": b"4194304", "ceph.dir.layout.stripe_count": b"1"},  # a field missing
        {"ceph.dir.layout." + k: b"9" * 40 for k in ("stripe_unit", "stripe_count", "object_size")},
    ],
)
def test_an_odd_ceph_answer_is_ignored(answers: dict[str, bytes]) -> None:
    assert ceph_striping(answers.get, True) is None
    assert _striping("cephfs", _dir(answers), _file(CEPH_FILE)).stripe_unit_bytes == MiB  # the next one answers


def test_an_odd_json_falls_back_to_the_text_form() -> None:
    answers = {"ceph.dir.layout.json": b'{"stripe_unit": 0}', "ceph.dir.layout": CEPH_ROOT["ceph.dir.layout"]}
    got = ceph_striping(answers.get, True)
    assert got is not None and got.source == "ceph.dir.layout"


def test_an_unprintable_pool_name_is_left_out() -> None:
    answers = {"ceph.dir.layout": b"stripe_unit=4194304 stripe_count=1 object_size=4194304 pool=a\x1b[2Jb"}
    got = ceph_striping(answers.get, True)
    assert got is not None and got.details == ()


# --- Lustre: lustre.lov values, one field a line (little-endian, as on x86-64 and aarch64) ------------
LOV_V1 = bytes.fromhex(
    "d00bd10b"  # lmm_magic LOV_USER_MAGIC_V1
    "01000000"  # lmm_pattern RAID0
    "0000000000000000 0000000000000000"  # lmm_oi
    "00001000"  # lmm_stripe_size 1 MiB
    "0400"  # lmm_stripe_count 4
    "ffff"  # lmm_stripe_offset -1 (any)
)
LOV_V3 = bytes.fromhex(
    "d00bd30b"  # LOV_USER_MAGIC_V3
    "01000000"
    "0000000000000000 0000000000000000"
    "00004000"  # 4 MiB
    "0100"  # 1 stripe
    "0300"  # on OST 3
    "666c617368000000 0000000000000000"  # lmm_pool_name "flash"
    "0000000000000000 0000000000000000 0000000003000000"  # lmm_objects[0] (a file's)
)
LOV_PFL = bytes.fromhex(
    "d00bd60b"  # lcm_magic LOV_USER_MAGIC_COMP_V1
    "c0000000"  # lcm_size 192
    "01000000"  # lcm_layout_gen
    "0000 0200 0000"  # lcm_flags, lcm_entry_count 2, lcm_mirror_count
    "000000000000 0000000000000000"  # padding
    # lcm_entries[0]: id 1, flags 0, extent [0, 64 MiB), blob at 128, 32 bytes, gen, timestamp, padding
    "01000000 00000000 0000000000000000 0000000400000000 80000000 20000000 00000000 0000000000000000 00000000"
    # lcm_entries[1]: id 2, extent [64 MiB, EOF), blob at 160, 32 bytes
    "02000000 00000000 0000000400000000 ffffffffffffffff a0000000 20000000 00000000 0000000000000000 00000000"
    # the components: v1, 1 MiB x 1 stripe; v1, 4 MiB x every OST
    "d00bd10b 01000000 0000000000000000 0000000000000000 00001000 0100 ffff"
    "d00bd10b 01000000 0000000000000000 0000000000000000 00004000 ffff ffff"
)
# the same, its first component Data-on-MDT (pattern 0x100, 1 MiB on the MDT, no stripes)
LOV_PFL_DOM = LOV_PFL[:128] + bytes.fromhex("d00bd10b 00010000") + LOV_PFL[136:]


def test_lustre_v1() -> None:
    got = lustre_striping(LOV_V1)
    assert got is not None and (got.stripe_unit_bytes, got.stripe_count, got.object_bytes) == (MiB, 4, None)
    assert dict(got.details) == {"pattern": "0x1", "stripe_offset": "any"}


def test_lustre_v3_with_its_pool() -> None:
    got = lustre_striping(LOV_V3)
    assert got is not None and (got.stripe_unit_bytes, got.stripe_count) == (4 * MiB, 1)
    assert dict(got.details) == {"pattern": "0x1", "pool": "flash", "stripe_offset": "3"}


def test_lustre_pfl_takes_its_first_component_and_says_so() -> None:
    got = lustre_striping(LOV_PFL, "lustre.lov of directory /l")
    assert got is not None and (got.stripe_unit_bytes, got.stripe_count) == (MiB, 1)
    assert "component 1 of 2" in got.source and "[0, 67108864)" in got.source and "PFL" in got.source


def test_lustre_pfl_passes_over_a_data_on_mdt_component() -> None:
    got = lustre_striping(LOV_PFL_DOM)
    assert got is not None and got.stripe_unit_bytes == 4 * MiB and got.stripe_count is None
    assert "component 1 (data on the MDT) passed over" in got.source and "every OST" in got.source


def test_lustre_defaults_and_every_ost() -> None:
    default = LOV_V1[:24] + bytes.fromhex("00000000 0000 ffff")  # size 0, count 0: the file system's
    got = lustre_striping(default)
    assert got is not None and (got.stripe_unit_bytes, got.stripe_count) == (None, None)
    assert (
        "stripe size: the file system's default" in got.source
        and "stripe count: the file system's default" in got.source
    )


def test_lustre_in_the_other_byte_order() -> None:
    swapped = b"".join(
        struct.pack(">" + f, *struct.unpack_from("<" + f, LOV_V1, o)) for f, o in (("II", 0), ("QQ", 8), ("IHH", 24))
    )
    got = lustre_striping(swapped)
    assert got is not None and (got.stripe_unit_bytes, got.stripe_count) == (MiB, 4)


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\xd0\x0b",
        LOV_V1[:31],  # short of a header
        bytes.fromhex("d00bda0b") + bytes(60),  # LOV_MAGIC_FOREIGN: not striping
        b"\x00" * 64,
        LOV_V1[:24] + bytes.fromhex("01000100 0400 ffff"),  # stripe size not a multiple of 64 KiB
        LOV_V1[:24] + bytes.fromhex("00001000 feff ffff"),  # an insane stripe count (65534)
        LOV_PFL[:4] + struct.pack("<I", 4096) + LOV_PFL[8:],  # lcm_size beyond the value
        LOV_PFL[:14] + struct.pack("<H", 500) + LOV_PFL[16:],  # more entries than fit
        LOV_PFL[:14] + struct.pack("<H", 0) + LOV_PFL[16:],  # none
        LOV_PFL[:56] + struct.pack("<I", 190) + LOV_PFL[60:],  # a component beyond the end
        LOV_PFL[:56] + struct.pack("<I", 8) + LOV_PFL[60:],  # a component inside the header
        LOV_PFL[:128] + b"\xde\xad\xbe\xef" + LOV_PFL[132:],  # a component that is no lov_user_md
    ],
)
def test_an_odd_lustre_value_is_ignored(value: bytes) -> None:
    assert lustre_striping(value) is None


@given(st.binary(max_size=512))
def test_any_bytes_read_as_a_lustre_layout_without_raising(value: bytes) -> None:
    got = lustre_striping(value)
    assert got is None or got.stripe_unit_bytes is None or got.stripe_unit_bytes % 65536 == 0


@given(st.binary(max_size=200), st.sampled_from(["ceph.dir.layout.json", "ceph.dir.layout"]))
def test_any_bytes_read_as_a_ceph_layout_without_raising(value: bytes, name: str) -> None:
    got = ceph_striping({name: value}.get, True)
    assert got is None or (got.object_bytes or 0) % (got.stripe_unit_bytes or 1) == 0


def test_a_lustre_directory_then_a_file_then_st_blksize() -> None:
    got = _striping("lustre", _dir({"lustre.lov": LOV_V3}))
    assert got.stripe_unit_bytes == 4 * MiB and got.source == "lustre.lov of directory /c"
    got = _striping("lustre", _dir(NOTHING), _file({"lustre.lov": LOV_V1}))
    assert got.stripe_count == 4 and got.source == "lustre.lov of the probe file"
    got = _striping("lustre", _dir({"lustre.lov": b"junk"}), io_block=2 * MiB)
    assert (got.stripe_unit_bytes, got.stripe_count) == (2 * MiB, None) and "st_blksize" in got.source
    assert _striping("lustre", _dir(NOTHING), io_block=3000) == Striping()  # not a block size


# --- GPFS, GlusterFS, NFS, and the rest --------------------------------------------------------------


def test_gpfs_stripes_over_its_block_size() -> None:
    got = _striping("gpfs", _dir(NOTHING), block=16 * MiB, io_block=16 * MiB)
    assert (got.stripe_unit_bytes, got.stripe_count, got.source) == (
        16 * MiB,
        None,
        "statvfs f_bsize (GPFS's block size)",
    )
    got = _striping("gpfs", _dir(NOTHING), block=1000, io_block=8 * MiB)
    assert (got.stripe_unit_bytes, got.source) == (8 * MiB, "st_blksize (GPFS's block size)")
    assert _striping("gpfs", _dir(NOTHING), block=1000, io_block=1000) == Striping()


# what GlusterFS 10.3 answered here: a one-brick volume's mount root, and a directory of a two-brick
# distribute volume
GLUSTER_ONE = b"<POSIX(/tmp/detect/gluster/brick1):vm:/tmp/detect/gluster/brick1/>\x00"
GLUSTER_TWO = (
    b"((<DISTRIBUTE:detectgv2-dht> <POSIX(/tmp/detect/gluster/b2a):vm:/tmp/detect/gluster/b2a/d> "
    b"<POSIX(/tmp/detect/gluster/b2b):vm:/tmp/detect/gluster/b2b/d>) (detectgv2-dht-layout "
    b"(detectgv2-client-0 2147483647 4294967295) (detectgv2-client-1 0 2147483646)))\x00"
)


def test_glusterfs_shows_its_bricks_and_no_stripes() -> None:
    got = _striping("glusterfs", _dir({"glusterfs.pathinfo": GLUSTER_TWO}))
    assert (got.stripe_unit_bytes, got.stripe_count, got.object_bytes) == (None, None, None)
    assert dict(got.details) == {"bricks": "2", "translators": "DISTRIBUTE"}
    got = _striping("glusterfs", _dir({"trusted.glusterfs.pathinfo": GLUSTER_ONE}))
    assert got.details == (("bricks", "1"),)
    assert gluster_details(b"\xff" * 100) == () and _striping("glusterfs", _dir(NOTHING)) == Striping()


def test_nfs_transfer_sizes_from_the_mount_options() -> None:
    (mount,) = parse_mountinfo(
        "61 27 0:52 / /mnt/nfs rw,relatime - nfs4 fs1:/export rw,vers=4.2,rsize=1048576,wsize=524288,hard,proto=tcp"
    )
    got = _striping("nfs", _dir(NOTHING), mount=mount)
    assert dict(got.details) == {"rsize": "1048576", "wsize": "524288", "vers": "4.2"}
    assert got.stripe_unit_bytes is None
    odd = Mount("/m", "nfs", options=("rsize=lots", "wsize=0", "vers=" + "9" * 40))
    assert nfs_details(odd) == ()


@pytest.mark.parametrize("family", ["local", "memory", "unknown", "beegfs"])
def test_other_families_have_no_layout(family: str) -> None:
    assert _striping(family, _dir(CEPH_ROOT | {"lustre.lov": LOV_V1})) == Striping()


# --- probe_fs with recorded answers: what it reads, where, and that it writes nothing else -------------


class _System:
    """A file system's answers to getxattr (on the directory by path, on the probe file by descriptor)
    and its setxattr calls, for probe_fs."""

    def __init__(self, on_dir: dict[str, bytes], on_file: dict[str, bytes], set_error: int | None = None) -> None:
        self.on_dir, self.on_file, self.set_error = on_dir, on_file, set_error
        self.set: list[tuple[str, bytes]] = []

    def getxattr(self, target: object, name: str, **kw: object) -> bytes:
        got = (self.on_file if isinstance(target, int) else self.on_dir).get(name)
        if got is None:
            raise OSError(errno.ENODATA, "No data available")
        return got

    def setxattr(self, target: object, name: str, value: bytes, *a: object, **kw: object) -> None:
        assert isinstance(target, int), "only the probe file's layout is ever set"
        if self.set_error is not None:
            raise OSError(self.set_error, os.strerror(self.set_error))
        self.set.append((name, value))


def _on(monkeypatch: pytest.MonkeyPatch, path: Path, mountinfo: str, magic: int, system: _System) -> None:
    monkeypatch.setattr(fsutil, "locate", lambda d: place(str(path), mountinfo, magic))
    monkeypatch.setattr(os, "getxattr", system.getxattr)
    monkeypatch.setattr(os, "setxattr", system.setxattr)


LUSTRE_LINE = "70 27 0:60 / {} rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,flock,lazystatfs"
CEPH_LINE = "42 27 0:39 / {} rw,nosuid,nodev,relatime - fuse.ceph-fuse ceph-fuse rw,user_id=0,group_id=0,allow_other"


def test_probe_fs_on_lustre_reads_the_directorys_striping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _on(monkeypatch, tmp_path, LUSTRE_LINE.format(tmp_path), 0x0BD00BD0, _System({"lustre.lov": LOV_V3}, {}))
    probe = fsutil.probe_fs_explained(tmp_path, writable=True)
    f = probe.facts
    assert (f.fs_type, f.family, f.mount_point) == ("lustre", "lustre", str(tmp_path))
    assert (f.stripe_unit_bytes, f.stripe_count, f.object_bytes, f.layout_settable) == (4 * MiB, 1, None, True)
    assert probe.sources["stripe_unit_bytes"] == f"lustre.lov of directory {tmp_path}"
    assert dict(probe.details)["pool"] == "flash" and dict(probe.details)["statfs_magic"] == "0xbd00bd0 (lustre)"
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_probe_fs_on_cephfs_takes_the_probe_files_layout_and_sets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = _System({}, CEPH_FILE)  # the directory answers nothing (a client before Ceph 15)
    _on(monkeypatch, tmp_path, CEPH_LINE.format(tmp_path), FUSE_MAGIC, system)
    probe = fsutil.probe_fs_explained(tmp_path, writable=True)
    f = probe.facts
    assert (f.family, f.stripe_unit_bytes, f.stripe_count, f.object_bytes) == ("cephfs", MiB, 4, 4 * MiB)
    assert probe.sources["object_bytes"] == "ceph.file.layout of the probe file"
    assert system.set == [("ceph.file.layout.stripe_count", b"4")]  # to what it was, on the probe file
    assert f.layout_settable and probe.sources["layout_settable"] == "the probe file's layout was set"
    assert os.listdir(tmp_path) == []


def test_a_ceph_client_that_may_not_set_layouts_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _on(monkeypatch, tmp_path, CEPH_LINE.format(tmp_path), FUSE_MAGIC, _System(CEPH_ROOT, CEPH_FILE, errno.EPERM))
    probe = fsutil.probe_fs_explained(tmp_path, writable=True)
    assert not probe.facts.layout_settable and "could not be set" in probe.sources["layout_settable"]
    assert probe.facts.stripe_count == 1  # the directory's layout, which answered first


def test_a_read_only_probe_on_cephfs_sets_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data.bin").write_bytes(b"x" * 4096)
    system = _System(CEPH_ROOT, CEPH_FILE)
    _on(monkeypatch, tmp_path, CEPH_LINE.format(tmp_path), FUSE_MAGIC, system)
    before = sorted(os.listdir(tmp_path))
    probe = fsutil.probe_fs_explained(tmp_path, writable=False, sample=tmp_path / "data.bin")
    assert system.set == [] and sorted(os.listdir(tmp_path)) == before
    assert probe.facts.layout_settable and "not tried" in probe.sources["layout_settable"]
    assert probe.facts.stripe_unit_bytes == 4 * MiB


def test_probe_fs_ignores_hostile_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hostile = {"lustre.lov": b"\xd0\x0b\xd6\x0b" + b"\xff" * 60, "ceph.dir.layout.json": b"{" * 5000}
    _on(monkeypatch, tmp_path, LUSTRE_LINE.format(tmp_path), 0x0BD00BD0, _System(hostile, hostile))
    f = fsutil.probe_fs(tmp_path, writable=True)
    assert f.family == "lustre" and f.stripe_count is None
    assert f.stripe_unit_bytes in (None, f.io_block_bytes)  # st_blksize, where it is a block size
