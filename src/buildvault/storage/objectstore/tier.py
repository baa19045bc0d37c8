"""The object-store tier as the server assembles it: tiered CAS + AC over the bucket, the
upload journal and its uploader, the bucket's health.

    tier = build_object_tier(settings, fast_cas, fast_ac, data_dir, recorder=metrics)
    await tier.start()   # once the event loop runs: opens the journal, starts the uploader
    tier.cas, tier.ac    # the tiered stores
    await tier.aclose()

The slow side is composed from one-behaviour decorators, outermost first:

    MeteredBlobStore("object_store")        per-tier metrics (if a recorder is given)
      FailOpenBlobStore(health, budget)     unavailable = Unavailable, fast; probes while down
        ExistenceCache(PresenceIndex)       FindMissingBlobs without per-digest HEADs
          ObjectStore                       the bucket (boto3 off the event loop)

and the action side is MeteredActionStore(FailOpenActionStore(ObjectStore)). A server that
writes the bucket also renews the last use of the entries it serves (storage/objectstore/last_use.py), so
`buildvault gc` never ages out an entry builds still hit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildvault.storage import ActionStore, BlobStore, StorageError
from buildvault.storage.fail_open import FailOpenActionStore, FailOpenBlobStore, SlowTierHealth
from buildvault.storage.metrics import MeteredActionStore, MeteredBlobStore, StoreRecorder
from buildvault.storage.objectstore.journal import AC, CAS, JournalEntry, UploadJournal
from buildvault.storage.objectstore.last_use import LastUseRefresher
from buildvault.storage.objectstore.presence import ExistenceCache, PresenceIndex
from buildvault.storage.objectstore.tiered import TieredActionStore, TieredBlobStore

if TYPE_CHECKING:
    from buildvault.config import Settings
    from buildvault.storage.objectstore.store import ObjectStore

OBJECT_STORE_TIER = "object_store"


class ObjectTier:
    """The object-store tier: tiered CAS + AC, journal, uploader, health."""

    def __init__(
        self,
        object_store: ObjectStore,
        cas: TieredBlobStore,
        ac: TieredActionStore,
        journal: UploadJournal | None,
        health: SlowTierHealth,
        existence: ExistenceCache,
        last_use: LastUseRefresher | None = None,
    ) -> None:
        self.object_store = object_store
        self.cas = cas
        self.ac = ac
        self.journal = journal
        self.health = health
        self.existence = existence
        self.presence = existence.index
        self.last_use = last_use
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
        """What server/metrics.py's object-tier collector reads at every scrape."""
        stats: dict[str, Any] = {
            "healthy": self.health.healthy,
            "requests": dict(self.object_store.request_counts),
            "corrupt_objects": self.object_store.corrupt_objects,
            "presence_entries": len(self.presence),
            "cas": dict(self.cas.counters),
            "ac": dict(self.ac.counters),
        }
        if self.journal is not None:
            stats["journal"] = self.journal.stats()
        if self.last_use is not None:
            stats["last_use"] = {**self.last_use.counters, "pending": self.last_use.pending}
        return stats

    async def aclose(self) -> None:
        if self.last_use is not None:
            await self.last_use.aclose()
        if self.journal is not None and self._started:
            await self.journal.close()
        await self.existence.aclose()
        await self.health.close()
        self.object_store.close()


def build_object_tier(
    settings: Settings,
    fast_cas: BlobStore,
    fast_ac: ActionStore,
    data_dir: str | Path | None = None,
    *,
    object_store: ObjectStore | None = None,
    recorder: StoreRecorder | None = None,
    timeout: float = 10.0,
    budget: float | None = None,
    journal_options: dict[str, Any] | None = None,
    health_options: dict[str, Any] | None = None,
    presence: PresenceIndex | None = None,
    uploads: bool = True,
    head_concurrency: int = 32,
    **store_options: Any,
) -> ObjectTier | None:
    """The tiered stack for Settings, or None when no bucket is configured (local only).

    The journal lives in `{data_dir or settings.dir}/upload-journal`. Read-only
    (settings.s3_read_only) consumes the bucket and never writes it (no journal at all);
    `uploads=False` likewise keeps this server from uploading. `budget` (default
    settings.s3_request_budget) bounds bucket checks on a request path. Call `await tier.start()`."""
    if not settings.s3_bucket:
        return None
    from buildvault.storage.objectstore.store import ObjectStore

    store = object_store or ObjectStore.from_settings(settings, head_concurrency=head_concurrency, **store_options)
    read_only = settings.s3_read_only or store.read_only
    health = SlowTierHealth(store.probe, name=f"object store bucket {store.bucket}", **(health_options or {}))
    budget = settings.s3_request_budget if budget is None else budget
    journal = None
    if not read_only and uploads:
        directory = Path(data_dir if data_dir is not None else settings.dir) / "upload-journal"
        journal = UploadJournal(directory, **(journal_options or {}))
    cache = ExistenceCache(store, presence)
    slow_cas: BlobStore = FailOpenBlobStore(cache, health, budget=budget, timeout=timeout, parallel=head_concurrency)
    slow_ac: ActionStore = FailOpenActionStore(store, health, budget=budget, timeout=timeout)
    if recorder is not None:
        slow_cas = MeteredBlobStore(slow_cas, recorder, OBJECT_STORE_TIER)
        slow_ac = MeteredActionStore(slow_ac, recorder, OBJECT_STORE_TIER)
    cas = TieredBlobStore(
        fast_cas, slow_cas, journal, known_in_slow=cache.known_present, read_only=read_only, uploads=uploads
    )
    last_use = None if read_only or not uploads else LastUseRefresher(store.refresh_entry, lambda: health.healthy)
    served = last_use.served if last_use is not None else None
    ac = TieredActionStore(fast_ac, slow_ac, journal, read_only=read_only, uploads=uploads, served=served)
    return ObjectTier(store, cas, ac, journal, health, cache, last_use)
