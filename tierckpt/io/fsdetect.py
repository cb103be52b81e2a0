"""What file system a path is on: its mount (``/proc/self/mountinfo``), its ``statfs`` magic, and the
family they name (the kind of storage, for sizing: ``cephfs``, ``lustre``, ``local`` ...).

Pure functions over recorded answers (:func:`parse_mountinfo`, :func:`find_mount`, :func:`decide_family`,
:func:`place`), so tests feed what a Lustre or GPFS client once said, and thin readers of this machine
(:func:`read_mountinfo`, :func:`statfs_magic`, :func:`locate`). Every input is bounded; a line or value
that makes no sense is skipped with a debug log, never an exception.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FUSE_MAGIC",
    "MAGICS",
    "SHARED_FAMILIES",
    "TYPES",
    "Mount",
    "Place",
    "decide_family",
    "find_mount",
    "locate",
    "parse_mountinfo",
    "place",
    "read_mountinfo",
    "statfs_magic",
]

log = logging.getLogger(__name__)

FUSE_MAGIC = 0x65735546  #: every FUSE file system's magic: the mount's subtype (``fuse.X``) says which
#: ``statfs`` ``f_type`` magic numbers (linux/magic.h and the file systems' own headers): (name, family)
MAGICS: Mapping[int, tuple[str, str]] = {
    0xEF53: ("ext2/3/4", "local"),
    0x58465342: ("xfs", "local"),
    0x9123683E: ("btrfs", "local"),
    0x2FC12FC1: ("zfs", "local"),
    0xF2F52010: ("f2fs", "local"),
    0xCA451A4E: ("bcachefs", "local"),
    0x794C7630: ("overlay", "local"),
    0x01021994: ("tmpfs", "memory"),
    0x858458F6: ("ramfs", "memory"),
    0x6969: ("nfs", "nfs"),
    0x0BD00BD0: ("lustre", "lustre"),
    0x47504653: ("gpfs", "gpfs"),
    0x00C36400: ("ceph", "cephfs"),
    0x19830326: ("beegfs", "beegfs"),
    FUSE_MAGIC: ("fuse", ""),  # no family of its own
}
_DISKS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "overlay", "vfat", "exfat", "ntfs3")
#: mount types (``/proc/self/mountinfo``'s, FUSE subtypes as ``fuse.X``) and their family
TYPES: Mapping[str, str] = {
    **dict.fromkeys(_DISKS, "local"),
    "fuseblk": "local",  # a disk behind FUSE (ntfs-3g)
    **dict.fromkeys(("tmpfs", "ramfs"), "memory"),
    **dict.fromkeys(("nfs", "nfs4"), "nfs"),
    **dict.fromkeys(("ceph", "fuse.ceph-fuse", "fuse.ceph"), "cephfs"),
    **dict.fromkeys(("glusterfs", "fuse.glusterfs"), "glusterfs"),
    **{name: name for name in ("lustre", "gpfs", "beegfs")},
}
#: families of file systems that many nodes mount at once (``tierckpt probe``'s default kind there: pfs)
SHARED_FAMILIES = frozenset({"cephfs", "glusterfs", "lustre", "gpfs", "nfs", "beegfs"})

_MAX_MOUNTINFO = 8 << 20  # bytes of /proc/self/mountinfo read (a host with 30,000 mounts has ~4 MiB)
_MAX_LINE = 64 << 10  # a longer line is no mount's
_OCTAL = re.compile(rb"\\([0-3][0-7]{2})")


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mountinfo``.

    Attributes:
        mount_point: where it is mounted (octal escapes such as ``\\040`` undone).
        fs_type: its type (``ext4``, ``fuse.ceph-fuse``, ``nfs4`` ...).
        source: what is mounted (a device, ``host:/export``, ``ceph-fuse`` ...).
        device: its ``major:minor``, as ``st_dev`` of the files on it shows them (None: unreadable).
        options: its per-mount options, then its file system's (``rw``, ``rsize=1048576`` ...).
    """

    mount_point: str
    fs_type: str
    source: str = ""
    device: tuple[int, int] | None = None
    options: tuple[str, ...] = ()

    def option(self, name: str) -> str | None:
        """The value of option ``name`` (``rsize`` of ``rsize=1048576``; ``""`` for a bare flag), the
        file system's taking precedence; None where it is not given."""
        for opt in reversed(self.options):
            key, eq, value = opt.partition("=")
            if key == name:
                return value if eq else ""
        return None


@dataclass(frozen=True)
class Place:
    """Where a path is: its mount, type and family, and why (see :func:`place`).

    Attributes:
        fs_type: the mount's type (empty: no mount found).
        family: the family (``unknown`` where neither answer names one).
        mount_point: the mount point (empty: no mount found).
        magic: the ``statfs`` magic (None: not read).
        mount: the mount's line (None: not found).
        why: which answer gave the family, in words (for ``tierckpt probe``).
    """

    fs_type: str = ""
    family: str = "unknown"
    mount_point: str = ""
    magic: int | None = None
    mount: Mount | None = None
    why: str = ""


def _unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` a space, ``\\134`` a backslash) undone."""
    raw = _OCTAL.sub(lambda m: bytes([int(m[1], 8)]), os.fsencode(field))
    return os.fsdecode(raw)


def _device(field: str) -> tuple[int, int] | None:
    major, colon, minor = field.partition(":")
    if len(field) > 24 or not colon or not major.isdigit() or not minor.isdigit():
        return None
    return int(major), int(minor)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/self/mountinfo`` text, in its order (a later one is mounted over an
    earlier one at the same point). A line that is not a mount's (too long, too few fields, no ``-``
    separator) is skipped with a debug log."""
    out = []
    for n, line in enumerate(text[:_MAX_MOUNTINFO].splitlines(), 1):
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            sep = -1
        if len(line) > _MAX_LINE or sep < 0 or len(fields) < sep + 3 or not fields[4].startswith("/"):
            if line.strip():
                log.debug("mountinfo line %d is no mount's: %.200r", n, line)
            continue
        opts = fields[5].split(",") + (fields[sep + 3].split(",") if len(fields) > sep + 3 else [])
        out.append(Mount(
            mount_point=_unescape(fields[4]), fs_type=_unescape(fields[sep + 1]), source=_unescape(fields[sep + 2]),
            device=_device(fields[2]), options=tuple(_unescape(o) for o in opts if o),
        ))  # fmt: skip
    return out


def _under(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def find_mount(mounts: Sequence[Mount], path: str, device: tuple[int, int] | None = None) -> Mount | None:
    """The mount holding the absolute, resolved ``path``: the longest mount point it is under (the last
    listed of equal ones: mounted over the others), among those whose device is ``device`` (``st_dev``
    of the path) where any is; else among all (a btrfs subvolume's files show another device than its
    mount's line)."""
    under = [m for m in mounts if _under(path, m.mount_point)]
    same = [m for m in under if device is not None and m.device == device]
    best = None
    for m in same or under:
        if best is None or len(m.mount_point) >= len(best.mount_point):
            best = m
    return best


def _type_family(fs_type: str) -> str | None:
    return TYPES.get(fs_type)


def decide_family(fs_type: str, magic: int | None) -> tuple[str, str]:
    """The family of a path on a mount of type ``fs_type`` (empty: not found) whose ``statfs`` magic is
    ``magic`` (None: not read), and why, in words.

    The magic comes from the path itself and wins where it names a family: the mount's line was found by
    its path alone. FUSE's magic names no family: the mount's subtype (``fuse.ceph-fuse``) decides, where
    the line is a FUSE mount's. Where the magic is unknown or was not read, the mount's type decides.
    """
    by_type = _type_family(fs_type) if fs_type else None
    named = MAGICS.get(magic) if magic is not None else None
    shown = f"statfs magic {magic:#x}" if magic is not None else ""
    if named is None:
        if by_type is not None:
            why = "no statfs magic" if magic is None else f"{shown} is none this table knows"
            return by_type, f"the mount's type {fs_type!r} ({why})"
        return "unknown", f"neither the mount's type {fs_type!r} nor {shown or 'statfs'} names a family"
    name, family = named
    if magic == FUSE_MAGIC:
        if fs_type.startswith("fuse"):
            return by_type or "unknown", f"{shown} (FUSE) and the mount's subtype {fs_type!r}"
        return (
            "unknown",
            f"{shown} says FUSE but the mount table's line is {fs_type or 'missing'!r}: which FUSE is unknown",
        )
    if by_type is None or by_type == family:
        agree = "" if by_type is None else f", as the mount's type {fs_type!r} says"
        missing = " (no mount found)" if not fs_type else ""
        return family, f"{shown} ({name}){agree}{missing}"
    log.info("statfs says %s (%s) but the mount table says %r; taking %s", shown, name, fs_type, family)
    return family, f"{shown} ({name}), over the mount table's {fs_type!r}: statfs answers for the path itself"


def place(path: str, mountinfo: str | None, magic: int | None, device: tuple[int, int] | None = None) -> Place:
    """Where the resolved ``path`` is, from a ``/proc/self/mountinfo`` text (None: unreadable), its
    ``statfs`` magic and its ``st_dev``: the mount (:func:`find_mount`) and the family
    (:func:`decide_family`)."""
    mount = find_mount(parse_mountinfo(mountinfo), path, device) if mountinfo is not None else None
    fs_type = mount.fs_type if mount is not None else ""
    family, why = decide_family(fs_type, magic)
    return Place(fs_type, family, mount.mount_point if mount is not None else "", magic, mount, why)


# --- readers of this machine -------------------------------------------------------------------------


def read_mountinfo(path: str = "/proc/self/mountinfo") -> str | None:
    """The text of this process's mount table (its first 8 MiB), or None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_MOUNTINFO).decode("utf-8", "surrogateescape")
    except OSError as e:
        log.debug("cannot read %s: %s", path, e)
        return None


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def statfs_magic(path: str | os.PathLike[str]) -> int | None:
    """``statfs(2)``'s ``f_type`` of ``path`` (``os.statvfs`` has none), or None where it fails.

    ``f_type`` is the first field of ``struct statfs``, a ``long`` (x86-64, aarch64, ppc64le, riscv64);
    magics are 32 bits."""
    statfs = getattr(_libc, "statfs", None)
    if statfs is None:
        return None
    buf = ctypes.create_string_buffer(512)  # larger than struct statfs anywhere
    if statfs(os.fsencode(path), buf) != 0:
        log.debug("statfs(%s) failed: %s", path, os.strerror(ctypes.get_errno()))
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def locate(directory: str | os.PathLike[str]) -> Place:
    """Where ``directory`` is on this machine (:func:`place` of its resolved path, this process's mount
    table, its magic and its device)."""
    path = os.path.realpath(directory)
    try:
        st = os.stat(path)
        device: tuple[int, int] | None = (os.major(st.st_dev), os.minor(st.st_dev))
    except OSError:
        device = None
    return place(path, read_mountinfo(), statfs_magic(path), device)
