"""HARNESS SELF-TEST ONLY -- NOT the buildvault server.

A tiny in-memory HTTP key/value store (GET/HEAD/PUT/DELETE on any path) used
by ``test_harness_selfcheck.py`` to exercise the real ccache (and Bazel HTTP)
clients before buildvault's server exists.  It records every request (method,
path, headers, body length) so the tests can check -- and README.md documents --
exactly what the real clients send.

Never use this as a reference for server behaviour beyond what the recorded
requests show; it does no validation at all.
"""

from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass, field


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body_len: int | None
    client_port: int = 0
    status: int = 0


@dataclass
class _State:
    blobs: dict[str, bytes] = field(default_factory=dict)
    requests: list[RecordedRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real server
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet

    # -- helpers -----------------------------------------------------------
    def _record(self, body_len: int | None) -> RecordedRequest:
        rec = RecordedRequest(
            method=self.command,
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body_len=body_len,
            client_port=self.client_address[1],
        )
        with self.server.state.lock:
            self.server.state.requests.append(rec)
        return rec

    def _reply(
        self, rec: RecordedRequest, status: int, body: bytes = b"", head: bool = False, length: int | None = None
    ) -> None:
        rec.status = status
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        if status == 200 and (body or head):
            self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    # trailers until blank line
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after chunk
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    # -- methods (BaseHTTPRequestHandler answers Expect: 100-continue itself) --
    def do_GET(self) -> None:
        rec = self._record(None)
        with self.server.state.lock:
            data = self.server.state.blobs.get(self.path)
        if data is None:
            self._reply(rec, 404)
        else:
            self._reply(rec, 200, data)

    def do_HEAD(self) -> None:
        rec = self._record(None)
        with self.server.state.lock:
            data = self.server.state.blobs.get(self.path)
        if data is None:
            self._reply(rec, 404, head=True)
        else:
            self._reply(rec, 200, head=True, length=len(data))

    def do_PUT(self) -> None:
        body = self._read_body()
        rec = self._record(len(body))
        with self.server.state.lock:
            self.server.state.blobs[self.path] = body
        self._reply(rec, 200)

    def do_DELETE(self) -> None:
        rec = self._record(None)
        with self.server.state.lock:
            existed = self.server.state.blobs.pop(self.path, None) is not None
        self._reply(rec, 200 if existed else 404)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class SelftestHttpStore:
    """In-memory PUT/GET store on 127.0.0.1:<ephemeral port>, run in a thread.

    Usage::

        with SelftestHttpStore() as store:
            store.url  # "http://127.0.0.1:PORT"
    """

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = _State()
        self._thread = threading.Thread(target=self._server.serve_forever, name="selftest-http-store", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._server.state.lock:
            return list(self._server.state.requests)

    @property
    def blobs(self) -> dict[str, bytes]:
        with self._server.state.lock:
            return dict(self._server.state.blobs)

    def clear_log(self) -> None:
        with self._server.state.lock:
            self._server.state.requests.clear()

    def start(self) -> SelftestHttpStore:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> SelftestHttpStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
