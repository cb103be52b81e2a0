"""Read side of the directory tiers: one committed copy, opened as a whole, inside the tier's closed world.

A copy is opened from the tier's directory down, one ``openat`` at a time, never following a link
(``O_NOFOLLOW``): the step directory, the rank directory (kept open by descriptor), then the manifest
and every blob relative to it. Each entry is ``lstat``-ed before it is opened and opened with
``O_NONBLOCK``, so a FIFO, socket, device, directory or link in place of a file is refused by name
(CorruptCheckpointError) and nothing blocks in ``open(2)``. Once the blobs are open the copy is a
snapshot: a save that replaces it (a rename swap) or an eviction (a rename, then unlinks) by another
process changes names, not the open files, so the reader keeps reading the copy it opened. A copy
that goes away before it is fully opened raises CheckpointEvictedError, not damage: an entry missing
from a rank directory is damage only while that directory is still the one committed under its name.

A per-node copy (``files: per_node``) keeps its blobs in a node file of the step directory, which the
copy holds open too: its manifest file ends in a location block (:mod:`tierckpt.format.location`),
checked whole and stripped before the manifest is handed on; the node file is opened relative to the
step directory, and the region the block names must lie inside it before any byte is read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import NoReturn, Protocol

from tierckpt.errors import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, TierIOError
from tierckpt.format.layout import data_offsets
from tierckpt.format.location import MAX_LOCATION_BYTES, Location, split_location
from tierckpt.format.manifest import HEADER, MAGIC, MAX_PAYLOAD_BYTES, TRAILER_BYTES, BlobEntry
from tierckpt.io.engine import IOEngine
from tierckpt.io.fsutil import dio_alignment
from tierckpt.io.geometry import IOGeometry
from tierckpt.tiers.base import CheckpointKey, Tier, TierCopy, TierReader

__all__ = ["DATA_NAME", "MANIFEST_NAME", "FileCopy", "FileSpace", "io_error", "read_regular"]

MANIFEST_NAME = "manifest"
DATA_NAME = "data.bin"  # a copy's blobs back to back, where the tier writes one data file a copy
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# the header's length is checked against the file's size before the rest is read (docs/format.md)
_MAX_MANIFEST_BYTES = HEADER.size + MAX_PAYLOAD_BYTES + TRAILER_BYTES + MAX_LOCATION_BYTES
_OPAQUE_BYTES = 1 << 20  # read whole without looking; larger manifests must show their framing first


def io_error(tier: str, what: str, e: OSError) -> TierIOError:
    """A TierIOError naming the tier, with ``e`` as its cause."""
    err = TierIOError(e.errno, f"tier {tier!r}: {what}: {e.strerror or e}", e.filename)
    err.__cause__ = e
    return err


class FileSpace(Protocol):
    """What the reader and the writer of a copy use of their directory tier (a
    :class:`~tierckpt.tiers._files.FileTier`): its name, directory, I/O geometry and engine."""

    name: str
    path: Path

    @property
    def geometry(self) -> IOGeometry: ...
    @property
    def engine(self) -> IOEngine: ...


def kind_of(mode: int) -> str:
    """What a file of this mode is, for messages."""
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link: links inside a tier are not followed"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return what
    return "not a regular file"


class FileCopy(TierCopy):
    """A committed copy on a :class:`~tierckpt.tiers._files.FileTier`, held open by its rank directory
    (and its step directory, where a per-node copy's node file is).

    Args:
        tier: the tier.
        space: its directory, I/O mode and engine (the same object as ``tier``).
        key: the checkpoint.
        step_name: its step directory's name.
        rank_name: its rank directory's name.

    Raises:
        CheckpointNotFoundError: the tier holds no such copy (now).
        CorruptCheckpointError: the step or rank entry is not a directory (a link, a file …).
    """

    def __init__(self, tier: Tier, space: FileSpace, key: CheckpointKey, step_name: str, rank_name: str) -> None:
        super().__init__(tier, key)
        self.space = space
        self.path = space.path / step_name / rank_name
        try:  # the tier's own configured path may be a link (the user's choice); nothing below it
            root = os.open(space.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise io_error(tier.name, f"cannot open {space.path}", e) from e
        try:
            self.step_fd = self._open_dir(root, step_name, space.path / step_name)
            try:
                self.fd = self._open_dir(self.step_fd, rank_name, self.path)
            except BaseException:
                os.close(self.step_fd)
                raise
        finally:
            os.close(root)
        st = os.fstat(self.fd)
        self._ident = (st.st_dev, st.st_ino)
        self.location: Location | None = None  #: a per-node copy's, once its manifest file is read
        self._manifest_read = False

    def _open_dir(self, parent: int, name: str, path: Path) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"tier {self.tier.name!r} holds no checkpoint for step {self.key.step} rank {self.key.rank}"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise io_error(self.tier.name, f"cannot open {path}", e) from e
            try:
                what = kind_of(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
            except OSError:
                what = "not a directory"
            raise self._bad(f"{path} is not a checkpoint directory ({what})") from None

    def _bad(self, message: str, blob: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, tier=self.tier.name, step=self.key.step, blob=blob)

    def still_committed(self) -> bool:
        """Whether the directory held open is still the one committed under its name."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def _stale(self, e: OSError) -> bool:
        """Whether ``e`` is a network file system's ``ESTALE`` for the directory held open, removed or
        replaced since (GlusterFS answers so where a local file system answers ENOENT)."""
        return e.errno == errno.ESTALE and not self.still_committed()

    def _missing(self, what: str, name: str, blob: str | None = None, where: Path | None = None) -> NoReturn:
        if self.still_committed():  # the committed copy lacks it: damage
            raise self._bad(f"{what} {(where or self.path) / name} is missing", blob)
        raise CheckpointEvictedError(
            f"tier {self.tier.name!r}: step {self.key.step} rank {self.key.rank} was evicted or replaced "
            f"by another process while it was being opened"
        )

    def _open_file(
        self, name: str, what: str, flags: int = 0, blob: str | None = None, *, in_step: bool = False
    ) -> tuple[int, int]:
        """Open regular file ``name`` of the copy (``in_step``: of its step directory): (descriptor, size)."""
        where, dir_fd = (self.path.parent, self.step_fd) if in_step else (self.path, self.fd)
        p = where / name
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            self._missing(what, name, blob, where)
        except OSError as e:
            if self._stale(e):
                self._missing(what, name, blob, where)
            raise io_error(self.tier.name, f"cannot stat {p}", e) from e
        if not stat.S_ISREG(mode):
            raise self._bad(f"{what} {p} is not a regular file ({kind_of(mode)})", blob)
        try:
            fd = os.open(name, _FILE_FLAGS | flags, dir_fd=dir_fd)
        except FileNotFoundError:
            self._missing(what, name, blob, where)
        except OSError as e:
            if e.errno == errno.ELOOP:  # replaced by a link since the stat
                raise self._bad(f"{what} {p} is not a regular file ({kind_of(stat.S_IFLNK)})", blob) from None
            if self._stale(e):
                self._missing(what, name, blob, where)
            raise io_error(self.tier.name, f"cannot open {p}", e) from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise self._bad(f"{what} {p} is not a regular file ({kind_of(st.st_mode)})", blob)
        return fd, st.st_size

    def read_manifest(self) -> bytes:
        """The manifest's bytes. One larger than 1 MiB must start with the format's magic and a payload
        length that matches the file's size (with at most a location block past it), checked before the
        rest is read, so that a huge (e.g. sparse) file is refused after reading 24 bytes; nothing larger
        than the format allows is read. A per-node copy's location block is checked and stripped (kept
        in :attr:`location`)."""
        p = self.path / MANIFEST_NAME
        fd, size = self._open_file(MANIFEST_NAME, "manifest")
        try:
            if size > _MAX_MANIFEST_BYTES:
                raise self._bad(f"manifest {p} is {size} bytes, more than a manifest can be ({_MAX_MANIFEST_BYTES})")
            if size > _OPAQUE_BYTES:  # a small file is read as it is; decode_head checks everything
                magic, _, _, _, n = HEADER.unpack(pread_all(fd, HEADER.size, 0))
                if magic != MAGIC:
                    raise self._bad(f"bad magic {magic!r} (not a tierckpt manifest)")
                if not 0 <= size - (HEADER.size + n + TRAILER_BYTES) <= MAX_LOCATION_BYTES:
                    raise self._bad(f"manifest {p} is {size} bytes, its header says {n} + framing")
            try:
                manifest, self.location = split_location(pread_all(fd, size, 0), f"manifest {p}")
            except CorruptCheckpointError as e:
                raise self._bad(str(e)) from None
            self._manifest_read = True
            return manifest
        except OSError as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise io_error(self.tier.name, f"cannot read {p}", e) from e
        finally:
            os.close(fd)

    def reader(self, blobs: Sequence[BlobEntry]) -> TierReader:
        """Open every blob now (the copy is a snapshot from here on) and check its size. A copy holding
        a ``data.bin`` keeps all its blobs in it, back to back (tierckpt.tiers._filewrite)."""
        flags = os.O_DIRECT if self.space.geometry.direct else 0
        if not self._manifest_read:
            self.read_manifest()  # where a per-node copy's blobs are
        if self.location is not None:
            return self._node_reader(blobs, self.location, flags)
        if blobs and all(b.name != DATA_NAME for b in blobs) and self._present(DATA_NAME):
            fd, size = self._open_file(DATA_NAME, "data file", flags, DATA_NAME)
            need = _region_bytes(blobs)
            if size < need:
                os.close(fd)
                raise self._bad(
                    f"data file {self.path / DATA_NAME} is truncated: {size} bytes, its manifest declares "
                    f"{len(blobs)} blob(s) of {need} bytes in all",
                    DATA_NAME,
                )
            return FileReader(self.space, self.path, blobs, [fd], [(0, o, DATA_NAME) for o in data_offsets(blobs)])
        fds: list[int] = []
        try:
            for b in blobs:
                fd, size = self._open_file(b.name, "blob file", flags, b.name)
                fds.append(fd)
                if size < b.stored:
                    raise self._bad(
                        f"blob file {self.path / b.name} is truncated: {size} bytes, {_declares(b)}", b.name
                    )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return FileReader(self.space, self.path, blobs, fds, [(i, 0, b.name) for i, b in enumerate(blobs)])

    def _node_reader(self, blobs: Sequence[BlobEntry], loc: Location, flags: int) -> TierReader:
        """A per-node copy's reader: its region of the node file ``loc`` names, which must lie inside the
        file (a missing node file, while the copy is still the committed one, is damage)."""
        fd, size = self._open_file(loc.name, "node file", flags, loc.name, in_step=True)
        need = _region_bytes(blobs)
        if loc.offset + need > size:
            os.close(fd)
            raise self._bad(
                f"node file {self.path.parent / loc.name} is {size} bytes: the region of rank {self.key.rank} "
                f"(offset {loc.offset}, {len(blobs)} blob(s) of {need} bytes in all) does not fit in it",
                loc.name,
            )
        where = [(0, loc.offset + o, loc.name) for o in data_offsets(blobs)]
        return FileReader(self.space, self.path.parent, blobs, [fd], where)

    def _present(self, name: str) -> bool:
        """Whether the copy's directory has an entry ``name`` (of any kind: opening it checks that)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as e:
            if self._stale(e):
                return False
            raise io_error(self.tier.name, f"cannot stat {self.path / name}", e) from e
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            os.close(self.step_fd)
            self.fd = self.step_fd = -1


def _region_bytes(blobs: Sequence[BlobEntry]) -> int:
    """The bytes a copy's region of a data or node file must hold: every blob at its place (after the
    sizes of the blobs before it), the last one as far as the copy holds it (its ``held``, where set)."""
    return sum(b.size for b in blobs[:-1]) + blobs[-1].stored if blobs else 0


def _declares(b: BlobEntry) -> str:
    """What a copy's manifest says blob ``b``'s file holds, for errors."""
    if b.held is None:
        return f"its manifest declares {b.size}"
    return f"the copy's frame index declares {b.held} (its stored stream, padded; {b.size} bytes raw)"


def read_regular(tier: str, path: Path, step: int, what: str, limit: int) -> bytes | None:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; None where there is none. Opened
    with ``O_NOFOLLOW | O_NONBLOCK``: a link is not followed, a FIFO never blocks.

    Raises:
        CorruptCheckpointError: naming ``what`` (e.g. "commit record") of ``step``: not a regular file (a
            link, a FIFO, a device, a directory), or larger than ``limit``.
        TierIOError: it cannot be read.
    """
    try:
        fd = os.open(path, _FILE_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(
                f"{what} {path} is not a regular file ({kind_of(stat.S_IFLNK)})", tier=tier, step=step
            ) from None
        raise io_error(tier, f"cannot read the {what} of step {step}", e) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{what} {path} is not a regular file ({kind_of(st.st_mode)})", tier=tier, step=step
            )
        if st.st_size > limit:
            raise CorruptCheckpointError(
                f"{what} {path} is {st.st_size} bytes, more than it can be ({limit})", tier=tier, step=step
            )
        return pread_all(fd, st.st_size, 0)
    except CorruptCheckpointError:
        raise
    except OSError as e:
        raise io_error(tier, f"cannot read the {what} of step {step}", e) from e
    finally:
        os.close(fd)


def pread_all(fd: int, n: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


class FileReader(TierReader):
    """Reads the blobs of a copy through descriptors opened by :meth:`FileCopy.reader`; ``where[i]`` is
    blob ``i``'s (descriptor index, offset in that file, file name)."""

    def __init__(
        self,
        tier: FileSpace,
        rank_dir: Path,
        blobs: Sequence[BlobEntry],
        fds: list[int],
        where: list[tuple[int, int, str]],
    ) -> None:
        self.tier, self.dir, self.blobs, self._fds, self._where = tier, rank_dir, list(blobs), fds, where
        self._lock = threading.Lock()

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        f, base, name = self._where[blob]
        fd = self._fds[f]
        # never past the blob's end: in one data file that would be the next blob's bytes
        nbytes = max(0, min(nbytes, self.blobs[blob].size - offset))
        return self.tier.engine.pread(fd, addr, nbytes, base + offset, path=str(self.dir / name))

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        if not self.tier.geometry.direct:
            return 1, 1  # buffered reads go anywhere
        # a fact of the blob's file (statx's; 4096 each where it cannot say), not a size the tier decides:
        # a read straight into a caller's tensor needs only this much alignment
        mem, off = dio_alignment(self.dir / self._where[blob][2])
        return max(mem, 1), max(off, 1)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
