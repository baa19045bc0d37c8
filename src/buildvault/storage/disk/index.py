"""The in-memory index: what is stored, in LRU order, and the space it uses or is promised.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from buildvault.digest import Digest, DigestFunction
from buildvault.storage.disk.layout import AC_TAG, FN_BYTE, SIZE_BYTES, cas_size, dir_id, held
from buildvault.storage.disk.records import charge

# Entries used this recently are not evicted for a write (see the module docstring). Ticks are
# whole seconds: an entry is held between HOLD_SECONDS - 1 and HOLD_SECONDS after its last use.
# 0: plain LRU.
HOLD_SECONDS = 2
AC_CACHE_BYTES = 4 << 20


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
        """The digests not stored, in input order, each once."""
        entries: dict[Any, int] = self.entries
        now = self.now()
        fn_byte = FN_BYTE
        fromhex = bytes.fromhex
        seen: set[object] = set()
        missing: list[Digest] = []
        for digest in digests:
            key: Any
            try:
                key = fn_byte[digest.function] + fromhex(digest.hash) + digest.size_bytes.to_bytes(SIZE_BYTES, "big")
                if len(key) != 39:
                    key = digest  # malformed: never stored
            except (ValueError, TypeError, OverflowError):
                key = digest
            if key in seen:
                continue
            seen.add(key)
            if entries.pop(key, None) is None:
                missing.append(digest)
            else:  # a client told "present" will reference it soon: keep it
                entries[key] = now
        return missing

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
