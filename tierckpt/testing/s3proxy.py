"""A fault-injecting HTTP proxy in front of an S3 server, for tests: it counts requests by S3 operation and,
when told to, answers errors (``503 SlowDown`` by default) or resets connections instead of forwarding.

Point a client (or a tier's ``endpoint_url``) at :attr:`S3Proxy.endpoint` instead of the server's::

    with S3Proxy("http://127.0.0.1:7480") as proxy:
        s3 = boto3.client("s3", endpoint_url=proxy.endpoint, ...)
        proxy.inject_errors(count=2, operations={"UploadPart"})  # the next two part uploads get 503 SlowDown
        proxy.inject_resets(count=1)                              # the request after is dropped unanswered
        ...
        assert proxy.count("ListObjectsV2", "ListObjects") == 0

Requests and responses are forwarded as they are, every end-to-end header included, so that SigV4
signatures stay valid: the client signs for the proxy's ``host:port``, which the server checks only against
the ``Host`` header it receives (radosgw does not compare it with its own address). Bodies stream through
in pieces of at most 1 MiB, both ways (``Content-Length`` or chunked); each client connection is kept alive
and has its own kept-alive connection to the server. ``Expect: 100-continue`` is answered by the proxy.

Requests are named from their method, path and query, with path-style addressing (``/BUCKET/KEY``): see
:func:`classify`. The proxy listens on 127.0.0.1 only and serves each client connection in a thread.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import logging
import select
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from tierckpt.testing.s3requests import classify

__all__ = ["Fault", "ProxiedRequest", "S3Proxy", "classify"]

log = logging.getLogger(__name__)

#: the largest piece of a body the proxy holds at once
PIECE_BYTES = 1 << 20
#: headers that concern one connection only (RFC 9110 §7.6.1), not forwarded; ``Expect`` is answered here
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
)
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
}


@dataclass
class Fault:
    """One injected fault: what it does, to which operations, for how long; :attr:`hits` counts the
    requests it answered. Made by :meth:`S3Proxy.inject_errors` and :meth:`S3Proxy.inject_resets`."""

    reset: bool
    operations: frozenset[str] | None
    remaining: int | None
    until: float | None
    status: int = 503
    code: str = "SlowDown"
    message: str = ""
    hits: int = 0

    def active(self, now: float) -> bool:
        """Whether the fault still answers requests (count left, time not over)."""
        return (self.remaining is None or self.remaining > 0) and (self.until is None or now < self.until)

    def take(self, operation: str, now: float) -> bool:
        """Whether it answers a request of ``operation`` now; if so, counts it."""
        if not self.active(now) or (self.operations is not None and operation not in self.operations):
            return False
        if self.remaining is not None:
            self.remaining -= 1
        self.hits += 1
        return True


@dataclass
class ProxiedRequest:
    """A request the proxy received: its operation (:func:`classify`), method, path with query, the
    ``Range`` header of a ``GetObject``, and what came of it: the status the client got (``None`` when the
    connection was reset, by a fault or because the server failed) and the fault that answered it."""

    operation: str
    method: str
    path: str
    range: str | None = None
    status: int | None = None
    fault: str | None = None
    started: float = field(default_factory=time.monotonic)


class S3Proxy:
    """A reverse proxy on 127.0.0.1 forwarding to the S3 server at ``upstream`` (``http://HOST:PORT``).

    Thread-safe: tests change faults and read counts while clients run. Faults are tried in the order they
    were injected; the first one that applies answers the request. :meth:`stop` (or leaving the ``with``
    block) closes the client connections still open.

    Args:
        upstream: the server's endpoint, ``http://HOST:PORT`` (no TLS).
        port: the port to listen on; 0 (default) lets the kernel choose.
        timeout_s: how long a connection may stay silent, on either side, before it is closed.
    """

    def __init__(self, upstream: str, port: int = 0, timeout_s: float = 120.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"upstream: expected an endpoint like 'http://127.0.0.1:7480', got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._log: list[ProxiedRequest] = []
        self._faults: list[Fault] = []
        self._server = _Server(("127.0.0.1", port), self)
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: where clients reach the server through the proxy."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> S3Proxy:
        """Serve in a background thread; returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, args=(0.05,), name="s3proxy", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the open connections and wait for their threads. Safe to call twice."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.close_connections()
        self._server.server_close()

    def __enter__(self) -> S3Proxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def counts(self) -> dict[str, int]:
        """Requests received so far by operation, answered by the server or by a fault alike."""
        with self._lock:
            return dict(self._counts)

    def count(self, *operations: str) -> int:
        """How many requests of these operations were received (all of them with none named)."""
        with self._lock:
            return sum(self._counts[op] for op in operations) if operations else sum(self._counts.values())

    def requests(self) -> list[ProxiedRequest]:
        """The requests received so far, in the order they arrived."""
        with self._lock:
            return list(self._log)

    def clear_counts(self) -> None:
        """Forget the requests received so far (counts and log); faults stay."""
        with self._lock:
            self._counts.clear()
            self._log.clear()

    def inject_errors(
        self,
        count: int | None = None,
        seconds: float | None = None,
        operations: Collection[str] | None = None,
        status: int = 503,
        code: str = "SlowDown",
    ) -> Fault:
        """Answer the next ``count`` requests, or all requests for ``seconds`` from now (whichever ends
        first when both are given; neither: until :meth:`clear_faults`), with ``status`` and an S3 XML error
        ``code``, instead of forwarding them; only requests of ``operations`` when given. A request's body
        is read and dropped first (unless the client waits for ``100 Continue``: then it is never sent,
        and the connection is closed after the answer)."""
        message = _MESSAGES.get(code, code)
        return self._inject(Fault(False, *self._scope(count, seconds, operations), status, code, message))

    def inject_resets(
        self, count: int | None = None, seconds: float | None = None, operations: Collection[str] | None = None
    ) -> Fault:
        """Reset the connection (close it with a TCP RST, no answer) of the next ``count`` requests, or
        of all requests for ``seconds``, as :meth:`inject_errors` selects them; the request's body may be
        in flight, as when a server crashes."""
        return self._inject(Fault(True, *self._scope(count, seconds, operations)))

    def clear_faults(self) -> None:
        """Forward every request from now on."""
        with self._lock:
            self._faults.clear()

    @staticmethod
    def _scope(
        count: int | None, seconds: float | None, operations: Collection[str] | None
    ) -> tuple[frozenset[str] | None, int | None, float | None]:
        if count is not None and count < 1:
            raise ValueError(f"count: expected a number of requests >= 1, got {count}")
        if seconds is not None and seconds <= 0:
            raise ValueError(f"seconds: expected a duration > 0, got {seconds}")
        if isinstance(operations, str):
            raise TypeError(f"operations: expected a collection of names, got the string {operations!r}")
        until = None if seconds is None else time.monotonic() + seconds
        return (None if operations is None else frozenset(operations)), count, until

    def _inject(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def admit(self, request: ProxiedRequest) -> Fault | None:
        """Record a request as it arrives; the fault that answers it, if any (the proxy's handlers call
        this)."""
        now = time.monotonic()
        with self._lock:
            self._counts[request.operation] += 1
            self._log.append(request)
            self._faults = [f for f in self._faults if f.active(now)]
            for fault in self._faults:
                if fault.take(request.operation, now):
                    request.fault = "reset" if fault.reset else f"{fault.status} {fault.code}"
                    return fault
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], proxy: S3Proxy) -> None:
        self.proxy = proxy
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._open_lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("s3proxy: a connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None
    _expects_continue = False

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.proxy.timeout_s)

    def finish(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        super().finish()

    def parse_request(self) -> bool:
        self._expects_continue = False
        return super().parse_request()

    def handle_expect_100(self) -> bool:
        self._expects_continue = True  # answered once the request is to be forwarded (see _forward)
        return True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("s3proxy: " + format, *args)

    def _handle(self) -> None:
        op = classify(self.command, self.path, self.headers)
        request = ProxiedRequest(op, self.command, self.path, self.headers.get("Range") if op == "GetObject" else None)
        fault = self.server.proxy.admit(request)
        if fault is not None and fault.reset:
            self._reset()
        elif fault is not None:
            request.status = fault.status
            self._answer_error(fault)
        else:
            self._forward(request)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _reset(self) -> None:
        """Close the client's connection with a TCP RST, answering nothing."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def _answer_error(self, fault: Fault) -> None:
        if self._expects_continue:
            self.close_connection = True  # the body never comes: nothing more may be read on this connection
        else:
            _copy_body(self.rfile, self.headers, None)
        resource = escape(urlsplit(self.path).path)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{escape(fault.code)}</Code><Message>{escape(fault.message)}</Message>"
            f"<Resource>{resource}</Resource><RequestId>s3proxy-{fault.hits}</RequestId></Error>"
        ).encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _connection(self) -> http.client.HTTPConnection:
        """The kept-alive connection to the server, new when there is none or the server closed it."""
        conn = self._upstream
        if conn is not None and conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
            conn.close()  # readable while idle: the server closed it (or sent something unasked)
        if conn is None:
            conn = self._upstream = http.client.HTTPConnection(
                *self.server.proxy.upstream, timeout=self.server.proxy.timeout_s
            )
        return conn

    def _forward(self, request: ProxiedRequest) -> None:
        """Forward the request and stream the answer back, its status noted in ``request`` first; when the
        server fails (no status), the client's connection is reset, as the server's was."""
        conn = self._connection()
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            if self._expects_continue:
                self.send_response_only(100)
                self.end_headers()
            _copy_body(self.rfile, self.headers, conn.send)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            log.debug("s3proxy: forwarding %s %s failed: %s", self.command, self.path, e)
            conn.close()
            self._reset()
            return
        request.status = response.status
        try:
            self._send_back(response)
        except (OSError, http.client.HTTPException) as e:
            log.debug("s3proxy: answering %s %s failed: %s", self.command, self.path, e)
            conn.close()
            self._reset()

    def _send_back(self, response: http.client.HTTPResponse) -> None:
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        has_body = self.command != "HEAD" and response.status not in (204, 304) and response.status >= 200
        rechunk = has_body and response.getheader("Content-Length") is None
        if rechunk:
            self.send_header("Transfer-Encoding", "chunked")
        if response.will_close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        piece = bytearray(PIECE_BYTES)
        view = memoryview(piece)
        while has_body:
            n = response.readinto(piece)
            if rechunk:
                self.wfile.write(b"%x\r\n" % n + bytes(view[:n]) + b"\r\n")
            elif n:
                self.wfile.write(view[:n])
            if not n:
                break
        response.close()


def _copy_body(rfile: io.BufferedIOBase, headers: Any, send: Any) -> None:
    """Read a request's body from ``rfile`` (``Content-Length`` bytes, or a chunked body with its framing
    as it came) and hand it to ``send`` piece by piece (dropped when ``send`` is ``None``)."""
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        _copy_chunked(rfile, send)
        return
    left = int(headers.get("Content-Length") or 0)
    while left > 0:
        piece = rfile.read(min(left, PIECE_BYTES))
        if not piece:
            raise ConnectionError(f"the client closed its connection with {left} bytes of the body not sent")
        if send is not None:
            send(piece)
        left -= len(piece)


def _copy_chunked(rfile: io.BufferedIOBase, send: Any) -> None:
    """Copy a chunked body, framing included: chunks, the last (empty) one, trailers, the blank line."""
    while True:
        line = rfile.readline(1024)
        if not line.endswith(b"\n"):
            raise ConnectionError(f"a chunked body broke off in a chunk's size line: {line[:60]!r}")
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if send is not None:
            send(line)
        if size == 0:
            break
        left = size + 2  # the chunk and its CRLF
        while left > 0:
            piece = rfile.read(min(left, PIECE_BYTES))
            if not piece:
                raise ConnectionError("the client closed its connection in the middle of a chunk")
            if send is not None:
                send(piece)
            left -= len(piece)
    while True:  # trailers, up to the blank line
        line = rfile.readline(8192)
        if send is not None:
            send(line)
        if line in (b"\r\n", b"\n", b""):
            return
