"""The REAPI v2 cache services and ByteStream over grpc.aio: thin adapters over the stores.

Every handler validates its request, calls storage (or `buildvault.actions`), and lets
exceptions travel to `rpc()`, which maps them through `buildvault.server.errors` and writes
the per-request log line. No bad input escapes as UNKNOWN or INTERNAL. zstd lives in
`buildvault.compression`; the listener that serves these services is `server/grpc/listener.py`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from buildvault import logs
from buildvault.server import errors
from buildvault.storage import CHUNK_SIZE

__all__ = [
    "MAX_BATCH_TOTAL_SIZE",
    "Context",
    "MAX_MESSAGE_SIZE",
    "READ_CHUNK_SIZE",
    "rpc",
    "server_options",
]

# The batch limit the server advertises (CacheCapabilities.max_batch_total_size_bytes): a
# little under 4 MiB so a full batch plus per-blob framing still fits a client's default 4 MiB
# inbound message limit.
MAX_BATCH_TOTAL_SIZE = (4 << 20) - (64 << 10)
# The server's own send/receive message limit: the batch limit plus headroom for the digests,
# statuses and framing around the blobs (about 100 bytes per blob).
MAX_MESSAGE_SIZE = MAX_BATCH_TOTAL_SIZE + (4 << 20)
# ByteStream.Read message size: the store's piece size, so each piece goes out as it is read;
# 2 MiB messages made reads of blobs kept as chunks slower (bench/notes/2026-12-06-reads-on-the-loop.md).
# Framed, a message stays far under the 4 MiB inbound limit gRPC clients have by default.
READ_CHUNK_SIZE = CHUNK_SIZE

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
# The servicer context every handler receives (its request/response types do not matter here).
Context = grpc.aio.ServicerContext[Any, Any]


def server_options(reuseport: bool = False) -> list[tuple[str, Any]]:
    """`reuseport`: several server processes share the port (server/processes/supervisor.py); off otherwise,
    so two servers can never silently share one."""
    return [
        ("grpc.so_reuseport", 1 if reuseport else 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_SIZE),
        ("grpc.max_send_message_length", MAX_MESSAGE_SIZE),
        # Clients (Bazel with --grpc_keepalive_time) may ping idle connections.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        # A fixed 1 MiB receive window per stream instead of bandwidth-delay probing, whose windows
        # grow per stream with nothing bounding their sum (Python cannot give gRPC a memory quota):
        # under ~100 uploads at once the chunks received but not yet read held ~270 MiB. Probing
        # off with the default 64 KiB window was ~0.7x on streamed writes; 1 MiB costs a single
        # stream ~0.9x of probing's rate (bench/RESULTS.md, "The side bias found").
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 1 << 20),
    ]


def rpc(name: str) -> Callable[[F], F]:
    """Wrap a handler `async def Method(self, request_or_iterator, context)`.

    Maps any exception through server/errors.py, and logs one JSON line per request at debug.
    Streaming responses are written with `context.write`, so every handler is a coroutine.
    """

    def decorate(method: F) -> F:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: Context) -> Any:
            token = logs.begin_request()
            started = time.perf_counter()
            code = "OK"
            try:
                return await method(self, request, context)
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except Exception as exc:  # the one place exceptions become statuses
                code = errors.map_exception(exc).code.name
                await errors.abort(context, exc)
            finally:
                if token is not None:
                    logs.end_request(token, name, code, started, _peer(context))

        return wrapper  # type: ignore[return-value]

    return decorate


def _code_name(context: Context) -> str:
    try:
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    except Exception:
        return "ABORTED"


def _peer(context: Context) -> str | None:
    try:
        return context.peer()
    except Exception:
        return None
