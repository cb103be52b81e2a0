"""The S3 requests of the ``s3`` tier, on boto3: one client per tier, each request retried on its own.

Every request goes through :meth:`Bucket.call`: a transient failure (503 SlowDown and other throttling
answers, a 5xx, a timeout, a reset or refused connection) is retried with exponential backoff and full
jitter, at most ``attempts`` times and within ``deadline_s`` from the first try; then, or at once for
any other failure, :class:`S3Error` names the operation, the endpoint, the bucket and the key. botocore's
own retries are off, so that these bounds are the only ones (docs/tiers.md, "S3"). Credentials come
from boto3's usual chain (environment, ``~/.aws/credentials`` and ``config``, a profile, instance
metadata); they are never logged and never part of an error.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from tierckpt.errors import ConfigError, CorruptCheckpointError, TierckptError, TierFullError, TierIOError

__all__ = ["Bucket", "Listed", "S3Error", "S3Settings", "Upload"]

log = logging.getLogger("tierckpt.s3")
T = TypeVar("T")

#: error codes S3 and its clones answer when a request may succeed if tried again
RETRY_CODES = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
        "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
        "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException", "InternalError",
        "ServiceUnavailable", "PriorRequestNotComplete", "ProvisionedThroughputExceededException",
    }
)  # fmt: skip
#: error codes that mean the bucket or the account is out of room
FULL_CODES = frozenset({"QuotaExceeded"})
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 8.0
#: how often a retry's backoff looks whether its request was told to stop
_GIVE_UP_POLL_S = 0.05
#: how long cleanup (aborting a failed copy's uploads, deleting what it completed) retries: what it leaves
#: behind is the next open's sweep's, and a failing save should not wait minutes on a server that is down
CLEANUP_DEADLINE_S = 5.0


@dataclass(frozen=True)
class S3Settings:
    """How a tier reaches its bucket (its ``options:``; docs/tiers.md, "S3").

    Attributes:
        endpoint_url: the S3 endpoint (None: AWS's, from the region).
        region: the signing region (None: the profile's or ``AWS_DEFAULT_REGION``, else us-east-1).
        addressing_style: ``path``, ``virtual`` or ``auto`` (boto3's).
        profile: the credentials profile (None: boto3's default chain).
        attempts: tries of one request, the first included.
        deadline_s: no retry starts later than this after a request's first try.
        connect_timeout_s: seconds to connect.
        read_timeout_s: seconds without a byte from the server.
        concurrency: requests in flight at once (parts, ranged GETs, deletes).
        sign_payload: sign each request's payload (its SHA-256) also over plain http.
    """

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    profile: str | None = None
    attempts: int = 8
    deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    concurrency: int = 8
    sign_payload: bool = False


class S3Error(TierIOError):
    """An S3 request failed (after its retries, where it was worth retrying).

    Attributes:
        op: the S3 operation (``UploadPart``, ``GetObject`` ...).
        status: the HTTP status (None: no answer).
        code: S3's error code (``NoSuchBucket`` ...), or the exception's type without an answer.
    """

    def __init__(self, message: str, op: str, status: int | None, code: str) -> None:
        super().__init__(message)
        self.op, self.status, self.code = op, status, code

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.op, self.status, self.code))


class S3FullError(S3Error, TierFullError):
    """The bucket or account is out of room (``QuotaExceeded``)."""


@dataclass(frozen=True)
class Listed:
    """One object a LIST showed."""

    key: str
    size: int
    modified: datetime


def _answer(e: BaseException) -> tuple[int | None, str]:
    """(HTTP status, error code) of a botocore exception; (None, its type) when no answer came."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err, meta = resp.get("Error") or {}, resp.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        return (status if isinstance(status, int) else None), str(err.get("Code") or status or type(e).__name__)
    return None, type(e).__name__


class RangeError(Exception):
    """The server answered a ranged GET with other bytes than those asked for (not retried)."""


def _missing(e: BaseException) -> bool:
    """Whether ``e`` says the object is not there (a missing bucket is another error)."""
    status, code = _answer(e)
    return status == 404 and code != "NoSuchBucket"


def _transient(e: BaseException) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(e, ClientError):
        status, code = _answer(e)
        return code in RETRY_CODES or (status is not None and (status >= 500 or status == 429))
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, IncompleteReadError, ResponseStreamingError

    if isinstance(e, BotoConnectionError | HTTPClientError | ResponseStreamingError | IncompleteReadError):
        return True
    if isinstance(e, BotoCoreError):
        return False  # credentials, parameters
    return isinstance(e, Urllib3Error | ConnectionError | TimeoutError)


class Bucket:
    """A bucket through one boto3 client: the requests the tier makes, each retried (see the module
    docstring), and a pool of ``settings.concurrency`` threads for those issued in the background.

    Args:
        settings: endpoint, credentials profile, retries, timeouts, concurrency.
        bucket: the bucket's name.
    """

    def __init__(self, settings: S3Settings, bucket: str) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise ConfigError(f"an s3 tier needs boto3 (pip install 'tierckpt[s3]'): {e}") from e

        self.settings, self.name = settings, bucket
        session = boto3.session.Session(profile_name=settings.profile)
        config = Config(
            region_name=settings.region or session.region_name or "us-east-1",
            # the payload's SHA-256 is left out of the signature (as boto3 does over https): hashing every
            # byte costs a core at these rates; the bytes are checked by tierckpt's checksums when read
            s3={"addressing_style": settings.addressing_style, "payload_signing_enabled": settings.sign_payload},
            retries={"max_attempts": 1, "mode": "standard"},
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            max_pool_connections=settings.concurrency + 4,
            # parts are sent straight from the tier's buffers (memoryviews, which botocore's checks refuse)
            parameter_validation=False,
            # checksums of the bytes are tierckpt's own (every read is verified); S3 clones differ in which
            # of the newer flexible checksums they take
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client: Any = session.client("s3", endpoint_url=settings.endpoint_url, config=config)
        self.endpoint = settings.endpoint_url or self.client.meta.endpoint_url
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix=f"tierckpt-s3-{bucket}")
        self._closed = threading.Event()

    def where(self, key: str | None) -> str:
        return f"s3://{self.name}/{key or ''} at {self.endpoint}"

    # -- the retry loop -----------------------------------------------------------------------------------
    def call(
        self,
        op: str,
        key: str | None,
        fn: Callable[[], T],
        *,
        cleanup: bool = False,
        give_up: Callable[[], bool] | None = None,
    ) -> T:
        """``fn()`` (one request, ``op`` on ``key``), retried while it fails transiently (module docstring).

        Raises:
            S3FullError: the bucket is out of room.
            S3Error: naming ``op``, the endpoint, the bucket and ``key``.
        """
        s, start, attempt = self.settings, time.monotonic(), 0
        attempts, deadline = (
            (min(s.attempts, 2), min(s.deadline_s, CLEANUP_DEADLINE_S)) if cleanup else (s.attempts, s.deadline_s)
        )
        while True:
            attempt += 1
            try:
                return fn()
            except TierckptError:
                raise  # tierckpt's own verdict on what came back (a head too large ...): not the request's
            except Exception as e:
                status, code = _answer(e)
                elapsed = time.monotonic() - start
                delay = random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt))
                stop = self._closed.is_set() or (give_up is not None and give_up())
                if _transient(e) and attempt < attempts and elapsed + delay < deadline and not stop:
                    log.info(
                        "%s of %s: %s (%s); try %d in %.2fs", op, self.where(key), code, status, attempt + 1, delay
                    )
                    if self._pause(delay, give_up):
                        continue
                tries = f" after {attempt} tries in {elapsed:.1f}s" if attempt > 1 else ""
                msg = f"S3 {op} of {self.where(key)} failed{tries}: {code}" + (f" (HTTP {status})" if status else "")
                detail = str(e)
                if (detail and code not in detail) or status is None:
                    msg += f": {detail}"
                cls = S3FullError if code in FULL_CODES else S3Error
                raise cls(msg, op, status, code) from e

    def _pause(self, secs: float, give_up: Callable[[], bool] | None) -> bool:
        """Wait ``secs`` before a retry; False as soon as the bucket closes or ``give_up()`` says so
        (looked at every :data:`_GIVE_UP_POLL_S`): a request told to stop does not sleep out its backoff."""
        end = time.monotonic() + secs
        while (left := end - time.monotonic()) > 0:
            if self._closed.wait(min(left, _GIVE_UP_POLL_S)) or (give_up is not None and give_up()):
                return False
        return True

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the bucket's pool."""
        return self._pool.submit(fn)

    def close(self) -> None:
        """Stop retrying, wait for the pool's requests, release the client's connections."""
        self._closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    # -- objects ------------------------------------------------------------------------------------------
    def check(self) -> datetime:
        """HEAD the bucket; the server's clock (from the answer's ``Date``)."""
        resp = self.call("HeadBucket", None, lambda: self.client.head_bucket(Bucket=self.name))
        return _date(resp)

    def put(self, key: str, body: bytes | memoryview) -> None:
        self.call("PutObject", key, lambda: self.client.put_object(Bucket=self.name, Key=key, Body=body))

    def get(self, key: str, limit: int) -> bytes | None:
        """The object's bytes, None when there is none.

        Raises:
            CorruptCheckpointError: the object is over ``limit`` bytes (nothing more is read of it).
        """

        def get() -> bytes | None:
            try:
                resp = self.client.get_object(Bucket=self.name, Key=key)
            except Exception as e:
                if _missing(e):
                    return None
                raise
            body, size = resp["Body"], int(resp.get("ContentLength") or 0)
            with contextlib.closing(body):
                if size > limit:
                    raise CorruptCheckpointError(f"{self.where(key)} holds {size} bytes, more than {limit} it may")
                return bytes(body.read())

        return self.call("GetObject", key, get)

    def head(self, key: str) -> int | None:
        """The object's size, None when there is none."""

        def head() -> int | None:
            try:
                return int(self.client.head_object(Bucket=self.name, Key=key)["ContentLength"])
            except Exception as e:
                if _missing(e):
                    return None
                raise

        return self.call("HeadObject", key, head)

    def get_into(
        self, key: str, offset: int, view: memoryview, give_up: Callable[[], bool] | None = None
    ) -> tuple[int, int | None] | None:
        """Ranged GET of ``len(view)`` bytes at ``offset`` into ``view``: (bytes read, the object's size),
        or None when there is no object. A range past the end reads 0 bytes."""
        n = len(view)

        def get() -> tuple[int, int | None] | None:
            try:
                resp = self.client.get_object(Bucket=self.name, Key=key, Range=f"bytes={offset}-{offset + n - 1}")
            except Exception as e:
                status = _answer(e)[0]
                if _missing(e):
                    return None
                if status == 416:  # the object ends before offset
                    return 0, None
                raise
            m = _RANGE.fullmatch(str(resp.get("ContentRange") or ""))
            body = resp["Body"]
            if m is None and offset == 0:  # a server that ignores the Range answers the whole object
                total: int | None = int(resp.get("ContentLength") or 0)
            elif m is None or int(m.group(1)) != offset:
                body.close()
                raise RangeError(f"asked bytes {offset}-{offset + n - 1}, got {resp.get('ContentRange')!r}")
            else:
                total = int(m.group(3)) if m.group(3) != "*" else None
            declared = resp.get("ContentLength")  # none: a chunked answer, read up to what was asked
            length, got = (int(declared) if declared is not None else None), 0
            try:
                got = _read_into(body, view, n if length is None else min(n, length))
            finally:
                _finish(body, whole=got == length)
            return got, total

        return self.call("GetObject", key, get, give_up=give_up)

    def list(self, prefix: str) -> Iterator[Listed]:
        """Every object under ``prefix`` (LIST requests of 1,000 keys each, each retried)."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.name, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            page: dict[str, Any] = self.call("ListObjectsV2", prefix, partial(self.client.list_objects_v2, **kw))
            for o in page.get("Contents") or ():
                yield Listed(str(o["Key"]), int(o["Size"]), o["LastModified"])
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def delete(self, keys: Sequence[str], *, cleanup: bool = False) -> None:
        """Delete ``keys`` (missing ones are no error), 1,000 a request.

        Raises:
            S3Error: naming the first key the server could not delete.
        """
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            request = partial(self.client.delete_objects, Bucket=self.name, Delete={"Objects": batch, "Quiet": True})
            resp: dict[str, Any] = self.call("DeleteObjects", batch[0]["Key"], request, cleanup=cleanup)
            errors = resp.get("Errors") or []
            if errors:
                e = errors[0]
                raise S3Error(
                    f"S3 DeleteObjects of {self.where(e.get('Key'))} failed: {e.get('Code')}: {e.get('Message')}"
                    + (f" (and {len(errors) - 1} more keys)" if len(errors) > 1 else ""),
                    "DeleteObjects",
                    None,
                    str(e.get("Code")),
                )

    # -- multipart uploads ----------------------------------------------------------------------------------
    def upload(self, key: str) -> Upload:
        """Start a multipart upload of ``key``."""
        resp = self.call(
            "CreateMultipartUpload", key, lambda: self.client.create_multipart_upload(Bucket=self.name, Key=key)
        )
        return Upload(self, key, str(resp["UploadId"]))

    def uploads(self, prefix: str) -> Iterator[tuple[str, str, datetime]]:
        """(key, upload id, initiated) of every multipart upload in progress under ``prefix``."""
        kw: dict[str, Any] = {"Bucket": self.name, "Prefix": prefix}
        while True:
            request = partial(self.client.list_multipart_uploads, **kw)
            page: dict[str, Any] = self.call("ListMultipartUploads", prefix, request)
            for u in page.get("Uploads") or ():
                yield str(u["Key"]), str(u["UploadId"]), u["Initiated"]
            if not page.get("IsTruncated"):
                return
            kw["KeyMarker"], kw["UploadIdMarker"] = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")

    def abort_upload(self, key: str, upload_id: str, *, cleanup: bool = False) -> None:
        """Abort an upload (one already gone is no error)."""

        def abort() -> None:
            try:
                self.client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)
            except Exception as e:
                if _answer(e)[0] != 404:
                    raise

        self.call("AbortMultipartUpload", key, abort, cleanup=cleanup)


class Upload:
    """One multipart upload: parts in any order and at once, then completed (or aborted)."""

    def __init__(self, bucket: Bucket, key: str, upload_id: str) -> None:
        self.bucket, self.key, self.id = bucket, key, upload_id
        self._etags: dict[int, str] = {}
        self._lock = threading.Lock()

    def part(self, number: int, body: memoryview, give_up: Callable[[], bool] | None = None) -> None:
        """Upload part ``number`` (1 …) from ``body`` (sent as it is, no copy)."""
        b = self.bucket

        def send() -> Any:
            stream = _MemoryStream(body)  # a fresh one each try: botocore rewinds what it reads
            return b.client.upload_part(Bucket=b.name, Key=self.key, UploadId=self.id, PartNumber=number, Body=stream)

        resp = b.call("UploadPart", self.key, send, give_up=give_up)
        with self._lock:
            self._etags[number] = str(resp["ETag"])

    def parts(self) -> int:
        with self._lock:
            return len(self._etags)

    def complete(self, size: int) -> None:
        """Make the parts uploaded so far the object of ``size`` bytes (it appears whole).

        A try whose answer was lost may have completed the upload already: the next one then finds no
        upload (``NoSuchUpload``), and the object, of its size, says it is done."""
        with self._lock:
            parts = [{"PartNumber": n, "ETag": t} for n, t in sorted(self._etags.items())]
        b, tries = self.bucket, [0]

        def complete() -> None:
            tries[0] += 1
            try:
                b.client.complete_multipart_upload(
                    Bucket=b.name, Key=self.key, UploadId=self.id, MultipartUpload={"Parts": parts}
                )
            except Exception as e:
                if tries[0] > 1 and _answer(e)[1] == "NoSuchUpload" and b.head(self.key) == size:
                    return
                raise

        b.call("CompleteMultipartUpload", self.key, complete)

    def abort(self, *, cleanup: bool = False) -> None:
        self.bucket.abort_upload(self.key, self.id, cleanup=cleanup)


class _MemoryStream(io.RawIOBase):
    """A request body over memory the caller keeps alive: seekable, as botocore needs to hash it and to
    rewind it, and read as slices of that memory (no copies)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out, self._pos = self._view[self._pos : end], max(self._pos, end)
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def _read_into(body: Any, view: memoryview, n: int) -> int:
    """Read up to ``n`` bytes of a response body into ``view``, straight into it: through http.client's
    own ``readinto`` where the body is not content-encoded (urllib3's adds a copy), else urllib3's, else
    by chunks."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    plain = raw is not None and not (getattr(raw, "headers", None) or {}).get("content-encoding")
    readinto = getattr(fp, "readinto", None) if plain else None
    readinto = readinto or getattr(raw, "readinto", None)
    got = 0
    while got < n:
        if readinto is not None:
            k = readinto(view[got:n])
        else:
            chunk = body.read(min(n - got, 8 << 20))
            k = len(chunk)
            view[got : got + k] = chunk
        if not k:
            break
        got += k
    return got


def _finish(body: Any, whole: bool) -> None:
    """Give a response's connection back to the pool when its body was read whole; else close it."""
    release = getattr(getattr(body, "_raw_stream", None), "release_conn", None)
    if whole and release is not None:
        release()
    else:
        body.close()


def _date(resp: dict[str, Any]) -> datetime:
    from email.utils import parsedate_to_datetime

    raw = ((resp.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
    try:
        return parsedate_to_datetime(raw) if raw else datetime.now().astimezone()
    except (TypeError, ValueError):
        return datetime.now().astimezone()
