"""Write side of a per-node copy (``files: per_node``): the node's shared data file and one rank's region.

The ranks of a node keep their blobs of a step in one file of the step directory, each rank's back to
back in its own region (docs/distributed.md, "A per-node data file")::

    step-000000000100/
      rank-00000/manifest      manifest bytes, then a location block (tierckpt.format.location)
      rank-00001/manifest
      node-00000-<host>-<pid>-<hex>.data   ranks 0 and 1's blobs

The node's first rank creates the file (:func:`create_node_file`: a fresh name every save, its room
allocated, its name durable) once it knows every region's size; each rank then writes its region
through a :class:`NodeFileWriter`, which publishes the rank's copy as :class:`FileWriter` does, once
its region is durable and the file is still linked. The rank executor does the exchange between them
(tierckpt.ranks.nodeplace); this module never talks to other ranks.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import secrets
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.format.layout import data_offsets
from tierckpt.format.location import Location, encode_location, split_location
from tierckpt.format.manifest import BlobEntry, decode_head
from tierckpt.io.fslayout import FileLayout
from tierckpt.io.fsutil import fsync_dir
from tierckpt.io.geometry import IOGeometry
from tierckpt.tiers._fileread import MANIFEST_NAME, FileSpace, io_error
from tierckpt.tiers._filescratch import HOST, drop_unused_node_files, release_node_file
from tierckpt.tiers._filewrite import FileWriter, device_full, make_scratch, set_file_layout
from tierckpt.tiers.base import CheckpointKey

__all__ = [
    "PER_NODE_CAPACITY",
    "PER_NODE_ONE_FILE",
    "NodeFileWriter",
    "check_per_node",
    "create_node_file",
    "node_file_name",
    "node_part",
]

#: why ``files: per_node`` takes no ``one_file: false``
PER_NODE_ONE_FILE = (
    "files: per_node keeps each rank's blobs back to back in its node's file, as one_file does: it cannot go "
    "with one_file: false (leave one_file out, or use files: per_rank)"
)
#: why ``files: per_node`` takes no ``capacity``
PER_NODE_CAPACITY = (
    "files: per_node cannot go with a capacity: a node file holds the copies of every rank of its node, "
    "so evicting one rank's copy to make room frees nothing (leave capacity out, or use files: per_rank)"
)
#: why ``files: per_node`` takes no ``{rank}`` in its path
PER_NODE_RANK_PATH = (
    "files: per_node shares one data file a step among the ranks of a node, in one directory: a path with "
    "{rank} gives each rank its own (use {node}, or files: per_rank)"
)
_MAX_UNIT = 16 << 20  # the largest alignment a layout may ask for (config: layout.align)


def node_file_name(first_rank: int) -> str:
    """A fresh name for the node file of the node whose first global rank is ``first_rank``, naming this
    host and process (so that a sweep can tell a dead creator's file)."""
    return f"node-{first_rank:05d}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}.data"


def node_part(geometry: IOGeometry, blobs: Sequence[BlobEntry]) -> tuple[int, int]:
    """(bytes, unit): the size of a copy's region in a node file (its blobs back to back) and the multiple
    its start must be: the tier's blob alignment (a stripe, where the file system has them), its I/O
    alignment, and the largest power of two (up to 16 MiB) dividing every blob's size, which the
    checkpoint's alignment divides (so that the region starts on a multiple of the manifest's ``align``).
    A copy without bytes takes ``(0, 1)``: it pads the file with nothing."""
    sizes = [b.size for b in blobs]
    if not any(sizes):  # no bytes: a region of none, anywhere (no padding before it)
        return 0, 1
    g = math.gcd(*sizes)
    pow2 = min(g & -g, _MAX_UNIT)
    return sum(sizes), math.lcm(geometry.blob_align_bytes, geometry.alignment_bytes, pow2)


def create_node_file(
    space: FileSpace, step_dir: Path, first_rank: int, nbytes: int, layout: tuple[str, FileLayout] | None
) -> str:
    """Create a new node file of ``nbytes`` in ``step_dir`` (made if missing), for the node whose first
    rank is ``first_rank``: ``O_EXCL`` under a fresh name, the file layout set before its first byte,
    ``posix_fallocate``d (a full device fails now), the step directory fsynced (its name durable before any
    manifest can name it). Its name.

    Raises:
        DeviceFullError: the device has no room for it (nothing is evicted for it: the save fails on the
            tier, see :meth:`Mover.with_room <tierckpt.background.mover.Mover.with_room>`).
        TierIOError: any other failure (nothing is left behind).
    """
    name = node_file_name(first_rank)
    path = step_dir / name
    fd = -1
    try:
        for attempt in (0, 1):  # another process may remove an empty step directory between the two
            step_dir.mkdir(exist_ok=True)
            if layout is not None and layout[0] == "lustre":  # the file takes its directory's default
                set_file_layout(layout, step_dir)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileNotFoundError:
                if attempt:
                    raise
        if layout is not None and layout[0] != "lustre":
            set_file_layout(layout, fd, path)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        # its name is durable before any manifest can name it; its size and blocks become durable with each
        # writer's fsync of its region (and the step directory's entry in the tier's with each publish)
        fsync_dir(step_dir)
    except OSError as e:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
        err = io_error(space.name, f"cannot create the node file of step {step_dir.name} ({path})", e)
        what = f"the node file {name} of step {int(step_dir.name.split('-')[1])} (the node of rank {first_rank})"
        raise device_full(space, what, nbytes, e) or err from e
    finally:
        if fd >= 0:
            os.close(fd)
    return name


def _nothing(_: int) -> None:
    """Nothing reserved: the node file's room was taken when it was created."""


class NodeFileWriter(FileWriter):
    """One rank's copy written into its region of its node's file, published as a :class:`FileWriter`'s.

    Args:
        tier: the tier's directory, I/O mode and engine.
        key: the checkpoint.
        blobs: its blobs (sizes multiples of the checkpoint's alignment).
        step_dir: the step's directory, which holds the node file.
        tmp: the scratch directory for the manifest (created; must not exist).
        final: the copy's rank directory once published.
        old: a free scratch name, for replacing an existing copy where an atomic swap is unsupported.
        place: the node file's name and where this rank's region starts in it.

    Raises:
        TierIOError: the node file is missing (swept, evicted meanwhile), not a regular file, or shorter
            than the region; the scratch directory cannot be made.
    """

    def __init__(
        self,
        tier: FileSpace,
        key: CheckpointKey,
        blobs: Sequence[BlobEntry],
        *,
        step_dir: Path,
        tmp: Path,
        final: Path,
        old: Path,
        place: Location,
    ) -> None:
        self.tier, self.key, self.blobs = tier, key, list(blobs)
        self._reserved, self._unreserve = 0, _nothing
        self.step_dir, self.tmp, self.final, self._old = step_dir, tmp, final, old
        self.place = place
        self._replaced: str | None = None  # the node file of the copy this one replaced, if another
        self.fds = []
        self._open = True
        self._bytes = sum(b.size for b in self.blobs)
        path = step_dir / place.name
        self._files = [str(path)]
        self._where = [(0, place.offset + o) for o in data_offsets(self.blobs)]
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if tier.geometry.direct else 0)
        try:
            make_scratch(step_dir, tmp)
            self.fds.append(os.open(path, flags))
            st = os.fstat(self.fds[0])
            #: the node file's identity: what :meth:`_seal` and the check after publishing compare its name
            #: with (kept apart from ``fds``, which the commit closes before the manifest is written)
            self._ident = (st.st_dev, st.st_ino)
            end = place.offset + self._bytes
            if not stat.S_ISREG(st.st_mode) or st.st_size < end:
                raise OSError(
                    errno.EINVAL,
                    f"the node file is {st.st_size} bytes, rank {key.rank}'s region ends at {end}",
                    str(path),
                )
        except OSError as e:
            self.abort()
            raise io_error(tier.name, f"cannot start step {key.step} in {path}", e) from e

    def _seal(self, manifest: bytes) -> bytes:
        """The manifest with the copy's location block, once its region is durable: refused (the copy
        is not published) when the node file was unlinked meanwhile (swept or evicted under it) or the
        region does not start on a multiple of the manifest's ``align``."""
        path = self._files[0]
        self._check_linked("the copy is not published")
        align = decode_head(manifest).align
        if self._bytes and self.place.offset % align:
            raise OSError(
                errno.EINVAL,
                f"rank {self.key.rank}'s region starts at {self.place.offset}, not a multiple of {align}",
                path,
            )
        return manifest + encode_location(self.place)

    def _check_linked(self, then: str) -> None:
        """Raise ENOENT unless the step directory still names this writer's node file (not swept, evicted
        or being dropped: tierckpt.tiers._filescratch renames a node file away before it unlinks it)."""
        try:
            st = os.stat(self._files[0], follow_symlinks=False)
            linked = (st.st_dev, st.st_ino) == self._ident
        except FileNotFoundError:
            linked = False
        if not linked:
            raise OSError(
                errno.ENOENT,
                f"the node file was removed while rank {self.key.rank}'s copy was written (swept or evicted): {then}",
                self._files[0],
            )

    def _replace(self) -> None:
        """Replace the existing copy; the node file it named is released once no manifest names it (a
        re-save's old file: readers that opened it keep reading it)."""
        replaced = _location_of(self.final / MANIFEST_NAME)
        super()._replace()
        self._replaced = None if replaced is None or replaced.name == self.place.name else replaced.name

    def _published(self) -> None:
        """After the copy's directory went into place: its node file must still be linked, or a sweep or
        an eviction that listed the step before this writer's scratch existed may unlink it now; the
        copy is then taken back (its commit fails: the step's record comes only after every rank's
        report, so nothing names it yet)."""
        try:
            self._check_linked("the copy is taken back")
        except OSError:
            gone = self._old
            with contextlib.suppress(OSError):
                os.rename(self.final, gone)
                shutil.rmtree(gone, ignore_errors=True)
                fsync_dir(self.step_dir)
            raise
        if self._replaced is not None:  # space only: the copy is published whatever happens here
            with contextlib.suppress(OSError):
                release_node_file(self.step_dir, self._replaced)

    def abort(self) -> None:
        was_open = self._open
        super().abort()
        if was_open:  # a failed save: its node file goes once no copy of the step and no writer is left
            drop_unused_node_files(self.step_dir)


def _location_of(manifest: Path) -> Location | None:
    """The location block of the manifest file ``manifest`` (None: none, or unreadable)."""
    try:
        return split_location(manifest.read_bytes())[1]
    except (OSError, ValueError):  # CorruptCheckpointError included
        return None


def check_per_node(cfg: TierConfig, opts: dict[str, Any]) -> None:
    """``files: per_node``'s settings that cannot work, refused by name (docs/distributed.md)."""
    if opts["one_file"] is False:
        raise ConfigError(f"{cfg.key}.options.one_file: {PER_NODE_ONE_FILE}")
    if cfg.capacity_bytes is not None:
        raise ConfigError(f"{cfg.key}.capacity: {PER_NODE_CAPACITY}")
    if cfg.location is not None and re.search(r"\{rank(?:[:!][^}]*)?\}", cfg.location.replace("{{", "")):
        raise ConfigError(f"{cfg.key}.path: {PER_NODE_RANK_PATH}")
