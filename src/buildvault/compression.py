"""zstd in both directions, for both protocols (gRPC compressed-blobs, HTTP Content-Encoding).

Compression: `zstd_compress` (a whole blob) and `zstd_compress_stream` (one frame that
declares its content size). Decompression: `ZstdDecoder` and the helpers over it accept one or
more concatenated frames, refuse output past a limit as soon as it appears, and report a body
that ends inside a frame. Every decoding failure is a `CompressionError` whose `reason` says
what was wrong; each protocol maps it to its own status (server/errors.py), this module knows
no protocol.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import zstandard

__all__ = [
    "FRAME_HEADER_MAX",
    "OFFLOAD_BYTES",
    "OUTPUT_CHUNK_SIZE",
    "ZSTD_LEVEL",
    "CompressionError",
    "Reason",
    "ZstdDecoder",
    "frame_content_size",
    "offload",
    "zstd_compress",
    "zstd_compress_stream",
    "zstd_decompress",
    "zstd_decompress_stream",
    "zstd_decompress_whole",
]

# Work on at least this many bytes goes to a worker thread (zstd releases the GIL); smaller
# pieces are cheaper to do in place than to hand over.
OFFLOAD_BYTES = 256 << 10
# What bazel-remote uses: cheap, and most of the gain.
ZSTD_LEVEL = 1
# Compressed and decompressed output is handed on in pieces of about this size (a gRPC
# message, an HTTP write, a store chunk).
OUTPUT_CHUNK_SIZE = 1 << 20
# The longest zstd frame header: enough input to read a frame's declared content size.
FRAME_HEADER_MAX = 18
# One 4-byte zstd block can expand to 128 KiB: the decoder feeds input in slices this small so
# that one slice never produces more than about 32 MiB, whatever the input claims.
_INPUT_SLICE = 1024


class Reason(enum.Enum):
    """Why a compressed payload was refused."""

    MALFORMED = "malformed"  # not zstd, or corrupt
    TRUNCATED = "truncated"  # the input ended inside a frame
    OVER_DECLARED_SIZE = "over declared size"  # more bytes than the digest the client named
    TOO_LARGE = "too large"  # more bytes than the server accepts for this kind of entry


class CompressionError(ValueError):
    """A compressed payload that cannot be accepted; `reason` says why, `limit` is the bound that applied."""

    def __init__(self, reason: Reason, message: str, limit: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.limit = limit


async def offload(fn: Callable[..., Any], data: bytes, *args: Any) -> Any:
    """`fn(data, *args)`, in a worker thread when `data` is big enough to be worth the hop."""
    if len(data) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, data, *args)
    return fn(data, *args)


# -- compression ------------------------------------------------------------------------------


def zstd_compress(data: bytes) -> bytes:
    """One zstd frame of `data` (its size declared in the frame header)."""
    out: bytes = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    return out


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


# -- decompression ----------------------------------------------------------------------------


def frame_content_size(head: bytes) -> int | None:
    """The content size the first frame's header declares, or None if it declares none or `head`
    (at least FRAME_HEADER_MAX bytes when the body has them) is no zstd frame header."""
    try:
        size: int = zstandard.frame_content_size(head)
    except zstandard.ZstdError:
        return None
    return size if size >= 0 else None


class ZstdDecoder:
    """Decodes a body of one or more zstd frames, piece by piece, into at most `limit` bytes.

    `declared=True` means `limit` is the size the client declared (more output is
    OVER_DECLARED_SIZE); `declared=False` means it is a server limit (more output is TOO_LARGE).
    Not thread-safe, but one `step` may run in a worker thread while the loop waits for it.
    """

    def __init__(self, limit: int, *, declared: bool = True) -> None:
        self.limit = limit
        self.total = 0  # bytes produced so far
        self._over = Reason.OVER_DECLARED_SIZE if declared else Reason.TOO_LARGE
        self._frames = zstandard.ZstdDecompressor()
        self._frame = self._frames.decompressobj()
        self._inside_frame = False  # input fed to the current frame that has not finished it

    def _after_frame_end(self, out: bytes) -> bytes:
        """The current frame ended: start the next one on its unused input (maybe several)."""
        parts = [out]
        while self._frame.eof:
            rest = self._frame.unused_data  # the next frame starts here
            self._frame = self._frames.decompressobj()
            self._inside_frame = bool(rest)
            if not rest:
                break
            parts.append(self._frame.decompress(rest))
        return b"".join(parts)

    def step(self, data: bytes | memoryview, pos: int = 0, want: int = OUTPUT_CHUNK_SIZE) -> tuple[bytes, int]:
        """Decode from data[pos:] until about `want` bytes came out or the input is used up.

        Returns (output, new pos). Raises CompressionError (MALFORMED, or the over-limit reason
        as soon as the total passes `limit`)."""
        view = memoryview(data)
        end = len(view)
        parts: list[bytes] = []
        produced = 0
        budget = self.limit - self.total
        try:
            while pos < end and produced < want:
                out = self._frame.decompress(view[pos : pos + _INPUT_SLICE])
                pos = min(pos + _INPUT_SLICE, end)
                if self._frame.eof:
                    out = self._after_frame_end(out)
                else:
                    self._inside_frame = True
                if out:
                    parts.append(out)
                    produced += len(out)
                    if produced > budget:
                        raise CompressionError(
                            self._over,
                            f"zstd data decompresses to more than the {self._limit_name()} {self.limit} bytes",
                            self.limit,
                        )
        except zstandard.ZstdError as e:
            raise CompressionError(Reason.MALFORMED, f"invalid zstd data: {e}") from None
        self.total += produced
        return (parts[0] if len(parts) == 1 else b"".join(parts)), pos

    def finish(self) -> None:
        """The input has ended: CompressionError(TRUNCATED) if it ended inside a frame."""
        if self._inside_frame:
            message = f"truncated zstd data: ended inside a frame after {self.total} bytes"
            raise CompressionError(Reason.TRUNCATED, message)

    def _limit_name(self) -> str:
        return "declared" if self._over is Reason.OVER_DECLARED_SIZE else "allowed"


def zstd_decompress(data: bytes, limit: int, *, declared: bool = True) -> bytes:
    """The decoded bytes of a whole zstd payload (one or more frames), at most `limit` of them.

    Memory is bounded by `limit` plus one step, whatever the payload claims."""
    decoder = ZstdDecoder(limit, declared=declared)
    view, pos, parts = memoryview(data), 0, []
    while pos < len(view):
        out, pos = decoder.step(view, pos)
        parts.append(out)
    decoder.finish()
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def zstd_decompress_whole(data: bytes, limit: int, *, declared: bool = True) -> bytes:
    """`zstd_decompress`, in a worker thread when the output may be big enough to be worth the hop.

    The work grows with the output, not the input (a small payload can expand a lot), so the
    decision looks at `limit`."""
    if limit >= OFFLOAD_BYTES or len(data) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(zstd_decompress, data, limit, declared=declared)
    return zstd_decompress(data, limit, declared=declared)


async def zstd_decompress_stream(
    chunks: AsyncIterable[bytes], limit: int, *, declared: bool = True
) -> AsyncIterator[bytes]:
    """Async-iterate the decoded bytes of a zstd stream (one or more frames) arriving as `chunks`.

    Pieces of about OUTPUT_CHUNK_SIZE; output past `limit` is refused as soon as it appears,
    a stream that ends inside a frame is TRUNCATED; big input pieces are decoded in a worker
    thread."""
    decoder = ZstdDecoder(limit, declared=declared)
    async for chunk in chunks:
        view, pos = memoryview(chunk), 0
        while pos < len(view):
            if len(view) - pos >= OFFLOAD_BYTES:
                out, pos = await asyncio.to_thread(decoder.step, view, pos)
            else:
                out, pos = decoder.step(view, pos)
            if out:
                yield out
    decoder.finish()
