"""The aiohttp application (routes, the request middleware) and the HTTP front end as an App listener."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web
from aiohttp.typedefs import Middleware

from buildvault import logs
from buildvault.actions import ActionCache
from buildvault.digest import InvalidDigest
from buildvault.history import Recorder
from buildvault.server.auth import Auth
from buildvault.server.auth.http_auth import HEALTHZ, auth_middleware, healthz
from buildvault.server.http.build_pages import DEFAULT_SECRET_PATTERNS, BuildPages
from buildvault.server.http.handlers import DEFAULT_MAX_ENTRY_SIZE, REQUEST_KIND, CacheHandlers, parse_cache_path
from buildvault.server.http.recorded import history_middleware
from buildvault.server.http.status import StatusPages
from buildvault.server.metrics import Metrics, http_method_label
from buildvault.server.services import Services, StartupError, StatsSource, format_address
from buildvault.storage import REQUEST_PROTOCOL, ActionStore, BlobStore

__all__ = ["HANDLERS_KEY", "STATUS_KEY", "HttpListener", "create_app"]

HANDLERS_KEY = web.AppKey("buildvault_http_handlers", CacheHandlers)
STATUS_KEY = web.AppKey("buildvault_http_status", StatusPages)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _installed_version() -> str:
    try:
        return version("buildvault")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


def _request_middleware(metrics: Metrics) -> Middleware:
    """Counts and times every request; with --log-level debug, one JSON line per request. Names
    the protocol for what the store and the ActionCache count (bytes, AC hits and misses)."""

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        start = time.perf_counter()
        token = logs.begin_request()
        protocol = REQUEST_PROTOCOL.set("http")
        status: int | str = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = "aborted"
            raise
        finally:
            kind = request.get(REQUEST_KIND, "other")
            elapsed = time.perf_counter() - start
            metrics.observe_request("http", http_method_label(request.method), kind, status, elapsed)
            REQUEST_PROTOCOL.reset(protocol)
            if token is not None:
                logs.note(path=request.rel_url.raw_path[:200])
                logs.end_request(token, f"HTTP {request.method[:16]} {kind}", str(status), start, request.remote)

    return middleware


# The pages and the `kind` label of their requests (their handlers set the same).
_PAGE_KINDS = {"/status": "status", "/status.html": "status", "/": "status", "/metrics": "metrics",
               "/status/history": "status"}


def _route(request: web.Request) -> tuple[str | None, str, str]:
    """For the auth middleware: labels the request's kind before any check (so a refused request
    is counted under its route, not `other`) and answers (instance, kind, hash) of a cache path,
    (None, "", "") for a page or a path that does not parse (which then needs the permission on
    some instance)."""
    kind = _PAGE_KINDS.get(request.path)
    if kind is not None:
        request[REQUEST_KIND] = kind
        return None, "", ""
    try:
        path = parse_cache_path(request.rel_url.raw_path)
    except InvalidDigest:
        return None, "", ""
    request[REQUEST_KIND] = path.kind
    return path.instance, path.kind, path.hash


def create_app(
    cas: BlobStore,
    action_store: ActionStore,
    metrics: Metrics | None = None,
    *,
    action_cache: ActionCache | None = None,
    stats: StatsSource | None = None,
    max_blob_size: int | None = None,
    max_entry_size: int = DEFAULT_MAX_ENTRY_SIZE,
    version: str | None = None,
    auth: Auth | None = None,
    history: Recorder | None = None,
    secret_patterns: Sequence[str] = DEFAULT_SECRET_PATTERNS,
) -> web.Application:
    """The aiohttp application: cache endpoints, /status, /status.html, / and /metrics.

    GET /cas/{hash} finds blobs through `cas.lookup` (hash only, from the store's own index).
    Without `stats`, the status pages use `cas.stats` if the store has one.
    """
    metrics = metrics or Metrics(version=version or _installed_version())
    handlers = CacheHandlers(
        cas,
        action_cache or ActionCache(cas, action_store, recorder=metrics),
        max_blob_size=max_blob_size,
        max_entry_size=max_entry_size,
    )
    pages = StatusPages(
        metrics,
        version or metrics.version or _installed_version(),
        stats,
    )
    middlewares = [_request_middleware(metrics)]
    if auth is not None and auth.enabled:  # inside the request log/metrics middleware: refusals are counted
        middlewares.append(auth_middleware(auth, _route))
    if history is not None:  # inside access control: a refused request is not recorded
        middlewares.append(history_middleware(history))
    app = web.Application(middlewares=middlewares)
    app[HANDLERS_KEY] = handlers
    app.router.add_get(HEALTHZ, healthz)  # always open
    app[STATUS_KEY] = pages
    for route, page in (
        ("/status", pages.status_json),
        ("/status.html", pages.status_html),
        ("/", pages.status_html),
        ("/metrics", pages.metrics_text),
        ("/status/history", pages.history_json),
    ):
        app.router.add_get(route, page)  # answers HEAD too
    # The build pages (invocations, actions, misses explained) over the history and the CAS.
    BuildPages(history, cas, action_store, auth, secret_patterns).add_routes(app)
    app.router.add_route("*", "/{tail:.*}", handlers.handle)

    async def start_history(_: web.Application) -> None:
        pages.history.start()

    async def stop_history(_: web.Application) -> None:
        await pages.history.stop()

    app.on_startup.append(start_history)
    app.on_cleanup.append(stop_history)
    return app


class HttpListener:
    """The HTTP front end as an App listener: serves an aiohttp app on `address` (port 0: any)."""

    name = "http"

    def __init__(self, address: str, app: web.Application, ssl_context: ssl.SSLContext | None = None) -> None:
        self.requested = address
        self.app = app
        self.ssl_context = ssl_context  # HTTPS when set
        self._runner: web.AppRunner | None = None
        self._address: str | None = None
        self._stopping: asyncio.Future[None] | None = None

    @classmethod
    def from_services(cls, address: str, services: Services) -> HttpListener:
        """The bazel-remote protocol over the App's shared stores, ActionCache and metrics."""
        app = create_app(
            services.blobs,
            services.actions,
            services.metrics,
            action_cache=services.action_cache,
            stats=services.storage_stats,
            max_blob_size=services.max_cas_blob_size or None,
            version=services.version,
            auth=services.auth,
            history=services.history,
            secret_patterns=services.secret_patterns or DEFAULT_SECRET_PATTERNS,
        )
        app[STATUS_KEY].pins = services.pins
        tls = services.auth.tls if services.auth is not None else None
        return cls(address, app, tls.http_context() if tls is not None else None)

    @property
    def address(self) -> str | None:
        return self._address

    async def start(self) -> None:
        host, _, port = self.requested.rpartition(":")
        host = host.strip("[]")
        # Request bodies reach the handlers as sent: zstd is decoded (and its hash verified) by
        # the handlers, and aiohttp must not try to decode any other encoding.
        runner = web.AppRunner(self.app, access_log=None, auto_decompress=False, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, int(port), reuse_address=True, ssl_context=self.ssl_context)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise StartupError(f"cannot listen on {self.requested} (HTTP): {e}") from None
        self._runner = runner
        bound = int(port)
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or ():
            bound = sock.getsockname()[1]
            break
        self._address = format_address(host, bound)

    async def stop(self, grace: float) -> None:
        """Stop accepting; let in-flight requests finish for up to `grace` seconds, then cancel them.

        A second call (App.hurry, grace 0) cancels what is still running at once."""
        runner = self._runner
        if runner is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(runner, grace))
        elif grace <= 0 and runner.server is not None:
            await runner.server.shutdown(0)
        await asyncio.shield(self._stopping)

    async def _stop(self, runner: web.AppRunner, grace: float) -> None:
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            # An idle keep-alive connection would hold the whole grace period: close each
            # connection now (a busy one closes once its request is answered).
            for connection in list(runner.server.connections):
                connection.close()
            await runner.server.shutdown(max(grace, 0.0))
        await runner.cleanup()
        self._runner = None
