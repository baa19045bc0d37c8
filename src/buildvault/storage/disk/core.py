"""The state every disk-store operation shares, and the steps reads and writes have in common.

`Core` holds the layout, the index, the worker pool and its coalescer, and the maps of renames
and unlinks in flight (at most one per key, so the index never says "present" for a file an
eviction is about to remove, nor the reverse). Eviction lives here because both paths need it:
writes make room, reads drop entries whose file turned out damaged or gone.

`suspects` holds hashes a lookup by hash alone found no file for: the size is not known there,
so the entry (if the index has one) is re-checked by the next FindMissingBlobs or write naming
it (healing.py). It is empty almost always, and the hot paths test only that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buildvault.storage import StorageError
from buildvault.storage.disk import fileops, records
from buildvault.storage.disk.coalescer import Coalescer
from buildvault.storage.disk.index import Index
from buildvault.storage.disk.layout import AcKeys, Layout, dir_id

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
# coalesced (coalescer.py).
SMALL_OP = WRITE_BATCH
# Hashes remembered for a re-check; beyond this the oldest are forgotten (the entry then heals at
# its next read instead).
MAX_SUSPECTS = 4096


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    """The store's worker pool; `trips` counts work items submitted (an observable of the
    one-trip-per-batch rule)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self.trips = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.trips += 1
        return super().submit(fn, *args, **kwargs)


class Core:
    """Shared state of one open store (event-loop side)."""

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
        self.publishing: dict[bytes, asyncio.Future[None]] = {}
        self.deleting: dict[bytes, asyncio.Future[None]] = {}
        self.tasks: set[asyncio.Future[Any]] = set()
        self.suspects: dict[str, None] = {}  # hex hashes to re-check (insertion order: oldest first)
        self.closing = False

    def check_open(self) -> None:
        if self.closing:
            raise StorageError("disk store is closed")

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

    async def wait_idle(self) -> None:
        """Until every rename, unlink and publish started so far has finished."""
        while self.in_flight():
            await asyncio.gather(
                *self.tasks, *self.publishing.values(), *self.deleting.values(), return_exceptions=True
            )
            await asyncio.sleep(0)  # their done-callbacks run in the next iteration

    def dirs_in_flight(self) -> set[bytes]:
        """Directories with a rename or unlink under way: their mtime says nothing yet."""
        return {dir_id(key) for key in (*self.publishing, *self.deleting)}

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
