"""What a cache request says at the HTTP level: its path, its headers, its body; errors as responses.

Everything here is about HTTP itself, not about what the cache does with the bytes
(handlers.py).

The path: the URL grammar of the bazel-remote HTTP protocol and ccache's HTTP storage layouts.

- `layout=bazel` (and Bazel itself): `/{instance…}/ac/{sha256}` and `/{instance…}/cas/{sha256}`.
- ccache `layout=subdirs`: `/{instance…}/{first 2 chars}/{the rest}`; `layout=flat`:
  `/{instance…}/{key}`, where the key is ccache's 20-byte key in its string form: 4 hex digits
  + 29 base32hex (33 characters) up to ccache 4.7, 40 lowercase hex digits from 4.8 on. Both
  map to the 64-hex key that `layout=bazel` uses for the same 20 bytes, so the three layouts
  (and both key spellings) share one set of action entries.

Anything else is an InvalidDigest naming what was wrong; no path escapes its instance.

The headers: Content-Length, Content-Encoding, Accept-Encoding, X-Digest-SizeBytes.
"""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from buildvault.digest import Digest, DigestFunction, InvalidDigest, is_hash, verify_instance_name
from buildvault.storage import CHUNK_SIZE

__all__ = [
    "REQUEST_KIND",
    "CachePath",
    "HttpError",
    "accepts_zstd",
    "body_chunks",
    "ccache_key_to_hash",
    "chain",
    "content_encoding",
    "content_length",
    "declared_size",
    "error_response",
    "parse_cache_path",
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


# -- the path ------------------------------------------------------------------------------------
_PATH_CHARS = re.compile(r"[A-Za-z0-9_.\-/]*")
_MAX_PATH = 1024
# ccache's 20-byte keys: up to 4.7 written as 4 hex digits + 29 base32hex digits (33 characters),
# from 4.8 on as 40 lowercase hex digits. The lengths (33/31 against 40/38) tell them apart.
_CCACHE_SUBDIR = re.compile(r"[0-9a-f]{2}")
_CCACHE_REST = re.compile(r"[0-9a-f]{2}[0-9a-v]{29}|[0-9a-f]{38}")
_CCACHE_FLAT = re.compile(r"[0-9a-f]{4}[0-9a-v]{29}|[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class CachePath:
    """A parsed cache URL path."""

    instance: str
    kind: str  # "ac" or "cas"
    hash: str  # 64 lowercase hex digits
    layout: str = "bazel"  # "bazel", "ccache-subdirs" or "ccache-flat"

    @property
    def digest(self) -> Digest:
        """The storage key. The HTTP protocol has no sizes; stores key by function and hash."""
        return Digest(self.hash, 0, DigestFunction.SHA256)


def ccache_key_to_hash(key: str) -> str:
    """ccache's key string -> the 64 hex digits `layout=bazel` sends for the same 20 bytes.

    The key is 40 lowercase hex digits (ccache 4.8 and later) or 4 hex + 29 base32hex (up to
    4.7). ccache pads the 40 hex digits to SHA-256's 64 by repeating the first 24.
    """
    if not _CCACHE_FLAT.fullmatch(key):
        raise InvalidDigest(f"invalid ccache key {key[:100]!r}: want 40 hex digits, or 4 hex + 29 base32hex")
    if len(key) == 40:
        hex_digits = key
    else:
        raw = bytes.fromhex(key[:4]) + base64.b32hexdecode(key[4:].upper() + "===")
        if base64.b32hexencode(raw[2:]).decode().rstrip("=").lower() != key[4:]:
            raise InvalidDigest(f"invalid ccache key {key!r}: not canonical base32hex")
        hex_digits = raw.hex()
    return hex_digits + hex_digits[:24]


def parse_cache_path(raw_path: str) -> CachePath:
    """`/{instance…}/ac|cas/{hash}` or a ccache subdirs/flat path; InvalidDigest when neither."""
    if not raw_path.startswith("/") or not _PATH_CHARS.fullmatch(raw_path) or len(raw_path) > _MAX_PATH:
        raise InvalidDigest(f"invalid path {raw_path[:100]!r}")
    segments = raw_path[1:].split("/")
    last = segments[-1]
    if len(segments) >= 2 and segments[-2] in ("ac", "cas") and len(last) == 64:
        if not is_hash(last):
            raise InvalidDigest(f"invalid SHA-256 hash {last!r}: want 64 lowercase hex digits")
        return CachePath(verify_instance_name("/".join(segments[:-2])), segments[-2], last)
    if len(segments) >= 2 and _CCACHE_SUBDIR.fullmatch(segments[-2]) and _CCACHE_REST.fullmatch(last):
        hash_ = ccache_key_to_hash(segments[-2] + last)
        return CachePath(verify_instance_name("/".join(segments[:-2])), "ac", hash_, "ccache-subdirs")
    if _CCACHE_FLAT.fullmatch(last):
        return CachePath(verify_instance_name("/".join(segments[:-1])), "ac", ccache_key_to_hash(last), "ccache-flat")
    if len(segments) >= 2 and segments[-2] in ("ac", "cas"):
        raise InvalidDigest(f"invalid SHA-256 hash {last[:100]!r}: want 64 lowercase hex digits")
    raise InvalidDigest(
        f"invalid path {raw_path[:100]!r}: want /[instance/]ac/<sha256>, /[instance/]cas/<sha256> "
        "or a ccache key path"
    )
