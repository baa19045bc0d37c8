"""The gRPC side of access control: a check in front of every method handler, wrapped on when it
is registered (server/grpc/registration.py), so the check runs with the request in hand: the
instance name comes from the request (`instance_name`, or the ByteStream resource name; for
Write, the first message), the principal from the `authorization` metadata entry or the
client certificate's CN. A refusal ends the call with UNAUTHENTICATED or PERMISSION_DENIED
before the service sees the request. `grpc.health.v1.Health` is always open.
GetCapabilities answers any caller without a bad credential (Bazel asks it before anything
else), with `update_enabled` from the caller's own ActionCache write permission.
"""

from __future__ import annotations

import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from buildvault import logs
from buildvault.digest import InvalidDigest, parse_read_resource, parse_write_resource
from buildvault.remote_apis import re_pb2
from buildvault.server.auth.audit import grpc_write
from buildvault.server.auth.grants import Caller, Permission
from buildvault.server.auth.policy import ANONYMOUS, Refusal
from buildvault.server.auth.runtime import Auth

__all__ = ["caller_may", "checked", "rule_of"]

_RE = "/build.bazel.remote.execution.v2."
_RA = "/build.bazel.remote.asset.v1."
_BS = "/google.bytestream.ByteStream/"
_BES = "/google.devtools.build.v1.PublishBuildEvent/"
_OPEN_PREFIX = "/grpc.health.v1.Health/"

# method -> (permission, where the instance name is): "field" (request.instance_name),
# "read" / "write" (a ByteStream resource name), None (no instance: any instance will do).
_RULES: dict[str, tuple[Permission, str | None]] = {
    _RE + "Capabilities/GetCapabilities": (Permission.READ, "field"),
    _RE + "ContentAddressableStorage/FindMissingBlobs": (Permission.READ, "field"),
    _RE + "ContentAddressableStorage/BatchReadBlobs": (Permission.READ, "field"),
    _RE + "ContentAddressableStorage/GetTree": (Permission.READ, "field"),
    _RE + "ContentAddressableStorage/SplitBlob": (Permission.READ, "field"),
    _RE + "ContentAddressableStorage/BatchUpdateBlobs": (Permission.WRITE, "field"),
    _RE + "ContentAddressableStorage/SpliceBlob": (Permission.WRITE, "field"),
    _RE + "ActionCache/GetActionResult": (Permission.READ, "field"),
    _RE + "ActionCache/UpdateActionResult": (Permission.WRITE, "field"),
    _RE + "Execution/Execute": (Permission.EXECUTE, "field"),
    _RE + "Execution/WaitExecution": (Permission.EXECUTE, None),
    _RA + "Fetch/FetchBlob": (Permission.READ, "field"),
    _RA + "Fetch/FetchDirectory": (Permission.READ, "field"),
    _RA + "Push/PushBlob": (Permission.WRITE, "field"),
    _RA + "Push/PushDirectory": (Permission.WRITE, "field"),
    _BS + "Read": (Permission.READ, "read"),
    _BS + "Write": (Permission.WRITE, "write"),
    _BS + "QueryWriteStatus": (Permission.WRITE, "write"),
    # Build events: write on some instance here; the service checks the one `project_id` names.
    _BES + "PublishLifecycleEvent": (Permission.WRITE, None),
    _BES + "PublishBuildToolEventStream": (Permission.WRITE, None),
}
_CAPABILITIES = _RE + "Capabilities/GetCapabilities"
_EXECUTE = _RE + "Execution/Execute"
# Writes of entries (not of content-addressed blobs) go to the audit log once they succeed.
_AUDITED = frozenset({_RE + "ActionCache/UpdateActionResult", _RA + "Push/PushBlob", _RA + "Push/PushDirectory"})
Context = grpc.aio.ServicerContext[Any, Any]
# The authenticated principal of the current call (one task per gRPC call), for a service whose
# behaviour depends on a permission beyond the one its method needs (Fetch: may a reader download?).
_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("buildvault_grpc_caller", default=None)


def caller_may(auth: Auth | None, permission: Permission, instance: str) -> bool:
    """Whether the current call's caller holds `permission` on `instance` (True without access control)."""
    if auth is None or not auth.policy.enabled:
        return True
    return auth.policy.allows(_caller.get(), permission, instance)


def rule_of(method: str) -> tuple[Permission, str | None] | None:
    """The permission a method needs and where its instance is; None: always open (health).
    Methods not listed (reflection, new services) need read on some instance."""
    if method.startswith(_OPEN_PREFIX):
        return None
    return _RULES.get(method, (Permission.READ, None))


def _instance(request: Any, where: str | None) -> str | None:
    if where is None or request is None:
        return None
    if where == "field":
        name = getattr(request, "instance_name", None)
        return name if isinstance(name, str) else None
    resource = getattr(request, "resource_name", "")
    try:
        parsed = parse_read_resource(resource) if where == "read" else parse_write_resource(resource)
    except InvalidDigest:
        return None  # the service refuses the name itself (INVALID_ARGUMENT), storing nothing
    return parsed.instance_name


def _authorization(context: Context) -> str | None:
    """The one credential of the call. The same value twice is one credential: Bazel 4.2.3 sends
    its `--remote_header` twice on a Fetch call when `--experimental_remote_downloader` and
    `--remote_cache` name the same server (the channel's headers and the downloader's)."""
    found = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            value = value if isinstance(value, str) else "\x00"
            if found is not None and value != found:
                raise Refusal(True, "malformed", "unauthenticated: more than one authorization metadata entry")
            found = value
    return found


def _cert_cn(context: Context) -> str | None:
    names = context.auth_context().get("x509_common_name")
    if not names:
        return None
    try:
        return bytes(next(iter(names))).decode("utf-8")
    except UnicodeDecodeError:
        return None


def checked(auth: Auth, method: str, handler: Any) -> Any:
    """`handler` behind the check of `method`'s rule (unchanged for a method without one)."""
    rule = rule_of(method)
    if rule is None:
        return handler
    check = _Check(auth, method, rule)
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=check.unary(handler.unary_unary))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=check.unary_stream(handler.unary_stream))
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=check.stream_unary(handler.stream_unary))
    return handler._replace(stream_stream=check.stream_stream(handler.stream_stream))


class _Check:
    """The check of one method, and the wrappers that run it before the service."""

    __slots__ = ("auth", "method", "permission", "where")

    def __init__(self, auth: Auth, method: str, rule: tuple[Permission, str | None]) -> None:
        self.auth = auth
        self.method = method
        self.permission, self.where = rule

    async def run(self, request: Any, context: Context) -> Caller | None:
        """The caller; a refusal aborts the call (counted, logged)."""
        policy = self.auth.policy
        if not policy.enabled:
            logs.set_principal(ANONYMOUS)
            return None
        started = time.perf_counter()
        caller: Caller | None = None
        try:
            cn = _cert_cn(context) if policy.certificates_identify else None
            caller = await policy.authenticate(_authorization(context), cn)
            # GetCapabilities answers every caller whose credential (if any) is good: a client
            # without write permission learns update_enabled=false instead of failing to start.
            if self.method != _CAPABILITIES:
                policy.authorize(caller, self.permission, _instance(request, self.where))
        except Refusal as refusal:
            self.auth.refused("grpc", refusal)
            code = grpc.StatusCode.UNAUTHENTICATED if refusal.unauthenticated else grpc.StatusCode.PERMISSION_DENIED
            token = logs.begin_request()
            if token is not None:
                # An authenticated caller that lacks the permission is named, not "anonymous".
                logs.note(principal=caller.principal if caller else ANONYMOUS, refused=refusal.reason)
                logs.end_request(token, self.method.rpartition("/")[2], code.name, started, context.peer())
            await context.abort(code, str(refusal))
        logs.set_principal(caller.principal if caller else ANONYMOUS)
        _caller.set(caller)
        return caller

    def update_enabled(self, caller: Caller | None, request: Any, response: Any) -> Any:
        """GetCapabilities: `update_enabled` as this caller's ActionCache write permission."""
        allowed = self.auth.policy.allows(caller, Permission.WRITE, _instance(request, "field"))
        answer = re_pb2.ServerCapabilities()
        answer.CopyFrom(response)
        answer.cache_capabilities.action_cache_update_capabilities.update_enabled = allowed
        return answer

    def unary(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        capabilities = self.method == _CAPABILITIES

        audit = self.auth.audit if self.method in _AUDITED else None

        async def checked(request: Any, context: Context) -> Any:
            caller = await self.run(request, context)
            response = await behaviour(request, context)
            if audit is not None:
                grpc_write(audit, self.method, caller, request, context.peer())
            if capabilities and self.auth.policy.enabled and response is not None:
                return self.update_enabled(caller, request, response)
            return response

        return checked

    def unary_stream(self, behaviour: Callable[..., Any], *, streaming_requests: bool = False) -> Callable[..., Any]:
        """Also stream_stream (`streaming_requests`: the check sees no request, any instance will do)."""
        # An accepted Execute is audited when it starts: the server writes its result to the
        # ActionCache on behalf of this caller.
        audit = self.auth.audit if self.method == _EXECUTE else None
        if inspect.isasyncgenfunction(behaviour):

            async def generator(request: Any, context: Context) -> AsyncIterator[Any]:
                caller = await self.run(None if streaming_requests else request, context)
                if audit is not None:
                    grpc_write(audit, self.method, caller, request, context.peer())
                async for response in behaviour(request, context):
                    yield response

            return generator

        async def writing(request: Any, context: Context) -> Any:
            caller = await self.run(None if streaming_requests else request, context)
            if audit is not None:
                grpc_write(audit, self.method, caller, request, context.peer())
            return await behaviour(request, context)

        return writing

    def stream_unary(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        async def checked(requests: Any, context: Context) -> Any:
            if not self.auth.policy.enabled:
                logs.set_principal(ANONYMOUS)
                return await behaviour(requests, context)
            # The first message names the resource: read it, check, then hand the whole stream on.
            iterator = requests.__aiter__()
            try:
                first = await iterator.__anext__()
            except StopAsyncIteration:
                first = None
            await self.run(first, context)
            return await behaviour(_prepend(first, iterator), context)

        return checked

    def stream_stream(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        return self.unary_stream(behaviour, streaming_requests=True)


async def _prepend(first: Any, rest: Any) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for message in rest:
        yield message
