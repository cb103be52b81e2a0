"""File-system facts and durable-publish helpers: the facts of a tier's file system (:func:`probe_fs`:
block sizes, O_DIRECT and its alignment from statx, a read-only mount, and from :mod:`~tierckpt.io.fsdetect`
and :mod:`~tierckpt.io.fsstripes` its type, family, mount point and stripe layout), fsync of
directories."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.io.fsdetect import MAGICS, SHARED_FAMILIES, locate
from tierckpt.io.fsstripes import Candidate, candidates, ceph_settable, file_answers, striping_for
from tierckpt.io.geometry import PAGE, FsFacts

__all__ = ["FsProbe", "dio_alignment", "find_sample", "fsync_dir", "probe_fs", "probe_fs_explained"]

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


@dataclass(frozen=True)
class FsProbe:
    """The facts of a directory's file system and where each came from (:func:`probe_fs_explained`).

    Attributes:
        facts: the facts (:class:`~tierckpt.io.geometry.FsFacts`).
        sources: for each of their fields (and ``dio_align``), where its value came from, in words.
        details: what else the file system said (``statfs_magic``; a CephFS or Lustre ``pool``, a Lustre
            ``pattern``, GlusterFS ``bricks``, NFS ``rsize`` and ``wsize`` ...), as (name, value) text.
    """

    facts: FsFacts
    sources: Mapping[str, str]
    details: tuple[tuple[str, str], ...] = ()


@dataclass
class _FileSeen:
    """What the probe file (or the sample) showed while it was open."""

    label: str
    answers: dict[str, bytes] = field(default_factory=dict)
    settable: bool | None = None


def probe_fs(directory: Path, *, writable: bool, sample: Path | None = None) -> FsFacts:
    """The facts of the file system holding ``directory`` (:class:`~tierckpt.io.geometry.FsFacts`).

    Whether files there take O_DIRECT is learnt by creating and removing a probe file where ``writable``
    and the file system is not mounted read-only; otherwise without writing anything: by opening
    ``sample`` (an existing regular file there; a link is not followed, a FIFO never blocks) with
    O_DIRECT, and with no sample, O_DIRECT is not used (buffered reads work everywhere). The file
    system's type, family and layout are read from the mount table, ``statfs`` and extended attributes
    of the directory, of that file and (CephFS) of the directory's parents (:mod:`tierckpt.io.fsdetect`,
    :mod:`tierckpt.io.fsstripes`); on CephFS the probe file's layout is set to what it is, to learn
    whether this client may set layouts. Nothing else is written.

    Raises:
        OSError: the probe file cannot be created (for another reason than O_DIRECT refused).
    """
    return probe_fs_explained(directory, writable=writable, sample=sample).facts


def probe_fs_explained(directory: Path, *, writable: bool, sample: Path | None = None) -> FsProbe:
    """:func:`probe_fs`'s facts, with where each came from (for ``tierckpt probe``).

    Raises:
        OSError: the probe file cannot be created (for another reason than O_DIRECT refused).
    """
    where = locate(directory)
    sources = {
        "fs_type": f"/proc/self/mountinfo, the mount at {where.mount_point}" if where.mount else "no mount found",
        "mount_point": "/proc/self/mountinfo: the longest mount point over the resolved path",
        "family": where.why,
    }
    block, io_block, readonly = _block_sizes(directory, sources)
    direct, align, seen = _try_direct(directory, where.family, writable and not readonly, sample, sources)
    mem, off = align or (None, None)
    file = None if seen is None else Candidate(seen.label, False, seen.answers.get)
    asked = candidates(os.path.realpath(directory), file, where.mount_point, where.family)
    stripes = striping_for(where.family, asked, block_bytes=block, io_block_bytes=io_block, mount=where.mount)
    unstriped = "not known" if where.family in SHARED_FAMILIES | {"unknown"} else f"none: {where.family} storage"
    for name in ("stripe_unit_bytes", "stripe_count", "object_bytes"):
        sources[name] = stripes.source if getattr(stripes, name) is not None else unstriped
    settable, sources["layout_settable"] = _settable(where.family, readonly, seen)
    facts = FsFacts(
        block, io_block, direct, mem, off, readonly, fs_type=where.fs_type, family=where.family,
        mount_point=where.mount_point, stripe_unit_bytes=stripes.stripe_unit_bytes, stripe_count=stripes.stripe_count,
        object_bytes=stripes.object_bytes, layout_settable=settable,
    )  # fmt: skip
    named = MAGICS.get(where.magic, ("unknown",))[0] if where.magic is not None else ""
    magic = () if where.magic is None else (("statfs_magic", f"{where.magic:#x} ({named})"),)
    return FsProbe(facts, sources, (*magic, *stripes.details))


def _block_sizes(directory: Path, sources: dict[str, str]) -> tuple[int, int, bool]:
    """(``f_bsize``, ``st_blksize``, mounted read-only) of ``directory``, a page and False where they
    cannot be read; where each came from into ``sources``."""
    sources.update(
        block_bytes="statvfs f_bsize", readonly="statvfs f_flag", io_block_bytes="st_blksize of the directory"
    )
    try:
        vfs = os.statvfs(directory)
        block, readonly = vfs.f_bsize, bool(vfs.f_flag & os.ST_RDONLY)
    except OSError as e:
        block, readonly = PAGE, False
        sources["block_bytes"] = sources["readonly"] = f"statvfs failed ({e.strerror}): assumed"
    try:
        io_block = os.stat(directory).st_blksize
    except OSError as e:
        io_block = PAGE
        sources["io_block_bytes"] = f"stat failed ({e.strerror}): assumed"
    return block, io_block, readonly


def _try_direct(
    directory: Path, family: str, write: bool, sample: Path | None, sources: dict[str, str]
) -> tuple[bool, tuple[int, int] | None, _FileSeen | None]:
    """(O_DIRECT works, its statx alignment, what the file showed) from a new probe file (``write``),
    else from ``sample``; where they came from into ``sources``."""

    def look(fd: int, label: str, own: bool) -> _FileSeen:
        seen = _FileSeen(label, file_answers(family, fd))
        if family == "cephfs" and own:  # only ever our own, new, empty file's layout
            seen.settable = ceph_settable(fd)
        return seen

    direct: bool
    align: tuple[int, int] | None
    seen: _FileSeen | None
    if write:
        direct, align, seen = _probe_new_file(directory, look)
        sources["direct"] = "a probe file " + ("opened with O_DIRECT" if direct else "refused O_DIRECT")
    elif sample is not None:
        direct, align, seen = _probe_existing_file(sample, look)
        sources["direct"] = f"the file {sample} " + ("opened with O_DIRECT" if direct else "not opened with O_DIRECT")
    else:
        direct, align, seen = False, None, None
        sources["direct"] = "not tried: nothing to write, no file to open"
    sources["dio_align"] = "statx STATX_DIOALIGN of that file" if align else "not reported (statx)"
    return direct, align, seen


def _settable(family: str, readonly: bool, seen: _FileSeen | None) -> tuple[bool, str]:
    """Whether a writer may set a new file's layout there, and why."""
    if family not in ("cephfs", "lustre"):
        return False, f"no layout a client sets on {family}"
    if readonly:
        return False, "mounted read-only"
    if seen is not None and seen.settable is not None:
        return seen.settable, "the probe file's layout " + ("was set" if seen.settable else "could not be set")
    if family == "cephfs":
        return True, "CephFS's ceph.file.layout.* (not tried: no probe file)"
    return True, "Lustre's lustre.lov (llapi_layout) on a new file"


def _probe_new_file(
    directory: Path, look: Callable[[int, str, bool], _FileSeen]
) -> tuple[bool, tuple[int, int] | None, _FileSeen | None]:
    """(O_DIRECT works, its statx alignment, what ``look`` saw of it) for a file created in
    ``directory``, then removed.

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
                return False, None, None
            raise
        try:
            return hasattr(os, "O_DIRECT"), _statx_dio(probe), look(fd, "the probe file", True)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    raise FileExistsError(errno.EEXIST, f"{_PROBE_TRIES} probe file names were taken", str(directory))


def _probe_existing_file(
    sample: Path, look: Callable[[int, str, bool], _FileSeen]
) -> tuple[bool, tuple[int, int] | None, _FileSeen | None]:
    """(O_DIRECT works, its statx alignment, what ``look`` saw of it) for the regular file ``sample``,
    opened for reading only; (False, None, None) where it cannot be opened so or is no regular file."""
    try:
        fd = os.open(sample, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return False, None, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False, None, None
        return hasattr(os, "O_DIRECT"), _statx_dio(sample), look(fd, f"the file {sample}", False)
    finally:
        os.close(fd)


def find_sample(top: Path, depth: int = 3, per_dir: int = 256) -> Path | None:
    """A regular file under ``top`` to try O_DIRECT on without writing (:func:`probe_fs`'s ``sample``):
    the first by name, level by level, ``depth`` levels down at most, ``per_dir`` entries of each
    directory read, no link followed; None where there is none."""
    level = [top]
    for _ in range(depth):
        below: list[Path] = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    entries = sorted((e for _, e in zip(range(per_dir), it)), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.is_file(follow_symlinks=False):
                    return Path(e.path)
                if e.is_dir(follow_symlinks=False):
                    below.append(Path(e.path))
        level = below
    return None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
