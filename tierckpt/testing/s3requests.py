"""Which S3 operation an HTTP request is, from its method, path and query (path-style addressing): what
:class:`tierckpt.testing.s3proxy.S3Proxy` counts requests by."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["classify"]

#: a bucket's sub-resources (``GET /BUCKET?location``) and the operation each names, by method
_BUCKET_SUBRESOURCES = {
    ("GET", "uploads"): "ListMultipartUploads",
    ("GET", "versions"): "ListObjectVersions",
    ("GET", "location"): "GetBucketLocation",
    ("GET", "versioning"): "GetBucketVersioning",
    ("GET", "lifecycle"): "GetBucketLifecycle",
    ("PUT", "lifecycle"): "PutBucketLifecycle",
    ("GET", "policy"): "GetBucketPolicy",
    ("POST", "delete"): "DeleteObjects",
}


def classify(method: str, target: str, headers: Any = None) -> str:
    """The S3 operation of a request with path-style addressing, from its method, target (``/BUCKET/KEY?QUERY``)
    and headers (``x-amz-copy-source`` makes a copy): ``ListBuckets``, ``CreateBucket``, ``HeadBucket``,
    ``DeleteBucket``, ``ListObjectsV2`` (``list-type=2``), ``ListObjects``, ``ListMultipartUploads``,
    ``DeleteObjects``, a few bucket settings (``GetBucketLocation`` …), ``PutObject``, ``CopyObject``,
    ``GetObject``, ``HeadObject``, ``DeleteObject``, ``CreateMultipartUpload``, ``UploadPart``,
    ``UploadPartCopy``, ``ListParts``, ``CompleteMultipartUpload``, ``AbortMultipartUpload``; else
    ``"METHOD bucket"`` or ``"METHOD object"`` followed by the query's names (``"GET bucket?acl"``)."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    bucket, _, key = parts.path.lstrip("/").partition("/")
    copy = headers is not None and headers.get("x-amz-copy-source") is not None
    if not bucket:
        return "ListBuckets" if method == "GET" else f"{method} service"
    if not key:
        for name in query:
            if (method, name) in _BUCKET_SUBRESOURCES:
                return _BUCKET_SUBRESOURCES[method, name]
        listing = not set(query) - {"list-type", "prefix", "delimiter", "marker", "max-keys", "encoding-type",
                                    "continuation-token", "start-after", "fetch-owner"}  # fmt: skip
        simple = {
            ("GET", True): "ListObjectsV2" if query.get("list-type") == ["2"] else "ListObjects",
            ("HEAD", True): "HeadBucket",
            ("PUT", True): "CreateBucket",
            ("DELETE", True): "DeleteBucket",
        }
        return simple.get((method, listing and (method == "GET" or not query))) or _other(method, "bucket", query)
    if "uploadId" in query:
        by_method = {
            "PUT": "UploadPartCopy" if copy else "UploadPart",
            "POST": "CompleteMultipartUpload",
            "DELETE": "AbortMultipartUpload",
            "GET": "ListParts",
        }
        return by_method.get(method) or _other(method, "object", query)
    if method == "POST" and "uploads" in query:
        return "CreateMultipartUpload"
    if not query or set(query) <= {"versionId", "partNumber", "response-content-type"}:
        by_method = {
            "PUT": "CopyObject" if copy else "PutObject",
            "GET": "GetObject",
            "HEAD": "HeadObject",
            "DELETE": "DeleteObject",
        }
        if method in by_method:
            return by_method[method]
    return _other(method, "object", query)


def _other(method: str, what: str, query: dict[str, list[str]]) -> str:
    return f"{method} {what}" + (f"?{'&'.join(sorted(query))}" if query else "")
