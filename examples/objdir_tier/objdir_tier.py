"""``objdir``: a worked third-party tier with object-store semantics, kept in a local directory.

It behaves like an S3 bucket, so that a real object-store tier can be written the same way:

* objects are immutable and appear whole: a blob is a multipart upload (its parts written in order
  into a hidden upload, then completed by one rename); nothing is written in place;
* a checkpoint is published by a commit marker object written last; a replacement is a new version
  next to the old one (never overwritten), and the old version's objects are deleted after its
  marker; listing is by key prefix (``commits/step-…/rank-…/<version>``);
* reads are ranged GETs by key: a reader does not hold a copy open, so a copy deleted while it is read
  raises CheckpointEvictedError, and one version's bytes are never mixed with another's.

Location ``objdir:///absolute/path``; options ``{part_size: 8MiB}``: every write but a blob's last is at
least this large (S3 refuses parts under 5 MiB), which the tier declares as ``min_part_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tierckpt.config import TierConfig
from tierckpt.errors import (
    CheckpointEvictedError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    TierFullError,
)
from tierckpt.format.frames import held_sizes
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import ptr_mv
from tierckpt.tiers.base import CheckpointKey, EngineSource, Tier, TierCapabilities, TierCopy, TierReader, TierWriter
from tierckpt.tiers.options import Option, check_options, size

__all__ = ["Bucket", "ObjdirTier"]

OPTIONS = {"part_size": Option(size(lo=4 << 10, hi=1 << 30), default=8 << 20, doc="smallest part of an upload")}
_UPLOADS = ".uploads"  # incomplete uploads: never listed


def _done(n: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(n)
    return f


class Upload:
    """A multipart upload of one object: a hidden file its parts are appended to, in order."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket, self.path = bucket, bucket.root / _UPLOADS / secrets.token_hex(8)
        self.fd, self.nbytes = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), 0

    def part(self, view: memoryview) -> None:
        self.nbytes += len(view)
        while view:
            view = view[os.write(self.fd, view) :]

    def complete(self, key: str) -> None:
        """Make the upload the object ``key``: durable, then in place by one rename (it appears whole)."""
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        dst = self.bucket.root / key
        for attempt in (0, 1):  # a delete may remove an empty parent between mkdir and rename
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(self.path, dst)
                return
            except FileNotFoundError:
                if attempt:
                    raise

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Bucket:
    """A toy object store in a directory: PUT, multipart uploads, ranged GET, HEAD, LIST by prefix, DELETE."""

    def __init__(self, root: Path, *, readonly: bool = False) -> None:
        self.root = root
        if readonly and not root.is_dir():
            raise FileNotFoundError(f"no bucket at {root}")
        if not readonly:
            (root / _UPLOADS).mkdir(parents=True, exist_ok=True)

    def put(self, key: str, data: bytes) -> None:
        up = Upload(self)
        try:
            up.part(memoryview(data))
            up.complete(key)
        finally:
            up.abort()

    def get(self, key: str) -> bytes:
        """GET a whole object; FileNotFoundError if there is none."""
        with open(self.root / key, "rb") as f:
            return f.read()

    def get_into(self, key: str, offset: int, addr: int, nbytes: int) -> int:
        """Ranged GET into memory; the bytes there are (short at the object's end). FileNotFoundError if gone."""
        fd = os.open(self.root / key, os.O_RDONLY)
        try:
            got, view = 0, ptr_mv(addr, nbytes)
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
            return got
        finally:
            os.close(fd)

    def head(self, key: str) -> int | None:
        """The object's size, or None."""
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object whose key starts with ``prefix``, sorted (one LIST request)."""
        out = []
        for dirpath, dirs, files in os.walk(self.root / prefix.rpartition("/")[0]):
            dirs[:] = [d for d in dirs if d != _UPLOADS]
            for f in files:
                key = os.path.relpath(os.path.join(dirpath, f), self.root)
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        out.append((key, os.stat(os.path.join(dirpath, f)).st_size))
        return sorted(out)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / key)
        parent = (self.root / key).parent
        while parent != self.root:  # an object store has no directories: drop the empty ones
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def _ckpt(key: CheckpointKey) -> str:
    return f"step-{key.step:012d}/rank-{key.rank:05d}"


class ObjdirTier(Tier):
    """An object-store tier in a local directory (see the module docstring).

    Args:
        name: tier name.
        root: the directory (the "bucket"), created if missing.
        part_size: smallest write except a blob's last.
        capacity_bytes: most bytes of committed checkpoints and reservations, or None.
        blob_bytes: preferred blob size, or None for 256 MiB.
        readonly: only look (``tierckpt ls``): the directory must exist, and nothing is created.
    """

    kind = "objdir"
    preferred_blob_bytes = 256 << 20

    def __init__(
        self,
        name: str,
        root: str | os.PathLike[str],
        *,
        part_size: int = 8 << 20,
        capacity_bytes: int | None = None,
        blob_bytes: int | None = None,
        readonly: bool = False,
    ) -> None:
        super().__init__(name)
        self.bucket = Bucket(Path(root), readonly=readonly)
        self.capacity_bytes = capacity_bytes
        self.preferred_blob_bytes = blob_bytes or self.preferred_blob_bytes
        self.chunk_bytes = max(part_size, 8 << 20)
        self.capabilities = TierCapabilities(
            persistent=True,
            shared=True,
            device="object",
            alignment_bytes=1,
            sequential_writes=True,
            min_part_bytes=part_size,
            max_part_bytes=5 << 30,
            cheap_listing=False,
            encoded_copies=True,  # a compressed copy's blobs end at their stored streams (held_sizes)
        )
        self._lock = threading.Lock()
        self._reserved = 0
        self._unfreed: list[str] = []  # data prefixes of versions evicted with free=False

    @classmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> ObjdirTier:
        """``path: objdir:///absolute/path``, ``options: {part_size: 8MiB}``."""
        opts = check_options(cfg, OPTIONS)
        url = urlsplit(cfg.location or "")
        if url.scheme != "objdir" or url.netloc or not url.path.startswith("/") or url.query or url.fragment:
            raise ConfigError(f"{cfg.key}.path: expected a location like objdir:///absolute/path, got {cfg.location!r}")
        return cls(cfg.name, unquote(url.path), part_size=opts["part_size"], capacity_bytes=cfg.capacity_bytes,
                   blob_bytes=cfg.blob_bytes, readonly=cfg.readonly)  # fmt: skip

    def describe(self) -> str:
        return f"objdir://{self.bucket.root} (objects, parts of {self.capabilities.min_part_bytes} bytes)"

    # -- what is committed: the markers ----------------------------------------------------------------
    def _versions(self, key: CheckpointKey) -> list[str]:
        """Committed versions of ``key``, oldest first (one LIST)."""
        return [k.rpartition("/")[2] for k, _ in self.bucket.list(f"commits/{_ckpt(key)}/")]

    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        keys = set()
        for k, _ in self.bucket.list("commits/"):
            _, step, r, _ = k.split("/")
            key = CheckpointKey(int(step[5:]), int(r[5:]))
            if rank is None or key.rank == rank:
                keys.add(key)
        return sorted(keys)

    def holds(self, key: CheckpointKey) -> bool:
        return bool(self._versions(key))

    def used_bytes(self) -> int:
        live = {f"data/{k.partition('/')[2]}/" for k, _ in self.bucket.list("commits/")}
        return sum(n for k, n in self.bucket.list("data/") if k[: k.rfind("/") + 1] in live)

    # -- commit records: one object per step (a PUT is atomic) --------------------------------------------
    def write_record(self, step: int, data: bytes) -> None:
        self.bucket.put(f"records/step-{step:012d}", data)

    def read_record(self, step: int) -> bytes | None:
        try:
            return self.bucket.get(f"records/step-{step:012d}")
        except FileNotFoundError:
            return None

    def remove_record(self, step: int) -> None:
        self.bucket.delete(f"records/step-{step:012d}")

    def list_records(self) -> list[int]:
        return sorted(int(k.rpartition("-")[2]) for k, _ in self.bucket.list("records/step-"))

    # -- write -----------------------------------------------------------------------------------------
    def reserve(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        need = sum(b.size for b in blobs)
        if self.capacity_bytes is not None:
            used = self.used_bytes()
            with self._lock:
                if used + self._reserved + need > self.capacity_bytes:
                    raise TierFullError(f"tier {self.name!r}: step {key.step} needs {need} bytes, "
                                        f"{self.capacity_bytes - used - self._reserved} are free")  # fmt: skip
                self._reserved += need
        return _Writer(self, key, blobs, need if self.capacity_bytes is not None else 0)

    def _published(self, key: CheckpointKey) -> None:
        """After a commit: the newest version stays, older ones are unlisted, then deleted."""
        for v in self._versions(key)[:-1]:
            self.bucket.delete(f"commits/{_ckpt(key)}/{v}")
            self._delete_data(f"data/{_ckpt(key)}/{v}/")

    def _delete_data(self, prefix: str) -> None:
        for k, _ in self.bucket.list(prefix):
            self.bucket.delete(k)

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    # -- read and evict --------------------------------------------------------------------------------
    def open_copy(self, key: CheckpointKey) -> TierCopy:
        return _Copy(self, key)

    def read_manifest(self, key: CheckpointKey) -> bytes:
        with self.open_copy(key) as copy:
            return copy.read_manifest()

    def reader(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierReader:
        with self.open_copy(key) as copy:
            return copy.reader(blobs)

    def evict(self, key: CheckpointKey, *, free: bool = True) -> None:
        for v in self._versions(key):
            self.bucket.delete(f"commits/{_ckpt(key)}/{v}")  # unlisted now
            with self._lock:
                self._unfreed.append(f"data/{_ckpt(key)}/{v}/")
        if free:
            self.reclaim()

    def reclaim(self) -> None:
        with self._lock:
            prefixes, self._unfreed = self._unfreed, []
        for p in prefixes:
            self._delete_data(p)


class _Writer(TierWriter):
    """Blob after blob, each an upload of parts written in order; then the manifest, then the marker."""

    def __init__(self, tier: ObjdirTier, key: CheckpointKey, blobs: Sequence[BlobEntry], reserved: int) -> None:
        self.tier, self.key, self.blobs, self.reserved = tier, key, list(blobs), reserved
        self.version = f"{time.time_ns():020d}-{secrets.token_hex(4)}"  # newer versions sort later
        self.data = f"data/{_ckpt(key)}/{self.version}/"
        self.uploads: list[Upload] = []  # one per blob started; the last one is in progress
        self.short = False  # the last part was under min_part_bytes: the blob's last
        self.open = True

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        caps = self.tier.capabilities
        if not self.open:
            raise RuntimeError("writer already finished")
        while len(self.uploads) <= blob:  # a later blob: the one before is done (commit checks its length)
            self.uploads.append(Upload(self.tier.bucket))
            self.short = False
        up, size = self.uploads[blob], self.blobs[blob].size
        if blob != len(self.uploads) - 1 or offset != up.nbytes or offset + nbytes > size or self.short:
            raise ValueError(f"tier {self.tier.name!r}: sequential_writes: blob {blob} [{offset}, +{nbytes}) "
                             f"is not the next part (blob {len(self.uploads) - 1} at {up.nbytes} of {size})")  # fmt: skip
        # a part under min_part_bytes is the blob's last: it may end short of its size where the copy is
        # stored compressed (the manifest given to commit says what each blob holds)
        self.short = nbytes < caps.min_part_bytes and offset + nbytes != size
        up.part(ptr_mv(addr, nbytes, writable=False))
        return _done(nbytes)

    def _check_whole(self, blob: int, held: int) -> None:
        if self.uploads[blob].nbytes != held:
            raise ValueError(f"tier {self.tier.name!r}: blob {blob} holds {self.uploads[blob].nbytes} of its "
                             f"{held} bytes (sequential_writes: every blob whole, in order)")  # fmt: skip

    def commit(self, manifest: bytes) -> None:
        if not self.open:
            raise RuntimeError("writer already finished")
        try:
            while len(self.uploads) < len(self.blobs):  # blobs of 0 bytes are never written
                self.uploads.append(Upload(self.tier.bucket))
            # a copy stored compressed holds each blob's stored stream, shorter than its size
            held = held_sizes(manifest) or [b.size for b in self.blobs]
            for i, n in enumerate(held):
                self._check_whole(i, n)
            for up, b in zip(self.uploads, self.blobs):
                up.complete(self.data + b.name)
            self.tier.bucket.put(self.data + "manifest", manifest)
            self.tier.bucket.put(f"commits/{_ckpt(self.key)}/{self.version}", b"")  # the commit point
        except BaseException:
            self.abort()
            raise
        self.open = False
        self.tier._unreserve(self.reserved)
        self.tier._published(self.key)

    def abort(self) -> None:
        if self.open:
            self.open = False
            for up in self.uploads:
                up.abort()
            self.tier._delete_data(self.data)  # uploads already completed before a failed commit
            self.tier._unreserve(self.reserved)


class _Copy(TierCopy):
    """The newest committed version of a checkpoint, by name: its objects are read by key."""

    def __init__(self, tier: ObjdirTier, key: CheckpointKey) -> None:
        super().__init__(tier, key)
        self.otier, versions = tier, tier._versions(key)
        if not versions:
            raise CheckpointNotFoundError(f"tier {tier.name!r} holds no checkpoint for step {key.step} rank {key.rank}")
        self.version = versions[-1]
        self.data = f"data/{_ckpt(key)}/{self.version}/"

    def gone(self, what: str) -> OSError:
        """An object of the copy is missing: damage while its marker stands, else evicted or replaced."""
        if self.version in self.otier._versions(self.key):
            return CorruptCheckpointError(f"{what} is missing", tier=self.tier.name, step=self.key.step)
        return CheckpointEvictedError(f"tier {self.tier.name!r}: step {self.key.step} was evicted or replaced")

    def read_manifest(self) -> bytes:
        try:
            return self.otier.bucket.get(self.data + "manifest")
        except FileNotFoundError:
            raise self.gone(self.data + "manifest") from None

    def reader(self, blobs: Sequence[BlobEntry]) -> TierReader:
        for b in blobs:
            n = self.otier.bucket.head(self.data + b.name)
            if n is None:
                raise self.gone(self.data + b.name)
            if n < b.stored:  # its size, or what a copy stored compressed holds of it
                raise CorruptCheckpointError(f"{self.data}{b.name} holds {n} bytes, the copy declares {b.stored}",
                                             tier=self.tier.name, step=self.key.step, blob=b.name)  # fmt: skip
        return _Reader(self, [self.data + b.name for b in blobs])


class _Reader(TierReader):
    def __init__(self, copy: _Copy, keys: list[str]) -> None:
        self.copy, self.keys = copy, keys

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        try:
            return _done(self.copy.otier.bucket.get_into(self.keys[blob], offset, addr, nbytes))
        except FileNotFoundError:
            f: Future[int] = Future()
            f.set_exception(self.copy.gone(self.keys[blob]))
            return f

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return 1, 1  # a GET goes into any memory
