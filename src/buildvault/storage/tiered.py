"""A fast local tier in front of the shared object-store tier (S3/OBS), kept consistent.

    TieredBlobStore(fast, slow, journal, health=..., presence=...)
    TieredActionStore(fast, slow, journal, health=...)
    ObjectTier: both, plus the journal's uploader and the bucket's health, from Settings via
    `build_object_tier(settings, fast_cas, fast_ac, data_dir)`; `await tier.start()` once the
    event loop runs, `await tier.aclose()` on shutdown.

Reads: fast first. On a miss, a whole-blob read streams from the bucket to the client and,
through a tee, into `fast.write` (which verifies before publishing). The object store itself
verifies the hash and fails before the last chunk if the object is corrupt, so the backfill
is aborted too; a client that stops reading cancels the backfill, and a cancelled write leaves
nothing visible. Ranged reads of bucket-only blobs are served from the bucket, not backfilled.

Writes: the fast write completes the request, together with a durable journal entry (added
concurrently, *held* until the fast write succeeds, discarded if it fails); the journal's
uploader then copies fast -> bucket in the background. Nothing is journaled when the bucket
is known to hold the blob already, in read-only mode, or with uploads disabled.

Fast copy evicted before its upload: we do not pin journal blobs (the fast tier evicts
least-recently-used first, so this needs a backlog larger than the whole fast tier). The
uploader HEADs the bucket: if the blob is there (another server uploaded it) the entry is done;
otherwise it is logged and counted in `lost_uploads` and the entry is removed (there is
nothing left to upload; a client that needs the blob gets NotFound and rebuilds it).

Existence: `find_missing` = fast's answer, then a bounded local presence index of what the
bucket holds (learned from uploads, reads and HEADs; positive TTL, short negative TTL, LRU
bounded). Only unknown digests are HEADed, concurrently and bounded, each once (concurrent
callers share the answer). A warm cache makes no per-digest requests.

Fail-open: every bucket call has a bounded timeout. A failure marks the bucket down (logged
once per state change) and a background probe (HEAD bucket, exponential backoff) marks it up
again. While down: find_missing answers from fast alone (we never promise a blob we cannot
serve), reads of bucket-only blobs raise Unavailable, action-cache lookups miss (NotFound),
writes succeed locally and wait in the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import find_missing_indices_by_digests, read_blobs_one_by_one, write_blobs_one_by_one
from buildvault.storage import (
    ActionStore,
    BlobStore,
    DigestMismatch,
    NotFound,
    StorageError,
    Unavailable,
)
from buildvault.storage.journal import AC, CAS, JournalEntry, Ticket, UploadJournal

if TYPE_CHECKING:
    from buildvault.config import Settings
    from buildvault.storage.objectstore import ObjectStore

logger = logging.getLogger(__name__)

_BACKFILL_QUEUE_CHUNKS = 4


class PresenceIndex:
    """What the bucket is known to hold (or lack): an LRU of digest -> expiry, bounded.

    Roughly 200 bytes per entry (the default 262,144 entries: ~50 MB)."""

    def __init__(self, max_entries: int = 1 << 18, positive_ttl: float = 3600.0, negative_ttl: float = 30.0) -> None:
        self._entries: OrderedDict[bytes, float] = OrderedDict()  # expiry; negative value: known missing
        self._max_entries = max(1, max_entries)
        self.positive_ttl = positive_ttl
        self.negative_ttl = negative_ttl

    @staticmethod
    def _key(digest: Digest) -> bytes:
        return bytes.fromhex(digest.hash) + bytes((digest.function.wire,)) + digest.size_bytes.to_bytes(8, "big")

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: Digest) -> bool | None:
        """True: in the bucket; False: recently found missing; None: unknown or expired."""
        key = self._key(digest)
        value = self._entries.get(key)
        if value is None:
            return None
        now = time.monotonic()
        if abs(value) <= now:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value > 0

    def set(self, digest: Digest, present: bool) -> None:
        key = self._key(digest)
        if present:
            value = time.monotonic() + self.positive_ttl
        else:
            value = -(time.monotonic() + self.negative_ttl)
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def forget(self, digest: Digest) -> None:
        self._entries.pop(self._key(digest), None)

    def clear(self) -> None:
        self._entries.clear()


class SlowTierHealth:
    """Up/down state of the bucket. Logs once per change; probes with capped backoff while down."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[Any]] | None,
        *,
        name: str = "object store",
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
        probe_timeout: float = 10.0,
    ) -> None:
        self._probe = probe
        self.name = name
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._probe_timeout = probe_timeout
        self._healthy = True
        self._up = asyncio.Event()
        self._up.set()
        self._down_since = 0.0
        self._prober: asyncio.Task[None] | None = None
        self.transitions = 0
        self._closed = False

    @property
    def healthy(self) -> bool:
        return self._healthy

    def ok(self) -> None:
        if self._healthy:
            return
        self._healthy = True
        self.transitions += 1
        self._up.set()
        logger.warning("%s is reachable again after %.1fs", self.name, time.monotonic() - self._down_since)

    def failure(self, exc: BaseException) -> None:
        if not self._healthy or self._closed:
            return
        self._healthy = False
        self.transitions += 1
        self._down_since = time.monotonic()
        self._up.clear()
        reason = str(exc) or type(exc).__name__  # a timeout's str() is empty
        logger.error("%s is unavailable, serving from the local tier only: %s", self.name, reason)
        if self._probe is not None and (self._prober is None or self._prober.done()):
            try:
                self._prober = asyncio.get_running_loop().create_task(self._probe_loop())
            except RuntimeError:  # no running loop: the next caller will notice
                pass

    async def wait_healthy(self) -> None:
        await self._up.wait()

    async def _probe_loop(self) -> None:
        assert self._probe is not None
        delay = self._initial_backoff
        while not self._healthy and not self._closed:
            await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(self._probe(), self._probe_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # still down
                logger.debug("%s probe failed: %s", self.name, exc)
                delay = min(delay * 2, self._max_backoff)
            else:
                self.ok()

    async def close(self) -> None:
        self._closed = True
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)


def _is_slow_failure(exc: BaseException) -> bool:
    """An error that says "the bucket is down or too slow" (not "no such blob" or "refused")."""
    return isinstance(exc, (Unavailable, TimeoutError))


class TieredBlobStore:
    """BlobStore: `fast` (disk/memory) in front of `slow` (an ObjectStore or any BlobStore)."""

    def __init__(
        self,
        fast: BlobStore,
        slow: BlobStore,
        journal: UploadJournal | None,
        *,
        health: SlowTierHealth | None = None,
        presence: PresenceIndex | None = None,
        read_only: bool = False,
        uploads: bool = True,
        timeout: float = 10.0,
        head_concurrency: int = 32,
        head_before_upload: int = 1 << 20,
    ) -> None:
        self.fast = fast
        self.slow = slow
        self.journal = journal
        self.health = health or SlowTierHealth(getattr(slow, "probe", None) or (lambda: slow.find_missing([])))
        self.presence = presence or PresenceIndex()
        self.read_only = read_only
        # False: never journal (this server does not upload at all). See ObjectTier.pause_uploads
        # for stopping the uploader while still journaling.
        self.uploads = uploads
        self.timeout = timeout
        self._head_semaphore = asyncio.Semaphore(max(1, head_concurrency))
        self._heads_in_flight: dict[Digest, asyncio.Future[bool | None]] = {}
        self._head_before_upload = head_before_upload
        self.counters: dict[str, int] = {
            "fast_hits": 0,
            "slow_hits": 0,
            "misses": 0,
            "backfills": 0,
            "backfill_failures": 0,
            "uploads_skipped": 0,
            "lost_uploads": 0,
            "unavailable_reads": 0,
            "journal_skipped": 0,
        }

    @property
    def _journaling(self) -> bool:
        return self.journal is not None and self.uploads and not self.read_only

    # -- existence --------------------------------------------------------------------------

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        missing_fast = await self.fast.find_missing(digests)
        if not missing_fast or not self.health.healthy:
            return missing_fast
        unknown = [d for d in missing_fast if self.presence.get(d) is None]
        if unknown:
            await self._head_all(unknown)
        return [d for d in missing_fast if self.presence.get(d) is not True]

    async def _head_all(self, digests: list[Digest]) -> None:
        """HEAD each digest once (sharing in-flight HEADs with concurrent callers)."""
        loop = asyncio.get_running_loop()
        mine: list[Digest] = []
        waits: list[asyncio.Future[bool | None]] = []
        for digest in digests:
            future = self._heads_in_flight.get(digest)
            if future is None:
                future = self._heads_in_flight[digest] = loop.create_future()
                mine.append(digest)
            waits.append(future)
        deadline = time.monotonic() + self.timeout + len(mine) / 50.0

        async def head(digest: Digest) -> None:
            future = self._heads_in_flight[digest]
            result: bool | None = None
            try:
                if self.health.healthy:
                    async with self._head_semaphore:
                        remaining = deadline - time.monotonic()
                        if remaining > 0 and self.health.healthy:
                            result = await asyncio.wait_for(self._slow_exists(digest), remaining)
                            self.presence.set(digest, result)
                            self.health.ok()
            except Exception as exc:
                if _is_slow_failure(exc):
                    self.health.failure(exc)
                else:
                    logger.warning("HEAD %s: %s", digest, exc)
            finally:
                self._heads_in_flight.pop(digest, None)
                if not future.done():
                    future.set_result(result)

        try:
            if mine:
                await asyncio.gather(*(head(d) for d in mine))
            await asyncio.gather(*waits)
        finally:
            for digest in mine:  # cancelled: never leave concurrent callers waiting
                future = self._heads_in_flight.pop(digest, None)
                if future is not None and not future.done():
                    future.set_result(None)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        return await find_missing_indices_by_digests(self, function, hashes, sizes)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        return await read_blobs_one_by_one(self, digests)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        return await write_blobs_one_by_one(self, items)

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        """By hash alone: the fast tier's index, then the bucket (a HEAD gives the size).
        The bucket down or slow is a miss (fail open), like find_missing."""
        try:
            return await self.fast.lookup(function, hash)
        except NotFound:
            pass
        slow_lookup = getattr(self.slow, "lookup", None)
        if slow_lookup is None or not self.health.healthy:
            raise NotFound(f"blob {function.label}:{hash} not found")
        try:
            digest = await self._slow_call(slow_lookup(function, hash))
        except NotFound:
            raise
        except Exception as exc:
            if _is_slow_failure(exc):
                self.health.failure(exc)
                raise NotFound(f"blob {function.label}:{hash}: not in the local tier, object store unavailable") from exc
            raise
        self.health.ok()
        self.presence.set(digest, True)
        return digest

    async def _slow_exists(self, digest: Digest) -> bool:
        exists = getattr(self.slow, "exists", None)
        if exists is not None:
            return bool(await exists(digest))
        return not await self.slow.find_missing([digest])

    # -- reads ------------------------------------------------------------------------------

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        try:
            chunks = await self.fast.read(digest, offset, limit)
            self.counters["fast_hits"] += 1
            return chunks
        except NotFound:
            pass
        if not self.health.healthy:
            self.counters["unavailable_reads"] += 1
            raise Unavailable(f"blob {digest}: not in the local tier and the object store is unavailable")
        try:
            slow_chunks = await asyncio.wait_for(self.slow.read(digest, offset, limit), self.timeout)
        except NotFound:
            self.presence.set(digest, False)
            self.counters["misses"] += 1
            raise
        except Exception as exc:
            if _is_slow_failure(exc):
                self.health.failure(exc)
                self.counters["unavailable_reads"] += 1
                raise Unavailable(f"blob {digest}: object store unavailable: {exc}") from exc
            raise
        self.health.ok()
        self.presence.set(digest, True)
        self.counters["slow_hits"] += 1
        whole = offset == 0 and (limit == 0 or limit >= digest.size_bytes)
        if not whole:
            return self._guard(digest, slow_chunks)
        return self._read_through(digest, slow_chunks)

    async def _next_chunk(self, digest: Digest, iterator: AsyncIterator[bytes]) -> bytes | None:
        try:
            return await asyncio.wait_for(iterator.__anext__(), self.timeout)
        except StopAsyncIteration:
            return None
        except NotFound:
            self.presence.set(digest, False)  # corrupt in the bucket: let clients upload it again
            raise
        except Exception as exc:
            if _is_slow_failure(exc):
                self.health.failure(exc)
                raise Unavailable(f"blob {digest}: object store failed mid-stream: {exc}") from exc
            raise

    async def _guard(self, digest: Digest, slow_chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            while (chunk := await self._next_chunk(digest, slow_chunks)) is not None:
                yield chunk
        finally:
            await _aclose(slow_chunks)

    async def _read_through(self, digest: Digest, slow_chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Stream from the bucket to the client, teeing into fast.write (the backfill)."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_BACKFILL_QUEUE_CHUNKS)

        async def source() -> AsyncIterator[bytes]:
            while (item := await queue.get()) is not None:
                yield item

        def drain(_: asyncio.Task[None]) -> None:  # the write ended: never block the client on it
            while not queue.empty():
                queue.get_nowait()

        backfill = asyncio.ensure_future(self.fast.write(digest, source()))
        backfill.add_done_callback(drain)
        complete = False
        try:
            while (chunk := await self._next_chunk(digest, slow_chunks)) is not None:
                if not backfill.done():
                    await queue.put(chunk)
                yield chunk
            complete = True
        finally:
            await _aclose(slow_chunks)
            if complete and not backfill.done():
                await queue.put(None)
            else:
                backfill.cancel()  # client gone or stream failed: nothing becomes visible
            try:
                await asyncio.shield(backfill)
                self.counters["backfills"] += 1
            except asyncio.CancelledError:
                if not backfill.cancelled():
                    raise
                if complete:
                    self.counters["backfill_failures"] += 1
            except Exception as exc:
                self.counters["backfill_failures"] += 1
                logger.warning("backfill of blob %s into the local tier failed: %s", digest, exc)

    # -- writes -----------------------------------------------------------------------------

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        if not self._journaling or self.presence.get(digest) is True:
            if self._journaling:
                self.counters["journal_skipped"] += 1
            await self.fast.write(digest, chunks)
            return
        assert self.journal is not None
        await _journaled(self.journal.add_blob(digest, hold=True), self.journal, self.fast.write(digest, chunks))

    # -- upload (called by the journal's uploader) ------------------------------------------

    async def upload(self, entry: JournalEntry) -> int:
        digest = entry.digest
        if self.presence.get(digest) is True:
            self.counters["uploads_skipped"] += 1
            return 0
        try:
            if digest.size_bytes >= self._head_before_upload and self.presence.get(digest) is None:
                if await self._slow_call(self._slow_exists(digest)):
                    self.presence.set(digest, True)
                    self.counters["uploads_skipped"] += 1
                    return 0
            try:
                chunks = await self.fast.read(digest)
            except NotFound:
                if await self._slow_call(self._slow_exists(digest)):
                    self.presence.set(digest, True)
                    self.counters["uploads_skipped"] += 1
                    return 0
                self.counters["lost_uploads"] += 1
                logger.error("blob %s was evicted from the local tier before its upload: not in the bucket", digest)
                return 0
            try:
                await self._slow_call(self.slow.write(digest, chunks), digest.size_bytes)
            except DigestMismatch as exc:  # the local copy is bad: nothing sound to upload
                self.counters["lost_uploads"] += 1
                logger.error("blob %s: local copy does not match its digest, not uploaded: %s", digest, exc)
                return 0
            finally:
                await _aclose(chunks)
        except Exception as exc:
            if _is_slow_failure(exc):
                self.health.failure(exc)
                raise Unavailable(str(exc)) from exc
            raise
        self.health.ok()
        self.presence.set(digest, True)
        return digest.size_bytes

    async def _slow_call(self, awaitable: Awaitable[Any], size: int = 0) -> Any:
        # Bounded, but a big upload may take a while: allow at least 1 MiB/s on top.
        return await asyncio.wait_for(awaitable, self.timeout * 3 + size / (1 << 20))


class TieredActionStore:
    """ActionStore: `fast` in front of the bucket; entries reach the bucket via the journal."""

    def __init__(
        self,
        fast: ActionStore,
        slow: ActionStore,
        journal: UploadJournal | None,
        *,
        health: SlowTierHealth | None = None,
        read_only: bool = False,
        uploads: bool = True,
        timeout: float = 10.0,
    ) -> None:
        self.fast = fast
        self.slow = slow
        self.journal = journal
        self.health = health or SlowTierHealth(getattr(slow, "probe", None) or _no_probe)
        self.read_only = read_only
        self.uploads = uploads
        self.timeout = timeout
        self.counters: dict[str, int] = {"fast_hits": 0, "slow_hits": 0, "misses": 0, "lost_uploads": 0, "unavailable": 0}

    async def get(self, namespace: str, digest: Digest) -> bytes:
        try:
            data = await self.fast.get(namespace, digest)
            self.counters["fast_hits"] += 1
            return data
        except NotFound:
            pass
        if not self.health.healthy:
            self.counters["unavailable"] += 1
            raise NotFound(f"no entry for {digest} in {namespace!r} locally (object store unavailable)")
        try:
            data = await asyncio.wait_for(self.slow.get(namespace, digest), self.timeout)
        except NotFound:
            self.counters["misses"] += 1
            raise
        except Exception as exc:
            if not _is_slow_failure(exc):
                raise
            self.health.failure(exc)
            self.counters["unavailable"] += 1
            raise NotFound(f"no entry for {digest} in {namespace!r} locally (object store unavailable)") from exc
        self.health.ok()
        self.counters["slow_hits"] += 1
        try:
            await self.fast.put(namespace, digest, data)
        except Exception as exc:  # serving the entry matters more than caching it
            logger.warning("caching action entry %s locally failed: %s", digest, exc)
        return data

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        if self.journal is None or not self.uploads or self.read_only:
            await self.fast.put(namespace, digest, data)
            return
        await _journaled(
            self.journal.add_action(namespace, digest, hold=True), self.journal, self.fast.put(namespace, digest, data)
        )

    async def upload(self, entry: JournalEntry) -> int:
        assert entry.namespace is not None
        try:
            data = await self.fast.get(entry.namespace, entry.digest)
        except NotFound:
            self.counters["lost_uploads"] += 1
            logger.error("action entry %s in %r left the local tier before its upload", entry.digest, entry.namespace)
            return 0
        try:
            await asyncio.wait_for(self.slow.put(entry.namespace, entry.digest, data), self.timeout * 6)
        except Exception as exc:
            if _is_slow_failure(exc):
                self.health.failure(exc)
                raise Unavailable(str(exc)) from exc
            raise
        self.health.ok()
        return len(data)


async def _journaled(add: Awaitable[Ticket], journal: UploadJournal, local: Awaitable[None]) -> None:
    """Run the durable journal add (held) and the local write concurrently; acknowledge only
    when both are done. A failed local write discards the entry; a failed add fails the request."""
    add_task = asyncio.ensure_future(add)
    try:
        await local
    except BaseException:
        await asyncio.shield(_settle_later(add_task, journal, ok=False))
        raise
    try:
        ticket = await asyncio.shield(add_task)
    except asyncio.CancelledError:
        _settle_later(add_task, journal, ok=True)  # the local write succeeded: upload it anyway
        raise
    journal.release(ticket)


_background: set[asyncio.Future[Any]] = set()


def _settle_later(add_task: asyncio.Future[Ticket], journal: UploadJournal, ok: bool) -> asyncio.Future[None]:
    """Settle the held entry once its add finishes, whatever happens to the caller."""

    async def settle() -> None:
        try:
            ticket = await add_task
        except BaseException:
            return  # the add failed and cleaned up after itself
        if ok:
            journal.release(ticket)
        else:
            await journal.discard(ticket)

    task = asyncio.ensure_future(settle())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def _no_probe() -> None:
    return None


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


class ObjectTier:
    """The object-store tier as the server assembles it: tiered CAS + AC, journal, uploader."""

    def __init__(
        self,
        object_store: ObjectStore,
        cas: TieredBlobStore,
        ac: TieredActionStore,
        journal: UploadJournal | None,
        health: SlowTierHealth,
    ) -> None:
        self.object_store = object_store
        self.cas = cas
        self.ac = ac
        self.journal = journal
        self.health = health
        self._uploads_on = asyncio.Event()
        self._uploads_on.set()
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        if self.journal is not None:
            await self.journal.open()
            self.journal.start(self._upload, gate=self._gate)
        self._started = True

    async def _gate(self) -> None:
        await self._uploads_on.wait()
        await self.health.wait_healthy()

    async def _upload(self, entry: JournalEntry) -> int:
        if entry.kind == CAS:
            return await self.cas.upload(entry)
        if entry.kind == AC:
            return await self.ac.upload(entry)
        raise StorageError(f"unknown journal entry kind {entry.kind!r}")

    def pause_uploads(self) -> None:
        """Keep journaling writes but stop uploading them (until resume_uploads)."""
        self._uploads_on.clear()

    def resume_uploads(self) -> None:
        self._uploads_on.set()
        if self.journal is not None:
            self.journal.wake()

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "healthy": self.health.healthy,
            "requests": dict(self.object_store.request_counts),
            "corrupt_objects": self.object_store.corrupt_objects,
            "presence_entries": len(self.cas.presence),
            "cas": dict(self.cas.counters),
            "ac": dict(self.ac.counters),
        }
        if self.journal is not None:
            stats["journal"] = self.journal.stats()
        return stats

    async def aclose(self) -> None:
        if self.journal is not None and self._started:
            await self.journal.close()
        await self.health.close()
        self.object_store.close()


def build_object_tier(
    settings: Settings,
    fast_cas: BlobStore,
    fast_ac: ActionStore,
    data_dir: str | Path | None = None,
    *,
    object_store: ObjectStore | None = None,
    timeout: float = 10.0,
    journal_options: dict[str, Any] | None = None,
    health_options: dict[str, Any] | None = None,
    presence: PresenceIndex | None = None,
    uploads: bool = True,
    **store_options: Any,
) -> ObjectTier | None:
    """The tiered stack for Settings, or None when no bucket is configured (disk only).

    The journal lives in `{data_dir or settings.dir}/upload-journal`. Read-only
    (settings.s3_read_only) consumes the bucket and never writes it (no journal at all);
    `uploads=False` likewise keeps this server from uploading. Call `await tier.start()`."""
    if not settings.s3_bucket:
        return None
    from buildvault.storage.objectstore import ObjectStore

    store = object_store or ObjectStore.from_settings(settings, **store_options)
    read_only = settings.s3_read_only or store.read_only
    health = SlowTierHealth(store.probe, name=f"object store bucket {store.bucket}", **(health_options or {}))
    journal = None
    if not read_only and uploads:
        directory = Path(data_dir if data_dir is not None else settings.dir) / "upload-journal"
        journal = UploadJournal(directory, **(journal_options or {}))
    cas = TieredBlobStore(
        fast_cas, store, journal, health=health, presence=presence, read_only=read_only, uploads=uploads, timeout=timeout
    )
    ac = TieredActionStore(fast_ac, store, journal, health=health, read_only=read_only, uploads=uploads, timeout=timeout)
    return ObjectTier(store, cas, ac, journal, health)
