"""The fault-injecting proxy (tierckpt.testing.s3proxy) in front of the session's radosgw: boto3's
requests pass through it unchanged (SigV4 signed for the proxy's address; multipart uploads, ranged GETs,
bytes intact), are counted by operation, and see the errors and resets it injects as a real server's."""

from __future__ import annotations

import io
import os

import pytest

from tierckpt.testing.s3bucket import S3Bucket

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'tierckpt[s3]')")
from boto3.s3.transfer import TransferConfig  # noqa: E402
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError  # noqa: E402

pytestmark = [pytest.mark.remote]

MiB = 1 << 20
PARTS = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=4)


def test_requests_are_counted_by_operation(s3_proxy: S3Bucket) -> None:
    c, b = s3_proxy.new_client(), s3_proxy.name
    c.head_bucket(Bucket=b)
    c.put_object(Bucket=b, Key="a/1", Body=b"0123456789")
    c.put_object(Bucket=b, Key="a/2", Body=b"x")
    assert [o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix="a/")["Contents"]] == ["a/1", "a/2"]
    assert len(c.list_objects(Bucket=b)["Contents"]) == 2
    assert c.head_object(Bucket=b, Key="a/1")["ContentLength"] == 10
    assert c.get_object(Bucket=b, Key="a/1", Range="bytes=2-5")["Body"].read() == b"2345"
    up = c.create_multipart_upload(Bucket=b, Key="m")["UploadId"]
    c.upload_part(Bucket=b, Key="m", UploadId=up, PartNumber=1, Body=b"p")
    assert [u["UploadId"] for u in c.list_multipart_uploads(Bucket=b)["Uploads"]] == [up]
    c.abort_multipart_upload(Bucket=b, Key="m", UploadId=up)
    c.delete_object(Bucket=b, Key="a/1")
    c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "a/2"}]})
    assert s3_proxy.proxy is not None
    assert s3_proxy.proxy.counts() == {
        "HeadBucket": 1,
        "PutObject": 2,
        "ListObjectsV2": 1,
        "ListObjects": 1,
        "HeadObject": 1,
        "GetObject": 1,
        "CreateMultipartUpload": 1,
        "UploadPart": 1,
        "ListMultipartUploads": 1,
        "AbortMultipartUpload": 1,
        "DeleteObject": 1,
        "DeleteObjects": 1,
    }
    assert [r.range for r in s3_proxy.proxy.requests() if r.operation == "GetObject"] == ["bytes=2-5"]
    assert {r.status for r in s3_proxy.proxy.requests()} <= {200, 204, 206}
    assert s3_proxy.keys() == [] and s3_proxy.uploads() == []


def test_a_multipart_upload_and_ranged_gets_pass_through_intact(s3_proxy: S3Bucket) -> None:
    """40 MiB in five 8 MiB parts, four at a time, through the proxy; read back whole straight from
    radosgw, and in ranges (one across a part boundary, the last byte) and by a parallel download through
    the proxy."""
    assert s3_proxy.proxy is not None
    c, b = s3_proxy.new_client(), s3_proxy.name
    data = os.urandom(40 * MiB)
    c.upload_fileobj(io.BytesIO(data), b, "big", Config=PARTS)
    counts = s3_proxy.proxy.counts()
    assert (counts["CreateMultipartUpload"], counts["UploadPart"], counts["CompleteMultipartUpload"]) == (1, 5, 1)
    assert s3_proxy.client.get_object(Bucket=b, Key="big")["Body"].read() == data
    for first, last in ((0, 0), (8 * MiB - 3, 8 * MiB + 4), (len(data) - 1, len(data) - 1), (MiB, 17 * MiB)):
        got = c.get_object(Bucket=b, Key="big", Range=f"bytes={first}-{last}")["Body"].read()
        assert got == data[first : last + 1], (first, last)
    s3_proxy.proxy.clear_counts()
    out = io.BytesIO()
    c.download_fileobj(b, "big", out, Config=PARTS)
    assert out.getvalue() == data
    ranges = [r.range for r in s3_proxy.proxy.requests() if r.operation == "GetObject"]
    assert len(ranges) == 5 and all(r is not None and r.startswith("bytes=") for r in ranges), ranges


def test_injected_503_is_slowdown_to_boto3(s3_proxy: S3Bucket) -> None:
    """Without retries the client raises SlowDown (HTTP 503) and nothing is written; with the standard
    retries two 503s are retried and the third attempt lands."""
    proxy = s3_proxy.proxy
    assert proxy is not None
    once = s3_proxy.new_client(retries={"mode": "standard", "total_max_attempts": 1})
    proxy.inject_errors(count=1)
    with pytest.raises(ClientError) as err:
        once.put_object(Bucket=s3_proxy.name, Key="k", Body=b"data")
    assert err.value.response["Error"]["Code"] == "SlowDown"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert s3_proxy.keys() == []
    proxy.clear_counts()
    fault = proxy.inject_errors(count=2, operations={"PutObject"})
    s3_proxy.new_client().put_object(Bucket=s3_proxy.name, Key="k", Body=b"data")
    assert [(r.operation, r.status) for r in proxy.requests()] == [("PutObject", 503)] * 2 + [("PutObject", 200)]
    assert fault.hits == 2 and s3_proxy.keys() == ["k"]


def test_errors_for_a_while_on_some_operations(s3_proxy: S3Bucket) -> None:
    """Listing answers SlowDown until the faults are cleared, whatever the retries; reads go on."""
    proxy = s3_proxy.proxy
    assert proxy is not None
    c = s3_proxy.new_client()
    c.put_object(Bucket=s3_proxy.name, Key="k", Body=b"data")
    proxy.inject_errors(seconds=300, operations={"ListObjectsV2", "ListObjects"})
    with pytest.raises(ClientError, match="SlowDown"):
        c.list_objects_v2(Bucket=s3_proxy.name)
    assert proxy.count("ListObjectsV2") == 3  # the standard mode's three attempts
    assert c.get_object(Bucket=s3_proxy.name, Key="k")["Body"].read() == b"data"
    proxy.clear_faults()
    assert c.list_objects_v2(Bucket=s3_proxy.name)["KeyCount"] == 1


def test_faults_on_part_uploads_are_retried_and_the_object_is_whole(s3_proxy: S3Bucket) -> None:
    """A reset and a 503 on part uploads (8 MiB bodies: boto3 waits for ``100 Continue`` first) in the
    middle of a multipart upload: the retried parts land and the object reads back intact."""
    proxy = s3_proxy.proxy
    assert proxy is not None
    data = os.urandom(24 * MiB)
    proxy.inject_resets(count=1, operations={"UploadPart"})
    proxy.inject_errors(count=1, operations={"UploadPart"})
    s3_proxy.new_client().upload_fileobj(io.BytesIO(data), s3_proxy.name, "obj", Config=PARTS)
    parts = [r for r in proxy.requests() if r.operation == "UploadPart"]
    assert sorted(str(r.fault) for r in parts if r.fault) == ["503 SlowDown", "reset"]
    assert len(parts) == 5
    assert s3_proxy.client.get_object(Bucket=s3_proxy.name, Key="obj")["Body"].read() == data


def test_a_reset_without_retries_is_a_connection_error(s3_proxy: S3Bucket) -> None:
    proxy = s3_proxy.proxy
    assert proxy is not None
    proxy.inject_resets(count=1)
    once = s3_proxy.new_client(retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        once.head_bucket(Bucket=s3_proxy.name)
    once.head_bucket(Bucket=s3_proxy.name)
    assert [r.status for r in proxy.requests()] == [None, 200]
