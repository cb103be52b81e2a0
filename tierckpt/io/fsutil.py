"""File-system facts and durable-publish helpers: the facts of a tier's file system (:func:`probe_fs`:
block sizes, O_DIRECT and its alignment from statx, a read-only mount), fsync of directories."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from tierckpt.io.geometry import PAGE, FsFacts

__all__ = ["dio_alignment", "fsync_dir", "probe_fs"]

log = logging.getLogger(__name__)

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_PROBE_TRIES = 8  # names of a probe file tried before giving up (each one random: taken only if planted)


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


def _statx_dio(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(memory, offset) alignment O_DIRECT needs for ``path`` (statx ``STATX_DIOALIGN``); None where the
    kernel or the file system does not say."""
    statx = getattr(_libc, "statx", None)
    if statx is None:
        return None
    st = _Statx()
    if statx(_AT_FDCWD, os.fsencode(path), _AT_SYMLINK_NOFOLLOW, _STATX_DIOALIGN, ctypes.byref(st)) != 0:
        return None
    if not st.stx_mask & _STATX_DIOALIGN or not st.stx_dio_offset_align:
        return None
    return st.stx_dio_mem_align, st.stx_dio_offset_align


def dio_alignment(path: str | os.PathLike[str], default: int = PAGE) -> tuple[int, int]:
    """(memory alignment, offset alignment) that O_DIRECT needs for ``path``, from statx(STATX_DIOALIGN).

    Returns ``(default, default)`` where the kernel or file system does not report it.
    """
    return _statx_dio(path) or (default, default)


def probe_fs(directory: Path, *, writable: bool, sample: Path | None = None) -> FsFacts:
    """The facts of the file system holding ``directory`` (:class:`~tierckpt.io.geometry.FsFacts`).

    Whether files there take O_DIRECT is learnt by creating and removing a probe file where ``writable``
    and the file system is not mounted read-only; otherwise without writing anything: by opening
    ``sample`` (an existing regular file there; a link is not followed, a FIFO never blocks) with
    O_DIRECT, and with no sample, O_DIRECT is not used (buffered reads work everywhere).

    Raises:
        OSError: the probe file cannot be created (for another reason than O_DIRECT refused).
    """
    try:
        vfs = os.statvfs(directory)
        block, readonly = vfs.f_bsize, bool(vfs.f_flag & os.ST_RDONLY)
    except OSError:
        block, readonly = PAGE, False
    try:
        io_block = os.stat(directory).st_blksize
    except OSError:
        io_block = PAGE
    if writable and not readonly:
        direct, align = _probe_new_file(directory)
    elif sample is not None:
        direct, align = _probe_existing_file(sample)
    else:
        direct, align = False, None
    mem, off = align or (None, None)
    return FsFacts(block, io_block, direct, mem, off, readonly)


def _probe_new_file(directory: Path) -> tuple[bool, tuple[int, int] | None]:
    """(O_DIRECT works, its statx alignment) for a file created in ``directory``, then removed.

    The probe is a new file of a name no one can guess, created exclusively (``O_EXCL``: whatever is at
    that name already, a link included, is neither followed nor truncated; another name is tried) and
    never through a link (``O_NOFOLLOW``).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | _O_DIRECT
    for _ in range(_PROBE_TRIES):
        probe = directory / f".tierckpt-probe-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(probe, flags, 0o600)
        except FileExistsError:
            continue  # not ours: left alone
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                # refused O_DIRECT; a file system that creates the file first leaves it: ours, removed
                probe.unlink(missing_ok=True)
                return False, None
            raise
        try:
            return hasattr(os, "O_DIRECT"), _statx_dio(probe)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    raise FileExistsError(errno.EEXIST, f"{_PROBE_TRIES} probe file names were taken", str(directory))


def _probe_existing_file(sample: Path) -> tuple[bool, tuple[int, int] | None]:
    """(O_DIRECT works, its statx alignment) for the regular file ``sample``, opened for reading only;
    (False, None) where it cannot be opened so or is no regular file."""
    try:
        fd = os.open(sample, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return False, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False, None
        return hasattr(os, "O_DIRECT"), _statx_dio(sample)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
