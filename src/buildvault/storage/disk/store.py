"""The disk store itself: `DiskStorage` (open, close, checkpoints, sync points, observables). Its
two faces, `DiskBlobStore` (the CAS) and `DiskActionStore` (action entries), which share one size
cap and one LRU, are in reads.py, where a request enters.

The hot paths, the on-disk layout and durability are described in the modules that own them
(reads, writes, core; layout; durability, snapshot, startup) and in
docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from buildvault.digest import Digest, InvalidDigest
from buildvault.storage import StorageError
from buildvault.storage.disk import layout, records, snapshot, startup
from buildvault.storage.disk.core import HOLD_SECONDS, AcCache, Core, DiskStats, cas_key, held
from buildvault.storage.disk.durability import SYNC_INTERVAL, EntryValidator, Syncer, opaque_entry_is_intact
from buildvault.storage.disk.reads import DiskActionStore, DiskBlobStore, Reader
from buildvault.storage.disk.writes import Writer

log = logging.getLogger("buildvault.storage.disk")


class DiskStorage:
    """The local content-addressed store. Use `await DiskStorage.open()`; one process per root.

    Writes are acknowledged once renamed into place (no fsync each); every `sync_interval`
    seconds, if anything changed, the filesystem is synced and the sync point recorded. The index
    snapshot is written every `checkpoint_interval` seconds and by close(). Entries used within
    `hold_seconds` are not evicted for a write (core.py; 0: plain LRU). Entries up to
    `record_limit` bytes (default records.RECORD_LIMIT) are records in LMDB (records.py; 0: every
    entry is a file).
    """

    def __init__(self, root: Path, max_size: int, core: Core, validate_entry: EntryValidator) -> None:
        """Use `open`, which also loads the index and starts the background tasks."""
        self.root = root
        self.max_size = max_size
        self._validate = validate_entry
        self._core = core
        self._writer = Writer(self._core)
        self._reader = Reader(self._core)
        self._syncer = Syncer(self._core.layout, self._core.index, self._core.records)
        self._lock_fd: int | None = None
        self._checkpointer: asyncio.Task[None] | None = None
        self._checkpointing = asyncio.Lock()  # one checkpoint at a time
        self._closed = False
        self.load_info: dict[str, Any] = {}
        self.cas = DiskBlobStore(core, self._writer, self._reader)
        self.ac = DiskActionStore(self._writer, self._reader)

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        root: Path | str,
        max_size: int,
        *,
        checkpoint_interval: float | None = 600.0,
        max_workers: int | None = None,
        sync_interval: float | None = SYNC_INTERVAL,
        validate_entry: EntryValidator | None = None,
        clock: Callable[[], float] = time.time,
        hold_seconds: int = HOLD_SECONDS,
        record_limit: int | None = None,
    ) -> DiskStorage:
        """Lock `root`, clear leftover temp files and rebuild the index, all off the event loop.

        After an unclean shutdown, entries changed since the last sync point are verified first:
        blobs by size and hash, action entries by `validate_entry(kind, data)` where kind is the
        namespace's kind ("ac", "raw"); without a validator every entry must only be non-empty and
        not zero-filled. `clock` is the wall clock (seconds) the LRU ages are kept in.
        """
        root = Path(root)
        limit = records.RECORD_LIMIT if record_limit is None else record_limit
        core = Core(root, max_size, max_workers, clock, hold_seconds, limit)
        storage = cls(root, max_size, core, validate_entry or opaque_entry_is_intact)
        try:
            loaded = await core.io(storage._load, what=f"opening {root}")
        except BaseException:
            core.executor.shutdown(wait=False)
            storage._syncer.shutdown_now()
            core.records.close()
            if storage._lock_fd is not None:
                os.close(storage._lock_fd)
                storage._lock_fd = None
            raise
        core.index.load(loaded.entries, loaded.ac_sizes, loaded.used)
        storage.load_info = loaded.info
        if loaded.used > max_size:  # the cap was lowered since the last run
            await core.settle_all(core.evict(loaded.used - max_size, hold=False))
        if checkpoint_interval:
            storage._checkpointer = asyncio.create_task(storage._checkpoint_loop(checkpoint_interval))
        if sync_interval:
            storage._syncer.start(sync_interval)
        return storage

    def _load(self) -> startup.Loaded:
        started = time.perf_counter()
        where = self._core.layout
        self._lock_fd = startup.lock_root(where)
        loaded = startup.rebuild_index(where, self._validate, self._core.records)
        loaded.info["seconds"] = time.perf_counter() - started
        # What was found is on disk now (a killed process leaves it in the page cache only):
        # the new sync point also says "running", so a crash from here on is unclean.
        self._syncer.mark(time.time_ns(), False)
        return loaded

    async def close(self) -> None:
        """Refuse new work, finish publishes and deletions, write the snapshot, release the directory.

        Call it once the servers have stopped: a write still streaming may fail (its temp file is
        removed at the next start).
        """
        core = self._core
        if not core.refuse_new_work():
            return
        try:
            if self._checkpointer is not None:
                self._checkpointer.cancel()
                await asyncio.gather(self._checkpointer, return_exceptions=True)
            await self._syncer.stop()
            await core.drain()
            try:
                await self._checkpoint(quiesced=True)
            except StorageError as e:
                log.warning("could not write the index snapshot: %s", e)
            try:
                await self._syncer.mark_clean()  # everything is on disk: the next start verifies nothing
            except OSError as e:
                log.warning("could not record the clean shutdown: %s", e)
        finally:
            self._closed = True
            await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._core.executor.shutdown(wait=True)
        self._syncer.shutdown()
        self._core.records.close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def abandon(self) -> None:
        """Stop at once, as a killed process would: no snapshot, no last sync, no clean-shutdown
        record; the directory is released and the next open recovers (fault drills and tests)."""
        core = self._core
        core.refuse_new_work()
        if self._checkpointer is not None:
            self._checkpointer.cancel()
        self._syncer.abandon()
        core.executor.shutdown(wait=True)
        core.records.close()  # no sync: what LMDB committed is with the kernel, as after kill -9
        self._release_lock()
        self._closed = True

    async def __aenter__(self) -> DiskStorage:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- snapshot and sync points ----------------------------------------------------------

    async def checkpoint(self) -> None:
        """Persist the index and LRU order (snapshot.py); copying the keys is the only event-loop work."""
        await self._checkpoint(quiesced=False)

    async def _checkpoint(self, *, quiesced: bool) -> None:
        if self._closed:
            raise StorageError("disk store is closed")
        async with self._checkpointing:
            await snapshot.take(self._core, quiesced=quiesced)

    async def _checkpoint_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.checkpoint()
            except StorageError as e:
                log.warning("could not write the LRU snapshot: %s", e)

    async def sync(self) -> None:
        """Make every write acknowledged so far durable, and record the sync point."""
        if self._closed:
            raise StorageError("disk store is closed")
        await self._syncer.sync()

    async def namespaces(self) -> list[str]:
        """The AC namespaces that have a directory or a record in the store (pins are looked for in each)."""
        core = self._core
        on_disk = await core.io(layout.ac_namespaces, core.layout.ac_dir, what="listing namespaces")
        in_records = await core.io(records.namespaces, core.records, what="listing namespaces")
        return sorted(set(on_disk) | set(in_records))

    def protect(self, blobs: Iterable[Digest], actions: Iterable[tuple[str, Digest]]) -> None:
        """Replace the set of entries eviction must skip (pinned versions: their blobs and action
        entries). Entries not stored yet are protected once they are."""
        keys: set[bytes] = set()
        for digest in blobs:
            with contextlib.suppress(InvalidDigest):
                keys.add(cas_key(digest))
        for namespace, digest in actions:
            with contextlib.suppress(InvalidDigest):
                keys.add(self._core.ac_keys.key(namespace, digest))
        self._core.index.protected = keys

    # -- observables -----------------------------------------------------------------------

    def stats(self) -> DiskStats:
        return self._core.index.stats()

    @property
    def synced_at(self) -> int | None:
        """The last sync point recorded in SYNC (wall clock ns): every change before it is on disk."""
        return self._syncer.synced_at

    @property
    def sync_rounds(self) -> int:
        """How often the periodic syncer has woken up (it syncs only if something changed)."""
        return self._syncer.rounds

    @property
    def reserved_bytes(self) -> int:
        """Bytes promised to writes in progress."""
        return self._core.index.reserved

    @property
    def in_flight(self) -> int:
        """Renames, unlinks and publishes under way."""
        return self._core.in_flight()

    @property
    def pool_trips(self) -> int:
        """Work items handed to the worker pool so far (coalesced trips count once)."""
        return self._core.executor.trips

    @property
    def ac_memory(self) -> AcCache:
        """The action entries held in memory (len, nbytes; clear() makes the next get read the file)."""
        return self._core.index.ac_cache

    async def wait_idle(self) -> None:
        """Return once every rename, unlink and publish started so far has finished."""
        await self._core.wait_idle()

    def entry_paths(self) -> list[str]:
        """The file of every indexed entry that is a file, least recently used first (O(entries):
        for checks, not for request paths)."""
        path, index = self._core.layout.path, self._core.index
        return [path(key) for key in index.entries if not index.in_records(key)]

    def record_keys(self) -> list[bytes]:
        """The key of every indexed entry that is a record, least recently used first (for checks)."""
        index = self._core.index
        return [key for key in index.entries if index.in_records(key)]

    def stored_records(self) -> dict[bytes, int]:
        """Every record in LMDB, key -> data size (blocking, O(records): for checks, never on a
        request path)."""
        return dict(records.keys_and_sizes(self._core.records))

    def is_record(self, digest: Digest) -> bool:
        """Whether the blob `digest` is (or would be) a record rather than a file."""
        return held(self._core.index.limit, cas_key(digest), digest.size_bytes)

    @property
    def record_limit(self) -> int:
        """Entries up to this many bytes are records (0: none)."""
        return self._core.index.limit

    async def record_stats(self) -> dict[str, Any]:
        """LMDB's figures: entries, pages, the data file's bytes on disk (for checks and the bench)."""
        return dict(await self._core.io(records.stat, self._core.records, what="reading record stats"))

    def path_of(self, digest: Digest) -> str:
        """Where the blob `digest` is (or would be) stored as a file (see is_record)."""
        return self._core.layout.path(cas_key(digest))
