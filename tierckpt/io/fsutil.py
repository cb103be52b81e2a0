"""File-system facts and durable-publish helpers: O_DIRECT alignment (statx), fsync of directories."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
from pathlib import Path

__all__ = ["dio_alignment", "fsync_dir", "probe_direct"]

log = logging.getLogger(__name__)

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100


class _StatxTimestamp(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32), ("_r", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [
        ("stx_mask", ctypes.c_uint32), ("stx_blksize", ctypes.c_uint32), ("stx_attributes", ctypes.c_uint64),
        ("stx_nlink", ctypes.c_uint32), ("stx_uid", ctypes.c_uint32), ("stx_gid", ctypes.c_uint32),
        ("stx_mode", ctypes.c_uint16), ("_s0", ctypes.c_uint16), ("stx_ino", ctypes.c_uint64),
        ("stx_size", ctypes.c_uint64), ("stx_blocks", ctypes.c_uint64), ("stx_attributes_mask", ctypes.c_uint64),
        ("stx_atime", _StatxTimestamp), ("stx_btime", _StatxTimestamp), ("stx_ctime", _StatxTimestamp),
        ("stx_mtime", _StatxTimestamp), ("stx_rdev_major", ctypes.c_uint32), ("stx_rdev_minor", ctypes.c_uint32),
        ("stx_dev_major", ctypes.c_uint32), ("stx_dev_minor", ctypes.c_uint32), ("stx_mnt_id", ctypes.c_uint64),
        ("stx_dio_mem_align", ctypes.c_uint32), ("stx_dio_offset_align", ctypes.c_uint32),
        ("_spare", ctypes.c_uint64 * 12),
    ]  # fmt: skip


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def dio_alignment(path: str | os.PathLike[str], default: int = 4096) -> tuple[int, int]:
    """(memory alignment, offset alignment) that O_DIRECT needs for ``path``, from statx(STATX_DIOALIGN).

    Returns ``(default, default)`` where the kernel or file system does not report it.
    """
    statx = getattr(_libc, "statx", None)
    if statx is None:
        return default, default
    st = _Statx()
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, ctypes.byref(st)) != 0:
        return default, default
    if not st.stx_mask & _STATX_DIOALIGN or not st.stx_dio_offset_align:
        return default, default
    return st.stx_dio_mem_align, st.stx_dio_offset_align


def probe_direct(directory: Path) -> tuple[bool, int]:
    """Whether files in ``directory`` can be opened with O_DIRECT, and the offset alignment it needs.

    Creates and removes a small probe file.
    """
    probe = directory / f".tierckpt-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False, 4096
        raise
    try:
        mem, off = dio_alignment(probe)
        return hasattr(os, "O_DIRECT"), max(mem, off, 4096)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
