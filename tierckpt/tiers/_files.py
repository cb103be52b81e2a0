"""Directory-backed tiers (``local``, ``pfs``): layout, atomic publish, O_DIRECT blob I/O.

On disk (docs/format.md)::

    <path>/step-000000000100/rank-00000/manifest        the msgpack manifest (framed, checksummed)
    <path>/step-000000000100/rank-00000/blob-00000.bin  aggregated tensor bytes (a file a blob)
    <path>/step-000000000100/rank-00000/data.bin        or all the blobs in one file (``one_file``)
    <path>/step-000000000100/node-00000-<host>-<pid>-<hex>.data   or, ``files: per_node``, the blobs of
                                                        every rank of a node in one file (_nodefile)
    <path>/step-000000000100/.tmp-rank-00000-<host>-<pid>-<hex>/   a write in progress (never listed)

A rank's directory is written under a ``.tmp-`` name, every file and the directory are fsynced, and
only then is it renamed to ``rank-NNNNN`` (atomically swapped in with renameat2(RENAME_EXCHANGE) when
it replaces an existing copy) and the step directory fsynced. A reader lists only ``rank-NNNNN``
directories, so it never sees a half-written checkpoint, and a crash leaves the previous one intact.

This module is the tier itself (its settings and geometry, engine, lease, commit records, room, eviction);
its parts, each in a module of its own: the directory opened (``_filedir``), what it holds as its
directory lists it (``_filelisting``: the names of steps, copies and records), scratch names and the sweep
of dead processes' scratch (``_filescratch``), a copy read as a snapshot (``_fileread``), a copy written
and published (``_filewrite``; a per-node copy: ``_nodefile``), the directory's lease (``_lease``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tierckpt.config import LEASE_STALE_SECS, TierConfig
from tierckpt.errors import TierFullError
from tierckpt.format.location import Location
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.budget import Budget
from tierckpt.io.engine import IOEngine, make_engine
from tierckpt.io.fslayout import FileLayout, with_layout
from tierckpt.io.fsutil import fsync_dir, probe_fs
from tierckpt.io.geometry import FsFacts, IOGeometry, io_geometry
from tierckpt.ioconfig import IOConfig, default_io
from tierckpt.tiers._filedir import open_directory
from tierckpt.tiers._filelayout import check_file_layout, parse_file_layout
from tierckpt.tiers._filelisting import RECORD_NAME, FileListing, rank_dir_name, step_dir_name
from tierckpt.tiers._fileread import MANIFEST_NAME, FileCopy, io_error, read_regular
from tierckpt.tiers._filescratch import drop_unused_node_files, scratch_name, sweep
from tierckpt.tiers._filewrite import FileWriter, device_full, write_file
from tierckpt.tiers._lease import Lease
from tierckpt.tiers._nodefile import (
    PER_NODE_CAPACITY,
    PER_NODE_ONE_FILE,
    NodeFileWriter,
    check_per_node,
    create_node_file,
    node_part,
)
from tierckpt.tiers.base import CheckpointKey, EngineSource, Tier, TierCapabilities, TierReader, TierWriter
from tierckpt.tiers.options import Option, boolean, check_options, choice, local_directory

__all__ = ["FileTier"]

log = logging.getLogger(__name__)

_MAX_RECORD_BYTES = 1 << 27  # far more than a record of any job (docs/format.md): larger is not one


_OPTIONS = {
    "one_file": Option(
        boolean(), default=None, doc="all of a copy's blobs in one data file (default: true on pfs, false on local)"
    ),
    "files": Option(
        choice("per_rank", "per_node"),
        default="per_rank",
        doc="data files of a step: per_rank (one a rank) or per_node (the ranks of a node share one)",
    ),
}
FILES = ("per_rank", "per_node")
#: a shared tier's (``pfs``): also the layout it sets on its data files
_SHARED_OPTIONS = {
    **_OPTIONS,
    "file_layout": Option(
        parse_file_layout, default=None, doc="the layout set on new data files: stripe_unit, stripe_count, object_size"
    ),
}
#: the tier's own ``io`` settings that are inputs of its geometry, besides ``direct`` and the chunk
_OWN_IO = ("queue_depth", "stripe_unit_bytes", "stripe_count", "object_bytes")


class FileTier(Tier):
    """A tier in a directory. Subclasses set ``kind``, ``shared``, ``one_file``, ``whole_blocks`` and
    their preferred blob size; the sizes of its I/O are its :attr:`geometry`, from its file system's
    facts (:attr:`facts`, probed when it is built) and its io settings.

    Args:
        name: tier name.
        path: the directory (created if missing).
        engine: I/O engine for blob reads and writes (None: the hierarchy's, see :meth:`use_io`).
        direct: use O_DIRECT where the file system allows it (None: as the hierarchy's ``io``).
        chunk_bytes: size of one I/O operation (None: as the hierarchy's ``io``).
        capacity_bytes: most bytes of committed checkpoints and of those this process is writing, or None.
        blob_bytes: preferred blob size, or None for the kind's default.
        readonly: only read: the directory must exist; nothing is created or swept, no lease taken.
        job: the job identity to lease the directory for (default: from the environment; docs/jobs.md).
        lease_stale_secs: how long a lease holder on another host may go without renewing it.
        one_file: write each copy's blobs into one data file (``data.bin``) rather than a file a blob
            (None: the kind's default, :attr:`one_file`). Copies of either kind are read either way.
        files: ``per_rank`` (the default: each copy's own data files) or ``per_node``: the copies of the
            ranks of a node go into one data file a step, each rank's blobs back to back in its region
            (docs/distributed.md, "A per-node data file"); copies of every layout are read either way.
        file_layout: the layout to set on each new data file (CephFS, Lustre: :mod:`tierckpt.io.fslayout`);
            the geometry sizes for it rather than for the layout detected.
        io: the tier's own ``io`` settings (its config entry's): its queue depth and the stripes it sizes
            for (``stripe_unit_bytes`` ...) over the hierarchy's; None: the hierarchy's.
        bandwidth_bytes_per_sec: the tier's bandwidth budget (None: none): its :attr:`budget`, a token
            bucket of one chunk that paces the hierarchy's background reads and writes of the tier
            (docs/tiers.md, "Bandwidth budgets").
        throttle: what the budget paces: ``background`` (background copies, non-blocking saves) or
            ``all`` (prefetches, blocking saves and restores too).

    Raises:
        ValueError: a ``bandwidth_bytes_per_sec`` that is not positive, or an unknown ``throttle``; an
            unknown ``files``, or ``per_node`` with ``one_file=False``.
        TierBusyError: (writable) another job holds the directory's lease.
        TierIOError: the directory is missing (``readonly``), cannot be made, is not readable (and
            writable), or is on a read-only file system and the tier is not ``readonly``; or its file
            system refused ``file_layout`` on a probe file.
        ConfigError: its file system takes no ``file_layout`` from a client.
    """

    kind = "file"
    shared = False
    #: whether a copy's blobs go into one data file (``data.bin``) rather than a file each
    one_file = False
    #: whether I/O is aligned to the file system's block (a parallel file system's stripe or block)
    whole_blocks = False

    def __init__(
        self,
        name: str,
        path: str | os.PathLike[str],
        engine: IOEngine | None = None,
        *,
        direct: bool | None = None,
        chunk_bytes: int | None = None,
        capacity_bytes: int | None = None,
        blob_bytes: int | None = None,
        readonly: bool = False,
        job: str | None = None,
        lease_stale_secs: float = LEASE_STALE_SECS,
        one_file: bool | None = None,
        file_layout: FileLayout | None = None,
        io: IOConfig | None = None,
        bandwidth_bytes_per_sec: int | None = None,
        throttle: str = "background",
        files: str = "per_rank",
    ) -> None:
        super().__init__(name)
        if files not in FILES:
            raise ValueError(f"tier {name!r}: files: expected one of {', '.join(FILES)}, got {files!r}")
        if files == "per_node" and one_file is False:
            raise ValueError(f"tier {name!r}: {PER_NODE_ONE_FILE}")
        if files == "per_node" and capacity_bytes is not None:
            raise ValueError(f"tier {name!r}: {PER_NODE_CAPACITY}")
        self.files = files
        self.node_files = files == "per_node"
        if self.node_files:
            one_file = True  # a node file holds each rank's blobs back to back, as data.bin does
        # checked before anything is made; a bucket of one chunk (docs/tiers.md, "Bandwidth budgets")
        budget = None if bandwidth_bytes_per_sec is None else Budget(bandwidth_bytes_per_sec, throttle=throttle)
        if one_file is not None:
            self.one_file = one_file
        self.path = Path(path)
        open_directory(name, self.path, readonly)
        self._listing = FileListing(name, self.path)  # what it holds, as its directory lists it
        # the directory is this job's before anything is written or swept (released by close(), or GC)
        self._lease_args = (job, lease_stale_secs)
        self.lease: Lease | None = None
        if not readonly:
            self._take_lease()
        self._engine, self._engine_given, self._own_engine = engine, engine is not None, False
        # the tier's own settings, inputs of its geometry (None: the io settings of the hierarchy it joins)
        self._asked = (direct, chunk_bytes)
        self._own_io = {k: getattr(io, k) for k in _OWN_IO if io is not None and getattr(io, k) is not None}
        try:  # a read-only tier writes nothing, not even a probe file
            self.facts: FsFacts = probe_fs(
                self.path, writable=not readonly, sample=self._listing.sample() if readonly else None
            )
        except OSError as e:
            raise io_error(name, f"cannot probe {self.path}", e) from e
        self.file_layout = file_layout
        if file_layout is not None:
            check_file_layout(name, self.path, self.facts, file_layout, probe=not readonly)
        self.capacity_bytes = capacity_bytes
        if blob_bytes:
            self.preferred_blob_bytes = blob_bytes
        self.capabilities = TierCapabilities(
            persistent=True,
            shared=self.shared,
            device="file",
            alignment_bytes=self.facts.direct_alignment_bytes,
            encoded_copies=True,
        )
        self._fix_io(default_io())
        if budget is not None:
            budget.burst_bytes = self.geometry.chunk_bytes
            self.budget = budget
        self._lock = threading.Lock()
        self._reserved = 0  # bytes of checkpoints being written by this process (counted against capacity)
        self._evicted: list[Path] = []  # renamed away by evict(free=False), deleted by reclaim()
        if not readonly:
            sweep(self._listing.step_dirs())  # the scratch of dead processes of this host

    def plan_geometry(self, io: IOConfig) -> IOGeometry:
        """:func:`~tierckpt.io.geometry.io_geometry` of the tier's capabilities, its file system's
        :attr:`facts` (with the :attr:`file_layout` it sets on its data files) and its settings:
        ``direct``, the chunk, the queue depth and the stripes as given to the constructor, else as
        ``io`` says."""
        direct, chunk = self._asked
        return io_geometry(
            self.capabilities, replace(io, **self._own_io), with_layout(self.facts, self.file_layout),
            blob_bytes=self.preferred_blob_bytes, chunk_bytes=chunk, direct=direct, one_file=self.one_file,
            whole_blocks=self.whole_blocks,
        )  # fmt: skip

    def _fix_io(self, io: IOConfig) -> None:
        """Fix the geometry for ``io`` (saying so where O_DIRECT was asked for and is not to be had)."""
        g = self.fix_geometry(io)
        if (io.direct if self._asked[0] is None else self._asked[0]) and not g.direct:
            log.info(
                "tier %r: O_DIRECT is unavailable in %s (or, read-only, there was no file to try it on); "
                "using buffered I/O", self.name, self.path,
            )  # fmt: skip

    @property
    def direct(self) -> bool:
        """Whether its files are opened with O_DIRECT: its :attr:`geometry`'s ``direct``."""
        return self.geometry.direct

    @property
    def chunk_bytes(self) -> int:
        """The size of one I/O operation: its :attr:`geometry`'s ``chunk_bytes`` (the constructor's
        ``chunk_bytes``, else the hierarchy's ``io.chunk``, within its alignment). Setting it is giving the
        tier a chunk of its own, as the constructor's ``chunk_bytes`` does."""
        return self.geometry.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._asked = (self._asked[0], value)
        self.fix_geometry(self._geometry_io or default_io())

    def _take_lease(self) -> None:
        job, stale_secs = self._lease_args
        self.lease = Lease.acquire(self.path, tier=self.name, job=job, stale_secs=stale_secs)
        weakref.finalize(self, self.lease.release)

    def use_io(self, engines: EngineSource, io: IOConfig) -> None:
        """Take the engine, ``direct`` and chunk size not given to the constructor from the
        hierarchy's ``io`` settings (the hierarchy calls this when it is built; the engine is the
        hierarchy's, shared with its other tiers and closed with it). A writable tier closed by an
        earlier hierarchy takes its directory's lease again."""
        if self.lease is not None and self.lease.released:
            self._take_lease()
        self._fix_io(io)  # the hierarchy fixes it again: an override of this method cannot skip it
        if not self._engine_given:
            self._close_engine()  # an engine made while the tier was used on its own
            self._engine = engines.get(io.engine, self.geometry.queue_depth)

    @property
    def engine(self) -> IOEngine:
        """The I/O engine; a tier used outside any hierarchy without one makes its own (closed with it)."""
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    io = default_io()
                    self._engine, self._own_engine = make_engine(io.engine, self.geometry.queue_depth), True
        return self._engine

    @classmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> FileTier:
        """The location is the directory (``~``, ``$VAR`` expanded; relative to the YAML file); the
        options are ``one_file`` and, on a shared tier (``pfs``), ``file_layout`` (see the class). Its engine runs as many operations
        at once as its geometry's queue depth."""
        path = local_directory(cfg)
        opts = check_options(cfg, _SHARED_OPTIONS if cls.shared else _OPTIONS)
        if opts["files"] == "per_node":
            check_per_node(cfg, opts)
        tier = cls(
            cfg.name,
            path,
            direct=cfg.io.direct,
            chunk_bytes=cfg.io.chunk_bytes,
            capacity_bytes=cfg.capacity_bytes,
            blob_bytes=cfg.blob_bytes,
            readonly=cfg.readonly,
            job=cfg.job,
            lease_stale_secs=cfg.lease_stale_secs,
            one_file=opts["one_file"],
            file_layout=opts.get("file_layout"),
            io=cfg.io,
            bandwidth_bytes_per_sec=cfg.io.bandwidth_bytes_per_sec,
            throttle=cfg.io.throttle,
            files=opts["files"],
        )
        tier._engine, tier._engine_given = engines.get(cfg.io.engine, tier.plan_geometry(cfg.io).queue_depth), True
        return tier

    def describe(self) -> str:
        budget = f", {self.budget.describe()} budget" if self.budget is not None else ""
        return f"{self.path} ({'O_DIRECT' if self.direct else 'buffered'}, {self.engine.name} engine{budget})"

    def storage_facts(self) -> dict[str, Any]:
        """``{"facts": ..., "file_layout": ...}``: its file system's :attr:`facts` as probed, and the
        :attr:`file_layout` it sets on new data files (None: none); its geometry sizes for both."""
        layout = None if self.file_layout is None else dataclasses.asdict(self.file_layout)
        return {"facts": dataclasses.asdict(self.facts), "file_layout": layout}

    def location(self) -> str:
        return os.path.realpath(self.path)

    def _rank_dir(self, key: CheckpointKey) -> Path:
        return self._listing.rank_dir(key)

    # -- contract -------------------------------------------------------------------------------------
    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        """Every ``step-…/rank-…`` directory (of ``rank``, if given) that holds a ``manifest`` file (a
        commit renames a directory into place only after its manifest is durable). Anything else with
        such a name (an empty directory, a file, a copy missing its manifest) is not a checkpoint: it
        is skipped, with one warning, so that it never counts toward ``keep`` (which would evict good
        copies) nor hides the newest good step. With ``rank``, a step costs one ``stat`` of that rank's
        copy (a shared tier's step directory holding every rank's is not listed); without, a listing of
        the step directory and a ``stat`` per copy."""
        return self._listing.committed(rank)

    def holds(self, key: CheckpointKey) -> bool:
        """Whether ``key``'s rank directory holds a manifest file (one ``stat``; links are not followed)."""
        return self._listing.holds(key)

    # -- commit records: step-N/commit ----------------------------------------------------------------
    def _record_path(self, step: int) -> Path:
        return self.path / step_dir_name(step) / RECORD_NAME

    def write_record(self, step: int, data: bytes) -> None:
        """Write ``step-N/commit`` under a scratch name, fsync it, rename it into place (replacing the
        step's record) and fsync the step directory.

        Raises:
            DeviceFullError: the device is full (ENOSPC, EDQUOT): the hierarchy makes room and writes it again.
            TierIOError: any other failure.
        """
        self._check_lease()
        final = self._record_path(step)
        tmp = final.parent / scratch_name("tmp", None)
        try:
            final.parent.mkdir(exist_ok=True)
            write_file(tmp, data)
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            err = io_error(self.name, f"cannot write the commit record of step {step}", e)
            raise device_full(self, f"the commit record of step {step}", len(data), e) or err from e

    def read_record(self, step: int) -> bytes | None:
        """The bytes of ``step-N/commit``; None where there is none (or the step directory is a link, not
        followed). Anything but a regular file there (a link, a FIFO, a device, a directory) is refused,
        without following it or blocking in open(2).

        Raises:
            CorruptCheckpointError: the record is not a regular file, or larger than any record can be.
            TierIOError: it cannot be read.
        """
        p = self._record_path(step)
        if os.path.islink(p.parent):
            return None  # links are not followed
        return read_regular(self.name, p, step, "commit record", _MAX_RECORD_BYTES)

    def remove_record(self, step: int) -> None:
        self._check_lease()
        p = self._record_path(step)
        try:
            os.unlink(p)
        except FileNotFoundError:
            return
        except OSError as e:
            raise io_error(self.name, f"cannot remove the commit record of step {step}", e) from e
        with contextlib.suppress(OSError):
            fsync_dir(p.parent)

    def list_records(self) -> list[int]:
        """Steps whose directory holds a ``commit`` file (one ``stat`` a step)."""
        return self._listing.records()

    def used_bytes(self) -> int:
        """Bytes of the files of every committed copy in the directory."""
        return self._listing.used_bytes()

    def open_copy(self, key: CheckpointKey) -> FileCopy:
        """Open ``key``'s copy by its rank directory: the manifest and blobs read through it are that
        copy's, even if another process evicts or replaces the step meanwhile (tierckpt.tiers._fileread)."""
        return FileCopy(self, self, key, step_dir_name(key.step), rank_dir_name(key.rank))

    def read_manifest(self, key: CheckpointKey) -> bytes:
        with self.open_copy(key) as copy:
            return copy.read_manifest()

    def copy_files(self, key: CheckpointKey) -> dict[str, Any]:
        """``{"layout": "per_node", "node_file": name, "offset": n}`` for a per-node copy (its region
        of the step's node file), else ``{"layout": "per_rank", "data_files": [names]}``."""
        copy = self.open_copy(key)
        try:
            copy.read_manifest()
            if copy.location is not None:
                return {"layout": "per_node", "node_file": copy.location.name, "offset": copy.location.offset}
            return {"layout": "per_rank", "data_files": sorted(n for n in os.listdir(copy.path) if n != MANIFEST_NAME)}
        finally:
            copy.close()

    def close(self) -> None:
        """Release the lease (another job may write here once no process of this one holds it) and
        close the engine the tier made for itself (:attr:`engine`), if it made one."""
        if self.lease is not None:
            self.lease.release()
        self._close_engine()

    def lease_job(self) -> str | None:
        """The job identity the directory's lease is held for; None for a read-only tier (no lease)."""
        return None if self.lease is None else self.lease.job.value

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def _take_room(self, step: int, need: int, what: str = "checkpoint") -> int:
        """Take ``need`` bytes of the tier's capacity for a write of ``step`` (given back with
        :meth:`_unreserve`); the bytes taken (0 without a capacity). TierFullError when they are not free."""
        self._check_lease()
        if self.capacity_bytes is None:
            return 0
        used = self.used_bytes()  # listed outside the lock: a commit meanwhile counts twice, not never
        with self._lock:
            if used + self._reserved + need > self.capacity_bytes:
                raise TierFullError(
                    f"tier {self.name!r}: {what} of step {step} needs {need} bytes, "
                    f"{max(0, self.capacity_bytes - used - self._reserved)} of capacity "
                    f"{self.capacity_bytes} are free"
                )
            self._reserved += need
        return need

    def reserve(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        """A writer of ``key``'s copy. On a ``files: per_node`` tier used without a place from the rank
        executor (:meth:`reserve_at`), the copy gets a node file of its own (a node of one rank)."""
        if self.node_files:
            part, _ = self.node_part(blobs)
            return self.reserve_at(key, blobs, Location(self.create_node_file(key.step, key.rank, part), 0))
        need = self._take_room(key.step, sum(b.size for b in blobs))
        try:
            step_dir = self.path / step_dir_name(key.step)
            return FileWriter(
                self,
                key,
                blobs,
                need,
                self._unreserve,
                step_dir=step_dir,
                tmp=step_dir / scratch_name("tmp", key.rank),
                final=self._rank_dir(key),
                old=step_dir / scratch_name("old", key.rank),
                one_file=self.geometry.one_file,
                layout=None if self.file_layout is None else (self.facts.family, self.file_layout),
            )
        except BaseException:
            self._unreserve(need)
            raise

    # -- per-node copies (``files: per_node``; tierckpt.tiers._nodefile) --------------------------------
    def node_part(self, blobs: Sequence[BlobEntry]) -> tuple[int, int]:
        """The bytes of a copy's region in its node's file and the multiple its start must be."""
        return node_part(self.geometry, blobs)

    def create_node_file(self, step: int, first_rank: int, nbytes: int) -> str:
        """Create ``step``'s new node file of ``nbytes`` for the node whose first rank is ``first_rank``
        (its room checked against the capacity, then allocated on the device); its name. Counted in
        :meth:`used_bytes` from then on, once whatever copies it holds."""
        taken = self._take_room(step, nbytes, "the node file")
        try:
            layout = None if self.file_layout is None else (self.facts.family, self.file_layout)
            return create_node_file(self, self.path / step_dir_name(step), first_rank, nbytes, layout)
        finally:
            self._unreserve(taken)  # the file itself is counted now

    def reserve_at(self, key: CheckpointKey, blobs: Sequence[BlobEntry], place: Location) -> TierWriter:
        """A writer of ``key``'s copy into its region of the node file ``place`` names (made by
        :meth:`create_node_file`, by this rank or its node's first)."""
        self._check_lease()
        step_dir = self.path / step_dir_name(key.step)
        return NodeFileWriter(
            self,
            key,
            blobs,
            step_dir=step_dir,
            tmp=step_dir / scratch_name("tmp", key.rank),
            final=self._rank_dir(key),
            old=step_dir / scratch_name("old", key.rank),
            place=place,
        )

    def _unreserve(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._reserved -= nbytes

    def reader(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierReader:
        with self.open_copy(key) as copy:
            return copy.reader(blobs)

    def evict(self, key: CheckpointKey, *, free: bool = True) -> None:
        self._check_lease()
        src = self._rank_dir(key)
        gone = src.parent / scratch_name("evict", key.rank)
        try:
            os.rename(src, gone)
        except FileNotFoundError:
            if self.node_files:  # a failed save's: its node file goes once no copy and no writer is left
                drop_unused_node_files(src.parent)
            return
        except OSError as e:
            raise io_error(self.name, f"cannot evict step {key.step}", e) from e
        with contextlib.suppress(OSError):
            fsync_dir(src.parent)
        with self._lock:
            self._evicted.append(gone)
        if free:
            self.reclaim()

    def reclaim(self) -> None:
        """Delete the directories of evicted checkpoints (unlisted already; a crash leaves them to the
        next start's sweep)."""
        with self._lock:
            gone, self._evicted = self._evicted, []
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
            # the step's node files, once no copy (of any rank) and no write is left; then the directory
            drop_unused_node_files(p.parent)

    def _close_engine(self) -> None:
        """Close the engine the tier made for itself (:attr:`engine`), if it made one."""
        if self._own_engine and self._engine is not None:
            self._engine.close()
            self._engine, self._own_engine = None, False
