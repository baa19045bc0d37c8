"""The store's two faces, where a request enters, and the read paths: ranged reads, whole-blob
batches, lookup by hash alone, action entries.

The faces: `DiskBlobStore` (the CAS) and `DiskActionStore` (action entries) answer FindMissing
from the index (core.py), reads here, and hand writes to writes.py.

A read raises NotFound before producing any byte. Records (records.py) and other small blobs
are read whole in a coalesced trip (a batch's records in one LMDB read transaction; files the
page cache holds, on the event loop: `read_blobs`) and no file stays open; larger ones keep the
fd (an evicted blob stays readable) and are streamed. Every read of a whole blob is verified
(small ones before any byte is returned, streamed ones before their last chunk): a file can rot
or be edited under a running server. A file by the fast checksum recorded when its digest was
verified (filereads.py, `Check`; the digest itself for a file without one), a record by its
digest and CRC. A file or record found damaged (wrong size, content, checksum or CRC) is deleted
and reported missing, one found gone is dropped from the index: the client uploads it again. A
lookup by hash alone that finds no file marks the hash for a re-check (core.py).

The iterators `read` returns: a whole small blob already in memory (`WholeChunks`), or an open
file (`FileChunks`): its first chunk read in the trip that opened it, the rest on the event loop
while the page cache holds them, else one chunk ahead in the worker threads; checked on the way
when the whole blob is read (the last chunk is handed out only once the content is right).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.storage import CHUNK_SIZE, InvalidRange, NotFound, StorageError, Verified
from buildvault.storage.disk import fileops, filereads, layout, pagecache, records
from buildvault.storage.disk.core import SMALL_OP, Core, DiskStats, cas_key
from buildvault.storage.disk.layout import FN_BYTE, MAX_BLOB, SIZE_BYTES
from buildvault.storage.disk.writes import Writer

# read_blobs reads blob files up to this size whole, in its one trip (wanted whole in memory
# anyway: a chunk store's batch of chunks up to 2 MiB, a BatchReadBlobs); larger ones stream.
WHOLE_READ = 4 << 20
# read_blobs reads up to this many bytes of files the page cache holds on the event loop (about
# 1 ms: open, check, copy and checksum). A chunked 64 MiB read, one 2 MiB batch after another,
# took 0.9x the server CPU and the time without a worker trip per batch.
LOOP_READ = 4 << 20
# Smaller files stay in the one worker trip: the loop's checks cost about 20 us a file, more
# than copying it (a FastCDC chunk is at least 128 KiB, but a blob's last one).
LOOP_READ_MIN = 64 << 10


class Reader:
    """Reads of one store (event-loop side; file work in the pool)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._sizes: dict[bytes, int] = {}  # recent hash-only lookups: function byte + raw hash -> size

    async def read(self, digest: Digest, offset: int, limit: int) -> AsyncIterator[bytes]:
        core = self.core
        core.check_open()
        try:
            key = cas_key(digest)
        except InvalidDigest:
            raise NotFound(f"blob {digest} not found") from None
        if key not in core.index.entries:
            raise NotFound(f"blob {digest} not found")
        size = digest.size_bytes
        if offset < 0 or offset > size or limit < 0:
            raise InvalidRange(f"read offset {offset}/limit {limit} out of range for blob {digest}")
        end = size if limit == 0 else min(size, offset + limit)
        core.index.touch(key)
        path = core.layout.path(key)
        first = min(CHUNK_SIZE, end - offset)
        fd: int | None = None
        verification: Verification | None = None
        try:
            if size <= core.index.limit:  # a record, checked whole
                status, data = await core.ops.submit(records.get_one, (core.records, key, offset, end))
            elif size <= SMALL_OP:  # whole and verified, in a coalesced trip; no file stays open
                status, data = await core.ops.submit(filereads.read_small, (path, digest, offset, end))
            else:
                if offset == 0 and end == size:  # the whole blob: verified on the way
                    verification = Verification(filereads.Check(digest), lambda: core.drop_damaged(key))
                check = verification.check if verification is not None else None
                cf = core.executor.submit(filereads.open_range, path, size, offset, first, end, check)
                try:
                    status, fd, data = await asyncio.wrap_future(cf)
                except asyncio.CancelledError:
                    cf.add_done_callback(filereads.close_opened)
                    raise
        except OSError as e:
            raise fileops.storage_error(e, f"reading {digest}") from e
        if status == fileops.DAMAGED:
            core.drop_damaged(key)
        elif status == fileops.MISSING:
            core.drop_missing(key)
        if status != fileops.OK:
            raise NotFound(f"blob {digest} not found")
        if len(data) != first:
            core.drop_damaged(key)
            raise StorageError(f"blob {digest} is shorter on disk than its size")
        if fd is None:
            if verification is not None and not verification.check.ok:
                core.drop_damaged(key)
                raise NotFound(f"blob {digest} not found (damaged on disk)")
            return WholeChunks(data)
        return FileChunks(core.executor, fd, data, offset + len(data), end, f"blob {digest}", verification)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        """Whole blobs (BatchReadBlobs): every small one in one coalesced operation, the rest one by one."""
        core = self.core
        core.check_open()
        results: list[bytes | Exception | None] = [None] * len(digests)
        entries = core.index.entries
        now = core.index.now()
        fromhex = bytes.fromhex
        cas_dir = core.layout.cas_dir
        batch: list[tuple[str, Digest]] = []
        where: list[tuple[int, bytes, Digest]] = []
        record_batch: list[bytes] = []
        record_where: list[tuple[int, bytes, Digest]] = []
        limit = core.index.limit
        singles: list[int] = []
        loop_budget = LOOP_READ
        for i, digest in enumerate(digests):
            hex_hash, size, function = digest.hash, digest.size_bytes, digest.function
            try:
                key = FN_BYTE[function] + fromhex(hex_hash) + size.to_bytes(SIZE_BYTES, "big")
            except (ValueError, TypeError, OverflowError):
                key = b""
            if len(key) != 39 or entries.pop(key, None) is None:
                results[i] = NotFound(f"blob {digest} not found")
                continue
            entries[key] = now  # read: a use
            if size <= limit:
                record_batch.append(key)
                record_where.append((i, key, digest))
            elif size > WHOLE_READ:
                singles.append(i)
            else:
                path = f"{cas_dir}/{function.label}/{hex_hash[:2]}/{hex_hash}-{size}"
                data = filereads.read_cached(path, digest) if LOOP_READ_MIN <= size <= loop_budget else None
                if data is not None:  # the page cache held it: read here, no worker trip
                    loop_budget -= size
                    results[i] = data
                    continue
                batch.append((path, digest))
                where.append((i, key, digest))
        waits = []
        if record_batch:
            waits.append(core.ops.submit(records.get_many, (core.records, record_batch), 0))
        if batch:
            waits.append(core.ops.submit(filereads.read_many, (batch,), 0))
        found_lists = await asyncio.gather(*waits)
        groups = ([record_where] if record_batch else []) + ([where] if batch else [])
        for group, found in zip(groups, found_lists, strict=True):
            for (i, key, digest), (status, data) in zip(group, found, strict=True):
                if status == fileops.OK:
                    results[i] = data
                    continue
                if isinstance(data, OSError):  # status FAILED
                    results[i] = fileops.storage_error(data, f"reading {digest}")
                    continue
                if status == fileops.DAMAGED:
                    core.drop_damaged(key)
                elif status == fileops.MISSING:
                    core.drop_missing(key)
                results[i] = NotFound(f"blob {digests[i]} not found")
        for i in singles:
            try:
                results[i] = b"".join([chunk async for chunk in await self.read(digests[i], 0, 0)])
            except StorageError as e:
                results[i] = e
        return results  # type: ignore[return-value]  # every slot was filled above

    async def lookup(self, function: DigestFunction, hex_hash: str) -> Digest:
        """A stored blob by hash alone: the size from a small memo, else from the record keys with
        that hash and the names in the blob's shard directory (one seek and one listing, in one
        pool trip), confirmed by the index."""
        core = self.core
        core.check_open()
        try:
            raw = bytes.fromhex(hex_hash)
        except (ValueError, TypeError):
            raw = b""
        if len(raw) != 32 or raw.hex() != hex_hash:
            raise NotFound(f"blob {function.label}:{str(hex_hash)[:64]} not found")
        prefix = FN_BYTE[function] + raw
        entries = core.index.entries
        size = self._sizes.get(prefix)
        if size is None or prefix + size.to_bytes(SIZE_BYTES, "big") not in entries:
            directory = core.layout.shard_dir(function, hex_hash)
            try:
                sizes = await core.ops.submit(_sizes_of, (core.records, prefix, directory, hex_hash))
            except OSError as e:
                raise fileops.storage_error(e, f"looking up {hex_hash}") from e
            stored = (n for n in sizes if 0 <= n < MAX_BLOB and prefix + n.to_bytes(SIZE_BYTES, "big") in entries)
            size = next(stored, None)
            if size is None:
                core.suspect(hex_hash)  # an entry of this hash may be indexed with its file gone
                raise NotFound(f"blob {function.label}:{hex_hash} not found")
            if len(self._sizes) >= 1 << 16:
                self._sizes.clear()
            self._sizes[prefix] = size
        return Digest(hex_hash, size, function)

    async def get_entry(self, namespace: str, digest: Digest) -> bytes:
        core = self.core
        core.check_open()
        index = core.index
        key = core.ac_keys.key(namespace, digest)
        if key not in index.entries:
            raise NotFound(f"no entry for {digest} in {namespace!r}")
        index.touch(key)
        cached = index.ac_cache.get(key)
        if cached is not None:
            return cached
        published = index.ac_published
        data: bytes | None
        try:
            if index.in_records(key):
                status, data = await core.ops.submit(records.get_one, (core.records, key))
                if status == fileops.DAMAGED:
                    core.drop_damaged(key)
                    raise NotFound(f"no entry for {digest} in {namespace!r} (damaged on disk)")
                if status != fileops.OK:
                    data = None
            else:
                data = await core.ops.submit(filereads.read_file, (core.layout.path(key),))
        except OSError as e:
            raise fileops.storage_error(e, f"reading {namespace!r} entry {digest}") from e
        if data is None:
            core.drop_missing(key)
            raise NotFound(f"no entry for {digest} in {namespace!r}")
        if published == index.ac_published and key in index.entries and key not in core.publishing:
            index.ac_cache.put(key, data)  # no entry was replaced meanwhile: this is the current one
        return data


def _sizes_of(recs: records.Records, prefix: bytes, directory: str, hex_hash: str) -> list[int]:
    """Sizes of the stored blobs of one hash: its records, then its files."""
    return records.sizes_with_prefix(recs, prefix) + layout.sizes_named(directory, hex_hash)


class Verification:
    """The check of a whole-blob read (run in the worker threads), and what to do if it fails."""

    __slots__ = ("check", "damaged")

    def __init__(self, check: filereads.Check, damaged: Callable[[], None]) -> None:
        self.check = check
        self.damaged = damaged  # drops the entry from the index (and deletes its file)


class FileChunks:
    """Chunks of [offset, end) of an open file.

    A chunk the page cache holds (pagecache.py asks the kernel) is read on the event loop. A
    worker trip per chunk cost more than the read: on the bench's 64 MiB read, server CPU 46-48
    -> 39-40 ms and 1,176-1,240 -> 1,358-1,447 MiB/s. The loop pays the read and the check,
    about 0.1 ms per MiB here. From the first chunk that is not all cached on, the rest is read
    in the worker threads one chunk ahead, so disk and consumer overlap; so is all of a blob
    checked by its digest (a file without its fast checksum): SHA-256 is too slow for the loop.

    Holding the fd is what keeps an evicted (unlinked) blob readable. The fd is closed at the end,
    on aclose(), or when the iterator is collected; never while a read on it is still running.
    """

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        fd: int | None,
        first: bytes,
        pos: int,
        end: int,
        what: str,
        verification: Verification | None = None,
    ) -> None:
        self._executor = executor
        self._verification = verification
        self._cached: pagecache.Residency | None = (
            None  # made at the first chunk read on the loop; set before _fd, which _close tests first
        )
        self._fd = fd
        self._first: bytes | None = first
        self._pos = pos
        self._end = end
        self._what = what
        self._ahead: concurrent.futures.Future[bytes] | None = None
        self._ahead_len = 0
        self._from_cache = pagecache.AVAILABLE and (verification is None or verification.check.full is None)

    def __aiter__(self) -> FileChunks:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            self._read_ahead()
            if first:
                return first
        data = self._read_cached()
        if data is None:
            cf = self._ahead
            if cf is None:
                self._close()
                raise StopAsyncIteration
            try:
                data = await asyncio.wrap_future(cf)
            except BaseException as e:
                self._close()
                if isinstance(e, OSError):
                    raise fileops.storage_error(e, f"reading {self._what}") from e
                raise
            self._ahead = None
        if len(data) != self._ahead_len:
            self._close()
            if self._verification is not None:
                self._verification.damaged()
            raise StorageError(f"{self._what} is shorter on disk than its size")
        self._pos += len(data)
        verification = self._verification
        if verification is not None and self._pos >= self._end:  # the last chunk: check before handing it out
            self._close()
            if not verification.check.ok:  # finished in the hop that read the last chunk
                verification.damaged()
                raise NotFound(f"{self._what} is damaged on disk (its content does not match its digest)")
        self._read_ahead()
        return data

    def _read_ahead(self) -> None:
        if self._fd is not None and self._pos < self._end:
            self._ahead_len = min(CHUNK_SIZE, self._end - self._pos)
            if not self._from_cache:
                check, last = self._check_and_last()
                self._ahead = self._executor.submit(
                    filereads.pread_checked, self._fd, self._ahead_len, self._pos, check, last
                )
        else:
            self._close()

    def _read_cached(self) -> bytes | None:
        """The next chunk, read on the event loop if the page cache holds all of it; None if not
        (from then on the rest is read in the workers, one chunk ahead) or at the end."""
        if not self._from_cache or self._fd is None:
            return None
        if self._cached is None:
            self._cached = pagecache.Residency(self._fd, self._end)
        data = filereads.pread_cached(self._fd, self._ahead_len, self._pos, self._cached, *self._check_and_last())
        if data is None:
            self._from_cache = False
            self._forget_cache()
            self._read_ahead()
        return data

    def _forget_cache(self) -> None:
        cached, self._cached = self._cached, None
        if cached is not None:
            cached.close()

    def _check_and_last(self) -> tuple[filereads.Check | None, bool]:
        check = self._verification.check if self._verification is not None else None
        return check, self._pos + self._ahead_len >= self._end

    def _close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is None:
            return
        self._forget_cache()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.cancel() and not ahead.done():
            ahead.add_done_callback(lambda _f: os.close(fd))
        else:
            os.close(fd)

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()


class WholeChunks:
    """The bytes of a small read, as the iterator `read` returns (chunks of at most CHUNK_SIZE)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> WholeChunks:
        return self

    async def __anext__(self) -> bytes:
        data = self._data
        if not data:
            self._data = None
            raise StopAsyncIteration
        if len(data) <= CHUNK_SIZE:
            self._data = None
            return data
        self._data = data[CHUNK_SIZE:]
        return data[:CHUNK_SIZE]

    async def aclose(self) -> None:
        self._data = None


class DiskBlobStore:
    """BlobStore over the disk store (its CAS face; get one from `DiskStorage.open(...).cas`).
    A request enters here: reads go on in this module, writes in writes.py, FindMissingBlobs to
    the index (core.py)."""

    def __init__(self, core: Core, writer: Writer, reader: Reader) -> None:
        self._core = core
        self._writer = writer
        self._reader = reader

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        """In-memory only: no syscalls (but for hashes a lookup found no file for). Hits count as
        uses (they are about to be referenced)."""
        if self._core.suspects:
            await self._core.recheck(digests)
        return self._core.index.find_missing(digests)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        """find_missing for parallel lists of hex hashes and sizes (no Digest objects: FindMissingBlobs'
        hot path): the positions of the absent ones, first occurrences only, in order."""
        core = self._core
        core.check_open()
        if core.suspects:
            suspects = core.suspects
            await core.recheck(Digest(h, n, function) for h, n in zip(hashes, sizes, strict=False) if h in suspects)
        return core.index.missing_indices(function, hashes, sizes)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        return await self._reader.read(digest, offset, limit)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        """Whole blobs, each its bytes or its error (NotFound...): small ones in one pool trip."""
        return await self._reader.read_blobs(digests)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        """Verify and publish atomically. An already stored blob returns at once, leaving `chunks` unread."""
        await self._writer.write(digest, chunks)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        """Store whole blobs, each verified: None or the error, each. Small ones in one pool trip."""
        return await self._writer.write_blobs(items)

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        """write_blobs for bytes the caller hashed itself: not re-hashed, every other rule kept;
        each file records the caller's fast checksum, which whole reads verify."""
        pairs = [(digest, data) for digest, data, _ in items]
        return await self._writer.write_blobs(pairs, checksums=[checksum for _, _, checksum in items])

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        return await self._reader.lookup(function, hash)

    async def discard(self, digest: Digest) -> None:
        """Delete a blob kept another way now (as chunks); a pinned one stays (Core.discard)."""
        try:
            key = cas_key(digest)
        except InvalidDigest:
            return
        deleting = self._core.discard(key)
        if deleting is not None:
            await deleting

    def stats(self) -> DiskStats:
        return self._core.index.stats()


class DiskActionStore:
    """ActionStore over the disk store (its AC face; `DiskStorage.open(...).ac`): own subtree,
    same cap and LRU as the CAS. Entries are read in this module, written in writes.py."""

    def __init__(self, writer: Writer, reader: Reader) -> None:
        self._writer = writer
        self._reader = reader

    async def get(self, namespace: str, digest: Digest) -> bytes:
        return await self._reader.get_entry(namespace, digest)

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self._writer.put_entry(namespace, digest, data)
