"""Buckets on a test S3 server (radosgw of :class:`tierckpt.testing.clusters.CephCluster`, or any other):
made with a unique name, described as a tier's YAML entry, emptied and removed afterwards.

Needs ``boto3`` (``pip install 'tierckpt[s3]'``)::

    server = S3Server(ceph.s3_endpoint, ceph.access_key, ceph.secret_key)
    bucket = S3Bucket.create(server, bucket_name("my-test"))
    try:
        config = {"tiers": [..., bucket.tier_entry("obj", "ckpt")]}  # kind: s3, path: s3://NAME/ckpt
        ...
    finally:
        bucket.remove()  # every object and in-progress multipart upload, then the bucket

Clients made here use path-style addressing (``http://127.0.0.1:PORT/BUCKET/KEY``), SigV4, bounded
timeouts (10 s to connect, 60 s to read: a full radosgw makes requests wait instead of failing) and the
standard retry mode with 3 attempts.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from tierckpt.testing.s3proxy import S3Proxy

__all__ = ["S3Bucket", "S3Server", "bucket_name"]

#: the region clients name (radosgw's default zone group answers to any)
REGION = "us-east-1"
#: the most keys one DeleteObjects request may name (S3's limit)
_DELETE_BATCH = 1000


@dataclass(frozen=True)
class S3Server:
    """Where an S3 server answers and the credentials of its test user."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = REGION

    def client(self, endpoint: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client of this user, at ``endpoint`` (default: the server's), path-style; ``config``
        overrides entries of its ``botocore.config.Config`` (e.g. ``retries={"total_max_attempts": 1}``)."""
        import boto3
        from botocore.config import Config

        settings: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "signature_version": "s3v4",
            "connect_timeout": 10,
            "read_timeout": 60,
            "retries": {"mode": "standard", "total_max_attempts": 3},
        }
        settings.update(config)
        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**settings),
        )


def bucket_name(hint: str) -> str:
    """A bucket name unique to this call, from ``hint`` (a test's name): lowercase letters, digits and
    hyphens, 3 to 63 characters, as S3 requires."""
    slug = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:40].strip("-")
    return f"tck-{slug}-{uuid.uuid4().hex[:10]}" if slug else f"tck-{uuid.uuid4().hex[:10]}"


@dataclass
class S3Bucket:
    """A bucket of a test: its :attr:`name`; the :attr:`endpoint` tiers reach it at (a proxy's, when
    :attr:`proxy` is set); :attr:`client`, a boto3 client that goes straight to the :attr:`server`, so
    that a test's own requests are neither counted nor faulted by the proxy (:meth:`new_client` makes one
    that goes through it)."""

    name: str
    endpoint: str
    client: Any
    server: S3Server
    proxy: S3Proxy | None = None

    @classmethod
    def create(cls, server: S3Server, name: str, proxy: S3Proxy | None = None) -> S3Bucket:
        """Create the bucket ``name`` on ``server``; behind ``proxy``, tiers reach it through that."""
        client = server.client()
        client.create_bucket(Bucket=name)
        return cls(name, proxy.endpoint if proxy is not None else server.endpoint, client, server, proxy)

    def new_client(self, **config: Any) -> Any:
        """A new boto3 client at :attr:`endpoint` (through the proxy, when there is one), as
        :meth:`S3Server.client` makes them."""
        return self.server.client(self.endpoint, **config)

    def url(self, prefix: str = "") -> str:
        """``s3://NAME/PREFIX`` (``s3://NAME`` without a prefix)."""
        prefix = prefix.strip("/")
        return f"s3://{self.name}/{prefix}" if prefix else f"s3://{self.name}"

    def tier_entry(self, name: str = "obj", prefix: str = "", **options: Any) -> dict[str, Any]:
        """A tier's YAML entry on this bucket: ``{name, kind: s3, path: s3://NAME/PREFIX, options:
        {endpoint_url: ENDPOINT, **options}}``; add ``capacity``, ``keep`` and the like to the dict."""
        return {
            "name": name,
            "kind": "s3",
            "path": self.url(prefix),
            "options": {"endpoint_url": self.endpoint, **options},
        }

    def keys(self, prefix: str = "") -> list[str]:
        """The keys of the objects under ``prefix``, in S3's (lexicographic) order."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def uploads(self, prefix: str = "") -> list[tuple[str, str]]:
        """The multipart uploads in progress under ``prefix``: ``(key, upload id)`` pairs."""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.name, Prefix=prefix)
        return [(u["Key"], u["UploadId"]) for page in pages for u in page.get("Uploads", [])]

    def empty(self) -> None:
        """Abort every multipart upload in progress and delete every object."""
        for key, upload_id in self.uploads():
            self.client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)
        keys = self.keys()
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + _DELETE_BATCH]]
            answer = self.client.delete_objects(Bucket=self.name, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                raise RuntimeError(f"bucket {self.name}: cannot delete {answer['Errors'][:3]}")

    def remove(self) -> None:
        """Empty the bucket (:meth:`empty`) and delete it."""
        self.empty()
        self.client.delete_bucket(Bucket=self.name)
