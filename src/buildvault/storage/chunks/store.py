"""Dedup at rest: large blobs kept as content-defined chunks plus a chunk list.

A blob of at least `threshold` bytes, however it arrives (ByteStream, HTTP PUT, SpliceBlob), is
cut with FastCDC 2020 (the parameters the server advertises) and kept as its chunks, each an
ordinary blob of the inner store, plus a chunk list: an entry of the action store under the
namespace `chunks`, keyed by the blob's hash (a serialized SplitBlobResponse). Two blobs that
share content share chunks, stored once, and SplitBlob answers from the list.

Rules this decorator keeps:
- A chunk list is written only after every chunk it names is stored (and still is: a store
  smaller than the blob evicts its first chunks; StorageFull then) and the whole blob's size
  and hash were verified: a failed or mismatching write leaves no list (its chunks, each a valid
  blob of its own, are left to the LRU).
- A chunked blob is present only while its list and every chunk are: FindMissingBlobs and reads
  check the chunks, so a blob whose chunk was evicted is reported missing, never read torn.
- A chunk is stored through the inner store's `store_verified`: its name and its fast checksum
  were computed from the very bytes handed over, in `StreamCutter.cut`, so the inner store
  does not hash it again (and its reads check that checksum).
- Blobs stored whole before chunking was on (or below the threshold) are served as they are.

Chunking after the write: given `discard` (the local disk tier alone, where a whole copy can be
dropped; storage/build.py), a large blob is stored whole, verified as any blob is, and answered;
a background task then cuts the stored copy (read back under its fast checksum: no second
SHA-256 of the whole), stores its chunks, writes the list and only then discards the whole copy.
A crash leaves the whole copy, the list, or both (reads prefer the list; a whole copy no longer
read goes with the LRU). One conversion runs at a time, and only while the store is idle (no
large read or write in progress, none ended and no call begun for IDLE_AFTER): it pauses between
batches when a request comes, taking only the CPU the requests leave.
While the whole copies waiting exceed `backlog` bytes (0: always), blobs are cut as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from buildvault.config import Settings
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.storage import (
    CHUNK_SIZE,
    ActionStore,
    BlobStore,
    DigestMismatch,
    ForwardingBlobStore,
    InvalidRange,
    NotFound,
    StorageFull,
    ac_namespace,
    close_chunks,
    read_blobs_one_by_one,
    write_blobs_one_by_one,
)
from buildvault.storage.chunks.chunker import ChunkingParams, Piece, StreamCutter

log = logging.getLogger(__name__)

NAMESPACE = ac_namespace("", "chunks")
DEFAULT_THRESHOLD = Settings.chunking_threshold
DEFAULT_BACKLOG = Settings.chunking_backlog
# The background conversion waits until the store has had no call for this long (and no large
# request has ended for this long: a client reading blob after blob pauses between its reads).
IDLE_AFTER = 0.1
CONVERTER_TASK = "chunking after the write"  # the background task's name (bench/walks.py leaves it out)
# A SpliceBlob naming more chunks than this is refused (a blob of 100,000 tiny chunks would
# cost a store call per chunk for no dedup).
MAX_SPLICE_CHUNKS = 65_536
# The dedup figures remember this many chunk hashes (about 100 bytes each).
MAX_COUNTED_CHUNKS = 200_000
# A chunked write hands its bytes to the worker threads in batches of this size (one max-size
# chunk at the default parameters): per batch three thread hops (join; the blob's hash beside the
# cut and the chunks' hashes), whatever the message size (Bazel sends 16 KiB). 4 MiB batches ran
# no faster and held 12 MiB more at the peak (bench/notes/2026-12-06-chunk-writes.md).
CUT_BATCH = 2 << 20
MIN_CUT_BATCH = 1 << 20
# What the chunked writes in progress hold between them (about three batches each): under many
# concurrent uploads the batch shrinks (down to MIN_CUT_BATCH) instead of the memory growing.
CHUNK_BUFFER_BUDGET = 48 << 20
# A read of a chunked blob fetches whole chunks in batches of up to this many bytes (one store
# call instead of one per chunk: read on the event loop while the page cache holds the chunks,
# else one trip of the disk store's worker threads).
READ_BATCH = 2 << 20


class MissingChunks(NotFound):
    """SpliceBlob named chunks the CAS does not hold (NOT_FOUND naming them)."""

    def __init__(self, missing: Sequence[Digest]) -> None:
        self.missing = list(missing)
        names = ", ".join(f"{d.hash}/{d.size_bytes}" for d in self.missing[:10])
        more = f" and {len(self.missing) - 10} more" if len(self.missing) > 10 else ""
        super().__init__(f"{len(self.missing)} chunk(s) not in the CAS: {names}{more}")


class ChunkedBlobStore(ForwardingBlobStore):
    """Keeps blobs of at least `threshold` bytes as chunks in `inner` plus a list in `lists`."""

    def __init__(
        self,
        inner: BlobStore,
        lists: ActionStore,
        params: ChunkingParams | None = None,
        threshold: int = DEFAULT_THRESHOLD,
        chunk_writes: bool = True,
        discard: Callable[[Digest], Awaitable[None]] | None = None,
        backlog: int = DEFAULT_BACKLOG,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(inner)
        self.lists = lists
        self.params = params or ChunkingParams()
        self.threshold = threshold
        # False (`--chunking false`): new blobs go whole, blobs kept as chunks before are still served.
        self.chunk_writes = chunk_writes
        # What the status page shows, since this process started: the bytes of blobs kept as chunks,
        # and the bytes of the distinct chunks their lists name (a chunk counts once, however it
        # arrived: cut here, or uploaded by a client before its SpliceBlob).
        self.logical_bytes = 0
        self.stored_chunk_bytes = 0
        self._counted: set[str] = set()
        self._writing = 0  # chunked writes in progress
        # Chunking after the write (None: blobs are cut as they arrive).
        self._discard = discard
        self.backlog = backlog
        self._waiting: dict[Digest, None] = {}  # stored whole, to be converted (oldest first)
        self.backlog_bytes = 0  # their bytes, the one being converted included
        self._converting: dict[Digest, asyncio.Future[list[Digest] | None]] = {}
        self._converter: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()
        self._settled.set()
        # The conversion runs only while the store is idle: no large read or write in progress and
        # no call for IDLE_AFTER seconds (it takes the CPU requests leave; the backlog bound keeps
        # the whole copies from piling up under steady traffic).
        self._foreground = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._last_call = 0.0  # when the last call began, or the last large request ended
        self._clock = clock

    def stats(self) -> dict[str, float]:
        """Since this process started: bytes of blobs kept chunked, the chunk bytes they added."""
        stored = self.stored_chunk_bytes
        return {
            "logical_bytes": float(self.logical_bytes),
            "stored_bytes": float(stored),
            "dedup_ratio": self.logical_bytes / stored if stored else 1.0,
            "backlog_blobs": float(len(self._waiting)),
            "backlog_bytes": float(self.backlog_bytes),
        }

    def _enter(self) -> None:
        self._foreground += 1
        self._quiet.clear()

    def _leave(self) -> None:
        self._foreground -= 1
        self._last_call = self._clock()  # idle counts from the end: a client reading blob after blob leaves gaps
        if not self._foreground:
            self._quiet.set()

    async def _idle(self) -> None:
        """Return once the store is idle (see `_foreground`), for the background conversion."""
        while True:
            await self._quiet.wait()
            wait = self._last_call + IDLE_AFTER - self._clock()
            if wait <= 0 and not self._foreground:
                return
            await asyncio.sleep(max(wait, 0.0))

    async def _served(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`stream`, counted as a large read in progress while it is read."""
        self._enter()
        try:
            async for data in stream:
                yield data
        finally:
            self._leave()
            await close_chunks(stream)

    async def settled(self) -> None:
        """Return once no blob stored whole waits to be converted (tests and benchmarks)."""
        await self._settled.wait()

    async def aclose(self) -> None:
        """Stop converting: the blobs still waiting stay whole (served as they are)."""
        converter, self._converter = self._converter, None
        if converter is not None:
            converter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await converter
        self._waiting.clear()
        self.backlog_bytes = 0
        self._settled.set()

    # -- chunk lists ---------------------------------------------------------------------------

    async def chunk_list(self, digest: Digest) -> list[Digest] | None:
        """The chunks of a blob kept chunked (None: not kept chunked, or the list is unusable)."""
        try:
            data = await self.lists.get(NAMESPACE, digest)
        except NotFound:
            return None
        try:
            message = re_pb2.SplitBlobResponse.FromString(data)
            chunks = [Digest.from_proto(d, digest.function) for d in message.chunk_digests]
        except (DecodeError, ValueError):
            return None
        if sum(c.size_bytes for c in chunks) != digest.size_bytes:
            return None  # a list for another blob of this hash cannot exist; a damaged one is ignored
        return chunks

    async def _complete_list(self, digest: Digest) -> list[Digest] | None:
        chunks = await self.chunk_list(digest)
        if chunks is None or await self.inner.find_missing(chunks):
            return None
        return chunks

    async def _put_list(self, digest: Digest, chunks: Sequence[Digest]) -> None:
        message = re_pb2.SplitBlobResponse(
            chunk_digests=[c.to_proto(re_pb2.Digest) for c in chunks],
            chunking_function=re_pb2.ChunkingFunction.FAST_CDC_2020,
        )
        await self.lists.put(NAMESPACE, digest, message.SerializeToString())

    # -- the BlobStore protocol ----------------------------------------------------------------

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        self._last_call = self._clock()
        missing = await self.inner.find_missing(digests)
        if not any(d.size_bytes >= self.threshold for d in missing):
            return missing
        return [d for d in missing if d.size_bytes < self.threshold or await self._complete_list(d) is None]

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        self._last_call = self._clock()
        missing = await self.inner.find_missing_indices(function, hashes, sizes)
        threshold = self.threshold
        if not any(sizes[i] >= threshold for i in missing):
            return missing
        return [
            i
            for i in missing
            if sizes[i] < threshold or await self._complete_list(Digest(hashes[i], sizes[i], function)) is None
        ]

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        self._last_call = self._clock()
        if digest.size_bytes < self.threshold:
            return await self.inner.read(digest, offset, limit)
        chunks = await self._complete_list(digest)
        if chunks is None:
            try:
                stream = await self.inner.read(digest, offset, limit)
                return stream if self._discard is None else self._served(stream)
            except NotFound:
                # Converted meanwhile: its list was written before the whole copy was dropped.
                chunks = await self._complete_list(digest) if self._discard is not None else None
                if chunks is None:
                    raise
        if offset < 0 or limit < 0 or offset > digest.size_bytes:
            raise InvalidRange(f"offset {offset} (limit {limit}) outside blob {digest}")
        end = digest.size_bytes if limit == 0 else min(digest.size_bytes, offset + limit)
        stream = self._read_chunks(chunks, offset, end)
        return stream if self._discard is None else self._served(stream)

    async def _read_chunks(self, chunks: Sequence[Digest], start: int, end: int) -> AsyncIterator[bytes]:
        """The bytes [start, end) of a blob kept as `chunks`. Whole chunks are fetched a few at a time
        (`read_blobs`: one call of the disk store, each chunk verified there), up to READ_BATCH bytes;
        a chunk of which only part is wanted, or one larger than READ_BATCH, is read as a stream."""
        spans: list[tuple[Digest, int, int]] = []  # chunk, offset in it, limit (0: to its end)
        position = 0
        for chunk in chunks:
            chunk_end = position + chunk.size_bytes
            if chunk_end > start and position < end:
                first = max(start - position, 0)
                count = min(end, chunk_end) - position - first
                spans.append((chunk, first, 0 if first + count == chunk.size_bytes else count))
            position = chunk_end
            if position >= end:
                break
        i = 0
        while i < len(spans):
            batch: list[Digest] = []
            size = 0
            while i < len(spans) and spans[i][1:] == (0, 0) and size + spans[i][0].size_bytes <= READ_BATCH:
                batch.append(spans[i][0])
                size += spans[i][0].size_bytes
                i += 1
            if not batch:
                stream = await self.inner.read(*spans[i])
                i += 1
                try:
                    async for data in stream:
                        yield data
                finally:
                    await close_chunks(stream)
                continue
            for found in await self.inner.read_blobs(batch):
                if isinstance(found, Exception):
                    raise found
                if len(found) <= CHUNK_SIZE:
                    yield found
                    continue
                for at in range(0, len(found), CHUNK_SIZE):  # a read yields at most CHUNK_SIZE at a time
                    yield found[at : at + CHUNK_SIZE]

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        self._last_call = self._clock()
        if all(d.size_bytes < self.threshold for d in digests):
            return await self.inner.read_blobs(digests)
        return await read_blobs_one_by_one(self, digests)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        self._last_call = self._clock()
        if digest.size_bytes < self.threshold or not self.chunk_writes:
            await self.inner.write(digest, chunks)
            return
        self._enter()
        try:
            if self._discard is None or self.backlog_bytes + digest.size_bytes > self.backlog:
                await self._write_chunked(digest, chunks)
                return
            await self.inner.write(digest, chunks)
        finally:
            self._leave()
        self._convert_later(digest)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        self._last_call = self._clock()
        if not self.chunk_writes or all(d.size_bytes < self.threshold for d, _ in items):
            return await self.inner.write_blobs(items)
        return await write_blobs_one_by_one(self, items)

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        try:
            return await self.inner.lookup(function, hash)
        except NotFound:
            probe = Digest(hash, 0, function)
            try:
                data = await self.lists.get(NAMESPACE, probe)
                message = re_pb2.SplitBlobResponse.FromString(data)
            except (NotFound, DecodeError, InvalidDigest):
                raise NotFound(f"blob {function.label}:{hash} not found") from None
            digest = Digest(hash, sum(d.size_bytes for d in message.chunk_digests), function)
            if await self._complete_list(digest) is None:
                raise NotFound(f"blob {digest} not found") from None
            return digest

    # -- writing chunked -----------------------------------------------------------------------

    def _batch_size(self) -> int:
        """The batch a chunked write hands to the worker threads now: its share of
        CHUNK_BUFFER_BUDGET (about three batches each: one arriving, one cut, one being stored)."""
        share = CHUNK_BUFFER_BUDGET // (3 * max(1, self._writing))
        return max(MIN_CUT_BATCH, min(CUT_BATCH, share))

    async def _write_chunked(
        self, digest: Digest, source: AsyncIterable[bytes], *, verified: bool = False, background: bool = False
    ) -> list[Digest]:
        """Receive, cut and store as a pipeline of three stages, one batch in each: while the event
        loop gathers batch N+2, batch N+1 is joined and hashed (the whole blob's hash and each
        chunk's name side by side in two worker threads) and batch N's new chunks are stored.
        Nothing heavy runs on the event loop; the list is written after the last chunk is stored.
        `verified`: `source` is the stored blob, read back under its checksum; not hashed again.
        `background`: between batches, wait while large requests are served."""
        cutter = StreamCutter(self.params, digest.function)
        listed: list[Digest] = []
        cutting: asyncio.Task[None] | None = None
        storing: asyncio.Task[None] | None = None

        async def cut_batch(parts: list[bytes], final: bool) -> None:
            nonlocal storing
            loop = asyncio.get_running_loop()
            buffer, start = await loop.run_in_executor(None, cutter.join, parts)
            if verified:
                pieces = await loop.run_in_executor(None, cutter.cut, buffer, final)
                del buffer
            else:
                hashing = loop.run_in_executor(None, cutter.hash_blob, buffer, start)
                try:
                    pieces = await loop.run_in_executor(None, cutter.cut, buffer, final)
                    del buffer
                finally:
                    if not hashing.done():
                        hashing.add_done_callback(_retrieved)
                await hashing
            listed.extend(p.digest for p in pieces)
            if storing is not None:
                await storing  # one batch's chunks in flight at a time
                storing = None
            if pieces:
                storing = _started(self._store_pieces(pieces))

        received = 0
        parts: list[bytes] = []
        batched = 0
        self._writing += 1
        try:
            batch = self._batch_size()
            async for data in source:
                received += len(data)
                if received > digest.size_bytes:
                    raise DigestMismatch(f"more than the {digest.size_bytes} bytes declared for {digest}")
                parts.append(data)
                batched += len(data)
                if batched >= batch:
                    if cutting is not None:
                        await cutting
                    cutting = _started(cut_batch(parts, False))
                    parts, batched = [], 0
                    batch = self._batch_size()
                    if background:
                        await self._idle()
            if cutting is not None:
                await cutting
            if received != digest.size_bytes:
                raise DigestMismatch(f"uploaded {received} bytes, {digest} declares {digest.size_bytes}")
            cutting = _started(cut_batch(parts, True))
            del parts
            await cutting
            if storing is not None:
                await storing
        finally:
            self._writing -= 1
            for task in (cutting, storing):
                if task is not None and not task.done():
                    # Failed or cancelled: the batches in hand are dropped (threads finish on their
                    # own; a chunk already stored is a valid blob of its own, left to the LRU).
                    task.cancel()
        if not verified and cutter.hexdigest() != digest.hash:
            raise DigestMismatch(
                f"uploaded bytes ({received} bytes, {digest.function.label} {cutter.hexdigest()}) do not match {digest}"
            )
        # A store smaller than the blob (or one evicting hard) may have dropped a chunk stored
        # earlier in this write: a list then would answer OK for a blob already missing.
        evicted = await self.inner.find_missing(list(dict.fromkeys(listed)))
        if evicted:
            raise StorageFull(f"blob {digest}: {len(evicted)} of its chunks were evicted while it was written")
        await self._put_list(digest, listed)
        self._count(digest, listed)
        return listed

    def _count(self, digest: Digest, listed: Sequence[Digest]) -> None:
        if len(self._counted) > MAX_COUNTED_CHUNKS:
            self._counted.clear()  # a bound on memory: later figures count some chunks twice
        self.logical_bytes += digest.size_bytes
        for chunk in listed:
            if chunk.hash not in self._counted:
                self._counted.add(chunk.hash)
                self.stored_chunk_bytes += chunk.size_bytes

    async def _store_pieces(self, pieces: Sequence[Piece]) -> None:
        """Store the chunks the inner store lacks (a chunk repeated in the group is stored once)."""
        unique = {p.digest: p for p in pieces}
        absent = await self.inner.find_missing(list(unique))
        if absent:
            # Each chunk's name and fast checksum were computed from these very bytes
            # (StreamCutter.cut): the inner store need not hash them again
            # (storage/__init__.py, `store_verified`).
            outcomes = await self.inner.store_verified([(d, unique[d].data, unique[d].fast) for d in absent])
            for outcome in outcomes:
                if outcome is not None:
                    raise outcome

    # -- SplitBlob and SpliceBlob (REAPI v2.12) ------------------------------------------------

    async def split(self, digest: Digest) -> list[Digest]:
        """The chunk digests of a stored blob; a blob stored whole is chunked now (its chunks are
        stored, so every one returned is readable afterwards). NotFound if the blob is absent."""
        if digest.size_bytes == 0:
            return []
        chunks = await self._complete_list(digest)
        if chunks is not None:
            return chunks
        chunks = await self._convert(digest)
        if chunks is None:
            raise NotFound(f"blob {digest} not found")
        return chunks

    async def splice(self, digest: Digest, chunks: Sequence[Digest]) -> None:
        """Make `digest` from `chunks` in order: MissingChunks if any is absent, DigestMismatch if
        their concatenation is not the blob (nothing stored then), ValueError for a bad request."""
        if len(chunks) > MAX_SPLICE_CHUNKS:
            raise ValueError(f"{len(chunks)} chunks named; at most {MAX_SPLICE_CHUNKS} per SpliceBlob")
        total = sum(c.size_bytes for c in chunks)
        if total != digest.size_bytes:
            raise DigestMismatch(f"the chunks add up to {total} bytes, not the {digest.size_bytes} of {digest}")
        missing = await self.find_missing(list(dict.fromkeys(chunks)))
        if missing:
            raise MissingChunks(missing)
        if self.chunk_writes and digest.size_bytes >= self.threshold:
            await self._write_chunked(digest, self._concatenate(chunks))  # its chunks are mostly here
        else:
            await self.write(digest, self._concatenate(chunks))

    # -- chunking after the write --------------------------------------------------------------

    def _convert_later(self, digest: Digest) -> None:
        if digest in self._waiting:
            return
        self._waiting[digest] = None
        self.backlog_bytes += digest.size_bytes
        self._settled.clear()
        if self._converter is None or self._converter.done():
            self._converter = asyncio.create_task(self._convert_waiting(), name=CONVERTER_TASK)

    async def _convert_waiting(self) -> None:
        while self._waiting:
            await self._idle()
            digest = next(iter(self._waiting))
            try:
                await self._convert(digest, background=True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the blob stays whole, served as it is
                log.warning("blob %s stays whole: chunking it failed: %s", digest, exc)
            finally:
                if self._waiting.pop(digest, 0) is None:
                    self.backlog_bytes -= digest.size_bytes
        self._settled.set()

    async def _convert(self, digest: Digest, *, background: bool = False) -> list[Digest] | None:
        """Keep a blob stored whole as chunks (its list written before the whole copy is dropped);
        None if it is not stored. Concurrent conversions of one blob share the first one's work."""
        running = self._converting.get(digest)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[list[Digest] | None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)
        self._converting[digest] = future
        try:
            chunks = await self._complete_list(digest)
            if chunks is None:
                try:
                    stream = await self.inner.read(digest)
                except NotFound:
                    future.set_result(None)
                    return None
                try:
                    chunks = await self._write_chunked(digest, stream, verified=True, background=background)
                finally:
                    await close_chunks(stream)
            # A blob under the threshold stays whole (SplitBlob of any blob is answered); one
            # that is its own only chunk is both.
            if self._discard is not None and digest.size_bytes >= self.threshold and digest not in chunks:
                await self._discard(digest)
            future.set_result(chunks)
            return chunks
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            raise
        finally:
            del self._converting[digest]

    async def _concatenate(self, chunks: Sequence[Digest]) -> AsyncIterator[bytes]:
        for chunk in chunks:
            async for data in await self.read(chunk):
                yield data


def _started(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A pipeline stage as a task whose failure is never logged as lost (the write raises it)."""
    task = asyncio.ensure_future(coroutine)
    task.add_done_callback(_retrieved)
    return task


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as seen (one nobody awaits any more must not log it as lost)."""
    if not future.cancelled():
        future.exception()
