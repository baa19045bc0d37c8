"""The HTTP side of access control: an aiohttp middleware and the always-open `/healthz`.

GET and HEAD read; every other method writes (PUT stores; the rest get 405 from the handler
once allowed). The instance comes from the cache path; a path that does not parse needs the
permission on some instance and then gets the handler's own 400. A refusal's log line names
the caller when it was authenticated (it lacked the permission), else `anonymous`. `/status` and `/metrics`
need read on some instance (`--metrics-require-auth false` opens `/metrics`). Refusals are 401
with `WWW-Authenticate: Basic realm="buildvault"` or 403 naming the permission and instance.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from buildvault import logs
from buildvault.server.auth.audit import http_write
from buildvault.server.auth.grants import Caller, Permission
from buildvault.server.auth.policy import ANONYMOUS, Refusal
from buildvault.server.auth.runtime import Auth
from buildvault.server.auth.tls import common_name

__all__ = ["HEALTHZ", "PRINCIPAL", "auth_middleware", "healthz"]

HEALTHZ = "/healthz"
CHALLENGE = {"WWW-Authenticate": 'Basic realm="buildvault"'}
# The request key under which the middleware leaves the caller (None: no credential), for
# handlers that check an instance the path does not name (the build pages).
PRINCIPAL: Any = web.RequestKey("buildvault_caller", object) if hasattr(web, "RequestKey") else "buildvault_caller"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = Callable[[web.Request], tuple[str | None, str, str]]


async def healthz(request: web.Request) -> web.Response:
    """200 while the server runs; never asks for credentials."""
    return web.Response(text="ok\n")


def _cert_cn(request: web.Request) -> str | None:
    transport = request.transport
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    return common_name(ssl_object.getpeercert())


def _authorization(request: web.Request) -> str | None:
    values = request.headers.getall("Authorization", [])
    if len(values) > 1:
        raise Refusal(True, "malformed", "unauthenticated: more than one Authorization header")
    return values[0] if values else None


def auth_middleware(auth: Auth, route: Route) -> Any:
    """`route(request)`: (instance, kind, hash) of a cache path (kind "ac" or "cas"), (None, "", "")
    for a page or a path that does not parse. It also labels the request's route for the request
    metrics, so a refusal is counted under the route it was refused on. With `--audit-log`, a
    successful PUT of an action entry is recorded (audit.py)."""
    open_metrics = not auth.settings.metrics_require_auth
    audit = auth.audit

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        policy = auth.policy
        path = request.path
        if path == HEALTHZ or (open_metrics and path == "/metrics"):
            logs.note(principal=ANONYMOUS)
            return await handler(request)
        instance, kind, hash_ = route(request)
        caller: Caller | None = None
        if policy.enabled:
            permission = Permission.READ if request.method in ("GET", "HEAD") else Permission.WRITE
            try:
                cn = _cert_cn(request)
                if cn is None and auth.requires_client_certificate:
                    raise Refusal(True, "no_client_certificate", "unauthenticated: a client certificate is required")
                caller = await policy.authenticate(_authorization(request), cn)
                policy.authorize(caller, permission, instance)
            except Refusal as refusal:
                auth.refused("http", refusal)
                logs.note(principal=caller.principal if caller else ANONYMOUS, refused=refusal.reason)
                if refusal.unauthenticated:
                    return web.Response(status=401, text=str(refusal) + "\n", headers=CHALLENGE)
                return web.Response(status=403, text=str(refusal) + "\n")
        logs.note(principal=caller.principal if caller else ANONYMOUS)
        request[PRINCIPAL] = caller
        response = await handler(request)
        if audit is not None and kind == "ac" and request.method == "PUT" and response.status == 200:
            http_write(audit, caller, instance or "", hash_, request.remote)
        return response

    return middleware
