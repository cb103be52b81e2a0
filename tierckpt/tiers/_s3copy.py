"""One copy on the ``s3`` tier: written as multipart uploads and published by its head object; read by
ranged GETs of the version its head names.

A write is one part of one blob's multipart upload (part ``offset // part_size + 1``), sent from the
caller's memory as it is, on the bucket's pool: parts go up in any order and ``concurrency`` at once. The
uploads are completed only at commit, once every part of every blob is in, and the head object goes up
last: a copy interrupted before that is a set of multipart uploads, which :meth:`_Writer.abort` aborts
(or the next open's sweep, after a crash) and which no listing shows.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Protocol, cast

from tierckpt.errors import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, TierFullError
from tierckpt.format.frames import held_sizes
from tierckpt.format.manifest import BlobEntry
from tierckpt.format.objecthead import BLOB_NAME_RE, ObjectHead, encode_head
from tierckpt.io.buffers import ptr_mv
from tierckpt.tiers._s3client import Bucket, Upload
from tierckpt.tiers._s3keys import S3Keys, new_version
from tierckpt.tiers.base import CheckpointKey, Tier, TierCopy, TierReader, TierWriter

__all__ = ["MAX_PARTS", "S3Copy", "S3Writer", "check_blobs"]

log = logging.getLogger("tierckpt.s3")

#: S3's most parts in one multipart upload
MAX_PARTS = 10_000


class S3Tier(Protocol):
    """What a copy uses of its tier (:class:`tierckpt.tiers.s3.S3Tier`)."""

    name: str
    part_bytes: int
    bucket: Bucket
    keys: S3Keys

    def read_head(self, key: CheckpointKey) -> ObjectHead | None: ...

    def publish(self, key: CheckpointKey, head: bytes, version: str) -> None: ...


def check_blobs(tier: S3Tier, blobs: Sequence[BlobEntry]) -> None:
    """Refuse blobs the tier cannot store: a name its keys cannot carry, one twice, or one of more than
    :data:`MAX_PARTS` parts.

    Raises:
        ValueError: naming the blob and what to change.
    """
    part = tier.part_bytes
    if len({b.name for b in blobs}) != len(blobs):
        raise ValueError(f"tier {tier.name!r}: two blobs of one checkpoint share a name")
    for b in blobs:
        if not BLOB_NAME_RE.fullmatch(b.name):
            raise ValueError(f"tier {tier.name!r}: blob name {b.name!r} cannot be an object key here")
        if -(-b.size // part) > MAX_PARTS:
            raise ValueError(
                f"tier {tier.name!r}: blob {b.name!r} of {b.size} bytes needs more than {MAX_PARTS} parts of "
                f"{part} bytes (S3's limit): raise the tier's options.part_size or lower layout.blob_size"
            )


class S3Writer(TierWriter):
    """A copy being uploaded (see the module docstring).

    After the first part that fails, every later one fails at once with its error (queued parts are not
    sent, parts in retry give up), so that a copy to a server that is down fails within one request's
    retries, not one per part; after :meth:`cancel` (or :meth:`abort`) likewise. :meth:`abort` waits for
    every part it accepted before it aborts the uploads."""

    def __init__(self, tier: S3Tier, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> None:
        self.tier, self.key, self.blobs = tier, key, list(blobs)
        self.version, self.spread = new_version(), tier.keys.spread(key)
        self.prefix = tier.keys.data(key, self.version, self.spread)
        self._uploads: list[Upload | None] = [None] * len(self.blobs)
        self._completed: set[int] = set()  # blobs whose upload commit completed (objects now)
        self._parts: list[dict[int, int]] = [{} for _ in self.blobs]  # per blob: part number -> bytes
        self._futures: list[Future[int]] = []
        self._failed: BaseException | None = None
        self._head_sent = False  # the head's PUT was issued: it may be in place whatever came back
        self._lock = threading.Lock()
        self._starting = [threading.Lock() for _ in self.blobs]
        self._open = True
        self._cancelled = False

    def _upload(self, blob: int) -> Upload:
        with self._starting[blob]:  # one upload per blob, started by its first part
            up = self._uploads[blob]
            if up is None:
                self._check_going()
                up = self._uploads[blob] = self.tier.bucket.upload(self.prefix + self.blobs[blob].name)
            return up

    def _check_going(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._stopped():
            raise RuntimeError(f"tier {self.tier.name!r}: the writer of step {self.key.step} was aborted")

    def _stopped(self) -> bool:
        return self._failed is not None or not self._open or self._cancelled

    def cancel(self) -> None:
        """Parts in retry give up (within one backoff's poll), queued and later ones fail at once."""
        self._cancelled = True

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        part, size = self.tier.part_bytes, self.blobs[blob].size
        if offset % part or nbytes > min(part, size - offset) or nbytes <= 0:  # shorter: the blob's last part
            raise ValueError(
                f"tier {self.tier.name!r}: a write of blob {blob} at [{offset}, +{nbytes}) is not one of its "
                f"parts of {part} bytes (each write is one whole part: capabilities min/max_part_bytes)"
            )
        number = offset // part + 1
        view = ptr_mv(addr, nbytes, writable=False)

        def send() -> int:
            try:
                self._check_going()
                self._upload(blob).part(number, view, give_up=self._stopped)
            except BaseException as e:
                with self._lock:
                    self._failed = self._failed or e
                raise
            with self._lock:
                self._parts[blob][number] = nbytes
            return nbytes

        with self._lock:  # accepted and listed at once: an abort that follows waits for it
            if not self._open:
                raise RuntimeError("writer already finished")
            fut = self.tier.bucket.submit(send)
            self._futures.append(fut)
        return fut

    def commit(self, manifest: bytes) -> None:
        """Complete the uploads, then put the head. A full bucket (``QuotaExceeded``) leaves the writer as
        it was, to be committed again once room is made; any other failure aborts it."""
        if not self._open:
            raise RuntimeError("writer already finished")
        try:
            self._wait_writes()
            held = self._check_parts(manifest)
            self._complete_uploads(held)
            head = encode_head(self.version, self.spread, [(b.name, h) for b, h in zip(self.blobs, held)], manifest)
            self._head_sent = True
            self.tier.publish(self.key, head, self.version)
        except TierFullError:
            self._head_sent = False  # refused whole: no head went in
            raise
        except BaseException:
            self.abort()
            raise
        self._open = False

    def _check_parts(self, manifest: bytes) -> list[int]:
        """Each blob's object length, once every part of it is in: its size, or for a copy stored encoded
        (a version-6 manifest) what it holds (its stored stream, padded: the head records that).

        Raises:
            ValueError: a blob whose parts are not all in, or not of their lengths.
        """
        part = self.tier.part_bytes
        try:
            held = held_sizes(manifest) or [b.size for b in self.blobs]
        except CorruptCheckpointError:  # stored as it is given (its readers refuse it): every blob whole
            held = [b.size for b in self.blobs]
        for b, h, got in zip(self.blobs, held, self._parts, strict=True):
            want = {n + 1: min(part, h - n * part) for n in range(-(-h // part))}
            if got != want:
                raise ValueError(
                    f"tier {self.tier.name!r}: blob {b.name!r} has parts {sorted(got)} of {sorted(got.values())} "
                    f"bytes, not its {len(want)} parts of its {h} bytes"
                )
        return held

    def _complete_uploads(self, held: Sequence[int]) -> None:
        todo = [(i, u) for i, u in enumerate(self._uploads) if u is not None and i not in self._completed]
        done = [(i, self.tier.bucket.submit(partial(u.complete, held[i]))) for i, u in todo]
        first: BaseException | None = None
        for i, f in done:  # every one waited for: none still running when an abort follows
            try:
                f.result()
                self._completed.add(i)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _wait_writes(self) -> None:
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.result()

    def abort(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
            futures = list(self._futures)
        for f in futures:  # parts in flight read the caller's memory: wait for them
            f.cancel()
            with contextlib.suppress(BaseException):
                f.exception()
        try:
            for i, up in enumerate(self._uploads):
                if up is not None and i not in self._completed:
                    up.abort(cleanup=True)
            if self._completed and self._data_unnamed():
                keys = [self.prefix + self.blobs[i].name for i in sorted(self._completed)]
                self.tier.bucket.delete(keys, cleanup=True)
        except Exception as e:  # the next open's sweep takes what is left
            log.warning("tier %r: cleaning up an aborted copy of step %d: %s", self.tier.name, self.key.step, e)

    def _data_unnamed(self) -> bool:
        """Whether no head names this copy's data: always before the head's PUT was sent; after it, the
        PUT may have gone in though its answer was lost, and only a head read back says it did not."""
        if not self._head_sent:
            return True
        try:
            head = self.tier.read_head(self.key)
        except Exception:  # unknown: keep the data (a head may name it); the sweep decides later
            return False
        if head is not None and head.version == self.version:
            log.warning(
                "tier %r: step %d rank %d was published though its commit failed: its copy stays",
                self.tier.name, self.key.step, self.key.rank,
            )  # fmt: skip
            return False
        return True


class S3Copy(TierCopy):
    """One committed copy, by its head object read when it is opened: every read is of that version."""

    def __init__(self, tier: S3Tier, key: CheckpointKey) -> None:
        super().__init__(cast(Tier, tier), key)
        self.s3 = tier
        head = tier.read_head(key)
        if head is None:
            raise CheckpointNotFoundError(f"tier {tier.name!r} holds no checkpoint for step {key.step} rank {key.rank}")
        self.head: ObjectHead = head
        self.prefix = tier.keys.data(key, head.version, head.spread)

    def gone(self, what: str) -> OSError:
        """An object of the copy is missing: damage while its head still names it, else evicted or replaced."""
        try:
            now = self.s3.read_head(self.key)
        except CorruptCheckpointError:
            now = None
        if now is not None and now.version == self.head.version:
            return CorruptCheckpointError(f"{what} is missing", tier=self.tier.name, step=self.key.step)
        return CheckpointEvictedError(f"tier {self.tier.name!r}: step {self.key.step} was evicted or replaced")

    def read_manifest(self) -> bytes:
        return self.head.manifest

    def reader(self, blobs: Sequence[BlobEntry]) -> TierReader:
        sizes = dict(self.head.blobs)
        for b in blobs:
            if sizes.get(b.name) not in (b.size, b.stored):  # an encoded blob's head may name its stored size
                held = "no such blob" if b.name not in sizes else f"{sizes[b.name]} bytes"
                raise CorruptCheckpointError(
                    f"{self.s3.bucket.where(self.prefix + b.name)}: the manifest declares {b.size} bytes, "
                    f"the copy's head {held}",
                    tier=self.tier.name,
                    step=self.key.step,
                    blob=b.name,
                )
        return _Reader(self, list(blobs))


def _declares(b: BlobEntry) -> str:
    """What a copy says blob ``b``'s object holds, for errors."""
    if b.held is None:
        return f"its manifest declares {b.size}"
    return f"the copy's frame index declares {b.held} (its stored stream, padded) to {b.size} (its raw size)"


class _Reader(TierReader):
    """Ranged GETs on the bucket's pool, straight into the caller's memory (any address). After the first
    that fails, or :meth:`close`, the queued ones fail at once and those in retry give up: a caller that
    waits for every read it issued before freeing their memory waits one request's retries, not many."""

    def __init__(self, copy: S3Copy, blobs: list[BlobEntry]) -> None:
        self.copy, self.blobs = copy, blobs
        self._failed: BaseException | None = None
        self._closed = False

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return (1, 1)

    def _stopped(self) -> bool:
        return self._failed is not None or self._closed

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        b, copy = self.blobs[blob], self.copy
        key = copy.prefix + b.name
        if nbytes == 0 or offset >= b.size:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        view = ptr_mv(addr, nbytes)
        where = copy.s3.bucket.where(key)

        def get() -> int:
            if self._failed is not None:
                raise self._failed
            if self._closed:
                raise RuntimeError(f"{where}: read after the reader was closed")
            try:
                got = copy.s3.bucket.get_into(key, offset, view, give_up=self._stopped)
                if got is None:
                    raise copy.gone(where)
                n, total = got
                if total is not None and total != b.size and not b.stored <= total <= b.size:
                    raise CorruptCheckpointError(f"{where} holds {total} bytes, {_declares(b)}",
                                                 tier=copy.tier.name, step=copy.key.step, blob=b.name)  # fmt: skip
            except BaseException as e:
                self._failed = self._failed or e
                raise
            return n

        return copy.s3.bucket.submit(get)

    def close(self) -> None:
        self._closed = True
