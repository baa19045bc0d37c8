"""The object-store tier as one server runs it: tiered CAS + AC over the bucket, the upload
journal and its uploader, the bucket's health, the last-use renewal. storage/build.py
(`build_object_tier`) composes it; this is what the process holds on to.

    tier = build_object_tier(settings, fast_cas, fast_ac, data_dir, recorder=metrics)
    await tier.start()   # once the event loop runs: opens the journal, starts the uploader
    tier.cas, tier.ac    # the tiered stores
    tier.stats()         # for /metrics and /status
    await tier.aclose()
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from buildvault.storage import StorageError
from buildvault.storage.fail_open import SlowTierHealth
from buildvault.storage.objectstore.journal import AC, CAS, JournalEntry, UploadJournal
from buildvault.storage.objectstore.last_use import LastUseRefresher
from buildvault.storage.objectstore.presence import ExistenceCache
from buildvault.storage.objectstore.tiered import TieredActionStore, TieredBlobStore

if TYPE_CHECKING:
    from buildvault.storage.objectstore.store import ObjectStore


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

