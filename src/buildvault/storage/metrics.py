"""Per-tier metrics, counted at the store boundary.

Why a decorator: bytes read and written and action-entry hits are facts about a store, so they
are counted where a store is called, once per tier (the builder wraps every tier), instead of by
parsing protocol messages in a front end. storage/ defines no metric: it reports to a
`StoreRecorder` (server/metrics.py's `Metrics` is one), which owns the names.

The front end of a request may set `REQUEST_PROTOCOL` (e.g. "grpc") for the request's duration;
the recorder receives it with every count, so the outermost tier can carry the protocol label.
Batch calls are counted as one call; the per-blob work is a sum over the results.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Protocol

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import ActionStore, BlobStore, NotFound, Verified, as_pairs, close_chunks
from buildvault.storage.decorator import ForwardingActionStore, ForwardingBlobStore

# The tier that clients see (the whole stack); build.py names the others.
CLIENT_TIER = "client"

REQUEST_PROTOCOL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "buildvault_request_protocol", default=None
)


class StoreRecorder(Protocol):
    """Where a metered store reports. `tier` is the builder's name for the store ("client",
    "local", "object_store"); `protocol` is REQUEST_PROTOCOL at the time of the call."""

    def store_call(self, tier: str, operation: str) -> None: ...

    def store_read(self, tier: str, protocol: str | None, nbytes: int) -> None: ...

    def store_written(self, tier: str, protocol: str | None, nbytes: int) -> None: ...

    def store_action_lookup(self, tier: str, protocol: str | None, hit: bool) -> None: ...


class MeteredBlobStore(ForwardingBlobStore):
    """Counts calls by operation and the blob bytes that cross this boundary."""

    def __init__(self, inner: BlobStore, recorder: StoreRecorder, tier: str) -> None:
        super().__init__(inner)
        self.recorder = recorder
        self.tier = tier

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        self.recorder.store_call(self.tier, "find_missing")
        return await self.inner.find_missing(digests)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        self.recorder.store_call(self.tier, "find_missing")
        return await self.inner.find_missing_indices(function, hashes, sizes)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        self.recorder.store_call(self.tier, "read")
        chunks = await self.inner.read(digest, offset, limit)
        return self._counted(chunks, REQUEST_PROTOCOL.get())

    async def _counted(self, chunks: AsyncIterator[bytes], protocol: str | None) -> AsyncIterator[bytes]:
        total = 0
        try:
            async for chunk in chunks:
                total += len(chunk)
                yield chunk
        finally:
            await close_chunks(chunks)
            if total:
                self.recorder.store_read(self.tier, protocol, total)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        self.recorder.store_call(self.tier, "read_blobs")
        results = await self.inner.read_blobs(digests)
        total = sum(len(r) for r in results if isinstance(r, bytes))
        if total:
            self.recorder.store_read(self.tier, REQUEST_PROTOCOL.get(), total)
        return results

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        self.recorder.store_call(self.tier, "write")
        await self.inner.write(digest, chunks)
        if digest.size_bytes:
            self.recorder.store_written(self.tier, REQUEST_PROTOCOL.get(), digest.size_bytes)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        self.recorder.store_call(self.tier, "write_blobs")
        return self._written(items, await self.inner.write_blobs(items))

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        # Forwarded on purpose (metering changes no bytes): the local tier's fast path stays.
        self.recorder.store_call(self.tier, "write_blobs")
        return self._written(as_pairs(items), await self.inner.store_verified(items))

    def _written(
        self, items: Sequence[tuple[Digest, bytes]], outcomes: list[Exception | None]
    ) -> list[Exception | None]:
        total = sum(len(data) for (_, data), outcome in zip(items, outcomes, strict=True) if outcome is None)
        if total:
            self.recorder.store_written(self.tier, REQUEST_PROTOCOL.get(), total)
        return outcomes

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        self.recorder.store_call(self.tier, "lookup")
        return await self.inner.lookup(function, hash)


class MeteredActionStore(ForwardingActionStore):
    """Counts calls and action-entry lookups that found / did not find an entry."""

    def __init__(self, inner: ActionStore, recorder: StoreRecorder, tier: str) -> None:
        super().__init__(inner)
        self.recorder = recorder
        self.tier = tier

    async def get(self, namespace: str, digest: Digest) -> bytes:
        self.recorder.store_call(self.tier, "get")
        try:
            data = await self.inner.get(namespace, digest)
        except NotFound:
            self.recorder.store_action_lookup(self.tier, REQUEST_PROTOCOL.get(), False)
            raise
        self.recorder.store_action_lookup(self.tier, REQUEST_PROTOCOL.get(), True)
        return data

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        self.recorder.store_call(self.tier, "put")
        await self.inner.put(namespace, digest, data)
