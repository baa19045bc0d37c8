"""GET, HEAD and PUT of `/{instance…}/cas/{sha256}` and `/{instance…}/ac/{sha256}` (and ccache's layouts).

- CAS blobs stream in bounded memory. A PUT must carry Content-Length (of the body as sent)
  and is verified against the hash before it is stored. `Content-Encoding: zstd` uploads (with
  `X-Digest-SizeBytes`, as bazel-remote sends, or a zstd frame that declares its size) are
  decoded on the fly; `Accept-Encoding: zstd` downloads are compressed on the fly.
- Action entries are whole in memory (up to `max_entry_size`); which bodies are real
  ActionResults and which are raw entries is `ActionCache.store_entry`'s rule (actions.py).

Every exception becomes a status here, through server/errors.py: 400 bad path, hash or body;
404 missing; 405 other methods; 411 PUT without Content-Length; 413 over a size limit; 415 an
unsupported Content-Encoding; 507 the disk cannot take the write now.

The HTTP level (the first half of this module) is kept apart from what the cache does with
the bytes (`CacheHandlers`, the second half).

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

import asyncio
import base64
import logging
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from buildvault.actions import ActionCache
from buildvault.compression import (
    FRAME_HEADER_MAX,
    frame_content_size,
    zstd_compress_stream,
    zstd_decompress_stream,
    zstd_decompress_whole,
)
from buildvault.digest import Digest, DigestFunction, InvalidDigest, is_hash, verify_instance_name
from buildvault.server.errors import http_status, is_internal
from buildvault.storage import CHUNK_SIZE, BlobStore, NotFound, close_chunks, single_chunk

__all__ = [
    "ALLOWED_METHODS",
    "DEFAULT_MAX_ENTRY_SIZE",
    "PAGES",
    "REQUEST_KIND",
    "CacheHandlers",
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


# -- the handlers ----------------------------------------------------------------------------------

log = logging.getLogger("buildvault.http")

# The largest action entry (ActionResult or raw ccache entry) accepted: entries are held in
# memory whole. ccache result entries embed the object file, so leave room for big ones.
DEFAULT_MAX_ENTRY_SIZE = 128 << 20
ALLOWED_METHODS = "GET, HEAD, PUT"
# Paths served by the status pages (GET and HEAD only).
PAGES = frozenset({"/", "/status", "/status.html", "/metrics"})


class CacheHandlers:
    """The /ac/ and /cas/ handlers of one app, over injected stores and ActionCache semantics.

    They count nothing themselves: bytes are counted at the store boundary (storage.MeteredBlobStore)
    and AC hits by the ActionCache, under the protocol the request middleware names."""

    def __init__(
        self,
        cas: BlobStore,
        action_cache: ActionCache,
        *,
        max_blob_size: int | None = None,
        max_entry_size: int = DEFAULT_MAX_ENTRY_SIZE,
    ) -> None:
        self.cas = cas
        self.action_cache = action_cache
        self.max_blob_size = max_blob_size or None
        self.max_entry_size = max_entry_size

    # -- dispatch ------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Any method on any path the status pages do not serve: the one place exceptions become statuses."""
        request[REQUEST_KIND] = "other"
        try:
            if request.path in PAGES:
                raise HttpError(405, f"method {request.method[:16]} not allowed", {"Allow": "GET, HEAD"})
            path = parse_cache_path(request.rel_url.raw_path)
            request[REQUEST_KIND] = path.kind
            if request.method in ("GET", "HEAD"):
                if path.kind == "cas":
                    return await self._get_cas(request, path)
                return await self._get_ac(request, path)
            if request.method == "PUT":
                if path.kind == "cas":
                    return await self._put_cas(request, path)
                return await self._put_ac(request, path)
            raise HttpError(405, f"method {request.method[:16]} not allowed", {"Allow": ALLOWED_METHODS})
        except HttpError as e:
            return error_response(e.status, str(e), e.headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except (aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as e:
            return error_response(400, f"bad request body: {e}")
        except Exception as e:  # the one place exceptions become HTTP statuses
            if is_internal(e):
                log.error("internal error on %s %s", request.method, request.rel_url.raw_path[:200], exc_info=e)
            return error_response(http_status(e), str(e))

    # -- CAS -------------------------------------------------------------------------------------
    async def _get_cas(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        # HTTP names a blob by its hash alone: the store finds its size in its own index (and
        # knows the empty blob: storage.EmptyBlobStore).
        digest = await self.cas.lookup(DigestFunction.SHA256, path.hash)  # NotFound: 404
        size = digest.size_bytes
        if request.method == "HEAD":
            return web.Response(
                status=200, headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            )
        chunks = await self.cas.read(digest)  # NotFound before any byte
        return await self._stream(request, chunks, size)

    async def _stream(self, request: web.Request, chunks: AsyncIterator[bytes], size: int) -> web.StreamResponse:
        """Send `chunks` (identity, or zstd if the client accepts it)."""
        response = web.StreamResponse(status=200)
        response.content_type = "application/octet-stream"
        response.headers["Vary"] = "Accept-Encoding"
        sent = 0
        try:
            body: AsyncIterator[bytes] = chunks
            if accepts_zstd(request):
                response.headers["Content-Encoding"] = "zstd"
                body = zstd_compress_stream(chunks, size)
            else:
                response.content_length = size
            await response.prepare(request)
            try:
                async for chunk in body:
                    await response.write(chunk)
                    sent += len(chunk)
            except Exception as e:  # headers are out: no status can follow, only a cut connection
                log.warning("%s %s failed after %d bytes: %s", request.method, request.rel_url.raw_path[:200], sent, e)
                if request.transport is not None:
                    request.transport.abort()  # the client sees a short body, never other bytes
                return response
            await response.write_eof()
        finally:
            await close_chunks(chunks)
        return response

    async def _put_cas(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        length = content_length(request)
        encoding = content_encoding(request)
        body: AsyncIterator[bytes] = body_chunks(request)
        if encoding == "identity":
            size = length
        else:
            body, size = await self._zstd_upload(request, body)
        if self.max_blob_size is not None and size > self.max_blob_size:
            raise HttpError(413, f"blob of {size} bytes is over the {self.max_blob_size}-byte limit")
        digest = Digest.parse(path.hash, size)
        try:
            await self.cas.write(digest, body)
        finally:
            await close_chunks(body)
        return web.Response(status=200)

    async def _zstd_upload(self, request: web.Request, body: AsyncIterator[bytes]) -> tuple[AsyncIterator[bytes], int]:
        """(decoded chunks, decoded size) of a zstd request body."""
        size = declared_size(request)
        head = b""
        if size is None:
            # No header: the zstd frame header must declare the content size.
            async for chunk in body:
                head += chunk
                if len(head) >= FRAME_HEADER_MAX:
                    break
            size = frame_content_size(head)
            if size is None:
                raise HttpError(
                    400, "a zstd upload needs X-Digest-SizeBytes or a zstd frame that declares its content size"
                )
        return zstd_decompress_stream(chain(head, body), size), size

    # -- AC --------------------------------------------------------------------------------------
    async def _get_ac(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        data = await self.action_cache.lookup_entry(path.instance, path.digest, counted=request.method == "GET")
        if data is None:
            raise NotFound(f"no action entry {path.hash}")
        if request.method == "HEAD":
            return web.Response(
                status=200, headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
            )
        return await self._stream(request, single_chunk(data), len(data))

    async def _put_ac(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        length = content_length(request)
        encoding = content_encoding(request)
        if length > self.max_entry_size:
            raise HttpError(413, f"action entry of {length} bytes is over the {self.max_entry_size}-byte limit")
        try:
            data = await request.content.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise HttpError(400, f"body ended after {len(e.partial)} of {length} bytes") from None
        if encoding == "zstd":
            data = await zstd_decompress_whole(data, self.max_entry_size, declared=False)
        await self.action_cache.store_entry(path.instance, path.digest, data)
        return web.Response(status=200)
