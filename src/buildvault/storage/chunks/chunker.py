"""FastCDC 2020 chunk boundaries, as REAPI v2.12 specifies them (ChunkingFunction.FAST_CDC_2020).

The cutting is pyfastcdc's (Cython, ~2 GB/s a core): normalization level 2, min = avg / 4,
max = avg * 4, the seed from `FastCdc2020Params`. It reproduces the specification's published
test vectors (tests/unit/test_chunker.py), so our boundaries are the ones every other client and
server of the same parameters computes, and a chunk one of them stored is found by the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from pyfastcdc import FastCDC

from buildvault.digest import Digest, DigestFunction, new_hasher
from buildvault.storage import fastsum

# The specification's recommended parameters: average 512 KiB, seed 0.
DEFAULT_AVG_SIZE = 512 * 1024


@dataclass(frozen=True)
class ChunkingParams:
    """FastCDC 2020's two parameters (the rest follow from them)."""

    avg_size: int = DEFAULT_AVG_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.avg_size < 256 or self.avg_size & (self.avg_size - 1):
            raise ValueError(f"FastCDC average chunk size must be a power of two >= 256, got {self.avg_size}")

    @property
    def min_size(self) -> int:
        return self.avg_size // 4

    @property
    def max_size(self) -> int:
        return self.avg_size * 4

    def cutter(self) -> FastCDC:
        return FastCDC(avg_size=self.avg_size, normalized_chunking=2, seed=self.seed)


def cut(data: bytes | bytearray | memoryview, params: ChunkingParams) -> list[memoryview]:
    """The chunks of a whole buffer, as views into it."""
    if not data:
        return []
    return [chunk.data for chunk in params.cutter().cut_buf(data)]


@dataclass(frozen=True)
class Piece:
    """One chunk of a stream, with its digest and the fast checksum of the same bytes, computed in
    one pass off the event loop (what `BlobStore.store_verified` takes)."""

    digest: Digest
    data: bytes
    fast: bytes


def _cut_window(
    window: bytearray, params: ChunkingParams, function: DigestFunction, final: bool
) -> tuple[list[Piece], int]:
    """Cut `window`; return the final chunks and how many bytes they cover. Every chunk but the
    last is final whatever follows (a cut point depends only on the bytes from the chunk's start
    up to the max size); the last is final only at the end of the stream."""
    views = cut(window, params)
    if not final:
        views = views[:-1]
    pieces = []
    used = 0
    for view in views:
        data = bytes(view)
        hasher = new_hasher(function)
        hasher.update(data)
        pieces.append(Piece(Digest(hasher.hexdigest(), len(data), function), data, fastsum.of(data)))
        used += len(data)
    return pieces, used


async def cut_stream(
    source: AsyncIterable[bytes], params: ChunkingParams, function: DigestFunction
) -> AsyncIterator[list[Piece]]:
    """The chunks of a stream, in order, in groups (one group per window cut in a worker thread).

    Memory stays bounded by about twice the max chunk size plus one incoming piece, and the
    boundaries are exactly those of cutting the whole stream at once."""
    window = bytearray()
    # Cut once the window holds a few max-size chunks: each cut re-scans only the last partial chunk.
    threshold = params.max_size * 2
    async for data in source:
        window += data
        if len(window) >= threshold:
            pieces, used = await asyncio.to_thread(_cut_window, window, params, function, False)
            del window[:used]
            if pieces:
                yield pieces
    if window:
        pieces, _ = await asyncio.to_thread(_cut_window, window, params, function, True)
        yield pieces
