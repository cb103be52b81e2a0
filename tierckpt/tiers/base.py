"""The tier contract: a place where a checkpoint's manifest and blobs can live.

Call sequence (like DCP's ``StorageWriter``; in a multi-rank job every rank runs it for its own
``CheckpointKey(step, rank)``, nothing is coordinated through the tier):

Write, by the hierarchy's saving thread::

    w = tier.reserve(key, blobs)          # room is checked and taken; nothing is visible yet
    w.buffer(i)                           # memory tiers: the blob's bytes, to pack into directly
    w.write(i, offset, addr, nbytes)      # any number, any order; returns a Future; aligned for files
    w.commit(manifest_bytes)              # after every write future is done: durable, then published
                                          # atomically (rename / swap); the step becomes listable
    w.abort()                             # instead of commit, on any failure: leaves no trace
    w.cancel()                            # optional, any thread, before waiting for the writes and
                                          # aborting: the writes in flight fail soon, later ones at once

A tier that keeps the copies of a node's ranks in one data file (``node_files``: a file tier with
``files: per_node``) is written the same way, except that its writer comes from
``tier.reserve_at(key, blobs, place)``: the rank executor gets each rank's ``place`` (the node file and
the offset of the rank's region) in one exchange per save and node, in which the node's first rank asks
``tier.node_part(blobs)`` of every rank and creates the file with ``tier.create_node_file(...)``
(docs/distributed.md, "A per-node data file"). The tier never calls the ranks' coordination itself.

Read, by any thread or process::

    tier.list_committed(rank=None)        # keys of committed checkpoints, oldest first (one rank's)
    tier.holds(key)                       # whether one key is committed (default: from list_committed)
    with tier.open_copy(key) as copy:     # one copy, opened as a whole (a snapshot where the tier can)
        copy.read_manifest()              # the manifest's bytes
        r = copy.reader(blobs)            # every blob opened and its size checked; then
                                          # r.read(i, offset, addr, nbytes) -> Future[int]; r.close()
    r.read_alignment(i)                   # optional: (memory, offset) alignment under which r.read may
                                          # target any memory, e.g. a caller's tensor (None: staging only)
    tier.read_manifest(key), tier.reader(key, blobs)   # the same, each opening the copy on its own

Commit records, by the hierarchy (docs/distributed.md): once every rank's copy of a step is durable on
the tier, one record per step says so (and names each rank's manifest). A step without its record is
not committed, whatever copies the tier holds::

    tier.write_record(step, data)         # atomically, replacing the step's record if there is one
                                          # (TierFullError on a full device: room is made, then again)
    tier.read_record(step)                # its bytes, or None
    tier.remove_record(step)              # before a step's copies are evicted (missing: ignored)
    tier.list_records()                   # steps that have one, oldest first

Memory tiers keep records in the tier object (the default implementation); a persistent tier must
store them with its copies (the file tiers: ``step-N/commit``).

Readers take no lock and no lease: another process may evict or replace (save again) a checkpoint while
it is read. A tier whose copies other processes can change (the file tiers) makes :meth:`Tier.open_copy`
a snapshot: the manifest and every blob come from the one copy that was committed when it was opened,
however it is renamed or deleted afterwards. A copy that disappears before it is fully opened raises
:class:`~tierckpt.errors.CheckpointNotFoundError` (:class:`~tierckpt.errors.CheckpointEvictedError` where
the tier saw it go), never :class:`~tierckpt.errors.CorruptCheckpointError`: a healthy checkpoint is
never called damaged because it went away.

Evict, by the hierarchy's retention: ``tier.evict(key)`` makes the checkpoint unlistable first (one
rename), then frees it; ``tier.evict(key, free=False)`` leaves the freeing to the next
``tier.reclaim()``, which the mover calls once the save that triggered the eviction has resolved (so a
blocking save does not wait while gigabytes of files are deleted). A crash at any point leaves either
the old state or the new one.

Capabilities are declared data, validated when they are made (``TierCapabilities``) and read by the
hierarchy when it is built or a copy is planned (docs/tiers.md says who reads each).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import torch

from tierckpt.format.location import Location
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.budget import Budget
from tierckpt.io.geometry import IOGeometry, io_geometry
from tierckpt.ioconfig import IOConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierckpt.config import TierConfig
    from tierckpt.format.layout import Layout
    from tierckpt.format.tree import FlatState
    from tierckpt.io.buffers import StagingPool
    from tierckpt.io.engine import IOEngine
    from tierckpt.policies.compressconfig import CompressConfig
    from tierckpt.policies.compression import Adaptive

__all__ = [
    "DEVICES",
    "CheckpointKey",
    "EngineSource",
    "Tier",
    "TierCapabilities",
    "TierCopy",
    "TierReader",
    "TierWriter",
]


DEVICES = ("cpu", "cuda", "file", "object")
"""Where a tier's bytes live: process memory, CUDA device memory, files, an object store."""


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier is and what its writes need, declared once; each field says who reads it.

    Not declared: how a tier makes its commit atomic (a rename, a swap, a commit marker written last).
    That is the tier's own business; the contract is that ``commit`` publishes the whole checkpoint at
    once and that a half-written copy is never listed, and nothing above the tier acts differently.

    Attributes:
        persistent: survives the end of the process. Read by the hierarchy at build: a hierarchy with
            no persistent tier warns (its checkpoints die with the process).
        shared: visible from other nodes (a parallel file system, an object store). Routes the tier's
            eviction decisions through the hierarchy's Coordinator (every rank evicts the same steps);
            a restore reads a shared tier's blobs with every staging slot.
        device: where the bytes live, one of :data:`DEVICES`: ``cpu`` (process memory), ``cuda``,
            ``file`` or ``object`` (an object store).
        alignment_bytes: buffers, offsets and lengths of writes and reads must be multiples of this (a
            power of two; 1: none). Sets the checkpoint's alignment (the largest of the layout's and
            every tier's).
        sequential_writes: each blob must be written front to back: its writes arrive in increasing
            offset order, contiguous, each issued once the previous one completed, one blob after
            another (a streaming or multipart upload). Makes the mover issue this tier's writes in
            order, one at a time per blob. False: any order, many in flight.
        min_part_bytes: the smallest write the tier accepts, except a blob's last (an S3 multipart
            part is at least 5 MiB). With ``max_part_bytes``, bounds the chunk size of writes to the tier.
        max_part_bytes: the largest write the tier accepts (None: no bound); at least
            ``alignment_bytes`` and ``min_part_bytes``.
        cheap_listing: ``list_committed`` / ``holds`` cost no more than a local metadata lookup. False
            (an object store's LIST costs a round trip and money): retention uses the hierarchy's
            record of what it committed instead of listing the tier after every commit.
        encoded_copies: the tier can store a compressed copy (docs/tiers.md, "Compression"): its writer
            takes blobs whose writes stop before the blob's size (at the stored stream's end:
            :class:`BlobEntry` ``held``), its commit keeps what was written, and its reader opens each blob
            at its ``held`` length. Read when the tier's ``compress:`` is set: a tier that does not declare
            it gets ``none`` by default and refuses any other setting. The built-in host, local, pfs and s3
            tiers declare it.

    Raises:
        ValueError: naming the field, e.g. a ``device`` outside :data:`DEVICES` (listing them), an
            alignment that is not a power of two, or ``min_part_bytes > max_part_bytes``.
    """

    persistent: bool
    shared: bool
    device: str
    alignment_bytes: int
    sequential_writes: bool = False
    min_part_bytes: int = 0
    max_part_bytes: int | None = None
    cheap_listing: bool = True
    encoded_copies: bool = False

    def __post_init__(self) -> None:
        for name in ("persistent", "shared", "sequential_writes", "cheap_listing", "encoded_copies"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TierCapabilities.{name}: expected True or False, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise ValueError(f"TierCapabilities.device: expected one of {', '.join(DEVICES)}, got {self.device!r}")
        align = self.alignment_bytes
        if not _is_int(align) or align < 1 or align & (align - 1) or align > 1 << 30:
            raise ValueError(f"TierCapabilities.alignment_bytes: expected a power of two from 1 to 1GiB, got {align!r}")
        if not _is_int(self.min_part_bytes) or self.min_part_bytes < 0:
            raise ValueError(f"TierCapabilities.min_part_bytes: expected an int >= 0, got {self.min_part_bytes!r}")
        top = self.max_part_bytes
        if top is not None and (not _is_int(top) or top < max(align, self.min_part_bytes, 1)):
            raise ValueError(
                f"TierCapabilities.max_part_bytes: expected None or an int >= alignment_bytes ({align}) and "
                f">= min_part_bytes ({self.min_part_bytes}), got {top!r}"
            )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, order=True)
class CheckpointKey:
    """One rank's part of one step."""

    step: int
    rank: int = 0


class EngineSource:
    """Gives tiers an I/O engine for their settings; engines are shared and closed by the hierarchy."""

    def get(self, engine: str, queue_depth: int) -> IOEngine:  # pragma: no cover - interface
        raise NotImplementedError


class TierWriter(ABC):
    """One checkpoint being written to one tier (see the module docstring for the sequence)."""

    def buffer(self, blob: int) -> torch.Tensor | None:
        """The blob's own memory (uint8, aligned) on memory tiers, to pack into; None on file tiers."""
        return None

    @abstractmethod
    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        """Write ``nbytes`` at ``addr`` to ``offset`` of blob ``blob``; keep the memory alive until done."""

    @abstractmethod
    def commit(self, manifest: bytes) -> None:
        """Make everything durable, then publish atomically. Raises on failure (the writer is aborted),
        except :class:`~tierckpt.errors.TierFullError` (e.g. a full device as the manifest is written):
        the writer is left as it was, so that the hierarchy makes room and commits again, or aborts."""

    @abstractmethod
    def abort(self) -> None:
        """Drop everything written so far. Idempotent; never raises for cleanup problems."""

    def cancel(self) -> None:  # noqa: B027 - optional hook
        """Make the writes in flight fail soon and later ones fail at once, dropping nothing yet: the
        caller then waits for their futures (their memory is read until they resolve) and calls
        :meth:`abort`. For a writer whose writes can wait long (a remote store's retries); the default
        does nothing, for writes that end on their own. Idempotent; from any thread."""


class TierReader(ABC):
    """Reads the blobs of one committed checkpoint."""

    def buffer(self, blob: int) -> torch.Tensor | None:
        """The blob's own memory (uint8) on memory tiers, to copy from directly; None on file tiers."""
        return None

    @abstractmethod
    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        """Read into ``addr``; the result is the byte count (short only when the blob is truncated).

        ``addr``, ``offset`` and ``nbytes`` are multiples of the checkpoint's alignment (callers read
        into aligned staging buffers), or of :meth:`read_alignment` where that is not None.
        """

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        """``(memory, offset)`` alignment under which :meth:`read` may target any memory (a caller's
        tensor instead of a staging buffer); lengths must be multiples of the offset alignment.

        None (the default): only reads into buffers aligned to the checkpoint's alignment are supported.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release file descriptors."""


class TierCopy:
    """One committed copy of a checkpoint, opened for reading by :meth:`Tier.open_copy`; a context manager.

    This default reads through the tier's own :meth:`Tier.read_manifest` and :meth:`Tier.reader`, at
    different times: it is no snapshot, since a replace between the two would pair one version's
    manifest with another's blobs. Every tier whose copies can be replaced or evicted while they are
    read (by another thread or process) overrides :meth:`Tier.open_copy` to return a snapshot (see the
    module docstring); the conformance suite checks it.

    Args:
        tier: the tier.
        key: the checkpoint.
    """

    def __init__(self, tier: Tier, key: CheckpointKey) -> None:
        self.tier, self.key = tier, key

    def read_manifest(self) -> bytes:
        """The manifest's bytes (CorruptCheckpointError when it is not a readable manifest file)."""
        return self.tier.read_manifest(self.key)

    def reader(self, blobs: Sequence[BlobEntry]) -> TierReader:
        """Open the blobs named by this copy's manifest; a blob shorter than its declared size raises
        CorruptCheckpointError before anything is read. The reader outlives :meth:`close`."""
        return self.tier.reader(self.key, blobs)

    def close(self) -> None:
        """Release what the copy holds open (readers made from it stay usable)."""

    def __enter__(self) -> TierCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Tier(ABC):
    """A storage tier. Subclasses declare ``kind`` and ``capabilities`` and implement the sequence above.

    Attributes:
        name: the tier's name in the hierarchy (policies and records use it).
        preferred_blob_bytes: the blob size the kind writes best: a declared preference, one input of
            :meth:`plan_geometry` (the size a save uses is the checkpoint geometry's ``blob_bytes``: the
            largest any tier prefers, unless ``layout.blob_size``).
        chunk_bytes: the size of one I/O operation the kind prefers: a declared preference, one input of
            :meth:`plan_geometry` (the size used is :attr:`geometry`'s ``chunk_bytes``, within the
            tier's part sizes and alignment; the file tiers take the hierarchy's ``io.chunk`` instead
            unless given their own, and read it as their geometry's).
        budget: the tier's bandwidth budget, or None: a token bucket that the hierarchy's data path
            charges before each read and write of the tier's blobs that it paces (docs/tiers.md,
            "Bandwidth budgets"). One per tier object: hierarchies that share the tier share it. A file
            tier makes it from its ``bandwidth_bytes_per_sec``; a tier of any other kind that moves its
            bytes through :meth:`TierWriter.write` and :meth:`TierReader.read` takes one from its YAML
            entry's ``io.bandwidth`` (or have one assigned); a memory tier takes none.
        compress: how the tier stores its copies (docs/tiers.md, "Compression"): set by the hierarchy it
            joins, from its entry's ``compress:``, else the default for its capabilities
            (:func:`~tierckpt.policies.compressconfig.tier_compress`: ``auto`` on shared persistent file
            tiers and object stores, ``none`` elsewhere); assign one before to choose it from Python.
        adaptive: the compression decisions for the tier's copies, kept up to date from what its
            writers measure: one per tier object, shared by every copy written to it (set with
            ``compress``).

    What a full tier does (wait for room or fail) is policy, not the tier's: ``policy.on_full``.
    """

    kind: str = "abstract"
    capabilities: TierCapabilities
    # declared preferences, inputs of the geometry (docs/tiers.md, "I/O geometry"); no I/O reads them
    preferred_blob_bytes: int = 256 << 20
    chunk_bytes: int = 32 << 20
    _geometry: IOGeometry | None = None
    _geometry_io: IOConfig | None = None  # the io settings it was fixed for
    budget: Budget | None = None
    compress: CompressConfig | None = None
    adaptive: Adaptive | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> Tier:
        """Build the tier from its config entry (``Hierarchy.from_config`` calls it for each entry).

        The common keys are checked already; the kind checks its own ``cfg.options``
        (:func:`tierckpt.tiers.options.check_options`) and parses its own ``cfg.location`` (a directory:
        :func:`tierckpt.tiers.options.local_directory`; a URL: the kind's own parsing).

        Args:
            cfg: the entry.
            engines: the hierarchy's shared I/O engines (``engines.get(cfg.io.engine, cfg.io.queue_depth)``).

        Raises:
            ConfigError: naming the key (``tiers[1].path: ...``, ``tiers[1].options.bucket: ...``).
        """

    def use_io(self, engines: EngineSource, io: IOConfig) -> None:
        """Called once by the hierarchy the tier joins: take what the constructor left unset (a file
        tier's engine, ``direct``, chunk size) from the hierarchy's ``io`` settings. This default fixes
        the tier's :attr:`geometry` for them; the hierarchy fixes it again right after
        (:meth:`fix_geometry`), so an override that does not call ``super().use_io(engines, io)`` still
        gets the geometry of the hierarchy's ``io``."""
        self.fix_geometry(io)

    @final
    def fix_geometry(self, io: IOConfig) -> IOGeometry:
        """Fix the tier's :attr:`geometry` as :meth:`plan_geometry` makes it for the io settings ``io``,
        and return it. The hierarchy calls it for every tier it is built with, after :meth:`use_io`;
        not to be overridden (a kind sizes its I/O in :meth:`plan_geometry`)."""
        self._geometry, self._geometry_io = self.plan_geometry(io), io
        return self._geometry

    def plan_geometry(self, io: IOConfig) -> IOGeometry:
        """The tier's I/O geometry under the io settings ``io`` (docs/tiers.md, "I/O geometry"): by
        default :func:`~tierckpt.io.geometry.io_geometry` of its capabilities, :attr:`chunk_bytes` and
        :attr:`preferred_blob_bytes`; a kind that knows more of its storage overrides it (the file tiers
        add their file system's facts)."""
        return io_geometry(self.capabilities, io, blob_bytes=self.preferred_blob_bytes, chunk_bytes=self.chunk_bytes)

    @property
    def geometry(self) -> IOGeometry:
        """The sizes of the tier's I/O (alignment, chunk, blob size, staging slots ...), fixed by
        :meth:`fix_geometry` when it joins a hierarchy; before that, under the default io settings."""
        return self._geometry if self._geometry is not None else self.plan_geometry(IOConfig())

    @abstractmethod
    def reserve(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        """Take room for a checkpoint with these blobs; raise TierFullError when there is none."""

    #: whether the copies of a node's ranks share one data file a step (a file tier's ``files: per_node``):
    #: its writers then come from :meth:`reserve_at`, with a place the rank executor got for them
    node_files: bool = False

    def node_part(self, blobs: Sequence[BlobEntry]) -> tuple[int, int]:
        """Optional (:attr:`node_files` tiers): the bytes a copy of ``blobs`` takes in its node's file, and
        the multiple its region's start must be (the node's first rank lays the regions out)."""
        raise NotImplementedError(f"tier kind {self.kind!r} writes no node files (Tier.node_part)")

    def create_node_file(self, step: int, first_rank: int, nbytes: int) -> str:
        """Optional (:attr:`node_files` tiers): create ``step``'s new node file of ``nbytes`` (room
        allocated, its name durable), for the node whose first rank is ``first_rank``; its name. Run by
        that rank once per save and node. TierFullError when there is no room (the save then fails on the tier: nothing is evicted for it)."""
        raise NotImplementedError(f"tier kind {self.kind!r} writes no node files (Tier.create_node_file)")

    def reserve_at(self, key: CheckpointKey, blobs: Sequence[BlobEntry], place: Location) -> TierWriter:
        """Optional (:attr:`node_files` tiers): :meth:`reserve`, the copy's blobs going to its region of
        the node file at ``place`` (made by :meth:`create_node_file`)."""
        raise NotImplementedError(f"tier kind {self.kind!r} writes no node files (Tier.reserve_at)")

    @abstractmethod
    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        """Committed checkpoints on this tier, sorted by (step, rank); only ``rank``'s when given (a
        shared tier then need not look at every rank's copies)."""

    def holds(self, key: CheckpointKey) -> bool:
        """Whether ``key`` is committed here (a cheaper question than :meth:`list_committed` where a
        tier can answer it alone, as file tiers do with one ``stat``)."""
        return key in self.list_committed(key.rank)

    @abstractmethod
    def read_manifest(self, key: CheckpointKey) -> bytes:
        """The manifest bytes; CheckpointNotFoundError if ``key`` is not committed here."""

    @abstractmethod
    def reader(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierReader:
        """Open the blobs of a committed checkpoint for reading."""

    def open_copy(self, key: CheckpointKey) -> TierCopy:
        """Open ``key``'s copy on this tier for reading: its manifest and blobs then come from that one
        copy (see the module docstring). CheckpointNotFoundError if ``key`` is not committed here."""
        return TierCopy(self, key)

    @abstractmethod
    def evict(self, key: CheckpointKey, *, free: bool = True) -> None:
        """Remove a committed checkpoint (missing keys are ignored).

        Args:
            key: the checkpoint.
            free: free its space now; with ``False`` it is only made unlistable at once, and
                :meth:`reclaim` frees it later (tiers whose freeing is cheap free it anyway).
        """

    # -- commit records (see the module docstring): in the tier object, for memory tiers --------------
    def write_record(self, step: int, data: bytes) -> None:
        """Publish ``step``'s commit record atomically (replacing the step's record if there is one).

        A persistent tier must override the record methods and keep records durably with its copies;
        this default keeps them in the tier object, which is right only for a tier whose copies do not
        outlive the process."""
        if self.capabilities.persistent:
            raise NotImplementedError(f"tier kind {self.kind!r} keeps no commit records (Tier.write_record)")
        self.__records()[step] = bytes(data)

    def read_record(self, step: int) -> bytes | None:
        """``step``'s commit record, or None when the tier holds none."""
        if self.capabilities.persistent:
            raise NotImplementedError(f"tier kind {self.kind!r} keeps no commit records (Tier.read_record)")
        return self.__records().get(step)

    def remove_record(self, step: int) -> None:
        """Remove ``step``'s commit record (none: nothing to do): the step is no longer committed here."""
        if self.capabilities.persistent:
            raise NotImplementedError(f"tier kind {self.kind!r} keeps no commit records (Tier.remove_record)")
        self.__records().pop(step, None)

    def list_records(self) -> list[int]:
        """The steps whose commit record the tier holds, oldest first."""
        if self.capabilities.persistent:
            raise NotImplementedError(f"tier kind {self.kind!r} keeps no commit records (Tier.list_records)")
        return sorted(self.__records())

    def __records(self) -> dict[int, bytes]:
        records: dict[int, bytes] | None = self.__dict__.get("_memory_records")
        if records is None:
            records = self.__dict__.setdefault("_memory_records", {})
        return records

    # -- optional methods: a tier overrides them where it can do better than the generic path ----------
    def pack(
        self,
        writer: TierWriter,
        flat: FlatState,
        layout: Layout,
        staging: Callable[[], StagingPool],
        on_staged: Callable[[], None],
    ) -> list[int] | None:
        """Optional: snapshot a save's tensors into ``writer`` (from this tier's :meth:`reserve`) itself.

        The mover calls it for the first copy of a save on this tier. A tier whose memory the generic
        packer cannot write with ``memmove`` (device memory) copies the tensors with its own means, calls
        ``on_staged()`` once nothing more is read from the caller's tensors, and returns one xxh3-64
        checksum per tensor extent of ``layout`` (docs/format.md). Return None (the default) to let the
        generic packer fill ``writer.buffer(i)`` or call ``writer.write``.

        Args:
            writer: the reserved checkpoint.
            flat: the flattened state (its tensors, in extent order).
            layout: where each tensor's bytes go.
            staging: this tier's worker's staging buffers (host memory), e.g. for checksumming.
            on_staged: call once the caller's tensors may change again.
        """
        return None

    def copy_buffer(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        """Optional: copy ``nbytes`` between two uint8 buffers, one of them this tier's and not in host
        memory (``TierWriter.buffer`` / ``TierReader.buffer`` on a device). The mover calls it for a
        device ↔ memory copy between two memory tiers; the default is a synchronous ``Tensor.copy_``
        (a gpu tier overrides it with a copy on its own stream)."""
        dst[:nbytes].copy_(src[:nbytes])

    def reclaim(self) -> None:  # noqa: B027 - optional hook
        """Free the space of checkpoints evicted with ``free=False``."""

    def used_bytes(self) -> int:
        """Bytes held by committed checkpoints (for capacity checks and ``tierckpt ls``)."""
        return 0

    def describe(self) -> str:
        """Where the tier keeps its bytes, for humans."""
        return self.kind

    def storage_facts(self) -> dict[str, Any]:
        """Optional: what the tier knows of its storage, as plain values (``tierckpt inspect --json``
        shows them beside its geometry): nothing by default; a file tier's file-system facts
        (:class:`~tierckpt.io.geometry.FsFacts`) and the layout it sets on its new data files."""
        return {}

    def copy_files(self, key: CheckpointKey) -> dict[str, Any]:
        """Optional: where ``key``'s copy keeps its bytes, as plain values (``tierckpt inspect --json``
        shows them): nothing by default; a file tier's layout (``per_rank``: its data files;
        ``per_node``: the node file and the offset of the copy's region in it)."""
        return {}

    def lease_job(self) -> str | None:
        """Optional: the job identity this tier's lease on its location is held for (docs/jobs.md), or
        None (the default) for a tier that holds no lease: memory tiers, a read-only file tier. A tier
        that leases its location to one job at a time returns the identity it holds it for; a hierarchy
        checks that every tier's is its own job's (:func:`~tierckpt.tiers.jobs.hierarchy_job`)."""
        return None

    def location(self) -> str | None:
        """Optional: where the tier keeps its bytes, as a string two tiers that would share copies both
        return (a resolved directory, a bucket URL with its prefix); None (the default) for a place of
        its own, such as process memory. A hierarchy refuses two tiers at one location: each one's
        retention would evict the other's copies."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (the hierarchy closes shared engines itself)."""
