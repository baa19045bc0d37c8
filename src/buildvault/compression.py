"""zstd streaming shared by both protocols (gRPC compressed-blobs, HTTP Content-Encoding)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import zstandard

# Work on at least this many bytes goes to a worker thread (zstd releases the GIL); smaller
# pieces are cheaper to do in place than to hand over.
OFFLOAD_BYTES = 256 << 10
# What bazel-remote uses: cheap, and most of the gain.
ZSTD_LEVEL = 1
# Compressed output is handed on in pieces no larger than this (a gRPC message, an HTTP write).
OUTPUT_CHUNK_SIZE = 1 << 20


async def offload(fn: Callable[..., Any], data: bytes, *args: Any) -> Any:
    """`fn(data, *args)`, in a worker thread when `data` is big enough to be worth the hop."""
    if len(data) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, data, *args)
    return fn(data, *args)


async def zstd_compress_stream(chunks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Async-iterate a zstd frame (content size `size` in its header) of the bytes `chunks` yields."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=size)
    async for chunk in chunks:
        out = await offload(compressor.compress, chunk)
        for start in range(0, len(out), OUTPUT_CHUNK_SIZE):
            yield out[start : start + OUTPUT_CHUNK_SIZE]
    out = compressor.flush()
    for start in range(0, len(out), OUTPUT_CHUNK_SIZE):
        yield out[start : start + OUTPUT_CHUNK_SIZE]
