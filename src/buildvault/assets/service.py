"""Fetch and Push behaviour, knowing nothing of gRPC (server/grpc/fetch.py and push.py adapt it).

FetchBlob: an index entry for the request (by checksum, whatever the URL, when the request has
one; else by URI and naming qualifiers) that is not expired, not older than
`oldest_content_accepted`, and whose blob is in the CAS, is a hit. A sha256 checksum whose blob is
already in the CAS (pushed, or uploaded by a build) is a hit too. Otherwise the origin is tried,
URI after URI, under the rules of origin.py; identical fetches in flight share one download, in a
process (one task) and across the server's processes (locks.py: the lock's second holder finds
the first one's entry in the index).

Who may download (`--asset-reader-downloads`): a caller with write permission always may; a
reader only when the request carries a checksum (`checksum`, the default: the bytes stored are
those the reader's own workspace pins, so nobody plants content under a name another build
trusts), never (`never`), or always (`always`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import DecodeError

from buildvault.actions import MissingBlobs
from buildvault.assets.errors import AssetNotFound, AssetTimeout, InvalidAssetRequest
from buildvault.assets.index import AssetIndex, Entry, sri_key, uri_key
from buildvault.assets.locks import DownloadLocks
from buildvault.assets.origin import AttemptFailed, ChecksumMismatch, OriginFetcher, Refused, TooLarge
from buildvault.assets.request import AssetRequest, public_uri, uri_host
from buildvault.digest import Digest, DigestFunction
from buildvault.remote_apis import re_pb2
from buildvault.storage import NotFound, StorageError, single_chunk

__all__ = ["MAX_PUSHED_DIRECTORIES", "READER_DOWNLOADS", "Assets", "CountingRecorder", "FetchRecorder", "Found"]

log = logging.getLogger("buildvault.assets")

READER_DOWNLOADS = ("never", "checksum", "always")
MAX_PUSHED_DIRECTORIES = 10_000  # each is named in the entry (about 80 bytes)
_BATCH = 500


class FetchRecorder(Protocol):
    """Counts fetches by result (hit, downloaded, miss, refused, checksum_mismatch) and
    downloaded bytes; server/metrics.py's Metrics is one."""

    def asset_fetch(self, result: str) -> None: ...

    def asset_downloaded(self, nbytes: int) -> None: ...

    def asset_indexed(self) -> None: ...


class CountingRecorder:
    """A FetchRecorder that only counts in memory (tests, tools)."""

    def __init__(self) -> None:
        self.results: dict[str, int] = {}
        self.downloaded_bytes = 0
        self.indexed = 0

    def asset_fetch(self, result: str) -> None:
        self.results[result] = self.results.get(result, 0) + 1

    def asset_downloaded(self, nbytes: int) -> None:
        self.downloaded_bytes += nbytes

    def asset_indexed(self) -> None:
        self.indexed += 1


@dataclass(frozen=True)
class Found:
    """A Fetch's answer: the content, the URI it is known by, and when it stops being served."""

    entry: Entry
    uri: str


class Assets:
    def __init__(
        self,
        index: AssetIndex,
        fetcher: OriginFetcher | None,
        *,
        reader_downloads: str,  # --asset-reader-downloads (config.py holds the default)
        recorder: FetchRecorder | None = None,
        clock: Callable[[], float] = time.time,
        locks: DownloadLocks | None = None,  # one download across processes (locks.py)
    ) -> None:
        if reader_downloads not in READER_DOWNLOADS:
            raise ValueError(f"reader_downloads: {reader_downloads!r} is not never, checksum or always")
        self.index = index
        self.fetcher = fetcher
        self.reader_downloads = reader_downloads
        self.recorder: FetchRecorder = recorder or CountingRecorder()
        self.clock = clock
        self.locks = locks
        self._inflight: dict[tuple[object, ...], asyncio.Task[Found]] = {}

    async def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        if self.fetcher is not None:
            await self.fetcher.close()

    # -- Fetch ------------------------------------------------------------------------------

    def _answer(self, entry: Entry, request: AssetRequest) -> Found:
        return Found(entry, entry.uri if entry.uri in request.uris else request.uris[0])

    async def _lookup(self, request: AssetRequest, oldest: float | None) -> Entry | None:
        if request.checksums:
            entry = await self._by_checksums(request, oldest)
        else:
            keys = [uri_key(uri, request.named) for uri in request.uris]
            entry = await self.index.find(request.instance_name, request.digest_function, keys, oldest=oldest)
        if entry is None and oldest is None:
            entry = await self._in_cas(request)
        return entry

    async def fetch_blob(
        self, request: AssetRequest, *, may_write: bool, oldest: float | None = None, timeout: float | None = None
    ) -> Found:
        entry = await self._lookup(request, oldest)
        if entry is not None:
            self.recorder.asset_fetch("hit")
            return self._answer(entry, request)
        if self.fetcher is None:
            self.recorder.asset_fetch("miss")
            raise AssetNotFound(
                "not in the asset index, and this server downloads nothing (--asset-origins none)",
                [(public_uri(u), "not in the index") for u in request.uris],
            )
        if not may_write and not self._reader_may_download(request):
            self.recorder.asset_fetch("miss")
            need = "a checksum.sri qualifier or " if self.reader_downloads == "checksum" else ""
            raise AssetNotFound(
                f"not in the asset index; a download from the origin needs {need}write permission on the instance",
                [(public_uri(u), "not in the index") for u in request.uris],
            )
        key = request.dedup_key()
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._download_once(request, oldest, timeout))
            self._inflight[key] = task
            task.add_done_callback(lambda done: self._finished(key, done))
        # A caller that goes away does not cancel the download others (or a retry) wait for.
        return await asyncio.shield(task)

    async def _by_checksums(self, request: AssetRequest, oldest: float | None) -> Entry | None:
        """A hit needs, for every algorithm the request names, an entry under one of its values,
        all of them the same blob: content verified against sha384 alone does not answer a
        request that also pins a sha512."""
        found: Entry | None = None
        for algorithm in dict.fromkeys(c.algorithm for c in request.checksums):
            keys = [sri_key(c) for c in request.checksums if c.algorithm == algorithm]
            entry = await self.index.find(request.instance_name, request.digest_function, keys, oldest=oldest)
            if entry is None or (found is not None and entry.digest != found.digest):
                return None
            found = found or entry
        return found

    def _finished(self, key: tuple[object, ...], task: asyncio.Task[Found]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: a download whose callers all went away fails quietly

    def _reader_may_download(self, request: AssetRequest) -> bool:
        if self.reader_downloads == "always":
            return True
        return self.reader_downloads == "checksum" and bool(request.checksums)

    async def _in_cas(self, request: AssetRequest) -> Entry | None:
        """A sha256 checksum whose blob is already in the CAS (pushed, uploaded, or fetched by a
        server that shares the bucket but not this index entry)."""
        if request.digest_function is not DigestFunction.SHA256 or any(
            c.algorithm != "sha256" for c in request.checksums
        ):
            return None
        for checksum in request.checksums:
            if checksum.algorithm != "sha256":
                continue
            try:
                digest = await self.index.blobs.lookup(DigestFunction.SHA256, checksum.hex)
            except (NotFound, StorageError):
                continue
            return Entry(digest, self.clock(), request.uris[0], tuple(request.qualifiers()))
        return None

    async def _download_once(self, request: AssetRequest, oldest: float | None, timeout: float | None) -> Found:
        """`_download`, once across the server's processes: under the download's lock, and only
        if the index still has no answer once the lock is ours (another process may have just
        stored it)."""
        if self.locks is None:
            return await self._download(request, timeout)
        name = hashlib.sha256(repr(request.dedup_key()).encode()).hexdigest()
        async with contextlib.AsyncExitStack() as held:
            try:
                async with asyncio.timeout(timeout):
                    await held.enter_async_context(self.locks.hold(name))
            except TimeoutError:
                self.recorder.asset_fetch("miss")
                raise AssetTimeout(
                    "timed out waiting for the same download in another server process",
                    [(public_uri(u), "timed out") for u in request.uris],
                ) from None
            entry = await self._lookup(request, oldest)
            if entry is not None:
                self.recorder.asset_fetch("hit")
                return self._answer(entry, request)
            return await self._download(request, timeout)

    async def _download(self, request: AssetRequest, timeout: float | None) -> Found:
        assert self.fetcher is not None
        attempts: list[tuple[str, str]] = []
        kinds: list[str] = []
        for i, uri in enumerate(request.uris):
            shown = public_uri(uri)
            started = self.clock()
            try:
                digest = await self.fetcher.download(
                    uri, request.headers[i], request.checksums, request.digest_function, timeout
                )
            except (AttemptFailed, TimeoutError) as e:
                answer, kind = _failure(e)
                attempts.append((shown, answer))
                kinds.append(kind)
                continue
            entry = Entry(digest, started, uri, tuple(request.qualifiers()))
            keys = [sri_key(c) for c in request.checksums] + [uri_key(uri, request.named)]
            await self.index.record(request.instance_name, keys, entry)
            self.recorder.asset_indexed()
            self.recorder.asset_fetch("downloaded")
            log.info("asset downloaded from %s: %s", uri_host(uri), digest)
            return Found(entry, uri)
        result = (
            "checksum_mismatch"
            if "checksum_mismatch" in kinds
            else ("refused" if kinds and all(k == "refused" for k in kinds) else "miss")
        )
        self.recorder.asset_fetch(result)
        for (shown, _answer), kind in zip(attempts, kinds, strict=True):
            log.info("asset fetch from %s failed (%s)", uri_host(shown), kind)
        if kinds and all(k == "timeout" for k in kinds):
            raise AssetTimeout("every origin timed out", attempts)
        raise AssetNotFound("no origin could be fetched", attempts)

    async def fetch_directory(self, request: AssetRequest, *, oldest: float | None = None) -> Found:
        keys = [uri_key(uri, request.named) for uri in request.uris] + [sri_key(c) for c in request.checksums]
        entry = await self.index.find(
            request.instance_name, request.digest_function, keys, oldest=oldest, directory=True
        )
        if entry is None:
            self.recorder.asset_fetch("miss")
            raise AssetNotFound(
                "no directory was pushed for these URIs (directories are served from Push only)",
                [(public_uri(u), "not in the index") for u in request.uris],
            )
        self.recorder.asset_fetch("hit")
        return self._answer(entry, request)

    # -- Push -------------------------------------------------------------------------------

    async def push_blob(self, request: AssetRequest, digest: Digest, expire_at: float | None) -> None:
        """Associate the URIs (and any checksum given, trusted from a writer) with a blob already
        in the CAS; FAILED_PRECONDITION (MissingBlobs) names it if it is not."""
        missing = await self.index.blobs.find_missing([digest])
        if missing:
            raise MissingBlobs(missing)
        await self._record(
            request, Entry(digest, self.clock(), request.uris[0], tuple(request.qualifiers()), expire_at)
        )

    async def push_directory(self, request: AssetRequest, root: Digest, expire_at: float | None) -> None:
        """Associate the URIs with a Directory tree whose every Directory and file is in the CAS;
        a Tree blob of it is stored so gc keeps the whole tree for the entry."""
        directories, missing = await self._walk(root)
        if missing:
            raise MissingBlobs(missing)
        tree = re_pb2.Tree(root=directories[0][1], children=[d for _, d in directories[1:]])
        data = tree.SerializeToString()
        tree_digest = Digest.of(data, root.function)
        await self.index.blobs.write(tree_digest, single_chunk(data))
        await self._record(
            request,
            Entry(
                root,
                self.clock(),
                request.uris[0],
                tuple(request.qualifiers()),
                expire_at,
                tree_digest,
                tuple(d for d, _ in directories[1:]),
            ),
        )

    async def _record(self, request: AssetRequest, entry: Entry) -> None:
        keys = [uri_key(uri, request.named) for uri in request.uris] + [sri_key(c) for c in request.checksums]
        await self.index.record(request.instance_name, keys, entry)
        self.recorder.asset_indexed()
        log.info("asset pushed for %s: %s", ", ".join(sorted({uri_host(u) for u in request.uris})), entry.digest)

    async def _walk(self, root: Digest) -> tuple[list[tuple[Digest, re_pb2.Directory]], list[Digest]]:
        blobs = self.index.blobs
        directories: list[tuple[Digest, re_pb2.Directory]] = []  # the root first
        missing: list[Digest] = []
        files: set[Digest] = set()
        seen: set[Digest] = {root}
        frontier = [root]
        while frontier:
            batch, frontier = frontier[:_BATCH], frontier[_BATCH:]
            for digest, data in zip(batch, await blobs.read_blobs(batch), strict=True):
                if isinstance(data, NotFound):
                    missing.append(digest)
                    continue
                if isinstance(data, Exception):
                    raise data
                try:
                    directory = re_pb2.Directory.FromString(data)
                except DecodeError:
                    raise InvalidAssetRequest([("root_directory_digest", f"{digest} is not a Directory")]) from None
                directories.append((digest, directory))
                if len(directories) > MAX_PUSHED_DIRECTORIES:
                    raise InvalidAssetRequest(
                        [("root_directory_digest", f"more than {MAX_PUSHED_DIRECTORIES} directories")]
                    )
                try:
                    for node in directory.files:
                        files.add(Digest.from_proto(node.digest, root.function))
                    for sub in directory.directories:
                        child = Digest.from_proto(sub.digest, root.function)
                        if child not in seen:
                            seen.add(child)
                            frontier.append(child)
                except ValueError as e:
                    raise InvalidAssetRequest([("root_directory_digest", f"{digest}: {e}")]) from None
        listed = sorted(files, key=lambda d: d.hash)
        for start in range(0, len(listed), _BATCH):
            missing.extend(await blobs.find_missing(listed[start : start + _BATCH]))
        return directories, missing


def _failure(e: AttemptFailed | TimeoutError) -> tuple[str, str]:
    """What a failed attempt tells the client, and its kind (the fetch metric's result)."""
    if isinstance(e, Refused):
        return f"refused: {e}", "refused"
    if isinstance(e, ChecksumMismatch):
        return str(e), "checksum_mismatch"
    if isinstance(e, TooLarge):
        return f"too large: {e}", "miss"
    if isinstance(e, AttemptFailed):
        return str(e), "miss"
    return "timed out", "timeout"
