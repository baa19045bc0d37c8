"""Each service's method handlers wrapped once, as they are registered, instead of by grpc.aio
interceptors: an interceptor runs a chain of coroutines on every call, which cost 10-27 % of a
small call's throughput here (bench/RESULTS.md); a handler wrapped at registration costs only
the wrapper itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

__all__ = ["Wrap", "WrappingServer"]

# (full method "/package.Service/Method", its handler) -> the handler to serve it with.
Wrap = Callable[[str, Any], Any]


class WrappingServer:
    """The grpc.aio server as the generated `add_*Servicer_to_server` functions see it: every
    method handler they register goes in as `wrap(full_method, handler)`."""

    def __init__(self, server: grpc.aio.Server, wrap: Wrap) -> None:
        self.server = server
        self._wrap = wrap

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        wrapped = {name: self._wrap(f"/{service}/{name}", handler) for name, handler in handlers.items()}
        self.server.add_registered_method_handlers(service, wrapped)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers([_WrappedGeneric(h, self._wrap) for h in handlers])

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)


class _WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers are wrapped (each handler once: it is the same object
    call after call). The registered handlers above take precedence where both exist."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Wrap) -> None:
        self._inner = inner
        self._wrap = wrap
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(method, handler)
        if len(self._wrapped) < 256:  # method names are the client's: keep the memo bounded
            self._wrapped[method] = (handler, wrapped)
        return wrapped
