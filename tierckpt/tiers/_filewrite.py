"""Write side of the directory tiers: one copy being written under a scratch name, then published.

A copy's blobs go either into one file each (``blob-00000.bin`` …) or, on a tier that keeps one data
file per copy (``pfs`` by default: every file is load on a parallel file system's metadata server),
into a single ``data.bin`` holding the blobs back to back, blob ``i`` at the sum of the sizes before
it. Blob sizes are multiples of the checkpoint's alignment, so every blob starts aligned in that file
too. The manifest names the blobs either way; readers tell the two apart by the files present
(:mod:`tierckpt.tiers._fileread`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

from tierckpt.errors import CorruptCheckpointError, DeviceFullError
from tierckpt.format.frames import held_sizes
from tierckpt.format.layout import data_offsets
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.fslayout import FileLayout, set_layout
from tierckpt.io.fsutil import fsync_dir
from tierckpt.tiers._fileread import DATA_NAME, MANIFEST_NAME, FileSpace, io_error
from tierckpt.tiers.base import CheckpointKey, TierWriter

__all__ = ["FileWriter", "device_full", "make_scratch", "set_file_layout", "write_file"]

_RENAME_EXCHANGE = 2
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
log = logging.getLogger(__name__)


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Free ``[offset, offset + nbytes)`` of the file ``fd`` (it reads as zeros), its size kept; False
    where the file system cannot (EOPNOTSUPP and the like: the bytes then stay allocated)."""
    fn = getattr(_libc, "fallocate", None)
    if fn is None or nbytes <= 0:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fn(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries; False where renameat2(RENAME_EXCHANGE) is unsupported."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def make_scratch(step_dir: Path, tmp: Path) -> None:
    """Make the scratch directory ``tmp`` in ``step_dir`` (made too if missing; ``tmp`` must not exist)."""
    for attempt in (0, 1):  # another process may remove an empty step directory between the two
        step_dir.mkdir(exist_ok=True)
        try:
            tmp.mkdir()
            return
        except FileNotFoundError:
            if attempt:
                raise


def device_full(tier: FileSpace, what: str, need: int, e: OSError, whole: int | None = None) -> DeviceFullError | None:
    """A full device as the tier contract's "no room" (so that the hierarchy makes room as for a full
    ``capacity``): ENOSPC or EDQUOT while writing ``what`` (``need`` bytes) of a copy that would fit on
    the file system were it empty (``whole`` bytes in all; default ``need``). None for any other error,
    and for a copy larger than the whole device (no eviction makes it fit)."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    try:
        st = os.statvfs(tier.path)
    except OSError:
        return None
    if (need if whole is None else whole) > st.f_blocks * st.f_frsize:
        return None
    free = st.f_bavail * st.f_frsize
    return DeviceFullError(
        e.errno,
        f"tier {tier.name!r}: the device of {tier.path} is full: {what} needs {need} bytes, {free} are free "
        f"({e.strerror or e})",
        e.filename,
    )


def set_file_layout(layout: tuple[str, FileLayout], target: int | Path, path: str | Path | None = None) -> None:
    """Set ``layout`` on ``target`` (a new file's descriptor, or a directory); a refusal is an OSError
    naming the layout and the file (``path``, else ``target``)."""
    family, wanted = layout
    try:
        set_layout(family, target, wanted)
    except OSError as e:
        where = path if path is not None else target
        raise OSError(
            e.errno,
            f"the file system refused the file layout ({wanted.describe()}) on {where}: {e.strerror or e}",
            str(where),
        ) from e


class FileWriter(TierWriter):
    """One copy being written into the scratch directory ``tmp`` of ``step_dir``, published as ``final``.

    Args:
        tier: the tier's directory, I/O mode and engine.
        key: the checkpoint.
        blobs: its blobs (sizes multiples of the checkpoint's alignment).
        reserved: bytes of the tier's capacity to give back once committed or aborted.
        unreserve: gives ``reserved`` bytes back to the tier's capacity.
        step_dir: the step's directory (created if missing).
        tmp: the scratch directory to write in (created; must not exist).
        final: the copy's rank directory once published.
        old: a free scratch name, for replacing an existing copy where an atomic swap is unsupported.
        one_file: all blobs in one ``data.bin`` rather than a file each.
        layout: ``(family, layout)``: the layout to set on the data files before their first byte (on
            CephFS each new file's, on Lustre the scratch directory's default, which the files take;
            :mod:`tierckpt.io.fslayout`); None: the file system's own. A refusal fails the copy, naming
            the tier, the file and the layout.
    """

    #: whether each blob has a file of its own (else they share one: ``data.bin``, a node file)
    blob_files = False

    def __init__(
        self,
        tier: FileSpace,
        key: CheckpointKey,
        blobs: Sequence[BlobEntry],
        reserved: int,
        unreserve: Callable[[int], None],
        *,
        step_dir: Path,
        tmp: Path,
        final: Path,
        old: Path,
        one_file: bool,
        layout: tuple[str, FileLayout] | None = None,
    ) -> None:
        self.tier, self.key, self.blobs = tier, key, list(blobs)
        self._reserved, self._unreserve = reserved, unreserve  # given back once committed or aborted
        self.step_dir, self.tmp, self.final, self._old = step_dir, tmp, final, old
        self.fds: list[int] = []  # one per file
        self._open = True
        self.blob_files = not one_file
        names = [DATA_NAME] if one_file and self.blobs else [b.name for b in self.blobs]
        sizes = [sum(b.size for b in self.blobs)] if one_file else [b.size for b in self.blobs]
        self._bytes = sum(sizes)
        self._files = [str(tmp / n) for n in names]
        # blob i -> (file, offset of the blob in it)
        self._where = [(0, o) for o in data_offsets(self.blobs)] if one_file else [(i, 0) for i in range(len(blobs))]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if tier.geometry.direct else 0)
        try:
            make_scratch(step_dir, tmp)
            if layout is not None and layout[0] == "lustre":  # the files take the directory's default
                set_file_layout(layout, tmp)
            for path, size in zip(self._files, sizes):
                fd = os.open(path, flags, 0o644)
                self.fds.append(fd)
                if layout is not None and layout[0] != "lustre":  # on the new file, before its first byte
                    set_file_layout(layout, fd, path)
                if size:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now, not halfway; parallel O_DIRECT writes
        except OSError as e:
            self._reserved = 0  # reserve() gives it back when the writer cannot start
            self.abort()
            err = io_error(tier.name, f"cannot start step {key.step} in {step_dir}", e)
            raise device_full(tier, f"step {key.step}", sum(sizes), e) or err from e

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        f, base = self._where[blob]
        return self.tier.engine.pwrite(self.fds[f], addr, nbytes, base + offset, path=self._files[f])

    def commit(self, manifest: bytes) -> None:
        """Make the blobs durable, write the manifest, publish. A full device while the manifest is written
        raises :class:`DeviceFullError` and leaves the writer as it was, its blobs durable, so that the
        caller may make room and commit again (or abort); any other failure aborts it."""
        if not self._open:
            raise RuntimeError("writer already finished")
        try:
            if self.fds:  # not yet closed by a commit that found the device full
                self._free_tails(manifest)
            syncs = [self.tier.engine.fsync(fd, path=p) for fd, p in zip(self.fds, self._files)]
            for f in syncs:
                f.result()
            manifest = self._seal(manifest)
            for fd in self.fds:
                os.close(fd)
            self.fds = []
            self._write_manifest(manifest)
            if self.final.exists():
                self._replace()
            else:
                os.rename(self.tmp, self.final)
            fsync_dir(self.step_dir)
            fsync_dir(self.tier.path)
            self._published()
        except DeviceFullError:
            raise
        except OSError as e:
            self.abort()
            raise io_error(self.tier.name, f"cannot commit step {self.key.step}", e) from e
        self._open = False
        self._give_back()

    def _free_tails(self, manifest: bytes) -> None:
        """A copy stored encoded (a version-6 manifest: docs/format.md) holds less of each blob than its
        size: a blob's own file is cut to what it holds; a blob in a shared file (``data.bin``, a node
        file) keeps its place, the rest of its region punched out where the file system can."""
        try:
            held = held_sizes(manifest)
        except CorruptCheckpointError:  # stored as it is given (its readers refuse it): every blob whole
            return
        if held is None:
            return
        for i, (b, h) in enumerate(zip(self.blobs, held, strict=True)):
            f, base = self._where[i]
            if self.blob_files:
                os.ftruncate(self.fds[f], h)
                continue
            try:
                punch_hole(self.fds[f], base + h, b.size - h)
            except OSError as e:  # space only: the copy is whole either way
                log.warning("tier %r: freeing the unused end of %s's region in %s: %s", self.tier.name, b.name,
                            self._files[f], e)  # fmt: skip

    def _seal(self, manifest: bytes) -> bytes:
        """The manifest file's bytes, once the data files are durable (their descriptors still open): the
        manifest itself (a per-node copy's writer checks its node file and appends its location)."""
        return manifest

    def _published(self) -> None:
        """Run once the copy is in place (a per-node copy's writer checks its node file again)."""

    def _write_manifest(self, manifest: bytes) -> None:
        """Write the manifest into the scratch directory, durably; on a full device none is left there."""
        path = self.tmp / MANIFEST_NAME
        try:
            write_file(path, manifest)
            fsync_dir(self.tmp)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(path)
            what = f"the manifest of step {self.key.step}"
            full = device_full(self.tier, what, len(manifest), e, self._bytes + len(manifest))
            if full is None:
                raise
            raise full from e

    def _give_back(self) -> None:
        reserved, self._reserved = self._reserved, 0
        self._unreserve(reserved)

    def _replace(self) -> None:
        """Put the new copy in place of an existing one without a moment where neither is listed."""
        if _exchange(self.tmp, self.final):
            shutil.rmtree(self.tmp, ignore_errors=True)  # self.tmp now names the old copy
            return
        os.rename(self.final, self._old)
        os.rename(self.tmp, self.final)
        shutil.rmtree(self._old, ignore_errors=True)

    def abort(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        if self._open:
            self._open = False
            shutil.rmtree(self.tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.step_dir.rmdir()
            self._give_back()
