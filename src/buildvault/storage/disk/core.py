"""The one owner of the state every disk-store operation shares.

`Core` holds the layout, the index, the worker pool and its coalescer, and the maps of renames
and unlinks in flight (at most one per key, so the index never says "present" for a file an
eviction is about to remove, nor the reverse). Those maps, the publish tasks and the suspects
change only through its methods: reserving space (evicting first), claiming a key, starting and
finishing a publish, deleting, dropping a damaged or vanished entry, re-checking suspects. The
write and read paths (writes.py, reads.py) read that state but change it only through them.

Healing: a read that finds a file gone or damaged drops its entry at once (reads.py). A lookup by
hash alone (bazel-remote's GET /cas/{hash}) knows no size, so it cannot name the entry; it records
the hash in `suspects` instead, and the next FindMissingBlobs or write naming a digest of that hash
stats the file (one coalesced trip) before answering: gone or of the wrong size, the entry leaves
the index, so the blob is reported missing and the next upload stores it. A record (records.py) is
looked up in the same trip instead: its size is in its key, and its content is checked when it is
read. `suspects` is empty almost always, and the hot paths test only that.

One pool trip per event-loop iteration for small file operations (`Coalescer`): every small
operation (a whole small blob or entry written, read or unlinked) is queued on the event loop;
everything queued by the next loop iteration goes to the worker threads as one work item and its
results come back in one loop wakeup, so a BatchUpdateBlobs of 100 blobs is one trip, not 100.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from buildvault.digest import Digest, InvalidDigest
from buildvault.storage import CapacityExceeded, StorageError, StorageFull
from buildvault.storage.disk import fileops, records
from buildvault.storage.disk.index import Index, Reservation
from buildvault.storage.disk.layout import AcKeys, Layout, cas_key, dir_id

log = logging.getLogger("buildvault.storage.disk")

# Incoming chunks are gathered to this size before one thread hop hashes and writes them:
# Bazel sends 16 KiB ByteStream chunks, and 4,096 hops for a 64 MiB blob would cost more than the I/O.
WRITE_BATCH = 1 << 20
# What the streamed uploads in progress may hold in memory between them: each up to three batches
# (one arriving, one being hashed, one being written), so under many concurrent uploads the batch
# shrinks (down to MIN_WRITE_BATCH) instead of the memory growing with them; a few at once keep
# WRITE_BATCH.
UPLOAD_BUFFER_BUDGET = 48 << 20
MIN_WRITE_BATCH = 64 << 10
# Blobs and entries up to this size are written and read whole, and their file operations are
# coalesced (Coalescer).
SMALL_OP = WRITE_BATCH
# Hashes remembered for a re-check; beyond this the oldest are forgotten (the entry then heals at
# its next read instead).
MAX_SUSPECTS = 4096

TRIP_OPS = 128  # operations per coalesced trip, at most
TRIP_BYTES = 8 << 20  # bytes written per coalesced trip, at most
OWN_TRIP_BYTES = 256 << 10  # an operation on this many bytes gets a trip of its own (no head-of-line wait)

_Op = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    """The store's worker pool; `trips` counts work items submitted (an observable of the
    one-trip-per-batch rule)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self.trips = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.trips += 1
        return super().submit(fn, *args, **kwargs)


def _run_ops(ops: list[_Op]) -> list[tuple[bool, Any]]:
    """A coalesced trip: run each operation, keeping its result or its exception."""
    results: list[tuple[bool, Any]] = []
    for fn, args, _future in ops:
        try:
            results.append((True, fn(*args)))
        except Exception as e:  # delivered to that operation's caller
            results.append((False, e))
    return results


def _deliver(ops: list[_Op], cf: concurrent.futures.Future[Any]) -> None:
    try:
        results = cf.result()
    except BaseException as e:  # _run_ops itself failed (MemoryError...)
        results = [(False, e)] * len(ops)
    for (_fn, _args, future), (ok, value) in zip(ops, results, strict=True):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class Coalescer:
    """Small file operations queued on the event loop, run in batches in the worker threads.

    Each `submit` returns an asyncio future. The first operation queued in a loop iteration
    schedules a flush for the next one; whatever is queued by then (up to TRIP_OPS operations
    or TRIP_BYTES bytes per trip) goes to the pool as one work item. Operations of one trip run
    in order; trips run concurrently. An operation on OWN_TRIP_BYTES or more (a whole batch, a
    large blob) goes at once, in a trip of its own, so small ones never wait behind it. Once the
    pool is shut down, every operation fails with StorageError.
    """

    __slots__ = ("_executor", "_pending", "_bytes")

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._pending: list[_Op] = []
        self._bytes = 0

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], nbytes: int = 0) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if nbytes >= OWN_TRIP_BYTES:  # hashing and writing it takes a while: others need not wait for it
            self._run([(fn, args, future)], loop)
            return future
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((fn, args, future))
        self._bytes += nbytes
        if len(self._pending) >= TRIP_OPS or self._bytes >= TRIP_BYTES:
            self._flush()
        return future

    def _flush(self) -> None:
        ops, self._pending, self._bytes = self._pending, [], 0
        if ops:
            self._run(ops, asyncio.get_running_loop())

    def _run(self, ops: list[_Op], loop: asyncio.AbstractEventLoop) -> None:
        try:
            cf = self._executor.submit(_run_ops, ops)
        except RuntimeError as e:  # the pool is shut down: the store is closing
            for _fn, _args, future in ops:
                if not future.done():
                    future.set_exception(StorageError(f"disk store is closed ({e})"))
            return
        cf.add_done_callback(lambda cf: loop.call_soon_threadsafe(_deliver, ops, cf))


class Core:
    """Shared state of one open store (event-loop side), and the only code that changes it."""

    def __init__(
        self,
        root: Path,
        max_size: int,
        max_workers: int | None,
        clock: Callable[[], float],
        hold_seconds: int,
        record_limit: int,
    ) -> None:
        self.layout = Layout(root)
        self.index = Index(max_size, clock, hold_seconds, record_limit)
        self.records = records.Records(self.layout.records_dir, max_size, record_limit)
        self.ac_keys = AcKeys()
        workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self.executor = CountingPool(workers, thread_name_prefix="buildvault-disk")
        self.ops = Coalescer(self.executor)
        # Read them anywhere; change them only through the methods below.
        self.publishing: dict[bytes, asyncio.Future[None]] = {}
        self.deleting: dict[bytes, asyncio.Future[None]] = {}
        self.tasks: set[asyncio.Future[Any]] = set()
        self.suspects: dict[str, None] = {}  # hex hashes to re-check (insertion order: oldest first)
        self.closing = False

    # -- open, closing, waiting ------------------------------------------------------------

    def check_open(self) -> None:
        if self.closing:
            raise StorageError("disk store is closed")

    def refuse_new_work(self) -> bool:
        """From now on every operation fails with StorageError; False if that was so already."""
        was_open = not self.closing
        self.closing = True
        return was_open

    async def io(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """Run blocking file work in the store's pool; OSErrors become storage errors."""
        try:
            return await asyncio.wrap_future(self.executor.submit(fn, *args))
        except OSError as e:
            raise fileops.storage_error(e, what) from e

    async def settle(self, cf: concurrent.futures.Future[Any]) -> None:
        """Wait for cleanup that must finish even if the caller is cancelled meanwhile."""
        await asyncio.shield(asyncio.wrap_future(cf))

    async def settle_all(self, futures: list[asyncio.Future[None]]) -> None:
        if futures:
            await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))

    def in_flight(self) -> int:
        """Renames, unlinks and publish tasks not finished yet."""
        return len(self.publishing) + len(self.deleting) + len(self.tasks)

    async def drain(self) -> None:
        """Wait once for every rename, unlink and publish under way now (close)."""
        await asyncio.gather(*self.tasks, *self.publishing.values(), *self.deleting.values(), return_exceptions=True)

    async def wait_idle(self) -> None:
        """Until every rename, unlink and publish started so far has finished."""
        while self.in_flight():
            await self.drain()
            await asyncio.sleep(0)  # their done-callbacks run in the next iteration

    def dirs_in_flight(self) -> set[bytes]:
        """Directories with a rename or unlink under way: their mtime says nothing yet."""
        return {dir_id(key) for key in (*self.publishing, *self.deleting)}

    # -- writes: space, the key, the publish -----------------------------------------------

    async def reserve(self, size: int, what: object) -> Reservation:
        """Promise `size` bytes to a write, evicting first, so the total on disk stays under max_size."""
        self.check_open()
        index = self.index
        if size > index.max_size:
            raise CapacityExceeded(f"{what} ({size} bytes) is larger than the store's {index.max_size} bytes")
        if index.reserved + size > index.max_size:
            raise StorageFull(f"no room for {what}: writes in progress hold the space")
        deletions: list[asyncio.Future[None]] = []
        over = index.used + index.reserved + size - index.max_size
        if over > 0:
            deletions = self.evict(over + index.slack)
            if index.used + index.reserved + size > index.max_size:
                # What is left was used in the last seconds (a client is about to fetch it) or is
                # promised to writes in progress: refusing this write is cheaper than a broken hit.
                raise StorageFull(f"no room for {what}: writes in progress and entries in use hold the space")
        reservation = Reservation(index, size)
        if deletions:
            try:
                await self.settle_all(deletions)  # let the space really be free before writing
            except BaseException:
                reservation.release()
                raise
        return reservation

    async def claim(self, key: bytes, replace: bool) -> bool:
        """Wait until no rename or unlink of `key` is in flight. False: a CAS entry that another
        writer published meanwhile (touched; nothing to do)."""
        while True:
            if not replace and key in self.index.entries:
                self.index.touch(key)
                return False
            other = self.publishing.get(key) or self.deleting.get(key)
            if other is None:
                return True
            if other.done():  # finished, its clean-up callback not yet run: awaiting would not yield
                if self.deleting.get(key) is other:
                    del self.deleting[key]
                continue
            with contextlib.suppress(Exception):  # only waiting for the slot; its outcome is re-checked
                await asyncio.shield(other)

    def start_publish(self, key: bytes) -> None:
        """`key` is being written (claimed, or free of any rename and unlink): others wait for it."""
        self.publishing[key] = asyncio.get_running_loop().create_future()

    def finish_publish(self, key: bytes, reservation: Reservation, size: int | None) -> None:
        """End the publish of `key`: index it if it is in place (`size` not None), release its
        reservation either way, and let those waiting for the key go on."""
        try:
            if size is not None:
                self.index.indexed(key, reservation, size)
        finally:
            reservation.release()
            self.publishing.pop(key).set_result(None)

    def track(self, task: asyncio.Future[Any]) -> None:
        """A publish task that must finish even if its caller is cancelled (close waits for it)."""
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("publish failed: %s", task.exception())

    # -- eviction, deletion, healing ------------------------------------------------------

    def evict(self, need: int, *, hold: bool = True) -> list[asyncio.Future[None]]:
        """Drop least recently used entries until `need` bytes are freed (with `hold`, none used
        within index.hold_seconds); unlink their files in the pool."""
        return [self.delete_file(key, record) for key, record in self.index.evict(need, self.publishing, hold=hold)]

    def where(self, key: bytes) -> str:
        """The indexed entry's file, or its record (for messages)."""
        if self.index.in_records(key):
            return f"record {key[1:33].hex()} in {self.layout.records_dir}"
        return self.layout.path(key)

    def delete_file(self, key: bytes, record: bool) -> asyncio.Future[None]:
        """Remove an entry's file, or its record, in the pool (the index has forgotten it)."""
        if record:
            future = self.ops.submit(records.delete_many, (self.records, [key]))
        else:
            future = self.ops.submit(fileops.unlink_quiet, (self.layout.path(key),))
        self.deleting[key] = future

        def done(f: asyncio.Future[None], key: bytes = key) -> None:
            if self.deleting.get(key) is f:
                del self.deleting[key]

        future.add_done_callback(done)
        return future

    def drop_missing(self, key: bytes) -> None:
        """The file or record vanished behind our back (deleted by hand, by verify --repair): forget it."""
        if key in self.index.entries and key not in self.publishing:
            log.warning("%s vanished from disk; dropping it from the index", self.where(key))
            self.index.forget(key)

    def drop_damaged(self, key: bytes) -> None:
        """The file or record has not the size or content its key says (bit rot, a hand edit):
        forget and delete it, so a NotFound makes the client upload it again."""
        if key in self.index.entries and key not in self.publishing:
            log.error("%s is damaged (wrong size or content); deleting it", self.where(key))
            record = self.index.in_records(key)
            self.index.forget(key)
            self.delete_file(key, record)

    def suspect(self, hex_hash: str) -> None:
        """A lookup by hash found no file: re-check any entry of that hash when next named."""
        suspects = self.suspects
        suspects.pop(hex_hash, None)
        suspects[hex_hash] = None
        if len(suspects) > MAX_SUSPECTS:
            del suspects[next(iter(suspects))]

    async def recheck(self, digests: Iterable[Digest]) -> None:
        """Stat the files of those `digests` whose hash is a suspect and which the index holds;
        drop those gone or damaged (call only when `suspects` is not empty)."""
        suspects = self.suspects
        held: list[tuple[bytes, int]] = []
        in_records: list[bool] = []
        for digest in [d for d in digests if d.hash in suspects]:
            suspects.pop(digest.hash, None)
            with contextlib.suppress(InvalidDigest):
                key = cas_key(digest)
                if key in self.index.entries and key not in self.publishing:
                    held.append((key, digest.size_bytes))
                    in_records.append(self.index.in_records(key))
        if not held:
            return
        files = [self.layout.path(key) for (key, _), record in zip(held, in_records, strict=True) if not record]
        keys = [key for (key, _), record in zip(held, in_records, strict=True) if record]
        try:
            sizes = await self.ops.submit(_sizes, (self.records, files, keys, in_records))
        except OSError as e:
            raise fileops.storage_error(e, "re-checking blobs a lookup did not find") from e
        for (key, size), found in zip(held, sizes, strict=True):
            if found is None:
                self.drop_missing(key)
            elif found != size:
                self.drop_damaged(key)


def _sizes(recs: records.Records, paths: list[str], keys: list[bytes], in_records: list[bool]) -> list[int | None]:
    """The size of each file (None: gone) and each record (its key's size, or None: gone), in order."""
    file_sizes = iter([fileops.stat_size(path) for path in paths])
    present = iter(records.present(recs, keys) if keys else [])
    key_sizes = iter([int.from_bytes(key[33:], "big") for key in keys])
    out: list[int | None] = []
    for record in in_records:
        if record:
            size = next(key_sizes)
            out.append(size if next(present) else None)
        else:
            out.append(next(file_sizes))
    return out
