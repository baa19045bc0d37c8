"""The HTTP side of the history (buildvault.history): ActionCache GETs (hit, miss) and PUTs
(upload) of the bazel-remote protocol are recorded with what HTTP has, which is no
RequestMetadata: instance, hash (`hash/0`: the protocol carries no size), outcome and timing.
They show on the action pages' usage lists; no invocation groups them. Refused requests (the
auth middleware answers first) are not recorded; nothing here can fail a request."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from buildvault.digest import InvalidDigest
from buildvault.history import Recorder
from buildvault.history.metadata import NONE
from buildvault.server.http.handlers import REQUEST_KIND, parse_cache_path

__all__ = ["history_middleware"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def history_middleware(recorder: Recorder) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        started = time.time()
        clock = time.perf_counter()
        response = await handler(request)
        if request.get(REQUEST_KIND) == "ac":
            method = request.method
            status = response.status
            if method in ("GET", "HEAD"):
                name, outcome = "ac_get", "hit" if status == 200 else "miss" if status == 404 else "failed"
            elif method == "PUT":
                name, outcome = "ac_update", "upload" if 200 <= status < 300 else "failed"
            else:
                return response
            try:
                path = parse_cache_path(request.rel_url.raw_path)
            except InvalidDigest:
                return response
            recorder.record("http", name, path.instance, f"{path.hash}/0", outcome, str(status), 0, started,
                            time.perf_counter() - clock, NONE)  # fmt: skip
        return response

    return middleware
