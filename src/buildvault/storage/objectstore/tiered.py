"""A fast local tier in front of a slow shared tier (the object store): read-through with a
verified backfill, and journaled write-back. Nothing else: the slow tier given here is already
wrapped by the builder (storage/objectstore/tier.py) in its presence cache (presence.py) and
its fail-open rule (storage/fail_open.py), so every failure of it arrives as `Unavailable`, promptly.

    TieredBlobStore(fast, slow, journal, known_in_slow=cache.known_present)
    TieredActionStore(fast, slow, journal)

Reads: fast first. On a miss, a whole-blob read streams from the slow tier to the client and,
through a tee, into `fast.write` (which verifies before publishing). The object store verifies
the hash and fails before the last chunk if the object is corrupt, so the backfill is aborted
too; a client that stops reading cancels the backfill, and a cancelled write leaves nothing
visible. Ranged reads of slow-only blobs are served from the slow tier, not backfilled.
Batches make one call per tier: the slow tier is asked only about what the fast one lacks.

Writes: the fast write completes the request, together with a durable journal entry (added
concurrently, *held* until the fast write succeeds, discarded if it fails); the journal's
uploader then copies fast -> slow in the background (`upload`). Nothing is journaled when the
slow tier is known to hold the blob already, in read-only mode, or with uploads disabled.

Fast copy evicted before its upload: we do not pin journal blobs (the fast tier evicts least
recently used first, so this needs a backlog larger than the whole fast tier). The uploader
asks the slow tier: if the blob is there (another server uploaded it) the entry is done;
otherwise it is logged and counted in `lost_uploads` (a client that needs it rebuilds it).

The slow tier unavailable: existence answers come from the fast tier alone (we never promise a
blob we cannot serve), lookups and action-cache gets miss, reads of slow-only blobs raise
Unavailable, writes succeed locally and wait in the journal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import ActionStore, BlobStore, DigestMismatch, NotFound, Unavailable, Verified, close_chunks
from buildvault.storage.objectstore.journal import JournalEntry, Ticket, UploadJournal

logger = logging.getLogger(__name__)

_BACKFILL_QUEUE_CHUNKS = 4
_HEAD_BEFORE_UPLOAD = 1 << 20  # a blob this large is worth one existence check before its upload


def _never(_: Digest) -> bool:
    return False


class TieredBlobStore:
    """BlobStore: `fast` (disk/memory) in front of `slow` (the wrapped object store, or any BlobStore)."""

    def __init__(
        self,
        fast: BlobStore,
        slow: BlobStore,
        journal: UploadJournal | None,
        *,
        known_in_slow: Callable[[Digest], bool] = _never,
        read_only: bool = False,
        uploads: bool = True,
        head_before_upload: int = _HEAD_BEFORE_UPLOAD,
    ) -> None:
        self.fast = fast
        self.slow = slow
        self.journal = journal
        self.known_in_slow = known_in_slow
        self.read_only = read_only
        self.uploads = uploads  # False: never journal (this server does not upload at all)
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
        missing = await self.fast.find_missing(digests)
        if not missing:
            return missing
        try:
            return await self.slow.find_missing(missing)
        except Unavailable:
            return missing

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        missing = await self.fast.find_missing_indices(function, hashes, sizes)
        if not missing:
            return missing
        try:
            absent = await self.slow.find_missing_indices(
                function, [hashes[i] for i in missing], [sizes[i] for i in missing]
            )
        except Unavailable:
            return missing
        return [missing[j] for j in absent]

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        """By hash alone: the fast tier's index, then the slow tier's (unavailable: a miss)."""
        try:
            return await self.fast.lookup(function, hash)
        except NotFound:
            pass
        try:
            return await self.slow.lookup(function, hash)
        except Unavailable as exc:
            raise NotFound(f"blob {function.label}:{hash[:64]}: not in the local tier ({exc})") from exc

    # -- reads ------------------------------------------------------------------------------

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        try:
            chunks = await self.fast.read(digest, offset, limit)
            self.counters["fast_hits"] += 1
            return chunks
        except NotFound:
            pass
        try:
            slow_chunks = await self.slow.read(digest, offset, limit)
        except NotFound:
            self.counters["misses"] += 1
            raise
        except Unavailable:
            self.counters["unavailable_reads"] += 1
            raise
        self.counters["slow_hits"] += 1
        if offset == 0 and (limit == 0 or limit >= digest.size_bytes):
            return self._read_through(digest, slow_chunks)
        return slow_chunks

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        results = await self.fast.read_blobs(digests)
        wanted = [i for i, r in enumerate(results) if isinstance(r, NotFound)]
        if not wanted:
            self.counters["fast_hits"] += len(results)
            return results
        self.counters["fast_hits"] += len(results) - len(wanted)
        try:
            found = await self.slow.read_blobs([digests[i] for i in wanted])
        except Unavailable as exc:
            self.counters["unavailable_reads"] += len(wanted)
            found = [exc] * len(wanted)
        backfill: list[tuple[Digest, bytes]] = []
        for i, result in zip(wanted, found, strict=True):
            results[i] = result
            if isinstance(result, bytes):
                self.counters["slow_hits"] += 1
                backfill.append((digests[i], result))
            elif isinstance(result, NotFound):
                self.counters["misses"] += 1
            elif isinstance(result, Unavailable):
                self.counters["unavailable_reads"] += 1
        if backfill:
            await self._backfill_batch(backfill)
        return results

    async def _backfill_batch(self, items: list[tuple[Digest, bytes]]) -> None:
        try:
            outcomes = await self.fast.write_blobs(items)
        except Exception as exc:  # serving the blobs matters more than caching them
            outcomes = [exc] * len(items)
        for (digest, _), outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                self.counters["backfills"] += 1
            else:
                self.counters["backfill_failures"] += 1
                logger.warning("backfill of blob %s into the local tier failed: %s", digest, outcome)

    async def _read_through(self, digest: Digest, slow_chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Stream from the slow tier to the client, teeing into fast.write (the backfill)."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_BACKFILL_QUEUE_CHUNKS)

        async def source() -> AsyncIterator[bytes]:
            while (item := await queue.get()) is not None:
                yield item

        def drain(_: asyncio.Future[None]) -> None:  # the write ended: never block the client on it
            while not queue.empty():
                queue.get_nowait()

        backfill = asyncio.ensure_future(self.fast.write(digest, source()))
        backfill.add_done_callback(drain)
        complete = False
        try:
            async for chunk in slow_chunks:
                if not backfill.done():
                    await queue.put(chunk)
                yield chunk
            complete = True
        finally:
            await close_chunks(slow_chunks)
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
            except Exception as exc:  # the client got its bytes; the local copy is optional
                self.counters["backfill_failures"] += 1
                logger.warning("backfill of blob %s into the local tier failed: %s", digest, exc)

    # -- writes -----------------------------------------------------------------------------

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        if self.journal is None or not self._journaling or self.known_in_slow(digest):
            if self._journaling:
                self.counters["journal_skipped"] += 1
            await self.fast.write(digest, chunks)
            return
        await _journaled(self.journal.add_blob(digest, hold=True), self.journal, self.fast.write(digest, chunks))

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        return await self._write_blobs([d for d, _ in items], lambda: self.fast.write_blobs(items))

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        """Bytes the caller hashed itself: the fast tier's own path for them, journaled the same way."""
        return await self._write_blobs([d for d, _, _ in items], lambda: self.fast.store_verified(items))

    async def _write_blobs(
        self, digests: Sequence[Digest], write_fast: Callable[[], Awaitable[list[Exception | None]]]
    ) -> list[Exception | None]:
        """Write the blobs of `digests` to the fast tier (`write_fast`), journaled for the bucket."""
        journal = self.journal
        if journal is None or not self._journaling:
            return await write_fast()
        journaled = [i for i, d in enumerate(digests) if not self.known_in_slow(d)]
        self.counters["journal_skipped"] += len(digests) - len(journaled)
        adds = [asyncio.ensure_future(journal.add_blob(digests[i], hold=True)) for i in journaled]
        try:
            outcomes = await write_fast()
        except BaseException:
            for add in adds:
                _settle_later(add, journal, ok=False)
            raise
        tickets = await asyncio.gather(*(asyncio.shield(a) for a in adds), return_exceptions=True)
        for i, add, ticket in zip(journaled, adds, tickets, strict=True):
            if isinstance(ticket, BaseException):  # the durable add failed: so does that write
                if outcomes[i] is None:
                    outcomes[i] = Unavailable(f"blob {digests[i]}: upload journal: {ticket}")
            elif outcomes[i] is None:
                journal.release(ticket)
            else:
                _settle_later(add, journal, ok=False)
        return outcomes

    # -- upload (called by the journal's uploader) ------------------------------------------

    async def _in_slow(self, digest: Digest) -> bool:
        return not await self.slow.find_missing([digest])

    async def upload(self, entry: JournalEntry) -> int:
        """Copy one journaled blob fast -> slow; the bytes uploaded. Unavailable: retry later."""
        digest = entry.digest
        if self.known_in_slow(digest):
            self.counters["uploads_skipped"] += 1
            return 0
        if digest.size_bytes >= self._head_before_upload:
            try:
                if await self._in_slow(digest):
                    self.counters["uploads_skipped"] += 1
                    return 0
            except Unavailable:
                pass  # no answer in time: the upload itself decides
        try:
            chunks = await self.fast.read(digest)
        except NotFound:
            if await self._in_slow(digest):
                self.counters["uploads_skipped"] += 1
                return 0
            self.counters["lost_uploads"] += 1
            logger.error("blob %s was evicted from the local tier before its upload: not in the bucket", digest)
            return 0
        try:
            await self.slow.write(digest, chunks)
        except DigestMismatch as exc:  # the local copy is bad: nothing sound to upload
            self.counters["lost_uploads"] += 1
            logger.error("blob %s: local copy does not match its digest, not uploaded: %s", digest, exc)
            return 0
        finally:
            await close_chunks(chunks)
        return digest.size_bytes


class TieredActionStore:
    """ActionStore: `fast` in front of the slow tier; entries reach it via the journal."""

    def __init__(
        self,
        fast: ActionStore,
        slow: ActionStore,
        journal: UploadJournal | None,
        *,
        read_only: bool = False,
        uploads: bool = True,
        served: Callable[[str, Digest], None] | None = None,
    ) -> None:
        self.fast = fast
        self.slow = slow
        self.journal = journal
        self.read_only = read_only
        self.uploads = uploads
        self.served = served  # told of every hit (storage/objectstore/last_use.py keeps the bucket's last use)
        events = ("fast_hits", "slow_hits", "misses", "lost_uploads", "unavailable")
        self.counters: dict[str, int] = dict.fromkeys(events, 0)

    async def get(self, namespace: str, digest: Digest) -> bytes:
        try:
            data = await self.fast.get(namespace, digest)
            self.counters["fast_hits"] += 1
            if self.served is not None:
                self.served(namespace, digest)
            return data
        except NotFound:
            pass
        try:
            data = await self.slow.get(namespace, digest)
        except NotFound:
            self.counters["misses"] += 1
            raise
        except Unavailable as exc:
            self.counters["unavailable"] += 1
            raise NotFound(f"no entry for {digest} in {namespace!r} locally ({exc})") from exc
        self.counters["slow_hits"] += 1
        if self.served is not None:
            self.served(namespace, digest)
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
        """Copy one journaled entry fast -> slow; the bytes uploaded. Unavailable: retry later."""
        assert entry.namespace is not None
        try:
            data = await self.fast.get(entry.namespace, entry.digest)
        except NotFound:
            self.counters["lost_uploads"] += 1
            logger.error("action entry %s in %r left the local tier before its upload", entry.digest, entry.namespace)
            return 0
        await self.slow.put(entry.namespace, entry.digest, data)
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
        except BaseException:  # the add failed and cleaned up after itself
            return
        if ok:
            journal.release(ticket)
        else:
            await journal.discard(ticket)

    task = asyncio.ensure_future(settle())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task
