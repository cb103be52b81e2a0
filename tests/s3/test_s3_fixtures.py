"""The S3 fixtures of tierckpt.testing.pytest_clusters on the session's radosgw: a fresh bucket with the
credentials in the environment, its tier entry, its removal (objects, uploads in progress, the bucket), and
radosgw killed and started again in the middle of a test."""

from __future__ import annotations

import os

import pytest

from tierckpt.testing.clusters import CephCluster
from tierckpt.testing.s3bucket import S3Bucket, S3Server, bucket_name

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'tierckpt[s3]')")
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402

pytestmark = [pytest.mark.remote]


def test_a_fresh_bucket_with_the_credentials_in_the_environment(s3_bucket: S3Bucket, s3_server: S3Server) -> None:
    """A client made from the environment alone (as a tier makes one) reaches the bucket; the entry
    names the bucket, the prefix and the endpoint."""
    assert s3_bucket.name.startswith("tck-test-a-fresh-bucket") and 3 <= len(s3_bucket.name) <= 63
    assert s3_bucket.keys() == [] and s3_bucket.endpoint == s3_server.endpoint
    assert (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]) == (
        s3_server.access_key,
        s3_server.secret_key,
    )
    c = boto3.client("s3", endpoint_url=s3_bucket.endpoint, config=Config(s3={"addressing_style": "path"}))
    c.put_object(Bucket=s3_bucket.name, Key="ckpt/x", Body=b"1")
    assert s3_bucket.keys("ckpt/") == ["ckpt/x"]
    assert s3_bucket.url("ckpt/") == f"s3://{s3_bucket.name}/ckpt" and s3_bucket.url() == f"s3://{s3_bucket.name}"
    assert s3_bucket.tier_entry("obj", "ckpt", part_bytes="8MiB") == {
        "name": "obj",
        "kind": "s3",
        "path": f"s3://{s3_bucket.name}/ckpt",
        "options": {"endpoint_url": s3_server.endpoint, "part_bytes": "8MiB"},
    }


def test_removing_a_bucket_takes_its_objects_and_uploads(s3_server: S3Server) -> None:
    b = S3Bucket.create(s3_server, bucket_name("removal"))
    for i in range(3):
        b.client.put_object(Bucket=b.name, Key=f"k/{i}", Body=b"x" * 1000)
    up = b.client.create_multipart_upload(Bucket=b.name, Key="m")["UploadId"]
    b.client.upload_part(Bucket=b.name, Key="m", UploadId=up, PartNumber=1, Body=b"p" * (5 << 20))
    assert len(b.keys()) == 3 and b.uploads() == [("m", up)]
    b.remove()
    with pytest.raises(ClientError) as err:
        b.client.head_bucket(Bucket=b.name)
    assert err.value.response["Error"]["Code"] == "404"


def test_the_proxy_bucket_points_tiers_at_the_proxy(s3_proxy: S3Bucket, s3_server: S3Server) -> None:
    """``s3_proxy``'s endpoint and entry are the proxy's; its ``client`` goes around it."""
    assert s3_proxy.proxy is not None and s3_proxy.endpoint == s3_proxy.proxy.endpoint != s3_server.endpoint
    assert s3_proxy.tier_entry()["options"] == {"endpoint_url": s3_proxy.proxy.endpoint}
    s3_proxy.client.put_object(Bucket=s3_proxy.name, Key="k", Body=b"1")
    assert s3_proxy.keys() == ["k"] and s3_proxy.proxy.count() == 0
    s3_proxy.new_client().head_object(Bucket=s3_proxy.name, Key="k")
    assert s3_proxy.proxy.counts() == {"HeadObject": 1}


def test_radosgw_killed_and_started_again_keeps_its_buckets(ceph_cluster: CephCluster, s3_bucket: S3Bucket) -> None:
    """Killed: requests are refused. Started again: same endpoint, same objects."""
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="k", Body=b"before")
    ceph_cluster.kill_rgw()
    assert not ceph_cluster.rgw_running
    once = s3_bucket.new_client(retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises(EndpointConnectionError):
        once.head_bucket(Bucket=s3_bucket.name)
    assert ceph_cluster.start_rgw() == s3_bucket.endpoint
    assert once.get_object(Bucket=s3_bucket.name, Key="k")["Body"].read() == b"before"
