"""A new data file's layout on a parallel file system that lets its writer choose one: what is set, the
bytes that set it, and the facts the geometry then sizes for.

Two file systems take a layout from a client, each through an extended attribute:

* **CephFS** (kernel client and ``ceph-fuse``): ``ceph.file.layout`` on a new, empty file, as the
  combined form ``stripe_unit=N stripe_count=N object_size=N`` (one ``setxattr``, so that no half-set
  layout is ever invalid; the object size must be a multiple of the stripe unit, and a file that holds
  a byte can no longer change). Set on each data file right after it is created, before anything else
  (``posix_fallocate`` included) touches it.
* **Lustre**: ``lustre.lov`` on a directory, a ``lov_user_md_v1`` (the bytes ``lfs setstripe DIR``
  sends): the directory's default striping, which every file created in it afterwards takes. A file's
  own layout is fixed when it is created (a ``lustre.lov`` on an existing file is silently ignored), so
  the writer sets it on its scratch directory before creating the data file there.

Any other file system has no such attribute: asking for a layout there is refused when the tier is
built (:func:`check_settable`), and so is one the file system turns down then (a probe file); a
refusal while a copy starts fails that copy (:func:`set_layout`), naming the tier, the file and the
layout. None falls back silently: the geometry is sized for the layout asked for, and a file with
another would be written in the wrong sizes.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tierckpt.io.geometry import FsFacts

__all__ = [
    "CEPH_XATTR",
    "LUSTRE_XATTR",
    "SETTABLE",
    "FileLayout",
    "check_settable",
    "layout_xattr",
    "lov_user_md_v1",
    "probe_layout",
    "set_layout",
    "with_layout",
]

CEPH_XATTR = "ceph.file.layout"
LUSTRE_XATTR = "lustre.lov"
#: the file-system families (:attr:`FsFacts.family`) whose files take a layout from the writer
SETTABLE = ("cephfs", "lustre")
_LOV_USER_MAGIC_V1 = 0x0BD10BD0
_LOV_PATTERN_RAID0 = 0x001
_STRIPE_OFFSET_ANY = 0xFFFF  # -1: the MDS chooses the first OST
_LOV_USER_MD_V1 = struct.Struct("<IIQQIHH")  # magic, pattern, lmm_oi (id, seq), stripe size, count, offset

Setxattr = Callable[[int | str, str, bytes], None]


@dataclass(frozen=True)
class FileLayout:
    """The layout a tier sets on its new data files (its ``file_layout`` option).

    Attributes:
        stripe_unit_bytes: bytes written to one target before the next (a multiple of 64 KiB).
        stripe_count: the targets a stripe spans.
        object_bytes: CephFS's object size (a multiple of the stripe unit; None: the stripe unit's
            smallest multiple of at least 4 MiB). Lustre has none: it must be None there.
    """

    stripe_unit_bytes: int
    stripe_count: int = 1
    object_bytes: int | None = None

    def describe(self) -> str:
        obj = "" if self.object_bytes is None else f", object size {self.object_bytes}"
        return f"stripe unit {self.stripe_unit_bytes}, stripe count {self.stripe_count}{obj}"


def _ceph_object_bytes(layout: FileLayout) -> int:
    unit = layout.stripe_unit_bytes
    return layout.object_bytes or -(-(4 << 20) // unit) * unit


def lov_user_md_v1(layout: FileLayout) -> bytes:
    """The 32 bytes of a ``struct lov_user_md_v1`` (little-endian, packed) for ``layout``: RAID0, the
    stripe size and count, any first OST."""
    return _LOV_USER_MD_V1.pack(
        _LOV_USER_MAGIC_V1, _LOV_PATTERN_RAID0, 0, 0, layout.stripe_unit_bytes, layout.stripe_count, _STRIPE_OFFSET_ANY
    )


def layout_xattr(family: str, layout: FileLayout) -> tuple[str, bytes]:
    """The extended attribute (name, value) that sets ``layout`` on a file system of ``family``.

    Raises:
        ValueError: the family takes no layout from a client, or the layout is not one it takes.
    """
    if family == "cephfs":
        value = f"stripe_unit={layout.stripe_unit_bytes} stripe_count={layout.stripe_count} "
        return CEPH_XATTR, (value + f"object_size={_ceph_object_bytes(layout)}").encode()
    if family == "lustre":
        if layout.object_bytes is not None:
            raise ValueError("a Lustre file has no object size: give a stripe unit and count only")
        return LUSTRE_XATTR, lov_user_md_v1(layout)
    raise ValueError(f"a {family} file system takes no file layout from a client (CephFS and Lustre do)")


def check_settable(facts: FsFacts, layout: FileLayout) -> None:
    """Whether a file system of these facts can take ``layout`` from its writer.

    Raises:
        ValueError: saying why not (its family, an object size on Lustre).
    """
    if facts.family not in SETTABLE:
        kind = facts.fs_type or facts.family
        raise ValueError(
            f"the file system there ({kind}) takes no file layout from a client (CephFS and Lustre do); "
            "to size for stripes it has, give io.stripe_unit / stripe_count / object_size instead"
        )
    layout_xattr(facts.family, layout)


def with_layout(facts: FsFacts, layout: FileLayout | None) -> FsFacts:
    """The facts of the files a writer that sets ``layout`` makes (None: ``facts`` as they are)."""
    if layout is None:
        return facts
    obj = _ceph_object_bytes(layout) if facts.family == "cephfs" else None
    return replace(
        facts, stripe_unit_bytes=layout.stripe_unit_bytes, stripe_count=layout.stripe_count, object_bytes=obj
    )


def set_layout(
    family: str, target: int | str | os.PathLike[str], layout: FileLayout, setxattr: Setxattr | None = None
) -> None:
    """Set ``layout`` on ``target``: on CephFS a new, empty data file (its descriptor or path); on Lustre
    the directory its data files will be created in.

    Args:
        family: the file system's family (:attr:`FsFacts.family`).
        target: the file or directory (see above).
        layout: what to set.
        setxattr: ``os.setxattr`` (tests pass a recorder).

    Raises:
        OSError: the file system refused it (EOPNOTSUPP, EINVAL, EPERM ...), as ``os.setxattr`` raises.
        ValueError: the family takes no layout (see :func:`layout_xattr`).
    """
    name, value = layout_xattr(family, layout)
    (setxattr or os.setxattr)(target if isinstance(target, int) else os.fspath(target), name, value)


def probe_layout(directory: Path, family: str, layout: FileLayout, setxattr: Setxattr | None = None) -> None:
    """Set ``layout`` once on a probe in ``directory`` (a new empty file on CephFS, a new directory on
    Lustre), then remove it: a tier learns when it is built whether its file system takes the layout.

    Raises:
        OSError: the file system refused it, or the probe could not be made.
    """
    probe = directory / f".tierckpt-layout-{os.getpid()}-{secrets.token_hex(8)}"
    if family == "lustre":
        probe.mkdir(mode=0o700)
        try:
            set_layout(family, probe, layout, setxattr)
        finally:
            probe.rmdir()
        return
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        set_layout(family, fd, layout, setxattr)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
