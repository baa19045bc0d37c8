"""The write path of CAS blobs and action entries: reserve, receive, verify, publish.

Entries up to the record limit are records (records.py): verified and committed in one coalesced
operation, a whole batch in one LMDB transaction. Others up to SMALL_OP bytes are gathered in
memory and verified, written and renamed in one coalesced operation; larger ones stream into a
temp file in batches of up to WRITE_BATCH (smaller when many uploads run at once:
UPLOAD_BUFFER_BUDGET), one batch hashed while the previous one is written, queued to the
workers without the event loop waiting for each (fileops.Pipeline). Either way
a blob becomes visible only once verified, by one commit or one atomic rename, and a failed or
cancelled write leaves nothing behind. Once the commit or rename is under way it completes and
is indexed even if the caller is cancelled.

BatchUpdateBlobs (`write_blobs`): the common case (small, new, room without evicting, no other
write of the same blob in flight) is reserved and claimed on the event loop and written in one
operation per layout: the records in one LMDB transaction (records.put_many), the files in one
trip (fileops.write_many); any other blob goes the one-by-one way (`write`).

`store_verified` (bytes the caller hashed itself, storage/__init__.py) is the same path without
the hash: every other step (size check, capacity, claims, atomic publish, sync) is the same. A
blob file gets its fast checksum (fileops.py) with the bytes: computed in the pass that verifies
the digest, or, for `store_verified`, the one the caller computed over the bytes it hashed, so a
whole read of bytes other than those is refused like a damaged file.

Space, claims and publishes go through the store's state owner (core.py).

A request enters through the store's faces (reads.py) and goes on here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterable, Sequence
from typing import Any

from buildvault.digest import Digest, InvalidDigest, new_hasher
from buildvault.storage import CapacityExceeded, DigestMismatch, StorageError, single_chunk
from buildvault.storage.disk import fileops, records
from buildvault.storage.disk.core import SMALL_OP, Core, Reservation, cas_key, held
from buildvault.storage.disk.layout import AC_TAG

__all__ = ["SMALL_OP", "WRITE_BATCH", "Writer"]

# Incoming chunks are gathered to this size before one thread hop hashes and writes them:
# Bazel sends 16 KiB ByteStream chunks, and 4,096 hops for a 64 MiB blob would cost more than the I/O.
WRITE_BATCH = SMALL_OP
# Batches a streamed upload may hold in its pipeline (being hashed, being written, queued) before
# the event loop waits for it to be half empty: the receive, the hash and the write then run
# without a hand-over per batch through the loop.
PIPELINE_DEPTH = 4
# What the streamed uploads in progress may hold in memory between them: each up to
# PIPELINE_DEPTH + 1 batches (the pipeline's and one arriving), so under many concurrent uploads
# the batch shrinks (down to MIN_WRITE_BATCH) instead of the memory growing with them; a few at
# once keep WRITE_BATCH.
UPLOAD_BUFFER_BUDGET = 48 << 20
MIN_WRITE_BATCH = 64 << 10

_Claim = tuple[int, bytes, int, Reservation]  # item, key, size, reservation


class Writer:
    """Writes of one store (event-loop side; file work in the pool)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.receiving = 0  # streamed uploads in _receive now

    def batch_size(self) -> int:
        """The batch of a streamed upload now: its share of UPLOAD_BUFFER_BUDGET (PIPELINE_DEPTH + 1 batches each)."""
        share = UPLOAD_BUFFER_BUDGET // ((PIPELINE_DEPTH + 1) * max(1, self.receiving))
        return max(MIN_WRITE_BATCH, min(WRITE_BATCH, share))

    async def _stored(self, digest: Digest, key: bytes) -> bool:
        """Before a blob write: refuse one larger than the store; True (and touched) when the blob
        is already stored, verified when it was written, so the caller need not write it."""
        core = self.core
        core.check_open()
        if digest.size_bytes > core.index.max_size:
            raise CapacityExceeded(f"blob {digest} is larger than the store's {core.index.max_size} bytes")
        if core.suspects and digest.hash in core.suspects:
            await core.recheck([digest])
        if key in core.index.entries:
            core.index.touch(key)
            return True
        return False

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        key = cas_key(digest)
        if not await self._stored(digest, key):  # stored: the stream is not read at all
            await self._store(key, digest, digest.size_bytes, chunks, digest, replace=False)

    async def _write_hashed(self, digest: Digest, data: bytes, checksum: bytes) -> None:
        """`write` of a whole blob whose caller hashed `data` itself: the size is checked, the hash
        not; `checksum` (the caller's fast checksum of the bytes it hashed) is recorded with it."""
        size = digest.size_bytes
        if len(data) != size:
            raise DigestMismatch(f"blob {digest}: got {len(data)} bytes, declared {size}")
        key = cas_key(digest)
        if not await self._stored(digest, key):
            await self._store(key, None, size, bytes(data), digest, replace=False, checksum=checksum)

    async def put_entry(self, namespace: str, digest: Digest, data: bytes) -> None:
        core = self.core
        core.check_open()
        key = core.ac_keys.key(namespace, digest)
        data = bytes(data)
        await self._store(key, None, len(data), data, f"{namespace!r} entry {digest}", replace=True)

    async def write_blobs(
        self, items: Sequence[tuple[Digest, bytes]], *, checksums: Sequence[bytes] | None = None
    ) -> list[Exception | None]:
        """Whole blobs (BatchUpdateBlobs). The common case (small, new, room without evicting,
        no other write of the same blob in flight) is reserved and claimed here and written in one
        coalesced operation; any other goes the one-by-one way. Like _store_small, a submitted
        write completes and is indexed even if the caller is cancelled. `checksums`: the caller
        hashed each blob's bytes itself (store_verified) and computed these fast checksums of
        them: sizes are checked, hashes not, and each file records its checksum."""
        hashed = checksums is not None
        core = self.core
        core.check_open()
        if core.suspects:
            await core.recheck(digest for digest, _ in items)
        index = core.index
        entries = index.entries
        publishing, deleting = core.publishing, core.deleting
        outcomes: list[Exception | None] = [None] * len(items)
        batch: list[tuple[str, str, bytes, Digest | None, bytes | None]] = []
        claimed: list[_Claim] = []
        record_batch: list[records.PutItem] = []
        record_claimed: list[_Claim] = []
        limit = index.limit
        others: list[int] = []
        contended: set[int] = set()
        tmp_dir, path = core.layout.tmp_dir, core.layout.path
        for i, (digest, data) in enumerate(items):
            size = digest.size_bytes
            try:
                key = cas_key(digest)
            except InvalidDigest as e:
                outcomes[i] = e
                continue
            if key in entries:
                index.touch(key)  # stored and verified already: the bytes need not be read
                continue
            if key in publishing or key in deleting:
                contended.add(i)  # e.g. the same blob twice in one batch: these bytes get checked too
                others.append(i)
                continue
            record = size <= limit and held(limit, key, size)
            cost = records.charge(key, size) if record else size
            if len(data) != size or size > SMALL_OP or index.used + index.reserved + cost > index.max_size:
                others.append(i)
                continue
            reservation = Reservation(index, cost)
            core.start_publish(key)
            check = None if hashed else digest
            if record:
                record_batch.append((key, bytes(data), check))
                record_claimed.append((i, key, size, reservation))
            else:
                batch.append((tmp_dir, path(key), bytes(data), check, checksums[i] if checksums is not None else None))
                claimed.append((i, key, size, reservation))
        futures = []
        if record_batch:
            nbytes = sum(len(item[1]) for item in record_batch)
            future = core.ops.submit(records.put_many, (core.records, record_batch), nbytes)
            futures.append(self._settle_group(future, record_claimed, outcomes))
        if batch:
            future = core.ops.submit(fileops.write_many, (batch,), sum(len(item[2]) for item in batch))
            futures.append(self._settle_group(future, claimed, outcomes))
        if futures:
            await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))
            for i, *_rest in [*record_claimed, *claimed]:
                error = outcomes[i]
                if isinstance(error, OSError):
                    outcomes[i] = fileops.storage_error(error, f"writing {items[i][0]}")
        if others:

            async def one(i: int) -> Exception | None:
                digest, data = items[i]
                try:
                    if checksums is not None:
                        await self._write_hashed(digest, data, checksums[i])
                        return None
                    if i in contended and len(data) == digest.size_bytes <= SMALL_OP:
                        await core.ops.submit(fileops.check_hash, (bytes(data), digest))
                    await self.write(digest, single_chunk(data))
                    return None
                except Exception as e:  # that blob's outcome
                    return e

            for i, outcome in zip(others, await asyncio.gather(*(one(i) for i in others)), strict=True):
                outcomes[i] = outcome
        return outcomes

    def _settle_group(
        self, future: asyncio.Future[list[Exception | None]], claimed: list[_Claim], outcomes: list[Exception | None]
    ) -> asyncio.Future[list[Exception | None]]:
        """When one coalesced write of several entries is done: index each written one, record the
        others' errors in `outcomes`, release the claims (runs even if the caller is cancelled)."""
        finish_publish = self.core.finish_publish

        def finished(future: asyncio.Future[list[Exception | None]]) -> None:
            results = None if future.cancelled() else (future.exception() or future.result())
            for n, (i, key, size, reservation) in enumerate(claimed):
                error = results if isinstance(results, BaseException) else None if results is None else results[n]
                written = results is not None and error is None
                try:
                    if not written:
                        outcomes[i] = error if isinstance(error, Exception) else StorageError("write abandoned")
                finally:
                    finish_publish(key, reservation, size if written else None)

        future.add_done_callback(finished)
        return future

    async def _store(
        self,
        key: bytes,
        digest: Digest | None,
        size: int,
        chunks: AsyncIterable[bytes] | bytes,
        what: object,
        *,
        replace: bool,
        checksum: bytes | None = None,
    ) -> None:
        """Reserve, receive into a temp file, publish: the one write path of CAS and AC.

        Entries up to SMALL_OP bytes are gathered first and take the coalesced path instead.
        `checksum`: a blob not verified here (`digest` None) whose caller computed its fast checksum.
        """
        reservation = await self.core.reserve(self.core.index.cost(key, size), what)
        if size <= SMALL_OP:
            try:
                if isinstance(chunks, bytes):
                    data = chunks
                else:
                    parts, total = [], 0
                    async for chunk in chunks:
                        total += len(chunk)
                        if total > size:
                            raise DigestMismatch(f"blob {what}: more than the declared {size} bytes")
                        parts.append(chunk)
                    if total != size:
                        raise DigestMismatch(f"blob {what}: got {total} bytes, declared {size}")
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                data = bytes(data)
            except BaseException:
                reservation.release()
                raise
            await self._store_small(key, digest, data, reservation, what, replace=replace, checksum=checksum)
            return
        try:
            temp = await self._receive(digest, size, chunks, what, checksum)
        except BaseException:
            reservation.release()
            raise
        await self._publish(key, temp, size, reservation, replace=replace)

    async def _receive(
        self,
        digest: Digest | None,
        size: int,
        chunks: AsyncIterable[bytes] | bytes,
        what: object,
        checksum: bytes | None = None,
    ) -> str:
        """Stream into a temp file in batches, verifying size and hash; return its path.

        On any failure (mismatch, ENOSPC, an error from the iterator, cancellation) the temp file is
        gone before this returns.
        """
        executor = self.core.executor
        hasher = new_hasher(digest.function) if digest is not None else None
        temp = fileops.TempFile(self.core.layout.tmp_dir, hasher, checksum)
        # Batches go to a pipeline of two stages in the pool (batch N hashed while N-1 is written)
        # while the event loop receives N+1; the loop waits only when PIPELINE_DEPTH batches are
        # held, not for each batch (bench/notes/2026-12-06-asset-download.md).
        pipeline = fileops.Pipeline(temp, executor)
        pending: concurrent.futures.Future[Any] | None = None
        self.receiving += 1
        try:
            if isinstance(chunks, bytes):
                parts = [chunks]
            else:
                parts, buffered, total = [], 0, 0
                async for chunk in chunks:
                    n = len(chunk)
                    if not n:
                        continue
                    total += n
                    if total > size:
                        raise DigestMismatch(f"blob {what}: more than the declared {size} bytes")
                    parts.append(chunk)
                    buffered += n
                    batch = self.batch_size()
                    if buffered >= batch:
                        pipeline.put(parts, buffered)
                        parts, buffered = [], 0
                        # A failed stage ends the upload now, not once the whole body is in.
                        if pipeline.error is not None or pipeline.held >= PIPELINE_DEPTH * batch:
                            await _drain(pipeline, PIPELINE_DEPTH * batch // 2, what)
                if total != size:
                    raise DigestMismatch(f"blob {what}: got {total} bytes, declared {size}")
                await _drain(pipeline, 0, what)
            pending = executor.submit(temp.finish, parts)
            actual = await _wait_io(pending, what)
            pending = None
            if digest is not None and actual != digest.hash:
                raise DigestMismatch(f"blob {what}: content hashes to {actual}")
            assert temp.path is not None
            return temp.path
        except BaseException:
            await self.core.settle(pipeline.stop())
            await self.core.settle(executor.submit(temp.abort, pending))
            # The traceback keeps this frame, and an abandoned upload's objects form a cycle that
            # may wait long for the garbage collector: hold none of its batches (about 1 MiB each).
            pending = None
            parts = []
            raise
        finally:
            self.receiving -= 1

    async def _publish(self, key: bytes, temp: str, size: int, reservation: Reservation, *, replace: bool) -> None:
        """Rename a verified temp file into place and index it; owns `temp` and `reservation`."""
        core = self.core
        duplicate = False
        try:
            duplicate = not await core.claim(key, replace)  # False: a concurrent writer got there first
        except BaseException:
            duplicate = True
            raise
        finally:
            if duplicate:
                reservation.release()
                await core.settle(core.executor.submit(fileops.unlink_quiet, temp))
        if duplicate:
            return
        core.start_publish(key)
        task = asyncio.ensure_future(self._rename_and_index(key, temp, size, reservation))
        core.track(task)
        await asyncio.shield(task)

    async def _rename_and_index(self, key: bytes, temp: str, size: int, reservation: Reservation) -> None:
        core = self.core
        final = core.layout.path(key)
        # An action entry replacing a record of it: the record goes once the file is in place.
        stale = [key] if key in core.index.entries and core.index.in_records(key) else []
        renamed = False
        try:
            try:
                await core.io(_rename_replacing, core.records, temp, final, stale, what=f"publishing {final}")
            except BaseException:
                await core.settle(core.executor.submit(fileops.unlink_quiet, temp))
                raise
            renamed = True
        finally:
            core.finish_publish(key, reservation, size if renamed else None)

    async def _store_small(
        self,
        key: bytes,
        digest: Digest | None,
        data: bytes,
        reservation: Reservation,
        what: object,
        *,
        replace: bool,
        checksum: bytes | None = None,
    ) -> None:
        """Verify, write and publish a small entry in one coalesced operation; owns `reservation`.
        Once submitted, the operation completes and is indexed even if the caller is cancelled."""
        core = self.core
        try:
            if not await core.claim(key, replace):
                reservation.release()
                if digest is not None:  # published by a concurrent writer: still, these bytes must be right
                    await core.ops.submit(fileops.check_hash, (data, digest))
                return
        except BaseException:
            reservation.release()
            raise
        core.start_publish(key)
        index = core.index

        def finished(future: asyncio.Future[None]) -> None:
            written = not future.cancelled() and future.exception() is None
            try:
                core.finish_publish(key, reservation, len(data) if written else None)
            finally:
                if written and key[0] == AC_TAG:
                    index.ac_cache.put(key, data)

        # An action entry may move between a record and a file when its size crosses the limit:
        # the old copy is removed in the same operation, once the new one is in place.
        old = key in index.entries and index.in_records(key)
        if held(index.limit, key, len(data)):
            stale_file = core.layout.path(key) if key[0] == AC_TAG and key in index.entries and not old else None
            future = core.ops.submit(records.put_one, (core.records, key, data, digest, stale_file), len(data))
        else:
            args = (core.layout.tmp_dir, core.layout.path(key), data, digest, checksum)
            stale = [key] if old else []
            future = core.ops.submit(_write_small_replacing, (core.records, stale, *args), len(data))
        future.add_done_callback(finished)
        try:
            await asyncio.shield(future)
        except OSError as e:
            raise fileops.storage_error(e, f"writing {what}") from e


def _write_small_replacing(recs: records.Records, stale: list[bytes], *args: Any) -> None:
    """fileops.write_small, then the removal of the record the file replaces (if any)."""
    fileops.write_small(*args)
    if stale:
        records.delete_many(recs, stale)


def _rename_replacing(recs: records.Records, temp: str, final: str, stale: list[bytes]) -> None:
    """fileops.rename, then the removal of the record the file replaces (if any)."""
    fileops.rename(temp, final)
    if stale:
        records.delete_many(recs, stale)


async def _drain(pipeline: fileops.Pipeline, most: int, what: object) -> None:
    """Until the pipeline holds at most `most` bytes; raises the error of a stage, if any."""
    waiting = pipeline.wait(most)
    if waiting is not None:
        await asyncio.wrap_future(waiting)
    if pipeline.error is not None:
        if isinstance(pipeline.error, OSError):
            raise fileops.storage_error(pipeline.error, f"writing {what}") from pipeline.error
        raise pipeline.error


async def _wait_io(cf: concurrent.futures.Future[Any], what: object) -> Any:
    try:
        return await asyncio.wrap_future(cf)
    except OSError as e:
        raise fileops.storage_error(e, f"writing {what}") from e
