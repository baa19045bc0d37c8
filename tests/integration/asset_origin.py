"""An HTTP origin for the Remote Asset tests: a real aiohttp server on loopback, in its own thread
(so a test can block on Bazel or the CLI while it serves), counting the requests per path.

    with AssetOrigin() as origin:
        origin.files["/a.tar.gz"] = data
        origin.url("/a.tar.gz")              # http://127.0.0.1:PORT/a.tar.gz
        origin.count("/a.tar.gz")            # requests that reached the origin for that path

Behaviours by path: `origin.redirects[path] = location`; `origin.slow[path] = seconds between
chunks`; `origin.chunked.add(path)`: no Content-Length; `origin.headers_seen[path]`: the
request headers of the last request.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

from aiohttp import web


class AssetOrigin:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.slow: dict[str, float] = {}
        self.chunked: set[str] = set()
        self.lying_length: dict[str, int] = {}
        self.requests: Counter[str] = Counter()
        self.headers_seen: dict[str, dict[str, str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}{path}"

    def count(self, path: str) -> int:
        return self.requests[path]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.requests[path] += 1
        self.headers_seen[path] = dict(request.headers)
        if path in self.redirects:
            raise web.HTTPFound(self.redirects[path])
        data = self.files.get(path)
        if data is None:
            return web.Response(status=404, text="no such file")
        response = web.StreamResponse()
        if path in self.lying_length:
            response.content_length = self.lying_length[path]
        elif path not in self.chunked:
            response.content_length = len(data)
        else:
            response.enable_chunked_encoding()
        await response.prepare(request)
        delay = self.slow.get(path)
        step = 64 << 10 if delay is None else 1024
        try:
            for start in range(0, len(data), step):
                await response.write(data[start : start + step])
                if delay is not None:
                    await asyncio.sleep(delay)  # the origin is slow on purpose (a slow-origin test)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, 0)
        loop.run_until_complete(site.start())
        server: Any = site._server
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def start(self) -> AssetOrigin:
        self._thread = threading.Thread(target=self._run, name="asset-origin", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the test origin did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> AssetOrigin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
