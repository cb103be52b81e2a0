"""tierckpt.testing.s3proxy without an S3 server: the operation names of the requests botocore makes, and
the proxy's HTTP mechanics against a small echo server (bodies of either framing, 100-continue, kept-alive
connections, errors and resets injected, a server that goes away). The same proxy in front of radosgw:
tests/s3/test_s3proxy.py."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from tierckpt.testing.s3proxy import S3Proxy, classify


class _Captured(Exception):
    def __init__(self, request: Any) -> None:
        self.request = request


def _operation_of(call: Callable[[Any], object]) -> str:
    """The name the proxy gives to the request botocore makes for ``call(client)`` (never sent)."""
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="a",
        aws_secret_access_key="b",
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )

    def capture(request: Any, **kwargs: Any) -> None:
        raise _Captured(request)

    client.meta.events.register("before-send.s3", capture)
    with pytest.raises(_Captured) as got:
        call(client)
    r = got.value.request
    parts = urlsplit(r.url)
    return classify(r.method, parts.path + (f"?{parts.query}" if parts.query else ""), r.headers)


B, K, U = "bkt", "dir/key", "upload-1"
CALLS: dict[str, Callable[[Any], object]] = {
    "ListBuckets": lambda c: c.list_buckets(),
    "CreateBucket": lambda c: c.create_bucket(Bucket=B),
    "HeadBucket": lambda c: c.head_bucket(Bucket=B),
    "DeleteBucket": lambda c: c.delete_bucket(Bucket=B),
    "ListObjectsV2": lambda c: c.list_objects_v2(Bucket=B, Prefix="dir/", ContinuationToken="t", MaxKeys=5),
    "ListObjects": lambda c: c.list_objects(Bucket=B, Prefix="dir/", Delimiter="/", Marker="m"),
    "ListMultipartUploads": lambda c: c.list_multipart_uploads(Bucket=B, Prefix="dir/"),
    "DeleteObjects": lambda c: c.delete_objects(Bucket=B, Delete={"Objects": [{"Key": K}]}),
    "GetBucketLocation": lambda c: c.get_bucket_location(Bucket=B),
    "PutObject": lambda c: c.put_object(Bucket=B, Key=K, Body=b"x"),
    "CopyObject": lambda c: c.copy_object(Bucket=B, Key=K, CopySource={"Bucket": B, "Key": "other"}),
    "GetObject": lambda c: c.get_object(Bucket=B, Key=K, Range="bytes=0-9"),
    "HeadObject": lambda c: c.head_object(Bucket=B, Key=K),
    "DeleteObject": lambda c: c.delete_object(Bucket=B, Key=K),
    "CreateMultipartUpload": lambda c: c.create_multipart_upload(Bucket=B, Key=K),
    "UploadPart": lambda c: c.upload_part(Bucket=B, Key=K, UploadId=U, PartNumber=3, Body=b"x"),
    "UploadPartCopy": lambda c: c.upload_part_copy(
        Bucket=B, Key=K, UploadId=U, PartNumber=1, CopySource={"Bucket": B, "Key": "o"}
    ),
    "ListParts": lambda c: c.list_parts(Bucket=B, Key=K, UploadId=U),
    "CompleteMultipartUpload": lambda c: c.complete_multipart_upload(
        Bucket=B, Key=K, UploadId=U, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": "e"}]}
    ),
    "AbortMultipartUpload": lambda c: c.abort_multipart_upload(Bucket=B, Key=K, UploadId=U),
}


@pytest.mark.parametrize("operation", sorted(CALLS))
def test_botocore_requests_are_named_by_their_operation(operation: str) -> None:
    assert _operation_of(CALLS[operation]) == operation


def test_requests_of_no_known_operation_are_named_by_method_and_query() -> None:
    assert classify("GET", "/bkt?acl") == "GET bucket?acl"
    assert classify("PUT", "/bkt/key?tagging") == "PUT object?tagging"
    assert classify("POST", "/") == "POST service"
    assert classify("GET", "/bkt/a/b/c") == "GetObject"  # a key with slashes


class _Echo(BaseHTTPRequestHandler):
    """Answers each request with a JSON description of it (method, path, headers, body length and
    checksum); ``GET /chunked`` answers in chunks; ``GET /close`` closes its connection after answering."""

    protocol_version = "HTTP/1.1"
    connections: set[tuple[str, int]] = set()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _pieces(self) -> Iterator[bytes]:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while size := int(self.rfile.readline().split(b";")[0], 16):
                yield self.rfile.read(size)
                self.rfile.read(2)
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            return
        left = int(self.headers.get("Content-Length") or 0)
        while left:
            piece = self.rfile.read(min(left, 65536))
            left -= len(piece)
            yield piece

    def _answer(self) -> None:
        _Echo.connections.add(self.client_address)
        length = total = 0
        for piece in self._pieces():
            length += len(piece)
            total += sum(piece)
        desc = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "length": length,
            "sum": total % 65521,
        }
        out = json.dumps(desc).encode()
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(out), 7):
                piece = out[i : i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(out)))
        if self.path == "/close":
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer


@pytest.fixture
def echo() -> Iterator[str]:
    _Echo.connections = set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo: str) -> Iterator[S3Proxy]:
    with S3Proxy(echo, timeout_s=10) as p:
        yield p


def _conn(proxy: S3Proxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(*urlsplit(proxy.endpoint).netloc.split(":"), timeout=10)  # type: ignore[arg-type]


def _ask(conn: http.client.HTTPConnection, method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    conn.request(method, path, **kw)
    r = conn.getresponse()
    data = r.read()
    return r.status, (json.loads(data) if r.status == 200 and data else {"raw": data, "headers": dict(r.getheaders())})


def test_bodies_and_headers_pass_through_on_one_kept_alive_connection(proxy: S3Proxy) -> None:
    """A 3 MiB body with Content-Length, a chunked one (framing kept: the server sees it chunked), a
    chunked answer, every end-to-end header as sent (Host included, for SigV4), all on one connection to
    the proxy and so one to the server."""
    conn = _conn(proxy)
    body = bytes(range(256)) * (3 * 4096)
    status, got = _ask(conn, "PUT", "/bkt/key", body=body, headers={"X-Amz-Date": "20260101T000000Z"})
    assert status == 200 and (got["length"], got["sum"]) == (len(body), sum(body) % 65521)
    assert got["headers"]["x-amz-date"] == "20260101T000000Z"
    assert got["headers"]["host"] == urlsplit(proxy.endpoint).netloc
    status, got = _ask(conn, "PUT", "/bkt/key2?partNumber=1&uploadId=u", body=iter([b"ab", b"c" * 70000]))
    assert status == 200 and got["length"] == 70002 and got["headers"]["transfer-encoding"] == "chunked"
    status, got = _ask(conn, "GET", "/chunked")
    assert status == 200 and got["path"] == "/chunked"
    assert len(_Echo.connections) == 1
    assert proxy.counts() == {"PutObject": 1, "UploadPart": 1, "ListObjects": 1}  # GET /chunked: a bucket
    assert [r.status for r in proxy.requests()] == [200, 200, 200]


def test_a_large_body_streams_through_in_pieces(proxy: S3Proxy) -> None:
    """64 MiB through the proxy (the server reads it in 64 KiB pieces): what the proxy and the server
    allocate meanwhile stays a few MiB, not the body's size."""
    body = b"\x07" * (64 << 20)
    conn = _conn(proxy)
    tracemalloc.start()
    try:
        status, got = _ask(conn, "PUT", "/bkt/big?partNumber=1&uploadId=u", body=body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status == 200 and got["length"] == len(body) and got["sum"] == 7 * len(body) % 65521
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated at the peak"


def test_expect_100_continue_is_answered_by_the_proxy(proxy: S3Proxy) -> None:
    """The client waits for ``100 Continue`` before its body; the server never sees ``Expect``."""
    with socket.create_connection(urlsplit(proxy.endpoint).netloc.split(":")) as s:  # type: ignore[arg-type]
        s.sendall(b"PUT /bkt/k HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100")
        s.sendall(b"hello")
        answer = b""
        while not answer.endswith(b"}"):
            answer += s.recv(65536)
    got = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert got["length"] == 5 and "expect" not in got["headers"]


def test_injected_errors_answer_s3_xml_for_a_count_then_forward(proxy: S3Proxy) -> None:
    fault = proxy.inject_errors(count=2, operations={"PutObject"})
    conn = _conn(proxy)
    assert _ask(conn, "GET", "/bkt/key")[0] == 200  # another operation: forwarded
    for _ in range(2):
        status, got = _ask(conn, "PUT", "/bkt/key", body=b"x" * 1000)  # the body is read and dropped
        assert status == 503 and b"<Code>SlowDown</Code>" in got["raw"] and b"<Resource>/bkt/key" in got["raw"]
    assert _ask(conn, "PUT", "/bkt/key", body=b"x")[0] == 200
    assert fault.hits == 2
    assert [(r.operation, r.status, r.fault) for r in proxy.requests()] == [
        ("GetObject", 200, None),
        ("PutObject", 503, "503 SlowDown"),
        ("PutObject", 503, "503 SlowDown"),
        ("PutObject", 200, None),
    ]
    proxy.inject_errors(status=500, code="InternalError")  # until cleared
    status, got = _ask(conn, "HEAD", "/bkt")
    assert status == 500 and got["raw"] == b""  # HEAD: no body
    proxy.clear_faults()
    assert _ask(conn, "HEAD", "/bkt")[0] == 200


def test_an_error_to_a_client_waiting_for_continue_closes_the_connection(proxy: S3Proxy) -> None:
    proxy.inject_errors(count=1)
    with socket.create_connection(urlsplit(proxy.endpoint).netloc.split(":")) as s:  # type: ignore[arg-type]
        s.sendall(b"PUT /bkt/k HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503") and b"Connection: close" in answer


def test_injected_resets_close_without_an_answer(proxy: S3Proxy) -> None:
    fault = proxy.inject_resets(count=1, operations={"GetObject"})
    conn = _conn(proxy)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _ask(conn, "GET", "/bkt/key")
    conn.close()
    assert _ask(_conn(proxy), "GET", "/bkt/key")[0] == 200
    assert fault.hits == 1 and [r.status for r in proxy.requests()] == [None, 200]


def test_a_time_window_of_errors_ends(proxy: S3Proxy) -> None:
    """Errors for a while: answered while the window is open, forwarded once it is over."""
    proxy.inject_errors(seconds=0.3)
    conn = _conn(proxy)
    assert _ask(conn, "GET", "/bkt/key")[0] == 503
    time.sleep(0.5)
    assert _ask(conn, "GET", "/bkt/key")[0] == 200


def test_a_server_that_closes_or_is_gone(echo: str) -> None:
    """The server closes its connection after an answer: the next request opens a new one. No server
    listening: the client's connection is reset, and the request is logged without a status."""
    with S3Proxy(echo) as proxy:
        conn = _conn(proxy)
        assert _ask(conn, "GET", "/close")[0] == 200
        assert _ask(conn, "GET", "/bkt/key")[0] == 200
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connections are refused
        with S3Proxy(dead) as proxy:
            with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
                _ask(_conn(proxy), "GET", "/bkt/key")
            assert [(r.operation, r.status) for r in proxy.requests()] == [("GetObject", None)]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="upstream: expected an endpoint like"):
        S3Proxy("https://127.0.0.1:1")
    with S3Proxy("http://127.0.0.1:1") as proxy:
        with pytest.raises(ValueError, match="count: expected a number of requests >= 1, got 0"):
            proxy.inject_errors(count=0)
        with pytest.raises(TypeError, match="operations: expected a collection of names"):
            proxy.inject_resets(count=1, operations="PutObject")
