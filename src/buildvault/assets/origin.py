"""Downloads from the origin, safe by default: the only place buildvault opens a connection a
client chose.

Rules (docs/asset.md):
- http and https only; `--asset-origins none` downloads nothing, `allow-list` only from the hosts
  of `--asset-allow-hosts`, `any` from any public host;
- no server-side request forgery: a loopback, link-local, private, multicast, unspecified or
  reserved address is refused, whether written in the URL or among the addresses its name
  resolves to (every one of them, checked in the resolver the connection itself uses, so a name
  cannot resolve one way for the check and another for the connect), on every redirect hop,
  unless `--asset-allow-private` or the hop's host as written is in `--asset-allow-hosts`;
- bounded: `--asset-max-size` (by Content-Length before a byte is read, and by counting),
  a connect timeout and a total timeout per URI, at most 5 redirects, `--asset-max-downloads`
  downloads in flight;
- credentials go only to the origin they were given for: a redirect to another origin drops them;
- the body is streamed into the CAS, never whole in memory: straight into the store when its
  SHA-256 and size are known up front (Content-Length and a sha256 checksum: the store verifies
  both before the blob is visible), else through a spool file beside the data directory, hashed
  on the way; every checksum is verified before anything is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from buildvault.assets.request import Checksum
from buildvault.config import parse_list
from buildvault.digest import Digest, DigestFunction, new_hasher
from buildvault.storage import BlobStore, DigestMismatch

__all__ = [
    "AttemptFailed",
    "ChecksumMismatch",
    "DownloadRecorder",
    "OriginFetcher",
    "OriginRules",
    "Refused",
    "TooLarge",
    "is_private_address",
]

MAX_REDIRECTS = 5
CHUNK = 1 << 20  # the spool file's read size
# aiohttp's buffer of a response body (it reads ahead up to twice this before pausing the socket),
# and the size of one receive from the socket (asyncio's default: 256 KiB)
READ_BUFFER = 1 << 20
SPOOL_BATCH = 4 << 20  # bytes a worker thread writes and hashes into the spool file at once
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class AttemptFailed(Exception):
    """One URI could not be fetched; the message is what its origin answered."""


class Refused(AttemptFailed, OSError):
    """The rules refuse this URL (scheme, origin list, a private address). An OSError too, so the
    resolver can raise it through aiohttp's connector."""


class ChecksumMismatch(AttemptFailed):
    pass


class TooLarge(AttemptFailed):
    pass


class DownloadRecorder(Protocol):
    def asset_downloaded(self, nbytes: int) -> None: ...


def is_private_address(address: str) -> bool:
    """Loopback, link-local, private, multicast, unspecified or reserved (IPv4-mapped IPv6 too)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True  # not an address we can reason about: refuse
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return bool(
        ip.is_loopback
        or ip.is_link_local
        or ip.is_private
        or ip.is_multicast
        or ip.is_unspecified
        or ip.is_reserved
        or not ip.is_global
    )


def _host_of(url: URL) -> str:
    return (url.host or "").strip("[]").lower().rstrip(".")


@dataclass(frozen=True)
class OriginRules:
    """`origins`: none, any or allow-list. `allow_hosts`: hosts as written (names or addresses)."""

    origins: str = "any"
    allow_hosts: frozenset[str] = frozenset()
    allow_private: bool = False

    @classmethod
    def parse_hosts(cls, text: str) -> frozenset[str]:
        return frozenset(h.strip("[]").lower().rstrip(".") for h in parse_list(text))

    def exempt(self, host: str) -> bool:
        """May this host (as written) reach a private address?"""
        return self.allow_private or host.strip("[]").lower().rstrip(".") in self.allow_hosts

    def check(self, url: URL) -> None:
        """Refused unless the URL may be fetched (before any connection; addresses the name
        resolves to are checked by `GuardedResolver`)."""
        if self.origins == "none":
            raise Refused("downloads are off on this server (--asset-origins none)")
        if url.scheme not in ("http", "https"):
            raise Refused(f"scheme {url.scheme!r} is not fetched (http and https only)")
        host = _host_of(url)
        if not host:
            raise Refused("no host in the URL")
        if self.origins == "allow-list" and host not in self.allow_hosts:
            raise Refused(f"host {host} is not in --asset-allow-hosts")
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return  # a name: its addresses are checked when it is resolved
        if is_private_address(host) and not self.exempt(host):
            raise Refused(f"{host} is a private, loopback, link-local or multicast address")


class GuardedResolver(AbstractResolver):
    """The connector's resolver: every address a name resolves to must be public, unless the
    name is exempt. One private address refuses the whole name (no picking the public ones)."""

    def __init__(self, rules: OriginRules) -> None:
        self.rules = rules
        self.inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        if not self.rules.exempt(host):
            for result in results:
                if is_private_address(result["host"]):
                    raise Refused(f"{host} resolves to {result['host']}, a private, loopback or link-local address")
        return results

    async def close(self) -> None:
        await self.inner.close()


def _origin(url: URL) -> tuple[str, str, int | None]:
    return url.scheme, _host_of(url), url.port


class OriginFetcher:
    """Downloads into the CAS under the rules; one instance per server (one connection pool)."""

    def __init__(
        self,
        rules: OriginRules,
        blobs: BlobStore,
        spool_dir: Path,
        *,
        max_size: int,  # the settings' values (config.py holds the defaults)
        connect_timeout: float,
        total_timeout: float,
        max_downloads: int,
        recorder: DownloadRecorder | None = None,
    ) -> None:
        self.rules = rules
        self.blobs = blobs
        self.spool_dir = spool_dir
        self.max_size = max_size
        self.connect_timeout = connect_timeout
        self.total_timeout = total_timeout
        self.slots = asyncio.Semaphore(max_downloads)
        self.recorder = recorder
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            connector = aiohttp.TCPConnector(resolver=GuardedResolver(self.rules), limit=0, ttl_dns_cache=10)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # the bytes as served are what the checksum covers
                trust_env=False,  # no proxy from the environment: the rules see the real origin
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout),
                read_bufsize=READ_BUFFER,
            )
        return self._session

    def clean_spool(self) -> None:
        """Remove what a crash left in the spool directory, partial downloads and lock files (the
        primary, at start-up, before any process downloads)."""
        for stale in [*self.spool_dir.glob("download-*"), *self.spool_dir.glob("lock-*")]:
            with contextlib.suppress(OSError):
                stale.unlink()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def download(
        self,
        uri: str,
        headers: dict[str, str],
        checksums: Sequence[Checksum],
        function: DigestFunction,
        timeout: float | None = None,
    ) -> Digest:
        """Fetch `uri` into the CAS and return its digest. Raises Refused, ChecksumMismatch,
        TooLarge, AttemptFailed, or TimeoutError past `timeout` (at most the server's)."""
        try:
            url = URL(uri)
        except (ValueError, TypeError):
            raise AttemptFailed("not a URL") from None
        self.rules.check(url)  # refused before waiting for a slot
        limit = self.total_timeout if timeout is None else min(timeout, self.total_timeout)
        session = self._open()
        async with self.slots, asyncio.timeout(limit):
            return await self._follow(session, url, headers, checksums, function)

    async def _follow(
        self,
        session: aiohttp.ClientSession,
        url: URL,
        headers: dict[str, str],
        checksums: Sequence[Checksum],
        function: DigestFunction,
    ) -> Digest:
        first = _origin(url)
        for _hop in range(MAX_REDIRECTS + 1):
            self.rules.check(url)
            sent = dict(headers) if _origin(url) == first else {}  # credentials stay with their origin
            sent["Accept-Encoding"] = "identity"
            try:
                async with session.get(url, headers=sent, allow_redirects=False) as response:
                    if response.status in _REDIRECTS:
                        location = response.headers.get("Location")
                        if not location:
                            raise AttemptFailed(f"HTTP {response.status} without a Location")
                        try:
                            url = url.join(URL(location))
                        except (ValueError, TypeError):
                            raise AttemptFailed("a redirect to a malformed Location") from None
                        continue
                    if response.status != 200:
                        raise AttemptFailed(f"HTTP {response.status} {response.reason or ''}".rstrip())
                    length = response.content_length
                    if length is not None and length > self.max_size:
                        raise TooLarge(f"{length} bytes is over --asset-max-size ({self.max_size})")
                    if length is None or length > READ_BUFFER:
                        _receive_in_large_pieces(response)
                    return await self._store(_pieces(response.content), length, checksums, function)
            except aiohttp.ClientConnectorError as e:
                refusal = e.os_error if isinstance(e.os_error, Refused) else e.__cause__
                if isinstance(refusal, Refused):
                    raise Refused(str(refusal)) from None
                raise AttemptFailed(f"cannot connect: {e.os_error.strerror or e.os_error}") from None
            except aiohttp.ClientError as e:
                raise AttemptFailed(f"{type(e).__name__}: {e}"[:300]) from None
        raise AttemptFailed(f"more than {MAX_REDIRECTS} redirects")

    async def _store(
        self,
        body: AsyncIterator[bytes],
        length: int | None,
        checksums: Sequence[Checksum],
        function: DigestFunction,
    ) -> Digest:
        sha256 = next((c for c in checksums if c.algorithm == "sha256"), None)
        if function is DigestFunction.SHA256 and sha256 is not None and length is not None:
            return await self._store_direct(body, length, sha256, checksums)
        return await self._store_spooled(body, checksums, function)

    def _counted(self, nbytes: int) -> None:
        if self.recorder is not None:
            self.recorder.asset_downloaded(nbytes)

    async def _store_direct(
        self, body: AsyncIterator[bytes], length: int, sha256: Checksum, checksums: Sequence[Checksum]
    ) -> Digest:
        """Straight into the store: it verifies the SHA-256 and size before the blob is visible;
        the other algorithms are checked here before the last chunk is handed over."""
        others = {c.algorithm: hashlib.new(c.algorithm) for c in checksums if c.algorithm != "sha256"}
        digest = Digest.parse(sha256.hex, length, DigestFunction.SHA256)
        received = 0

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal received
            async for chunk in body:
                received += len(chunk)
                if received > length:
                    raise AttemptFailed("the origin sent more than its Content-Length")
                for hasher in others.values():
                    hasher.update(chunk)
                if received == length and others:  # the last chunk: everything else must match first
                    _verify(checksums, {k: h.digest() for k, h in others.items()}, skip="sha256")
                yield chunk
            if received == 0 and others:
                _verify(checksums, {k: h.digest() for k, h in others.items()}, skip="sha256")
            if received != length:
                raise AttemptFailed(f"the body ended after {received} of {length} bytes")

        try:
            await self.blobs.write(digest, chunks())
        except DigestMismatch:
            raise ChecksumMismatch(f"the content does not match {sha256.sri}") from None
        finally:
            self._counted(received)
        return digest

    async def _store_spooled(
        self, body: AsyncIterator[bytes], checksums: Sequence[Checksum], function: DigestFunction
    ) -> Digest:
        """Through a spool file (size or hash not known up front), hashed in the writing thread:
        the body in batches of `SPOOL_BATCH`, each written and hashed by a worker thread while
        the next one is received (one batch in flight: memory stays about two batches)."""
        hashers: dict[str, Any] = {c.algorithm: hashlib.new(c.algorithm) for c in checksums}
        # The CAS digest, shared with a sha256 checksum when it is SHA-256 too (hashed once).
        own = hashers["sha256"] if function is DigestFunction.SHA256 and "sha256" in hashers else new_hasher(function)
        others = [hasher for hasher in hashers.values() if hasher is not own]
        fd, name = tempfile.mkstemp(prefix="download-", dir=self.spool_dir)
        path = Path(name)
        received = 0
        loop = asyncio.get_running_loop()
        writing: asyncio.Future[None] | None = None
        try:
            with os.fdopen(fd, "wb") as spool:

                def put(parts: list[bytes]) -> None:
                    for part in parts:
                        spool.write(part)
                        own.update(part)
                        for hasher in others:
                            hasher.update(part)

                async def flush(parts: list[bytes]) -> None:
                    nonlocal writing
                    if writing is not None:
                        await writing
                    writing = loop.run_in_executor(None, put, parts) if parts else None

                try:
                    batch: list[bytes] = []
                    batched = 0
                    async for chunk in body:
                        received += len(chunk)
                        if received > self.max_size:
                            raise TooLarge(f"more than --asset-max-size ({self.max_size}) bytes")
                        batch.append(chunk)
                        batched += len(chunk)
                        if batched >= SPOOL_BATCH:
                            await flush(batch)
                            batch, batched = [], 0
                    await flush(batch)
                    await flush([])
                finally:
                    self._counted(received)
                    if writing is not None and not writing.done():
                        # Failed or cancelled: let the thread finish before the file is closed
                        # (what it raises, if anything, is not this failure's cause).
                        with contextlib.suppress(Exception):
                            await asyncio.shield(writing)
            _verify(checksums, {k: h.digest() for k, h in hashers.items()})
            digest = Digest.parse(own.hexdigest(), received, function)
            await self.blobs.write(digest, _file_chunks(path))
            return digest
        finally:
            with contextlib.suppress(OSError):
                path.unlink()


def _verify(checksums: Sequence[Checksum], computed: dict[str, bytes], skip: str = "") -> None:
    """For every algorithm given, the content matches one of its values."""
    for algorithm, digest in computed.items():
        if algorithm == skip:
            continue
        wanted = [c for c in checksums if c.algorithm == algorithm]
        if wanted and all(c.digest != digest for c in wanted):
            got = Checksum(algorithm, digest)
            raise ChecksumMismatch(f"checksum mismatch: expected {' or '.join(c.sri for c in wanted)}, got {got.sri}")


def _receive_in_large_pieces(response: aiohttp.ClientResponse) -> None:
    """Receive a large body in reads of READ_BUFFER: asyncio's socket transport reads at most its
    `max_size` (256 KiB) per wakeup of the event loop, and a quarter of the wakeups took a quarter
    off the loop's CPU time per byte (bench/notes/2026-12-06-asset-download.md). Only where that
    attribute exists (a plain socket on asyncio's own loop); a TLS transport is left as it is."""
    connection = response.connection
    transport = connection.transport if connection is not None else None
    if transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = max(transport.max_size, READ_BUFFER)  # type: ignore[attr-defined]


async def _pieces(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body as received, piece by piece (no joining copies: `iter_chunked` joins its reads)."""
    async for piece, _end_of_http_chunk in content.iter_chunks():
        if piece:
            yield piece


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while True:
            chunk = await asyncio.to_thread(f.read, CHUNK)
            if not chunk:
                return
            yield chunk
