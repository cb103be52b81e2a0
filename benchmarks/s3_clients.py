"""The raw S3 client paths of ``bench_s3.py``: what each client library does at best with the same bytes.

Uploads (one object of ``len(src)`` bytes, multipart, ``part`` bytes a part, ``conc`` in flight):

* ``boto3``: create / ``upload_part`` on a thread pool / complete, each part's body a ``memoryview`` slice
  of the source (no copy). botocore accepts one only when it computes no flexible checksum
  (``request_checksum_calculation="when_required"``; else it calls ``tell()`` on the body) and with
  ``parameter_validation=False``. Payload signing off (``s3.payload_signing_enabled=False``): over plain
  HTTP botocore otherwise hashes every byte with SHA-256 for the signature.
* ``boto3-signed``: the same with the payload signed (SHA-256 of every byte, botocore's default).
* ``boto3-bytes``: the same as ``boto3``, each part copied into ``bytes`` first (what most callers do).
* ``boto3-defaults``: ``bytes`` parts and botocore's default config (CRC32 of every part, SHA-256 payload
  signature over HTTP).
* ``s3transfer``: ``upload_fileobj`` with a ``TransferConfig`` of the same part size and concurrency, on a
  client with the same tuned config, from a ``BytesIO`` over the source.
* ``obstore``: ``obstore.put(..., use_multipart=True, chunk_size=part, max_concurrency=conc)`` straight from
  the source buffer (Rust, outside the GIL), unsigned payload.
* ``obstore-signed``: the same with the payload signed (object_store's default).

Downloads (parallel ranged GETs of ``part`` bytes into one destination buffer):

* ``boto3``: ``get_object(Range=...)`` on a thread pool, the body read with ``readinto`` straight into the
  destination (http.client's response under urllib3's: no intermediate copy).
* ``boto3-urllib3``: the same through urllib3's ``readinto`` (it reads into a temporary and copies).
* ``obstore``: ``obstore.get_ranges`` (its own parallelism, at most 10 requests at a time; no coalescing),
  each range copied from the returned buffer into the destination.
* ``obstore-pool``: ``obstore.get_range`` on a thread pool of ``conc``, copied into the destination.
* ``s3transfer``: ``download_fileobj`` into a file object over the destination.

Every function takes an :class:`Endpoint` and raises on any failure; none measures anything.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

UPLOADS = ("boto3", "boto3-signed", "boto3-bytes", "boto3-defaults", "s3transfer", "obstore", "obstore-signed")
DOWNLOADS = ("boto3", "boto3-urllib3", "obstore", "obstore-pool", "s3transfer")
#: the clients whose part size and concurrency the sweep varies (the others run at the best of their library)
SWEPT_UPLOADS = ("boto3", "s3transfer", "obstore")
SWEPT_DOWNLOADS = ("boto3", "obstore", "obstore-pool")
PATTERN_PERIOD = (1 << 20) + 4099  # not a divisor of any part size: a range read at a wrong offset shows


@dataclass(frozen=True)
class Endpoint:
    """Where to talk S3, and as whom (the keys default to ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``)."""

    url: str
    bucket: str
    access_key: str = ""
    secret_key: str = ""
    region: str = "us-east-1"

    def keys(self) -> tuple[str, str]:
        return (self.access_key or os.environ.get("AWS_ACCESS_KEY_ID", ""),
                self.secret_key or os.environ.get("AWS_SECRET_ACCESS_KEY", ""))  # fmt: skip


def pattern(nbytes: int, seed: int) -> bytes:
    """``nbytes`` of a random block of :data:`PATTERN_PERIOD` bytes repeated (fast to make; every page
    written, so it is resident before any measurement)."""
    import random

    block = random.Random(seed).randbytes(PATTERN_PERIOD)
    return (block * (nbytes // PATTERN_PERIOD + 1))[:nbytes]


# -- boto3 ----------------------------------------------------------------------------------------------
def boto3_client(ep: Endpoint, conc: int, tuned: bool = True, signed: bool = False) -> Any:
    """A botocore S3 client with ``conc`` pooled connections; ``tuned``: no flexible checksums, no
    parameter validation, and unless ``signed`` no payload signature (see the module docstring)."""
    import boto3
    from botocore.config import Config

    opts: dict[str, Any] = {"max_pool_connections": max(conc, 10), "s3": {"addressing_style": "path"}}
    if tuned:
        opts |= {"parameter_validation": False, "request_checksum_calculation": "when_required",
                 "response_checksum_validation": "when_required"}  # fmt: skip
        opts["s3"] = {**opts["s3"], "payload_signing_enabled": signed}
    key, secret = ep.keys()
    return boto3.client("s3", endpoint_url=ep.url, region_name=ep.region, aws_access_key_id=key,
                        aws_secret_access_key=secret, config=Config(**opts))  # fmt: skip


def _spans(nbytes: int, part: int) -> list[tuple[int, int]]:
    return [(off, min(part, nbytes - off)) for off in range(0, nbytes, part)]


def boto3_upload(client: Any, ep: Endpoint, key: str, src: memoryview, part: int, conc: int, copy: bool) -> None:
    """A multipart upload of ``src`` with ``upload_part`` on ``conc`` threads (``copy``: bytes bodies)."""
    uid = client.create_multipart_upload(Bucket=ep.bucket, Key=key)["UploadId"]

    def one(i: int, off: int, n: int) -> dict[str, Any]:
        body = bytes(src[off : off + n]) if copy else src[off : off + n]
        r = client.upload_part(Bucket=ep.bucket, Key=key, UploadId=uid, PartNumber=i + 1, Body=body)
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    try:
        with ThreadPoolExecutor(conc) as pool:
            parts = list(pool.map(lambda a: one(*a), [(i, o, n) for i, (o, n) in enumerate(_spans(len(src), part))]))
        client.complete_multipart_upload(Bucket=ep.bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
    except BaseException:
        client.abort_multipart_upload(Bucket=ep.bucket, Key=key, UploadId=uid)
        raise


def s3transfer_upload(client: Any, ep: Endpoint, key: str, src: bytes, part: int, conc: int) -> None:
    """``upload_fileobj`` from a ``BytesIO`` sharing ``src`` (CPython does not copy ``bytes`` into one)."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    client.upload_fileobj(io.BytesIO(src), ep.bucket, key, Config=cfg)


def _readinto(stream: Any, dst: memoryview) -> None:
    got = 0
    while got < len(dst):
        n = stream.readinto(dst[got:])
        if not n:
            raise OSError(f"short body: {got} of {len(dst)} bytes")
        got += n


def boto3_download(client: Any, ep: Endpoint, key: str, dst: memoryview, part: int, conc: int, direct: bool) -> None:
    """Ranged GETs of ``part`` bytes on ``conc`` threads, each read into its slice of ``dst``; ``direct``:
    through http.client's ``readinto`` (under urllib3's), else urllib3's."""

    def one(off: int, n: int) -> None:
        r = client.get_object(Bucket=ep.bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")
        raw = r["Body"]._raw_stream  # urllib3's response; its _fp is http.client's
        if int(r["ContentLength"]) != n:
            raise OSError(f"range {off}+{n}: the server sent {r['ContentLength']} bytes")
        try:
            _readinto(raw._fp if direct else raw, dst[off : off + n])
        finally:
            raw.release_conn()

    with ThreadPoolExecutor(conc) as pool:
        list(pool.map(lambda a: one(*a), _spans(len(dst), part)))


class _BufferFile(io.RawIOBase):
    """A seekable, writable file over a memoryview (what ``download_fileobj`` writes into)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos + (self.pos if whence == io.SEEK_CUR else len(self.buf) if whence == io.SEEK_END else 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        self.buf[self.pos : self.pos + n] = view
        self.pos += n
        return n


def s3transfer_download(client: Any, ep: Endpoint, key: str, dst: memoryview, part: int, conc: int) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    client.download_fileobj(ep.bucket, key, _BufferFile(dst), Config=cfg)


# -- obstore --------------------------------------------------------------------------------------------
def obstore_store(ep: Endpoint, signed: bool = False) -> Any:
    from obstore.store import S3Store

    key, secret = ep.keys()
    return S3Store(ep.bucket, endpoint=ep.url, access_key_id=key, secret_access_key=secret, region=ep.region,
                   virtual_hosted_style_request=False, unsigned_payload=not signed,
                   client_options={"allow_http": True})  # fmt: skip


def obstore_upload(store: Any, key: str, src: memoryview, part: int, conc: int) -> None:
    import obstore

    obstore.put(store, key, src, use_multipart=True, chunk_size=part, max_concurrency=conc)


def obstore_download(store: Any, key: str, dst: memoryview, part: int, conc: int, pooled: bool) -> None:
    """``get_ranges`` (``pooled``: ``get_range`` on ``conc`` threads), each range copied into ``dst``."""
    import obstore

    spans = _spans(len(dst), part)
    if not pooled:
        got = obstore.get_ranges(store, key, starts=[o for o, _ in spans], lengths=[n for _, n in spans], coalesce=0)
        for (off, n), b in zip(spans, got):
            dst[off : off + n] = memoryview(b)
        return

    def one(off: int, n: int) -> None:
        dst[off : off + n] = memoryview(obstore.get_range(store, key, start=off, length=n))

    with ThreadPoolExecutor(conc) as pool:
        list(pool.map(lambda a: one(*a), spans))


# -- by name --------------------------------------------------------------------------------------------
def uploader(client: str, ep: Endpoint, conc: int) -> Callable[[str, bytes, int], None]:
    """``f(key, src, part)``: the named upload, its client made now (connections open on first use)."""
    view_of = memoryview
    if client.startswith("obstore"):
        store = obstore_store(ep, signed=client == "obstore-signed")
        return lambda key, src, part: obstore_upload(store, key, view_of(src), part, conc)
    c = boto3_client(ep, conc, tuned=client != "boto3-defaults", signed=client == "boto3-signed")
    if client == "s3transfer":
        return lambda key, src, part: s3transfer_upload(c, ep, key, src, part, conc)
    if client.startswith("boto3"):
        copy = client in ("boto3-bytes", "boto3-defaults")
        return lambda key, src, part: boto3_upload(c, ep, key, view_of(src), part, conc, copy)
    raise ValueError(f"unknown upload client {client!r} (known: {', '.join(UPLOADS)})")


def downloader(client: str, ep: Endpoint, conc: int) -> Callable[[str, memoryview, int], None]:
    """``f(key, dst, part)``: the named download into ``dst``."""
    if client.startswith("obstore"):
        store = obstore_store(ep)
        pooled = client == "obstore-pool"
        return lambda key, dst, part: obstore_download(store, key, dst, part, conc, pooled)
    c = boto3_client(ep, conc)
    if client == "s3transfer":
        return lambda key, dst, part: s3transfer_download(c, ep, key, dst, part, conc)
    if client in ("boto3", "boto3-urllib3"):
        direct = client == "boto3"
        return lambda key, dst, part: boto3_download(c, ep, key, dst, part, conc, direct)
    raise ValueError(f"unknown download client {client!r} (known: {', '.join(DOWNLOADS)})")
