"""The REAPI v2 cache services and ByteStream over grpc.aio: thin adapters over the stores.

Every handler validates its request, calls storage (or `buildvault.actions`), and lets
exceptions travel to `rpc()`, which maps them through `buildvault.server.errors` and writes
the per-request log line. No bad input escapes as UNKNOWN or INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import zstandard

from buildvault.compression import ZSTD_LEVEL, offload

from buildvault import logs
from buildvault.server import errors
from buildvault.storage import DigestMismatch

__all__ = [
    "MAX_BATCH_TOTAL_SIZE",
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
# ByteStream.Read chunk size.
READ_CHUNK_SIZE = 1 << 20

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def server_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_SIZE),
        ("grpc.max_send_message_length", MAX_MESSAGE_SIZE),
        # Clients (Bazel with --grpc_keepalive_time) may ping idle connections.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def rpc(name: str) -> Callable[[F], F]:
    """Wrap a handler `async def Method(self, request_or_iterator, context)`.

    Maps any exception through server/errors.py, and logs one JSON line per request at debug.
    Streaming responses are written with `context.write`, so every handler is a coroutine.
    """

    def decorate(method: F) -> F:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
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
            except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
                code = errors.map_exception(exc).code.name
                await errors.abort(context, exc)
            finally:
                if token is not None:
                    logs.end_request(token, name, code, started, _peer(context))

        return wrapper  # type: ignore[return-value]

    return decorate


def _code_name(context: grpc.aio.ServicerContext) -> str:
    try:
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    except Exception:  # noqa: BLE001
        return "ABORTED"


def _peer(context: grpc.aio.ServicerContext) -> str | None:
    try:
        return context.peer()
    except Exception:  # noqa: BLE001
        return None


# -- zstd, shared by CAS batches and ByteStream -------------------------------------------------



def zstd_compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def zstd_decompress(data: bytes, size: int) -> bytes:
    """Decompress a whole zstd payload that must yield exactly `size` bytes (memory bounded by `size`)."""
    sink = _Sink(size)
    try:
        with zstandard.ZstdDecompressor().stream_writer(sink, write_size=READ_CHUNK_SIZE, closefd=False) as writer:
            writer.write(data)
    except zstandard.ZstdError as e:
        raise errors.InvalidArgument(f"invalid zstd data: {e}") from None
    out = sink.take()
    if sink.total != size:
        raise DigestMismatch(f"zstd data decompresses to {sink.total} bytes, declared {size}")
    return out[0] if len(out) == 1 else b"".join(out)


class _Sink:
    """Collects decompressed output; refuses to grow past the declared size."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.total += len(data)
        if self.total > self.limit:
            raise DigestMismatch(f"zstd data decompresses to more than the declared {self.limit} bytes")
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> list[bytes]:
        parts, self.parts = self.parts, []
        return parts


async def zstd_decompress_stream(chunks: Any, size: int) -> Any:
    """Async-iterate the decompressed bytes of a zstd stream arriving as `chunks`.

    Output beyond the declared `size` is refused as soon as it appears; big input pieces are
    decompressed in a worker thread.
    """
    sink = _Sink(size)
    writer = zstandard.ZstdDecompressor().stream_writer(sink, write_size=READ_CHUNK_SIZE, closefd=False)
    try:
        async for piece in chunks:
            await offload(writer.write, piece)
            for out in sink.take():
                yield out
    except zstandard.ZstdError as e:
        raise errors.InvalidArgument(f"invalid zstd data: {e}") from None


