"""``s3``: a tier in an S3 bucket (AWS, Ceph's radosgw, or any S3-compatible object store).

A copy's blobs are multipart uploads (parts sent from the tier's source buffers, ``concurrency`` at
once), completed at commit; the copy is published by its head object (the manifest and the blobs' keys,
:mod:`tierckpt.format.objecthead`), written last; a step's commit record is one more object. A restore
reads the head with one GET and the blobs with parallel ranged GETs straight into their destination; no
read, save or eviction lists the bucket. Listing (``list_committed``, ``list_records``) is LIST requests,
which the hierarchy makes once a job (``cheap_listing`` is false). Keys: :mod:`tierckpt.tiers._s3keys`;
requests and their retries: :mod:`tierckpt.tiers._s3client`; docs/tiers.md, "S3", says what each option
does and what a checkpoint costs in requests.

Needs boto3 (``pip install 'tierckpt[s3]'``).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from tierckpt.config import TierConfig
from tierckpt.configvalues import expand_path, process_rank
from tierckpt.errors import ConfigError, CorruptCheckpointError, TierFullError
from tierckpt.format.manifest import BlobEntry
from tierckpt.format.objecthead import MAX_HEAD_BYTES, ObjectHead, decode_head
from tierckpt.tiers._s3client import Bucket, S3Error, S3Settings
from tierckpt.tiers._s3copy import S3Copy, S3Writer, check_blobs
from tierckpt.tiers._s3keys import S3Keys
from tierckpt.tiers.base import CheckpointKey, EngineSource, Tier, TierCapabilities, TierCopy, TierReader, TierWriter
from tierckpt.tiers.options import Option, boolean, check_options, choice, integer, number, size, text

__all__ = ["OPTIONS", "S3Tier", "parse_s3_url"]

log = logging.getLogger("tierckpt.s3")

#: the largest commit record a reader takes (8 bytes a rank, 2**24 ranks at most, and the framing)
MAX_RECORD_BYTES = 1 << 28
#: S3's smallest part (but a blob's last) and largest
MIN_PART, MAX_PART = 5 << 20, 5 << 30

OPTIONS = {
    "endpoint_url": Option(text(r"https?://[^\s/?#]+(/[^\s?#]*)?"), default=None, doc="the S3 endpoint URL"),
    "region": Option(text(r"[a-z0-9-]+"), default=None, doc="the signing region"),
    "addressing_style": Option(choice("auto", "path", "virtual"), default="auto", doc="bucket in path or host"),
    "profile": Option(text(), default=None, doc="credentials profile (~/.aws/credentials, ~/.aws/config)"),
    "part_size": Option(size(lo=MIN_PART, hi=MAX_PART), default=16 << 20, doc="bytes per multipart part"),
    "concurrency": Option(integer(1, 256), default=8, doc="requests in flight at once"),
    "hashed_prefixes": Option(integer(0, 4), default=0, doc="hex digits of hashed key prefix before each copy's data"),
    "retries": Option(integer(0, 100), default=7, doc="retries of a request that failed transiently"),
    "retry_deadline": Option(number(0, 86400), default=120.0, doc="seconds after which a request is not retried"),
    "connect_timeout": Option(number(0.1, 3600), default=10.0, doc="seconds to connect"),
    "read_timeout": Option(number(0.1, 3600), default=60.0, doc="seconds without a byte from the server"),
    "sign_payload": Option(boolean(), default=False, doc="sign every payload's SHA-256, also over plain http"),
    "create_bucket": Option(boolean(), default=False, doc="create the bucket when it does not exist"),
    "sweep": Option(boolean(), default=True, doc="rank 0 removes interrupted uploads and unpublished data at open"),
    "sweep_grace": Option(number(0, 86400), default=60.0, doc="seconds before the open that the sweep leaves alone"),
}
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_BAD_BUCKET = ("NoSuchBucket",)
_BAD_AUTH = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden", "403", "NoCredentialsError")


def parse_s3_url(url: str, key: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` → (bucket, prefix: "" or ending in "/"); ``$VAR`` and ``${VAR}`` are expanded.

    Raises:
        ConfigError: naming ``key``: not such a URL, a bad bucket name or prefix, an unset variable, or
            ``{rank}`` / ``{node}`` (every rank shares an s3 tier: its keys carry the rank already).
    """
    if re.search(r"\{(rank|node)(:[^}]*)?\}", url):
        raise ConfigError(f"{key}: an s3 tier is shared by every rank and node: no {{rank}} or {{node}} in {url!r}")
    if url.startswith("s3://") and "$" in url:
        url = "s3://" + str(expand_path(url[5:], key))
    m = re.fullmatch(r"s3://([^/]+)(?:/(.*))?", url)
    if m is None or not _BUCKET_RE.fullmatch(m.group(1)) or ".." in m.group(1):
        raise ConfigError(f"{key}: expected s3://BUCKET/PREFIX with a valid bucket name, got {url!r}")
    prefix = (m.group(2) or "").strip("/")
    if (any(p in (".", "..", "") for p in prefix.split("/")) and prefix) or re.search(r"[\x00-\x1f\\{}]", prefix):
        raise ConfigError(f"{key}: the prefix {prefix!r} has an empty or dot segment, or a control character")
    return m.group(1), prefix + "/" if prefix else ""


class S3Tier(Tier):
    """A tier in an S3 bucket (see the module docstring).

    Args:
        name: the tier's name.
        bucket: the bucket.
        prefix: the key prefix of everything the tier writes ("" or ending in "/").
        settings: endpoint, credentials profile, retries, timeouts, concurrency.
        part_size: bytes of each multipart part (every write but a blob's last is one whole part).
        hashed_prefixes: hex digits of hashed prefix in front of each copy's data keys (0: none).
        blob_bytes: preferred blob size (None: 256 MiB).
        readonly: only look (``tierckpt ls``): nothing is written, created or swept.
        create_bucket: create the bucket if it does not exist.
        sweep: remove, at open, the uploads and unpublished data that earlier processes left (give it
            to one rank of a job: every rank's copies are swept).
        sweep_grace_s: what was begun less than this before the open is left to a later sweep (another
            rank of the job may have opened first and begun its upload).

    Raises:
        ConfigError: the bucket does not exist, or the credentials are refused.
        S3Error: the endpoint cannot be reached (after the retries).
    """

    kind = "s3"

    def __init__(
        self,
        name: str,
        bucket: str,
        prefix: str = "",
        settings: S3Settings | None = None,
        *,
        part_size: int = 16 << 20,
        hashed_prefixes: int = 0,
        blob_bytes: int | None = None,
        readonly: bool = False,
        create_bucket: bool = False,
        sweep: bool = True,
        sweep_grace_s: float = 60.0,
    ) -> None:
        super().__init__(name)
        self.part_bytes = part_size
        self.preferred_blob_bytes = blob_bytes or self.preferred_blob_bytes
        self.chunk_bytes = part_size
        self.capabilities = TierCapabilities(
            persistent=True,
            shared=True,
            device="object",
            alignment_bytes=1,
            sequential_writes=False,
            min_part_bytes=part_size,
            max_part_bytes=part_size,
            cheap_listing=False,
            encoded_copies=True,
        )
        self.keys = S3Keys(prefix, hashed_prefixes)
        self.readonly = readonly
        self.bucket = Bucket(settings or S3Settings(), bucket)
        self._lock = threading.Lock()
        self._unfreed: list[str] = []  # data keys of copies evicted with free=False
        try:
            self.opened_at = self._open(create_bucket)
            if sweep and not readonly:
                self.sweep(self.opened_at - timedelta(seconds=sweep_grace_s))
        except BaseException:
            self.bucket.close()
            raise

    @classmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> S3Tier:
        """``path: s3://BUCKET/PREFIX``; ``options:`` as in :data:`OPTIONS`; no ``capacity``."""
        opts = check_options(cfg, OPTIONS)
        if cfg.location is None:
            raise ConfigError(f"{cfg.key}.path: an s3 tier needs a location such as s3://BUCKET/PREFIX")
        bucket, prefix = parse_s3_url(cfg.location, f"{cfg.key}.path")
        if cfg.capacity_bytes is not None:
            raise ConfigError(
                f"{cfg.key}.capacity: an s3 tier takes no capacity (a bucket does not fill up; bound what it "
                "keeps with the policy's retention)"
            )
        settings = S3Settings(
            endpoint_url=opts["endpoint_url"],
            region=opts["region"],
            addressing_style=opts["addressing_style"],
            profile=opts["profile"],
            attempts=opts["retries"] + 1,
            deadline_s=opts["retry_deadline"],
            connect_timeout_s=opts["connect_timeout"],
            read_timeout_s=opts["read_timeout"],
            concurrency=opts["concurrency"],
            sign_payload=opts["sign_payload"],
        )
        rank = cfg.rank if cfg.rank is not None else process_rank()
        try:
            return cls(cfg.name, bucket, prefix, settings, part_size=opts["part_size"],
                       hashed_prefixes=opts["hashed_prefixes"], blob_bytes=cfg.blob_bytes, readonly=cfg.readonly,
                       create_bucket=opts["create_bucket"], sweep=opts["sweep"] and rank == 0,
                       sweep_grace_s=opts["sweep_grace"])  # fmt: skip
        except ConfigError as e:
            raise ConfigError(f"{cfg.key}: {e}") from e

    def _open(self, create: bool) -> datetime:
        """Check the bucket answers (creating it when asked); the server's time."""
        b = self.bucket
        try:
            return b.check()
        except S3Error as e:
            if e.code == "NoCredentialsError":
                raise ConfigError(
                    f"found no credentials for bucket {b.name!r} at {b.endpoint}: set AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY, ~/.aws/credentials or options.profile"
                ) from e
            if e.code in _BAD_BUCKET or e.status == 404:
                if create and not self.readonly:
                    b.call("CreateBucket", None, self._create_bucket)
                    return b.check()
                raise ConfigError(f"bucket {b.name!r} does not exist at {b.endpoint} (options.create_bucket)") from e
            if e.code in _BAD_AUTH or e.status == 403:
                raise ConfigError(
                    f"{b.endpoint} refused the credentials for bucket {b.name!r} ({e.code}): check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws/credentials or options.profile"
                ) from e
            raise

    def _create_bucket(self) -> None:
        try:
            self.bucket.client.create_bucket(Bucket=self.bucket.name)
        except Exception as e:  # another rank made it first
            if getattr(e, "response", {}).get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise

    def describe(self) -> str:
        budget = f", {self.budget.describe()} budget" if self.budget is not None else ""
        return (
            f"s3://{self.bucket.name}/{self.keys.prefix} at {self.bucket.endpoint} (parts of {self.part_bytes} "
            f"bytes, {self.bucket.settings.concurrency} at once{budget})"
        )

    def location(self) -> str:
        return f"s3://{self.bucket.name}/{self.keys.prefix} at {self.bucket.endpoint}"

    def storage_facts(self) -> dict[str, Any]:
        s = self.bucket.settings
        return {
            "endpoint": self.bucket.endpoint,
            "bucket": self.bucket.name,
            "prefix": self.keys.prefix,
            "part_bytes": self.part_bytes,
            "concurrency": s.concurrency,
            "hashed_prefixes": self.keys.hashed,
            "attempts": s.attempts,
            "retry_deadline_s": s.deadline_s,
        }

    def copy_files(self, key: CheckpointKey) -> dict[str, Any]:
        head = self.read_head(key)
        if head is None:
            return {}
        return {"head": self.keys.head(key), "data": self.keys.data(key, head.version, head.spread)}

    # -- heads: what is committed ------------------------------------------------------------------------
    def read_head(self, key: CheckpointKey) -> ObjectHead | None:
        """``key``'s head object, None when there is none.

        Raises:
            CorruptCheckpointError: it is not a head object.
        """
        k = self.keys.head(key)
        data = self.bucket.get(k, MAX_HEAD_BYTES)
        if data is None:
            return None
        try:
            return decode_head(data, self.bucket.where(k))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(str(e), tier=self.name, step=key.step) from None

    def publish(self, key: CheckpointKey, head: bytes, version: str) -> None:
        """Put ``key``'s new head (its blobs are complete); then delete the data of the copy it replaced."""
        try:
            old = self.read_head(key)
        except CorruptCheckpointError:
            old = None  # its data, unknown, is left to the sweep
        try:
            self.bucket.put(self.keys.head(key), head)
        except S3Error as e:
            if isinstance(e, TierFullError):
                raise
            # a PUT whose answer was lost may be in place all the same: the head read back says
            now = self.read_head(key)
            if now is None or now.version != version:
                raise
            log.info("tier %r: step %d: the head's PUT failed (%s), yet it is in place", self.name, key.step, e)
        if old is not None and old.version != version:
            try:
                self.bucket.delete(self._data_keys(key, old))
            except S3Error as e:
                log.warning("tier %r: deleting the replaced copy of step %d: %s", self.name, key.step, e)

    def _data_keys(self, key: CheckpointKey, head: ObjectHead) -> list[str]:
        prefix = self.keys.data(key, head.version, head.spread)
        return [prefix + n for n, size in head.blobs if size > 0]

    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        keys = (self.keys.parse_head(o.key) for o in self.bucket.list(self.keys.heads))
        return sorted(k for k in keys if k is not None and (rank is None or k.rank == rank))

    def holds(self, key: CheckpointKey) -> bool:
        return self.bucket.head(self.keys.head(key)) is not None

    def used_bytes(self) -> int:
        """Bytes of the committed copies' objects (LIST requests; ``tierckpt ls`` and the tests ask)."""
        heads = {k: o.size for o in self.bucket.list(self.keys.heads) if (k := self.keys.parse_head(o.key))}
        data: dict[CheckpointKey, dict[str, int]] = {}
        for o in self.bucket.list(self.keys.data_root):
            got = self.keys.parse_data(o.key)
            if got is not None and got[0] in heads:
                versions = data.setdefault(got[0], {})
                versions[got[1]] = versions.get(got[1], 0) + o.size
        total = sum(heads.values())
        for key, versions in data.items():
            if len(versions) > 1:  # a replace in progress, or what a crash left: the head says which
                head = self.read_head(key)
                total += versions.get(head.version, 0) if head else 0
            else:
                total += next(iter(versions.values()))
        return total

    # -- write, read, evict --------------------------------------------------------------------------------
    def reserve(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        if self.readonly:
            raise PermissionError(f"tier {self.name!r} was opened read-only")
        check_blobs(self, blobs)
        return S3Writer(self, key, blobs)

    def open_copy(self, key: CheckpointKey) -> TierCopy:
        return S3Copy(self, key)

    def read_manifest(self, key: CheckpointKey) -> bytes:
        return S3Copy(self, key).read_manifest()

    def reader(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierReader:
        return S3Copy(self, key).reader(blobs)

    def evict(self, key: CheckpointKey, *, free: bool = True) -> None:
        try:
            head = self.read_head(key)
        except CorruptCheckpointError:
            head = None  # unlisted all the same; its data is left to the sweep
        self.bucket.delete([self.keys.head(key)])  # unlisted now
        if head is not None:
            with self._lock:
                self._unfreed += self._data_keys(key, head)
        if free:
            self.reclaim()

    def reclaim(self) -> None:
        with self._lock:
            keys, self._unfreed = self._unfreed, []
        try:
            self.bucket.delete(keys)
        except BaseException:
            with self._lock:
                self._unfreed += keys
            raise

    # -- commit records ------------------------------------------------------------------------------------
    def write_record(self, step: int, data: bytes) -> None:
        self.bucket.put(self.keys.record(step), bytes(data))

    def read_record(self, step: int) -> bytes | None:
        return self.bucket.get(self.keys.record(step), MAX_RECORD_BYTES)

    def remove_record(self, step: int) -> None:
        self.bucket.delete([self.keys.record(step)])

    def list_records(self) -> list[int]:
        steps = (self.keys.parse_record(o.key) for o in self.bucket.list(self.keys.records))
        return sorted(s for s in steps if s is not None)

    # -- what earlier processes left ---------------------------------------------------------------------
    def sweep(self, before: datetime) -> None:
        """Abort the multipart uploads under the prefix begun before ``before`` (server time), and delete
        the blob objects written before it that no head names (a crash between the completion of a
        copy's uploads and its head, or in an eviction). Errors are logged: a sweep never fails an open."""
        try:
            for k, upload_id, started in self.bucket.uploads(self.keys.prefix):
                if started < before and self.keys.parse_data(k) is not None:
                    self.bucket.abort_upload(k, upload_id)
            self.bucket.delete(self._orphans(before))
        except S3Error as e:
            log.warning("tier %r: sweeping what earlier processes left: %s", self.name, e)

    def _orphans(self, before: datetime) -> list[str]:
        # the data first, the heads after: a copy published between the two LISTs has its head seen
        data = list(self.bucket.list(self.keys.data_root))
        heads = {k for o in self.bucket.list(self.keys.heads) if (k := self.keys.parse_head(o.key))}
        groups: dict[tuple[CheckpointKey, str], list[str]] = {}
        fresh: set[tuple[CheckpointKey, str]] = set()
        for o in data:
            got = self.keys.parse_data(o.key)
            if got is None:
                continue
            groups.setdefault(got, []).append(o.key)
            if o.modified >= before:
                fresh.add(got)
        versions = Counter(key for key, _ in groups)
        live: dict[CheckpointKey, str | None] = {}  # the head's version, where a copy has several
        for key in (k for k, n in versions.items() if n > 1 and k in heads):
            try:
                head = self.read_head(key)
            except CorruptCheckpointError:
                head = None
            live[key] = head.version if head else None
        out = []
        for (key, version), objs in groups.items():
            if (key, version) in fresh:
                continue
            if key not in heads or (key in live and live[key] not in (None, version)):
                out += objs
        return out

    def close(self) -> None:
        self.bucket.close()
