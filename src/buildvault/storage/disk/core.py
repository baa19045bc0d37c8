"""The one owner of the state every disk-store operation shares.

`Core` holds the layout, the index, the worker pool and its coalescer, and the maps of renames
and unlinks in flight (at most one per key, so the index never says "present" for a file an
eviction is about to remove, nor the reverse). Those maps, the publish tasks and the suspects
change only through its methods: reserving space (evicting first), claiming a key, starting and
finishing a publish, deleting, dropping a damaged or vanished entry, re-checking suspects. The
write and read paths (writes.py, reads.py) read those maps but change them only through these
methods; the index they change through its own (`touch`, `Reservation`, the AC memory's `put`).

Healing: a read that finds a file gone or damaged drops its entry at once (reads.py). A lookup by
hash alone (bazel-remote's GET /cas/{hash}) knows no size, so it cannot name the entry; it records
the hash in `suspects` instead, and the next FindMissingBlobs or write naming a digest of that hash
stats the file (one coalesced trip) before answering: gone or of the wrong size, the entry leaves
the index, so the blob is reported missing and the next upload stores it. A record (records.py) is
looked up in the same trip instead: its size is in its key, and its content is checked when it is
read. `suspects` is empty almost always, and the hot paths test only that.

`Index`, the in-memory index: what is stored, in LRU order, and the space it uses or is promised.

Index memory: one dict, key = the layout's byte key, value = the last-access second, an int
object shared by every entry touched in the same second. Dict order is the LRU order (touch =
pop and re-insert). That is ~130 bytes per blob, where an OrderedDict would be ~190. Deleting
from the front of a dict leaves holes the next scan walks over, so eviction frees a little slack
(max_size/1024) at a time instead of one blob per write.

Recency is kept here and persisted in the snapshot, not derived from atime/mtime: atime is
usually off (noatime/relatime), and keeping mtime current would cost a metadata write per read.

Space: `used` counts published entries, `reserved` bytes promised to writes in progress
(`Reservation`); `used + reserved` never exceeds max_size once eviction has run. A file counts
its size, a record (an entry up to `limit` bytes: records.py) what it takes in LMDB's pages
(`records.charge`), so the cap holds on disk for both.

Eviction while serving: an entry used within the last HOLD_SECONDS (written, read, confirmed by
FindMissingBlobs, or named by an ActionResult just served, whose completeness check is such a
confirmation) is not evicted to make room for a write: the client told about it is about to
fetch or reference it, and an ActionCache hit whose output is gone fails a Bazel build, while a
refused upload (StorageFull: RESOURCE_EXHAUSTED) only costs a later rebuild. Dict order is
recency order, so eviction stops at the first such entry.

FindMissingBlobs is answered from the index alone (`find_missing`, `missing_indices`): no
syscalls, no pool trip, keys built inline (1,000 digests a call). Hits count as uses: a client
told "present" will reference the blob soon.

Action entries recently written or read are kept in memory (`AcCache`, first in first out within
AC_CACHE_BYTES), so a GetActionResult hit makes no trip to the worker threads; the index keeps it
current (an entry replaced or evicted leaves it at once).

The keys and paths every operation needs (`cas_key`, `Layout`, `AcKeys`, `held`) are made here,
in the format layout.py defines (whose module docstring draws the tree).

The pool file work runs in (`CountingPool`), and how small operations get there (`Coalescer`):
every small operation (a whole small blob or entry written, read or unlinked) is queued on the
event loop; everything queued by the next loop iteration goes to the worker threads as one work
item and its results come back in one loop wakeup, so a BatchUpdateBlobs of 100 blobs is one
trip, not 100.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.storage import CapacityExceeded, StorageError, StorageFull
from buildvault.storage.disk import fileops, records
from buildvault.storage.disk.layout import (
    AC_TAG,
    FN_BY_BYTE,
    FN_BYTE,
    MAX_BLOB,
    MAX_KEY,
    SIZE_BYTES,
    check_namespace,
    dir_id,
)
from buildvault.storage.disk.records import charge

log = logging.getLogger("buildvault.storage.disk")

# Blobs and entries up to this size are written and read whole, and their file operations are
# coalesced (`Coalescer`); larger writes stream in batches of this size (writes.py).
SMALL_OP = 1 << 20
# Hashes remembered for a re-check; beyond this the oldest are forgotten (the entry then heals at
# its next read instead).
MAX_SUSPECTS = 4096


# Entries used this recently are not evicted for a write (see the module docstring). Ticks are
# whole seconds: an entry is held between HOLD_SECONDS - 1 and HOLD_SECONDS after its last use.
# 0: plain LRU.
HOLD_SECONDS = 2
AC_CACHE_BYTES = 4 << 20


# -- keys and paths --------------------------------------------------------------------------------
def held(limit: int, key: bytes, size: int) -> bool:
    """Whether an entry of this key and size is a record (else a file)."""
    return size <= limit and len(key) <= MAX_KEY


def cas_key(digest: Digest) -> bytes:
    """Index key: function byte + raw hash + size. Raises InvalidDigest for a malformed hash."""
    try:
        raw = bytes.fromhex(digest.hash)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 32 or not 0 <= digest.size_bytes < MAX_BLOB:
        raise InvalidDigest(f"invalid digest {digest}")
    return FN_BYTE[digest.function] + raw + digest.size_bytes.to_bytes(SIZE_BYTES, "big")


def cas_size(key: bytes) -> int:
    """The blob size a CAS key carries."""
    return int.from_bytes(key[33:], "big")


class Layout:
    """The paths of one store root (computed once: `path` is on every hot path)."""

    __slots__ = ("root", "cas_dir", "ac_dir", "records_dir", "tmp_dir", "snapshot_path", "sync_path", "lock_path")

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cas_dir = str(root / "cas")
        self.ac_dir = str(root / "ac")
        self.records_dir = str(root / "records")
        self.tmp_dir = str(root / "tmp")
        self.snapshot_path = str(root / "index.lru")
        self.sync_path = str(root / "SYNC")
        self.lock_path = str(root / "LOCK")

    def path(self, key: bytes) -> str:
        """The file of an index key (an entry that is a file: `held`)."""
        if key[0] == AC_TAG:
            hex_hash = key[-32:].hex()
            namespace = key[1:-34].decode()
            label = FN_BY_BYTE[key[-33]].label
            return f"{self.ac_dir}/{namespace}/@{label}/{hex_hash[:2]}/{hex_hash}"
        hex_hash = key[1:33].hex()
        return f"{self.cas_dir}/{FN_BY_BYTE[key[0]].label}/{hex_hash[:2]}/{hex_hash}-{cas_size(key)}"

    def shard_dir(self, function: DigestFunction, hex_hash: str) -> str:
        """The CAS leaf directory a blob with this hash lives in."""
        return f"{self.cas_dir}/{function.label}/{hex_hash[:2]}"


class AcKeys:
    """AC index keys, with validated namespaces remembered (a namespace is checked once, not per call)."""

    __slots__ = ("_prefixes",)

    def __init__(self) -> None:
        self._prefixes: dict[str, bytes] = {}  # validated namespace -> key prefix

    def key(self, namespace: str, digest: Digest) -> bytes:
        """Raises InvalidDigest for a bad namespace or hash."""
        cached = self._prefixes.get(namespace)
        if cached is None:
            check_namespace(namespace)
            if len(self._prefixes) > 10_000:
                self._prefixes.clear()
            cached = self._prefixes[namespace] = b"A" + namespace.encode() + b"\x00"
        try:
            raw = bytes.fromhex(digest.hash)
        except (ValueError, TypeError):
            raw = b""
        if len(raw) != 32:
            raise InvalidDigest(f"invalid digest {digest}")
        return cached + FN_BYTE[digest.function] + raw


# -- the pool ---------------------------------------------------------------------------------------
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


@dataclass(frozen=True, slots=True)
class DiskStats:
    """What the metrics endpoint and the /status page show about the disk tier."""

    used_bytes: int
    max_bytes: int
    blob_count: int
    ac_entries: int
    evictions_total: int
    lru_age_seconds: float  # age of the least recently used entry: how long an item survives


class AcCache:
    """AC key -> entry bytes, oldest first. An entry over 1/64 of the capacity is not kept."""

    __slots__ = ("_entries", "nbytes")

    def __init__(self) -> None:
        self._entries: dict[bytes, bytes] = {}
        self.nbytes = 0  # bytes held

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> bytes | None:
        return self._entries.get(key)

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > AC_CACHE_BYTES // 64:
            return
        self.discard(key)
        entries = self._entries
        entries[key] = data
        self.nbytes += len(data)
        while self.nbytes > AC_CACHE_BYTES:
            self.discard(next(iter(entries)))

    def discard(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def held_bytes(self) -> int:
        """The sum of the held entries' sizes (recounted: `nbytes` must equal it)."""
        return sum(map(len, self._entries.values()))


class Index:
    """Keys in LRU order with their last access, AC sizes, and the space accounting.

    Event-loop side only. `clock` gives the wall clock in seconds (injectable for tests).
    """

    __slots__ = (
        "entries",
        "ac_sizes",
        "ac_cache",
        "max_size",
        "slack",
        "used",
        "reserved",
        "evictions",
        "ac_published",
        "unsynced",
        "tracking",
        "protected",
        "clock",
        "hold_seconds",
        "limit",
        "_tick",
    )

    def __init__(
        self,
        max_size: int,
        clock: Callable[[], float] = time.time,
        hold_seconds: int = HOLD_SECONDS,
        limit: int = 0,
    ) -> None:
        self.entries: dict[bytes, int] = {}  # key -> last access (unix seconds); order = LRU order
        self.ac_sizes: dict[bytes, int] = {}  # AC sizes are not in their keys (entries get replaced)
        self.ac_cache = AcCache()
        self.max_size = max_size
        # Evicting a little more than needed keeps front-of-dict scans rare (see module docstring).
        self.slack = min(max_size // 1024, 64 << 20)
        self.used = 0  # bytes of published entries
        self.reserved = 0  # bytes promised to writes in progress
        self.evictions = 0
        self.ac_published = 0  # AC publishes so far: a read that raced one is not cached
        self.unsynced = False  # something was published since the last sync point
        self.tracking: set[bytes] | None = None  # dirs whose entries changed during a checkpoint
        self.protected: set[bytes] = set()  # pinned entries: eviction never picks them
        self.clock = clock
        self.hold_seconds = hold_seconds
        self.limit = limit  # entries up to this size are records (records.py), larger ones files
        self._tick = int(clock())

    def load(self, entries: dict[bytes, int], ac_sizes: dict[bytes, int], used: int) -> None:
        self.entries, self.ac_sizes, self.used = entries, ac_sizes, used

    def now(self) -> int:
        """Current second, as one int object shared by all entries touched within it."""
        now = int(self.clock())
        if now != self._tick:
            self._tick = now
        return self._tick

    def touch(self, key: bytes) -> None:
        """A use: move to the most recently used end."""
        entries = self.entries
        del entries[key]
        entries[key] = self.now()

    def data_size(self, key: bytes) -> int:
        """The entry's size in bytes (an AC entry's from ac_sizes, a blob's from its key)."""
        return self.ac_sizes[key] if key[0] == AC_TAG else cas_size(key)

    def cost(self, key: bytes, size: int) -> int:
        """What an entry of `size` bytes counts for in the cap: its size as a file, its pages as a record."""
        return charge(key, size) if held(self.limit, key, size) else size

    def in_records(self, key: bytes) -> bool:
        """Whether the indexed entry `key` is a record (else a file)."""
        return held(self.limit, key, self.data_size(key))

    def entry_size(self, key: bytes) -> int:
        """What the indexed entry `key` counts for in the cap."""
        return self.cost(key, self.data_size(key))

    def forget(self, key: bytes) -> int:
        """Drop an entry from the index, the accounting and the AC cache; return its size."""
        size = self.entry_size(key)
        del self.entries[key]
        if self.ac_sizes.pop(key, None) is not None:
            self.ac_cache.discard(key)
        self.used -= size
        if self.tracking is not None:
            self.tracking.add(dir_id(key))
        return size

    def indexed(self, key: bytes, reservation: Reservation, size: int) -> None:
        """The entry (`size` bytes) is in place: index it, turning its reservation into used bytes."""
        if key in self.entries:
            self.forget(key)
        reservation.release()
        self.entries[key] = self.now()
        if key[0] == AC_TAG:
            self.ac_sizes[key] = size
            self.ac_published += 1
        self.used += self.cost(key, size)
        self.unsynced = True
        if self.tracking is not None:
            self.tracking.add(dir_id(key))

    def evict(self, need: int, busy: Container[bytes], *, hold: bool = True) -> list[tuple[bytes, bool]]:
        """Forget least recently used entries (skipping `busy` and protected ones, and with `hold`
        stopping at the first one used within `hold_seconds`) until `need` bytes are freed; return
        them, each with whether it is a record: their files or records are the caller's to delete.
        Fewer than `need` bytes may be freed."""
        victims: list[tuple[bytes, bool]] = []
        freed = 0
        now = self.now()
        # Entries used after `recent` are held; a tick after `now` (the clock was set back) is not,
        # or a clock set back an hour would hold every entry for that hour.
        recent = now - self.hold_seconds if hold and self.hold_seconds > 0 else now
        for key, tick in self.entries.items():
            if freed >= need or recent < tick <= now:
                break
            if key in busy or key in self.protected:  # busy: an AC entry being replaced becomes the newest
                continue
            size = self.data_size(key)
            record = held(self.limit, key, size)
            victims.append((key, record))
            freed += charge(key, size) if record else size
        for key, _record in victims:
            self.forget(key)
        self.evictions += len(victims)
        return victims

    def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        """The digests not stored, in input order, each once (`missing_indices` per digest function)."""
        functions = {d.function for d in digests}
        if len(functions) <= 1:  # the usual case: one function, one pass
            groups = [list(range(len(digests)))] if digests else []
        else:
            groups = [[i for i, d in enumerate(digests) if d.function is f] for f in functions]
        missing: list[int] = []
        for group in groups:
            absent = self.missing_indices(
                digests[group[0]].function,
                [digests[i].hash for i in group],
                [digests[i].size_bytes for i in group],
            )
            missing += (group[j] for j in absent)
        if len(groups) > 1:
            missing.sort()
        return [digests[i] for i in missing]

    def missing_indices(self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """find_missing without Digest objects: positions of the absent (first occurrences), ascending."""
        entries: dict[Any, int] = self.entries
        now = self.now()
        fn_byte = FN_BYTE[function]
        fromhex = bytes.fromhex
        missing: list[int] = []
        unique = len(set(hashes)) == len(hashes)  # the usual case: no need to track duplicates
        seen: set[object] = set()
        for i, (hex_hash, size) in enumerate(zip(hashes, sizes, strict=False)):  # callers pass equal lengths
            key: Any
            try:
                key = fn_byte + fromhex(hex_hash) + size.to_bytes(SIZE_BYTES, "big")
                if len(key) != 39:
                    key = (hex_hash, size)  # malformed: never stored
            except (ValueError, TypeError, OverflowError):
                key = (hex_hash, size)
            if not unique:
                if key in seen:
                    continue
                seen.add(key)
            if entries.pop(key, None) is None:
                missing.append(i)
            else:  # a client told "present" will reference it soon: keep it
                entries[key] = now
        return missing

    def stats(self) -> DiskStats:
        age = 0.0
        if self.entries:
            age = max(0.0, self.clock() - self.entries[next(iter(self.entries))])
        return DiskStats(
            used_bytes=self.used,
            max_bytes=self.max_size,
            blob_count=len(self.entries) - len(self.ac_sizes),
            ac_entries=len(self.ac_sizes),
            evictions_total=self.evictions,
            lru_age_seconds=age,
        )


class Reservation:
    """Bytes promised to one write. Publishing turns them into used bytes in the same step, so
    `used + reserved` never counts a blob twice; release() is idempotent for every other exit."""

    __slots__ = ("index", "size")

    def __init__(self, index: Index, size: int) -> None:
        self.index = index
        self.size = size
        index.reserved += size

    def release(self) -> None:
        self.index.reserved -= self.size
        self.size = 0


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

    def discard(self, key: bytes) -> asyncio.Future[None] | None:
        """Drop a stored blob its owner no longer needs (the chunk store, once the blob is kept as
        chunks): forget it and delete its file, unless it is pinned or being published. A read
        already under way keeps its open file."""
        if key not in self.index.entries or key in self.publishing or key in self.index.protected:
            return None
        record = self.index.in_records(key)
        self.index.forget(key)
        return self.delete_file(key, record)

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
            sizes = await self.ops.submit(records.sizes_of, (self.records, files, keys, in_records))
        except OSError as e:
            raise fileops.storage_error(e, "re-checking blobs a lookup did not find") from e
        for (key, size), found in zip(held, sizes, strict=True):
            if found is None:
                self.drop_missing(key)
            elif found != size:
                self.drop_damaged(key)
