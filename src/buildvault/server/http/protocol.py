"""HTTP-level rules of a cache request: its headers, its body, errors as responses, its metrics label.

Everything here is about HTTP itself (Content-Length, Content-Encoding, Accept-Encoding,
X-Digest-SizeBytes), not about what the cache does with the bytes (handlers.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from aiohttp import web

from buildvault.storage import CHUNK_SIZE

__all__ = [
    "REQUEST_KIND",
    "HttpError",
    "accepts_zstd",
    "body_chunks",
    "chain",
    "content_encoding",
    "content_length",
    "declared_size",
    "error_response",
]

# The `kind` metrics label of a request ("ac", "cas", "status", ...), set by whoever recognised it.
REQUEST_KIND: Any = web.RequestKey("buildvault_kind", str) if hasattr(web, "RequestKey") else "buildvault_kind"
_MAX_DECIMAL_DIGITS = 19  # fits in an int64, as sizes do everywhere else


class HttpError(Exception):
    """A request refused at the HTTP level, with its status and any headers to send back."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """A plain-text error reply (the message and a newline)."""
    return web.Response(status=status, text=message + "\n", headers=headers)


def accepts_zstd(request: web.Request) -> bool:
    """Whether Accept-Encoding names zstd with a q-value above 0."""
    for item in request.headers.getall("Accept-Encoding", []):
        for token in item.split(","):
            name, _, params = token.strip().partition(";")
            if name.strip().lower() == "zstd":
                q = params.strip().replace(" ", "")
                return not (q.startswith("q=") and _qvalue(q[2:]) == 0.0)
    return False


def _qvalue(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 1.0


def _decimal(text: str, header: str) -> int:
    text = text.strip()
    if not text.isdigit() or len(text) > _MAX_DECIMAL_DIGITS:
        raise HttpError(400, f"invalid {header} {text[:32]!r}")
    return int(text)


def content_length(request: web.Request) -> int:
    """The body length as sent; 411 without Content-Length, 400 if it is not a number."""
    text = request.headers.get("Content-Length")
    if text is None:
        raise HttpError(411, "PUT needs a Content-Length header")
    return _decimal(text, "Content-Length")


def content_encoding(request: web.Request) -> str:
    """"identity" or "zstd"; 415 for any other Content-Encoding."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return "identity"
    if encoding == "zstd":
        return "zstd"
    raise HttpError(415, f"unsupported Content-Encoding {encoding[:32]!r}: send identity or zstd")


def declared_size(request: web.Request) -> int | None:
    """X-Digest-SizeBytes (bazel-remote's uncompressed size of a zstd upload), if sent."""
    text = request.headers.get("X-Digest-SizeBytes")
    return None if text is None else _decimal(text, "X-Digest-SizeBytes")


async def body_chunks(request: web.Request) -> AsyncIterator[bytes]:
    """The request body in chunks of at most CHUNK_SIZE."""
    async for chunk in request.content.iter_chunked(CHUNK_SIZE):
        yield chunk


async def chain(first: bytes, rest: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """`first`, then everything `rest` yields."""
    if first:
        yield first
    async for chunk in rest:
        yield chunk

