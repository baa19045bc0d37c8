"""The bazel-remote HTTP protocol, /status and /metrics, on aiohttp in the server's event loop.

Endpoints (see docs/http.md):

- `GET|HEAD|PUT /{instance…}/cas/{sha256}`: CAS blobs, streamed in bounded memory. A PUT must
  carry Content-Length (of the body as sent) and is verified against the hash before it is
  stored. `Content-Encoding: zstd` uploads (with `X-Digest-SizeBytes`, as bazel-remote wants,
  or a zstd frame that declares its size) are decompressed on the fly; `Accept-Encoding: zstd`
  downloads are compressed on the fly.
- `GET|HEAD|PUT /{instance…}/ac/{sha256}`: action entries. A body that is a valid ActionResult
  whose referenced blobs are all present is a real action cache entry (what gRPC
  GetActionResult serves); anything else, e.g. a ccache entry with `layout=bazel`, is kept
  byte-for-byte in the instance's "raw" namespace, which only HTTP serves. A GET looks in the
  real AC first (completeness-checked) and then in the raw namespace.
- ccache's other layouts: `layout=subdirs` (`/{instance…}/{2 hex}/{31 chars}`) and
  `layout=flat` (`/{instance…}/{33 chars}`), keyed by ccache's 20-byte key in its string form
  (4 hex digits + 29 base32hex). They are mapped to the 64-hex key that `layout=bazel` uses for
  the same ccache key, so the three layouts share one set of raw entries.
- `GET /status` (JSON), `GET /` and `/status.html` (the same as a small HTML page),
  `GET /metrics` (Prometheus text format).

Status codes: 400 bad path, hash or body; 404 missing; 405 other methods (DELETE included);
411 PUT without Content-Length; 413 over the size limit; 415 an unsupported Content-Encoding;
507 the disk cannot take the write now. Storage errors are mapped by server/errors.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import inspect
import json
import logging
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import zstandard
from aiohttp import web

from buildvault import logs
from buildvault.actions import ActionCache, InvalidActionResult
from buildvault.compression import OFFLOAD_BYTES, zstd_compress_stream
from buildvault.digest import Digest, DigestFunction, InvalidDigest, is_hash, verify_instance_name
from buildvault.remote_apis import re_pb2
from buildvault.server.errors import http_status, is_internal
from buildvault.server.metrics import Metrics, http_method_label
from buildvault.storage import CHUNK_SIZE, ActionStore, BlobStore, NotFound, ac_namespace

log = logging.getLogger("buildvault.http")

__all__ = [
    "CachePath",
    "HttpListener",
    "ccache_key_to_hash",
    "create_app",
    "parse_cache_path",
]

# The largest action entry (ActionResult or raw ccache entry) accepted: entries are held in
# memory whole. ccache result entries embed the object file, so leave room for big ones.
DEFAULT_MAX_ENTRY_SIZE = 128 << 20
# Compress/decompress chunks at least this big in a worker thread (rule: never block the loop).
ALLOWED_METHODS = "GET, HEAD, PUT"
_PATH_CHARS = re.compile(r"[A-Za-z0-9_.\-/]*")
# ccache 4.x keys: 20 bytes written as 4 hex digits + 29 base32hex digits (33 characters).
_CCACHE_SUBDIR = re.compile(r"[0-9a-f]{2}")
_CCACHE_REST = re.compile(r"[0-9a-f]{2}[0-9a-v]{29}")
_CCACHE_FLAT = re.compile(r"[0-9a-f]{4}[0-9a-v]{29}")
_EMPTY_SHA256 = Digest.of(b"").hash
_ZSTD_MAX_FRAME_HEADER = 18
COMPLETE, INCOMPLETE, OPAQUE = "complete", "incomplete", "opaque"
_PAGES = frozenset({"/", "/status", "/status.html", "/metrics"})
HTTP_CACHE_KEY = web.AppKey("buildvault_http_cache", object)
# The `kind` metrics label of a request, set by the handler that recognised it.
_KIND: Any = web.RequestKey("buildvault_kind", str) if hasattr(web, "RequestKey") else "buildvault_kind"


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


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
    """ccache's key string (4 hex + 29 base32hex) -> the 64 hex digits `layout=bazel` sends.

    ccache pads its 40 hex digits to SHA-256's 64 by repeating the first 24.
    """
    raw = bytes.fromhex(key[:4]) + base64.b32hexdecode(key[4:].upper() + "===")
    if base64.b32hexencode(raw[2:]).decode().rstrip("=").lower() != key[4:]:
        raise InvalidDigest(f"invalid ccache key {key!r}: not canonical base32hex")
    hex_digits = raw.hex()
    return hex_digits + hex_digits[:24]


def parse_cache_path(raw_path: str) -> CachePath:
    """`/{instance…}/ac|cas/{hash}` or a ccache subdirs/flat path; InvalidDigest when neither."""
    if not raw_path.startswith("/") or not _PATH_CHARS.fullmatch(raw_path) or len(raw_path) > 1024:
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


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


class _HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _accepts_zstd(request: web.Request) -> bool:
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


def _content_length(request: web.Request) -> int:
    text = request.headers.get("Content-Length")
    if text is None:
        raise _HttpError(411, "PUT needs a Content-Length header")
    text = text.strip()
    if not text.isdigit() or len(text) > 19:
        raise _HttpError(400, f"invalid Content-Length {text[:32]!r}")
    return int(text)


def _content_encoding(request: web.Request) -> str:
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return "identity"
    if encoding == "zstd":
        return "zstd"
    raise _HttpError(415, f"unsupported Content-Encoding {encoding[:32]!r}: send identity or zstd")


async def _aclose(iterator: Any) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("buildvault")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


# --------------------------------------------------------------------------------------------
# The handlers
# --------------------------------------------------------------------------------------------


StatsSource = Callable[[], Any]  # returns a store stats object/mapping, or an awaitable of one


class HttpCache:
    """The request handlers; one per app. Stores, ActionCache semantics and metrics are injected."""

    def __init__(
        self,
        cas: BlobStore,
        action_store: ActionStore,
        metrics: Metrics,
        *,
        action_cache: ActionCache | None = None,
        stats: StatsSource | None = None,
        max_blob_size: int | None = None,
        max_entry_size: int = DEFAULT_MAX_ENTRY_SIZE,
        version: str | None = None,
    ) -> None:
        self.cas = cas
        self.action_store = action_store
        self.action_cache = action_cache or ActionCache(cas, action_store)
        self.metrics = metrics
        self.stats_source = stats if stats is not None else getattr(cas, "stats", None)
        self.max_blob_size = max_blob_size or None
        self.max_entry_size = max_entry_size
        self.version = version or metrics.version or _version()

    # -- dispatch ------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        request[_KIND] = "other"
        try:
            if request.path in _PAGES:
                raise _HttpError(405, f"method {request.method[:16]} not allowed", {"Allow": "GET, HEAD"})
            path = parse_cache_path(request.rel_url.raw_path)
            request[_KIND] = path.kind
            if request.method in ("GET", "HEAD"):
                if path.kind == "cas":
                    return await self._get_cas(request, path)
                return await self._get_ac(request, path)
            if request.method == "PUT":
                if path.kind == "cas":
                    return await self._put_cas(request, path)
                return await self._put_ac(request, path)
            raise _HttpError(405, f"method {request.method[:16]} not allowed", {"Allow": ALLOWED_METHODS})
        except _HttpError as e:
            return _error(e.status, str(e), e.headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except (aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as e:
            return _error(400, f"bad request body: {e}")
        except Exception as e:  # noqa: BLE001 - the one place exceptions become HTTP statuses
            if is_internal(e):
                log.error("internal error on %s %s", request.method, request.rel_url.raw_path[:200], exc_info=e)
            return _error(http_status(e), str(e))

    # -- CAS -------------------------------------------------------------------------------------
    async def _get_cas(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        # HTTP names a blob by its hash alone: the store finds its size in its own index.
        if path.hash == _EMPTY_SHA256:
            digest = Digest(path.hash, 0)
        else:
            digest = await self.cas.lookup(DigestFunction.SHA256, path.hash)  # NotFound: 404
        size = digest.size_bytes
        if request.method == "HEAD":
            return web.Response(
                status=200, headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            )
        chunks = await self.cas.read(digest) if size else _of(b"")  # NotFound before any byte
        return await self._stream(request, chunks, size, count_cas=True)

    async def _stream(
        self, request: web.Request, chunks: AsyncIterator[bytes], size: int, *, count_cas: bool
    ) -> web.StreamResponse:
        """Send `chunks` (identity, or zstd if the client accepts it)."""
        response = web.StreamResponse(status=200)
        response.content_type = "application/octet-stream"
        response.headers["Vary"] = "Accept-Encoding"
        sent = 0
        try:
            body: AsyncIterator[bytes] = chunks
            if _accepts_zstd(request):
                response.headers["Content-Encoding"] = "zstd"
                body = zstd_compress_stream(chunks, size)
            else:
                response.content_length = size
            await response.prepare(request)
            async for chunk in body:
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
        finally:
            await _aclose(chunks)
            if count_cas:
                self.metrics.cas_read("http", sent)
        return response

    async def _put_cas(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        length = _content_length(request)
        encoding = _content_encoding(request)
        received = _Counter()
        body: AsyncIterator[bytes] = _body(request, received)
        if encoding == "identity":
            size = length
        else:
            body, size = await self._zstd_upload(request, body)
        if self.max_blob_size is not None and size > self.max_blob_size:
            raise _HttpError(413, f"blob of {size} bytes is over the {self.max_blob_size}-byte limit")
        digest = Digest.parse(path.hash, size)
        try:
            await self.cas.write(digest, body)
        finally:
            await _aclose(body)
        self.metrics.cas_written("http", received.n)
        return web.Response(status=200)

    async def _zstd_upload(self, request: web.Request, body: AsyncIterator[bytes]) -> tuple[AsyncIterator[bytes], int]:
        """(uncompressed chunks, uncompressed size) of a zstd request body."""
        declared = request.headers.get("X-Digest-SizeBytes")
        head = b""
        if declared is not None:
            declared = declared.strip()
            if not declared.isdigit() or len(declared) > 19:
                raise _HttpError(400, f"invalid X-Digest-SizeBytes {declared[:32]!r}")
            size = int(declared)
        else:
            # No header: the zstd frame header must declare the content size.
            async for chunk in body:
                head += chunk
                if len(head) >= _ZSTD_MAX_FRAME_HEADER:
                    break
            try:
                size = zstandard.frame_content_size(head)
            except zstandard.ZstdError:
                size = -1
            if size < 0:
                raise _HttpError(
                    400, "a zstd upload needs X-Digest-SizeBytes or a zstd frame that declares its content size"
                )
        return _decompressed(_chain(head, body), size), size

    # -- AC --------------------------------------------------------------------------------------
    async def _classify(self, data: bytes) -> str:
        """COMPLETE: a valid ActionResult whose referenced blobs are all in the CAS (the
        ActionCache's completeness rules); INCOMPLETE: a valid one that references missing
        blobs; OPAQUE: anything else (e.g. a ccache entry)."""
        try:
            result = re_pb2.ActionResult.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError and friends: not an ActionResult
            return OPAQUE
        try:
            missing = await self.action_cache.missing_blobs(result, DigestFunction.SHA256)
        except (InvalidActionResult, InvalidDigest):
            return OPAQUE
        return INCOMPLETE if missing else COMPLETE

    async def _lookup_entry(self, path: CachePath) -> bytes | None:
        """A complete real AC entry for `path`, else its raw entry, else None.

        A raw entry that is an ActionResult (PUT before its blobs) is served only once every
        blob it references is present, like a real one."""
        try:
            data = await self.action_store.get(ac_namespace(path.instance), path.digest)
        except NotFound:
            data = None
        if data is not None and await self._classify(data) == COMPLETE:
            return data
        try:
            data = await self.action_store.get(ac_namespace(path.instance, "raw"), path.digest)
        except NotFound:
            return None
        return None if await self._classify(data) == INCOMPLETE else data

    async def _get_ac(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        data = await self._lookup_entry(path)
        if request.method == "GET":
            self.metrics.ac_lookup("http", data is not None)
        if data is None:
            raise NotFound(f"no action entry {path.hash}")
        if request.method == "HEAD":
            return web.Response(
                status=200, headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
            )
        return await self._stream(request, _of(data), len(data), count_cas=False)

    async def _put_ac(self, request: web.Request, path: CachePath) -> web.StreamResponse:
        length = _content_length(request)
        encoding = _content_encoding(request)
        if length > self.max_entry_size:
            raise _HttpError(413, f"action entry of {length} bytes is over the {self.max_entry_size}-byte limit")
        try:
            data = await request.content.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise _HttpError(400, f"body ended after {len(e.partial)} of {length} bytes") from None
        if encoding == "zstd":
            data = await asyncio.to_thread(_decompress_bounded, data, self.max_entry_size)
        if await self._classify(data) == COMPLETE:
            await self.action_store.put(ac_namespace(path.instance), path.digest, data)
        else:
            await self.action_store.put(ac_namespace(path.instance, "raw"), path.digest, data)
        return web.Response(status=200)

    # -- status and metrics ----------------------------------------------------------------------
    async def refresh_storage(self) -> None:
        """Update the storage gauges from the store's stats() (if it has one)."""
        if self.stats_source is None:
            return
        try:
            stats = self.stats_source()
            if inspect.isawaitable(stats):
                stats = await stats
        except Exception:  # noqa: BLE001 - /status must answer even if a store cannot tell
            log.warning("storage stats failed", exc_info=True)
            return
        self.metrics.set_storage(stats)

    async def status_document(self) -> dict[str, Any]:
        await self.refresh_storage()
        s = self.metrics.storage
        counts = self.metrics.ac_counts()
        execution = self.metrics.execution_status  # remote execution (issue 12): its own section
        return {
            **({"execution": execution()} if execution is not None else {}),
            "version": self.version,
            "uptime_seconds": round(self.metrics.uptime_seconds, 3),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.metrics.started)),
            "current_size_bytes": s.used_bytes,
            "max_size_bytes": s.max_bytes,
            "blob_count": s.blob_count,
            "ac_entries": s.ac_entries,
            "evictions": s.evictions,
            "oldest_item_age_seconds": s.oldest_item_age_seconds,
            "ac_hits": counts["hits"]["total"],
            "ac_misses": counts["misses"]["total"],
            "ac_hits_by_protocol": {k: v for k, v in counts["hits"].items() if k != "total"},
            "ac_misses_by_protocol": {k: v for k, v in counts["misses"].items() if k != "total"},
            # bazel-remote's field names, for tools written against its /status.
            "CurrSize": s.used_bytes,
            "MaxSize": s.max_bytes,
            "NumFiles": s.blob_count,
            "ServerTime": int(time.time()),
            "GitCommit": self.version,
        }

    async def status_json(self, request: web.Request) -> web.Response:
        request[_KIND] = "status"
        return web.json_response(await self.status_document(), dumps=lambda d: json.dumps(d, indent=2) + "\n")

    async def status_html(self, request: web.Request) -> web.Response:
        request[_KIND] = "status"
        return web.Response(text=_render_html(await self.status_document()), content_type="text/html")

    async def metrics_text(self, request: web.Request) -> web.Response:
        request[_KIND] = "metrics"
        await self.refresh_storage()
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = self.metrics.content_type
        return response


class _Counter:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


async def _body(request: web.Request, counter: _Counter) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK_SIZE):
        counter.n += len(chunk)
        yield chunk


async def _of(data: bytes | None) -> AsyncIterator[bytes]:
    if data:
        yield data


async def _chain(first: bytes, rest: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


# zstd can expand one 4-byte block to 128 KiB: feed the decompressor small slices of input so
# one call never produces more than ~32 MiB, and hand output on in CHUNK_SIZE pieces.
_ZSTD_SLICE = 1024


class _ZstdStream:
    """Decompresses a body of one or more zstd frames in bounded pieces, knowing whether it
    ended on a frame boundary."""

    def __init__(self) -> None:
        self._decompressor = zstandard.ZstdDecompressor()
        self._current = self._decompressor.decompressobj()
        self._pending = False  # input fed to the current frame that has not finished it

    def _feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        while data:
            out.append(self._current.decompress(data))
            self._pending = not self._current.eof
            if not self._current.eof:
                break
            data = self._current.unused_data
            self._current = self._decompressor.decompressobj()
        return b"".join(out)

    def step(self, data: memoryview, pos: int, want: int = CHUNK_SIZE) -> tuple[bytes, int]:
        """Decompress from data[pos:] until about `want` bytes came out; (output, new pos)."""
        out: list[bytes] = []
        produced = 0
        try:
            while pos < len(data) and produced < want:
                piece = self._feed(bytes(data[pos : pos + _ZSTD_SLICE]))
                pos += _ZSTD_SLICE
                if piece:
                    out.append(piece)
                    produced += len(piece)
        except zstandard.ZstdError as e:
            raise InvalidDigest(f"invalid zstd body: {e}") from None
        return b"".join(out), pos

    @property
    def complete(self) -> bool:
        return not self._pending


async def _decompressed(chunks: AsyncIterable[bytes], limit: int) -> AsyncIterator[bytes]:
    """Decompress a zstd stream; stop early once past `limit` bytes (the store then sees more
    bytes than declared and refuses the write)."""
    stream = _ZstdStream()
    produced = 0
    async for chunk in chunks:
        view, pos = memoryview(chunk), 0
        while pos < len(view):
            if len(view) - pos >= OFFLOAD_BYTES:
                out, pos = await asyncio.to_thread(stream.step, view, pos)
            else:
                out, pos = stream.step(view, pos)
            if out:
                produced += len(out)
                yield out
                if produced > limit:
                    return
    if not stream.complete:
        raise InvalidDigest("truncated zstd body")


def _decompress_bounded(data: bytes, limit: int) -> bytes:
    stream = _ZstdStream()
    view, pos, parts, produced = memoryview(data), 0, [], 0
    while pos < len(view):
        out, pos = stream.step(view, pos)
        parts.append(out)
        produced += len(out)
        if produced > limit:
            raise _HttpError(413, f"action entry is over the {limit}-byte limit once decompressed")
    if not stream.complete:
        raise InvalidDigest("truncated zstd body")
    return b"".join(parts)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=message + "\n", headers=headers)


# --------------------------------------------------------------------------------------------
# The status page
# --------------------------------------------------------------------------------------------


def _human_bytes(value: Any) -> str:
    if value is None:
        return "–"
    n = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(value)  # pragma: no cover


def _human_seconds(value: Any) -> str:
    if value is None:
        return "–"
    seconds = int(value)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours or days else []
    parts += [f"{minutes}m", f"{seconds}s"]
    return " ".join(parts)


def _execution_rows(execution: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The status page's remote-execution section: pools, workers, queued and running jobs."""
    if execution is None:
        return []
    rows: list[tuple[str, Any]] = [("Execution sandbox", execution["sandbox"])]
    for pool in execution["pools"]:
        summary = f"{pool['workers']} workers, {pool['busy']} busy, {pool['queued']} queued"
        rows.append((f"Pool {pool['pool']}", summary))
    for worker in execution["workers"]:
        doing = f"{worker['action']} for {_human_seconds(worker['running_seconds'])}" if worker["action"] else ""
        rows.append((f"Worker {worker['name']}", f"{worker['state']} {doing}".strip()))
    for job in execution["queued"]:
        rows.append(("Queued", f"{job['action']} ({job['pool']}) for {_human_seconds(job['age_seconds'])}"))
    for job in execution["running"]:
        rows.append(("Running", f"{job['action']} on {job['worker']} for {_human_seconds(job['age_seconds'])}"))
    return rows


def _render_html(doc: dict[str, Any]) -> str:
    hits, misses = doc["ac_hits"], doc["ac_misses"]
    ratio = f"{100.0 * hits / (hits + misses):.1f}%" if hits + misses else "–"
    used, cap = doc["current_size_bytes"], doc["max_size_bytes"]
    fill = f" ({100.0 * used / cap:.1f}%)" if used is not None and cap else ""
    rows = [
        ("Version", doc["version"]),
        ("Uptime", _human_seconds(doc["uptime_seconds"])),
        ("Disk used", _human_bytes(used) + fill),
        ("Disk limit", _human_bytes(cap)),
        ("CAS blobs", "–" if doc["blob_count"] is None else f"{doc['blob_count']:,}"),
        ("Action entries", "–" if doc["ac_entries"] is None else f"{doc['ac_entries']:,}"),
        ("Evictions", "–" if doc["evictions"] is None else f"{doc['evictions']:,}"),
        ("Oldest item", _human_seconds(doc["oldest_item_age_seconds"])),
        ("AC hits", f"{hits:,}"),
        ("AC misses", f"{misses:,}"),
        ("AC hit ratio", ratio),
    ]
    rows += _execution_rows(doc.get("execution"))  # remote execution (issue 12)
    body = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>buildvault status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}
table{{border-collapse:collapse}}th,td{{padding:.3em 1em;border-bottom:1px solid #ddd;text-align:left}}
th{{font-weight:600;color:#555}}td{{font-variant-numeric:tabular-nums}}
footer{{margin-top:1.5em;color:#777;font-size:.9em}}
</style></head>
<body><h1>buildvault</h1>
<table>
{body}
</table>
<footer><a href="/status">/status</a> (JSON) · <a href="/metrics">/metrics</a> (Prometheus)</footer>
</body></html>
"""


# --------------------------------------------------------------------------------------------
# The app and its listener
# --------------------------------------------------------------------------------------------


def _request_middleware(metrics: Metrics) -> Any:
    """Counts and times every request; with --log-level debug, one JSON line per request."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        start = time.perf_counter()
        token = logs.begin_request()
        status: int | str = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = "aborted"
            raise
        finally:
            kind = request.get(_KIND, "other")
            metrics.observe_request("http", http_method_label(request.method), kind, status, time.perf_counter() - start)
            if token is not None:
                logs.note(path=request.rel_url.raw_path[:200])
                logs.end_request(token, f"HTTP {request.method[:16]} {kind}", str(status), start, request.remote)

    return middleware


def create_app(
    cas: BlobStore,
    action_store: ActionStore,
    metrics: Metrics | None = None,
    *,
    action_cache: ActionCache | None = None,
    stats: StatsSource | None = None,
    max_blob_size: int | None = None,
    max_entry_size: int = DEFAULT_MAX_ENTRY_SIZE,
    version: str | None = None,
) -> web.Application:
    """The aiohttp application: cache endpoints, /status, /status.html, / and /metrics.

    GET /cas/{hash} finds blobs through `cas.lookup` (hash only, from the store's own index).
    """
    metrics = metrics or Metrics(version=version or _version())
    cache = HttpCache(
        cas,
        action_store,
        metrics,
        action_cache=action_cache,
        stats=stats,
        max_blob_size=max_blob_size,
        max_entry_size=max_entry_size,
        version=version,
    )
    app = web.Application(middlewares=[_request_middleware(metrics)])
    app[HTTP_CACHE_KEY] = cache
    for route, handler in (
        ("/status", cache.status_json),
        ("/status.html", cache.status_html),
        ("/", cache.status_html),
        ("/metrics", cache.metrics_text),
    ):
        app.router.add_get(route, handler)  # answers HEAD too
    app.router.add_route("*", "/{tail:.*}", cache.handle)
    return app


class HttpListener:
    """The HTTP front end as an App listener: serves `create_app(...)` on `address` (port 0: any)."""

    name = "http"

    def __init__(self, address: str, app: web.Application) -> None:
        self.requested = address
        self.app = app
        self._runner: web.AppRunner | None = None
        self._address: str | None = None
        self._stopping: asyncio.Future[None] | None = None

    @classmethod
    def from_services(
        cls,
        address: str,
        services: Any,
        metrics: Metrics,
        version: str | None = None,
        *,
        stats: StatsSource | None = None,
    ) -> HttpListener:
        """From the App's Services (blobs, actions, action_cache, max_cas_blob_size)."""
        app = create_app(
            services.blobs,
            services.actions,
            metrics,
            action_cache=services.action_cache,
            stats=stats,
            max_blob_size=services.max_cas_blob_size or None,
            version=version,
        )
        return cls(address, app)

    @property
    def address(self) -> str | None:
        return self._address

    async def start(self) -> None:
        host, _, port = self.requested.rpartition(":")
        host = host.strip("[]")
        # Request bodies reach the handlers as sent: zstd is decoded (and its hash verified) by
        # the handlers, and aiohttp must not try to decode any other encoding.
        runner = web.AppRunner(self.app, access_log=None, auto_decompress=False, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, int(port), reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            from buildvault.server.app import StartupError

            raise StartupError(f"cannot listen on {self.requested} (HTTP): {e}") from None
        self._runner = runner
        bound = int(port)
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or ():
            bound = sock.getsockname()[1]
            break
        self._address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    async def stop(self, grace: float) -> None:
        """Stop accepting; let in-flight requests finish for up to `grace` seconds, then cancel them.

        A second call (App.hurry, grace 0) cancels what is still running at once."""
        runner = self._runner
        if runner is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(runner, grace))
        elif grace <= 0 and runner.server is not None:
            await runner.server.shutdown(0)
        await asyncio.shield(self._stopping)

    async def _stop(self, runner: web.AppRunner, grace: float) -> None:
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            # An idle keep-alive connection would hold the whole grace period: close each
            # connection now (a busy one closes once its request is answered).
            for connection in list(runner.server.connections):
                connection.close()
            await runner.server.shutdown(max(grace, 0.0))
        await runner.cleanup()
        self._runner = None
