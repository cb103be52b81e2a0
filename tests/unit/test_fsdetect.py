"""Where a path is (tierckpt.io.fsdetect): the mount table parsed, the mount holding a path, and the family
from the mount's type and the statfs magic, with recorded answers of real machines (this one's ext4 disk,
tmpfs, a ceph-fuse and a GlusterFS mount started here) and of clients that cannot run here (Lustre, GPFS,
NFS, the kernel's CephFS client), and garbage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierckpt.io.fsdetect import (
    FUSE_MAGIC,
    Mount,
    decide_family,
    find_mount,
    locate,
    parse_mountinfo,
    place,
    read_mountinfo,
    statfs_magic,
)

# /proc/self/mountinfo of this machine with a ceph-fuse (Ceph 16.2.15) and two GlusterFS (10.3) mounts
# started by hand; /dev/shm is mounted twice, the second over the first
RECORDED = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=12358300k,nr_inodes=3089575,mode=755
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24731708k
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24731708k
42 27 0:39 / /tmp/detect/cephfs rw,nosuid,nodev,relatime - fuse.ceph-fuse ceph-fuse rw,user_id=0,group_id=0,allow_other
43 27 0:40 / /tmp/detect/glmnt rw,relatime - fuse.glusterfs vm:/detectgv rw,user_id=0,group_id=0,default_permissions,allow_other,max_read=131072
"""
# lines of clients that cannot run here, as their documentation and bug reports show them
NFS4 = "61 27 0:52 / /mnt/nfs rw,relatime shared:30 - nfs4 fs1:/export rw,vers=4.2,rsize=1048576,wsize=524288,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.2,local_lock=none,addr=10.0.0.1"
LUSTRE = (
    "70 27 0:60 / /lustre/scratch rw,relatime shared:40 - lustre 10.0.0.1@o2ib:/scratch rw,flock,lazystatfs,encrypt"
)
GPFS = "80 27 0:70 / /gpfs/fs1 rw,relatime shared:50 - gpfs fs1 rw"
CEPH_KERNEL = "90 27 0:80 / /mnt/cephfs rw,relatime - ceph 10.0.0.1:6789:/ rw,name=admin,secret=<hidden>,acl"
XFS = "100 27 259:1 / /scratch rw,noatime - xfs /dev/nvme0n1p1 rw,attr2,inode64,logbufs=8,noquota"


def test_the_recorded_table_parses_into_its_mounts() -> None:
    mounts = parse_mountinfo(RECORDED)
    assert [m.mount_point for m in mounts] == [
        "/proc", "/dev", "/dev/shm", "/", "/dev/shm", "/tmp/detect/cephfs", "/tmp/detect/glmnt",
    ]  # fmt: skip
    ceph = mounts[5]
    assert (ceph.fs_type, ceph.source, ceph.device) == ("fuse.ceph-fuse", "ceph-fuse", (0, 39))
    assert ceph.option("allow_other") == "" and ceph.option("nosuid") == "" and ceph.option("rsize") is None
    assert mounts[6].option("max_read") == "131072"
    assert mounts[3] == Mount(
        "/",
        "ext4",
        "/dev/vda",
        (254, 0),
        ("rw", "relatime", "rw", "discard", "resv_strict", "resuid=65534", "resgid=65534"),
    )


def test_optional_fields_and_octal_escapes() -> None:
    line = r"36 35 98:0 /mnt1 /mnt/my\040disk\134x rw,noatime master:1 shared:2 - fuse.my\040fs src\011tab rw,errors=continue"
    (m,) = parse_mountinfo(line)
    assert m.mount_point == "/mnt/my disk\\x" and m.fs_type == "fuse.my fs" and m.source == "src\ttab"
    assert m.option("errors") == "continue" and m.device == (98, 0)


def test_a_file_systems_option_wins_over_the_mounts_of_the_same_name() -> None:
    (m,) = parse_mountinfo("1 0 8:1 / /x ro,relatime - ext4 /dev/sda1 rw,data=ordered")
    assert m.option("rw") == "" and m.options[0] == "ro"
    assert Mount("/x", "nfs", options=("rsize=4096", "rsize=65536")).option("rsize") == "65536"


@pytest.mark.parametrize(
    "line",
    [
        "",
        "garbage",
        "1 2 3 4 5 6",  # no separator
        "1 2 8:1 / /x rw - ext4",  # no source
        "1 2 8:1 / relative rw - ext4 /dev/x rw",  # a mount point is absolute
        "1 2 8:1 / /x rw - ext4 /dev/x rw " + "y" * (70 << 10),  # longer than any mount's line
    ],
)
def test_a_line_that_is_no_mounts_is_skipped(line: str) -> None:
    assert parse_mountinfo(line + "\n" + XFS) == parse_mountinfo(XFS)


def test_an_odd_device_field_is_no_device() -> None:
    (m,) = parse_mountinfo("1 2 x:y / /x rw - ext4 /dev/x rw")
    assert m.device is None and m.fs_type == "ext4"


@given(st.text(max_size=400))
def test_any_text_parses_without_raising(text: str) -> None:
    for m in parse_mountinfo(text):
        assert m.mount_point.startswith("/")


def _point(path: str) -> str:
    got = find_mount(parse_mountinfo(RECORDED), path)
    assert got is not None
    return got.mount_point


def test_the_longest_mount_point_holds_a_path() -> None:
    assert _point("/tmp/detect/cephfs/ckpt/a") == "/tmp/detect/cephfs"
    assert _point("/tmp/detect/cephfs") == "/tmp/detect/cephfs"
    assert _point("/tmp/detect/cephfs2/x") == "/"  # a mount point is no prefix of a longer name
    assert _point("/work/main") == "/"
    assert find_mount([], "/x") is None


def test_of_two_mounts_at_one_point_the_later_one_holds_it() -> None:
    got = find_mount(parse_mountinfo(RECORDED), "/dev/shm/x")
    assert got is not None and got.device == (0, 27)


def test_the_paths_device_picks_among_mounts_at_one_point() -> None:
    got = find_mount(parse_mountinfo(RECORDED), "/dev/shm/x", device=(0, 23))  # the one underneath
    assert got is not None and got.device == (0, 23)
    # a device no line shows (a btrfs subvolume's): the longest mount point all the same
    got = find_mount(parse_mountinfo(RECORDED), "/tmp/detect/glmnt/x", device=(0, 99))
    assert got is not None and got.fs_type == "fuse.glusterfs"


@pytest.mark.parametrize(
    ("fs_type", "magic", "family"),
    [
        ("ext4", 0xEF53, "local"),
        ("xfs", 0x58465342, "local"),
        ("btrfs", 0x9123683E, "local"),
        ("tmpfs", 0x01021994, "memory"),
        ("ramfs", 0x858458F6, "memory"),
        ("nfs4", 0x6969, "nfs"),
        ("nfs", 0x6969, "nfs"),
        ("lustre", 0x0BD00BD0, "lustre"),
        ("gpfs", 0x47504653, "gpfs"),
        ("ceph", 0x00C36400, "cephfs"),
        ("fuse.ceph-fuse", FUSE_MAGIC, "cephfs"),
        ("fuse.glusterfs", FUSE_MAGIC, "glusterfs"),
        ("beegfs", 0x19830326, "beegfs"),
        ("overlay", 0x794C7630, "local"),
        ("zfs", 0x2FC12FC1, "local"),
        ("fuse.sshfs", FUSE_MAGIC, "unknown"),
        ("fuseblk", FUSE_MAGIC, "local"),  # ntfs-3g: a disk behind FUSE
    ],
)
def test_type_and_magic_agree(fs_type: str, magic: int, family: str) -> None:
    got, why = decide_family(fs_type, magic)
    assert got == family and why


def test_the_magic_wins_over_a_mount_line_that_disagrees() -> None:
    family, why = decide_family("nfs4", 0xEF53)
    assert family == "local" and "over the mount table's 'nfs4'" in why


def test_a_fuse_magic_under_a_line_that_is_no_fuse_mounts_names_no_family() -> None:
    family, why = decide_family("ext4", FUSE_MAGIC)
    assert family == "unknown" and "FUSE" in why


def test_the_type_decides_where_the_magic_is_missing_or_unknown() -> None:
    assert decide_family("lustre", None) == ("lustre", "the mount's type 'lustre' (no statfs magic)")
    assert decide_family("gpfs", 0x1234)[0] == "gpfs"
    assert decide_family("", 0x58465342)[0] == "local"  # no mount found: the magic alone
    family, why = decide_family("weirdfs", 0x1234)
    assert family == "unknown" and "weirdfs" in why and "0x1234" in why
    assert decide_family("", None)[0] == "unknown"


@pytest.mark.parametrize(
    ("line", "path", "magic", "want"),
    [
        (RECORDED, "/tmp/detect/cephfs/ckpt", FUSE_MAGIC, ("fuse.ceph-fuse", "cephfs", "/tmp/detect/cephfs")),
        (RECORDED, "/tmp/detect/glmnt", FUSE_MAGIC, ("fuse.glusterfs", "glusterfs", "/tmp/detect/glmnt")),
        (RECORDED, "/work/x", 0xEF53, ("ext4", "local", "/")),
        (RECORDED, "/dev/shm/x", 0x01021994, ("tmpfs", "memory", "/dev/shm")),
        (NFS4, "/mnt/nfs/ckpt", 0x6969, ("nfs4", "nfs", "/mnt/nfs")),
        (LUSTRE, "/lustre/scratch/u/ckpt", 0x0BD00BD0, ("lustre", "lustre", "/lustre/scratch")),
        (GPFS, "/gpfs/fs1/ckpt", 0x47504653, ("gpfs", "gpfs", "/gpfs/fs1")),
        (CEPH_KERNEL, "/mnt/cephfs/ckpt", 0x00C36400, ("ceph", "cephfs", "/mnt/cephfs")),
        (XFS, "/scratch/ckpt", 0x58465342, ("xfs", "local", "/scratch")),
    ],
)
def test_a_path_placed_from_recorded_answers(line: str, path: str, magic: int, want: tuple[str, str, str]) -> None:
    got = place(path, line, magic)
    assert (got.fs_type, got.family, got.mount_point) == want
    assert got.magic == magic and got.mount is not None and got.why


def test_a_path_without_a_mount_table_is_placed_by_its_magic() -> None:
    got = place("/x", None, 0x0BD00BD0)
    assert (got.fs_type, got.family, got.mount_point, got.mount) == ("", "lustre", "", None)
    assert "no mount found" in got.why


def test_this_machines_disk_is_placed_as_its_mount_table_says(tmp_path: Path) -> None:
    """The real readers: the mount table, statfs and the device agree on where tmp_path is."""
    text = read_mountinfo()
    if text is None:
        pytest.skip("no /proc/self/mountinfo here")
    got = locate(tmp_path)
    st_dev = os.stat(tmp_path).st_dev
    assert got.mount is not None and got.mount.device == (os.major(st_dev), os.minor(st_dev))
    assert got.magic == statfs_magic(tmp_path) and got.magic is not None
    assert got.family != "unknown", got.why  # a disk or a tmpfs, both known
    if got.fs_type in ("ext2", "ext3", "ext4"):  # this machine's disk
        assert (got.magic, got.family) == (0xEF53, "local")
    assert str(tmp_path.resolve()).startswith(got.mount_point)


def test_the_readers_fail_soft(tmp_path: Path) -> None:
    assert statfs_magic(tmp_path / "missing") is None
    assert read_mountinfo(str(tmp_path / "missing")) is None
