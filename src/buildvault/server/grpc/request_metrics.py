"""The gRPC side of the request metrics: a wrapper on every method handler (server/grpc/registration.py)
that times each RPC and records its status.

Metrics are defined in server/metrics.py; this module only feeds them. Blob bytes and AC hits
are not counted here but where both protocols share the path (the store boundary,
storage.MeteredBlobStore; the ActionCache, actions.py), under the protocol this wrapper names in
REQUEST_PROTOCOL.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from buildvault.server.metrics import GRPC_METHODS, GRPC_SERVICES, Metrics
from buildvault.storage import REQUEST_PROTOCOL

__all__ = ["grpc_labels", "metered"]

_GRPC_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}

def grpc_labels(full_method: str) -> tuple[str, str]:
    """`/pkg.Service/Method` -> (method label, kind label), both from fixed sets."""
    _, _, rest = full_method.partition("/")
    service, _, method = rest.partition("/")
    kind = GRPC_SERVICES.get(service)
    if kind is None:
        return "other", "other"
    return (method if method in GRPC_METHODS else "other"), kind


class _Call:
    """Book-keeping of one RPC: measures it and records its status once. Blob bytes and AC hits
    are counted by the store and the ActionCache under the protocol this call sets in
    REQUEST_PROTOCOL."""

    __slots__ = ("metrics", "method", "kind", "start")

    def __init__(self, metrics: Metrics, method: str, kind: str) -> None:
        self.metrics = metrics
        self.method = method
        self.kind = kind
        self.start = time.perf_counter()
        REQUEST_PROTOCOL.set("grpc")  # this RPC's own task context

    def finish(self, code: grpc.StatusCode) -> None:
        self.metrics.observe_request("grpc", self.method, self.kind, code.name, time.perf_counter() - self.start)


def _code_of(context: Any, default: grpc.StatusCode) -> grpc.StatusCode:
    try:
        code = context.code()
    except Exception:  # older grpc.aio contexts
        code = None
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, tuple):
        code = code[0]
    return _GRPC_CODE_BY_VALUE.get(code, default)


def _error_code(context: Any, error: BaseException) -> grpc.StatusCode:
    import asyncio

    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, grpc.aio.AbortError):
        return _code_of(context, grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN


def metered(metrics: Metrics, full_method: str, handler: Any) -> Any:
    """`handler` counted and timed with its status, and the protocol named for what the store and
    the ActionCache count (bytes, AC hits and misses; no message is parsed here)."""
    method, kind = grpc_labels(full_method)
    for name, wrap in _WRAPPERS:
        behaviour = getattr(handler, name)
        if behaviour is not None:
            return handler._replace(**{name: wrap(behaviour, metrics, method, kind)})
    return handler


def _wrap_unary_response(
    behaviour: Callable[..., Any], metrics: Metrics, method: str, kind: str
) -> Callable[..., Any]:
    """unary_unary and stream_unary handlers, and streaming ones that write to the context."""

    async def wrapper(request: Any, context: Any) -> Any:
        call = _Call(metrics, method, kind)
        try:
            response = behaviour(request, context)
            if inspect.isawaitable(response):
                response = await response
        except BaseException as e:
            call.finish(_error_code(context, e))
            raise
        call.finish(_code_of(context, grpc.StatusCode.OK))
        return response

    return wrapper


def _wrap_stream_response(
    behaviour: Callable[..., Any], metrics: Metrics, method: str, kind: str
) -> Callable[..., Any]:
    """unary_stream and stream_stream handlers: async generators, or coroutines that write their
    responses to the context."""
    if inspect.isasyncgenfunction(behaviour):

        async def generator(request: Any, context: Any) -> AsyncIterator[Any]:
            call = _Call(metrics, method, kind)
            try:
                async for response in behaviour(request, context):
                    yield response
            except BaseException as e:
                call.finish(_error_code(context, e))
                raise
            call.finish(_code_of(context, grpc.StatusCode.OK))

        return generator

    return _wrap_unary_response(behaviour, metrics, method, kind)


# The handler attribute and the wrapper for it.
_WRAPPERS = (
    ("unary_unary", _wrap_unary_response),
    ("unary_stream", _wrap_stream_response),
    ("stream_unary", _wrap_unary_response),
    ("stream_stream", _wrap_stream_response),
)
