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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

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
from buildvault.digest import Digest, DigestFunction
from buildvault.server.errors import http_status, is_internal
from buildvault.server.http.protocol import (
    REQUEST_KIND,
    CachePath,
    HttpError,
    accepts_zstd,
    body_chunks,
    chain,
    content_encoding,
    content_length,
    declared_size,
    error_response,
    parse_cache_path,
)
from buildvault.storage import BlobStore, NotFound, close_chunks, single_chunk

__all__ = ["ALLOWED_METHODS", "DEFAULT_MAX_ENTRY_SIZE", "PAGES", "CacheHandlers"]

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
