"""Each one-behaviour store decorator: what it changes, and that it forwards the rest (batch
paths included) as one call."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest
import urllib3.exceptions

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import (
    REQUEST_PROTOCOL,
    BlobStore,
    DigestMismatch,
    EmptyBlobStore,
    ForwardingBlobStore,
    InvalidRange,
    MeteredActionStore,
    MeteredBlobStore,
    NotFound,
    Unavailable,
    single_chunk,
)
from buildvault.storage.fail_open import FailOpenActionStore, FailOpenBlobStore, SlowTierHealth
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore
from buildvault.storage.objectstore.presence import ExistenceCache, PresenceIndex

EMPTY = Digest.of(b"")


class Recording(ForwardingBlobStore):
    """Counts the calls that reach `inner` and the digests asked about."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.asked: list[Digest] = []

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        self.calls["find_missing"] += 1
        self.asked += digests
        return await self.inner.find_missing(digests)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        self.calls["find_missing_indices"] += 1
        self.asked += [Digest(h, s, function) for h, s in zip(hashes, sizes, strict=True)]
        return await self.inner.find_missing_indices(function, hashes, sizes)

    async def write(self, digest: Digest, chunks) -> None:
        self.calls["write"] += 1
        await self.inner.write(digest, chunks)

    async def write_blobs(self, items):
        self.calls["write_blobs"] += 1
        return await self.inner.write_blobs(items)

    async def read_blobs(self, digests):
        self.calls["read_blobs"] += 1
        return await self.inner.read_blobs(digests)


class Gated(Recording):
    """A Recording whose find_missing waits for `release` after setting `entered`."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        self.entered.set()
        await self.release.wait()
        return await super().find_missing(digests)


def blobs(n: int) -> list[tuple[Digest, bytes]]:
    return [(Digest.of(data := os.urandom(50 + i)), data) for i in range(n)]


async def read_all(store: BlobStore, digest: Digest, offset: int = 0, limit: int = 0) -> bytes:
    return b"".join([c async for c in await store.read(digest, offset, limit)])


# -- the empty blob ------------------------------------------------------------------------


async def test_the_empty_blob_is_present_and_never_reaches_the_store():
    inner = Recording(MemoryBlobStore())
    store = EmptyBlobStore(inner)
    (d, data), = blobs(1)  # fmt: skip
    for function in DigestFunction:
        empty = Digest.of(b"", function)
        assert await store.find_missing([empty, d]) == [d]
        assert await store.lookup(function, empty.hash) == empty
        assert await read_all(store, empty) == b""
    assert EMPTY not in inner.asked
    assert await store.find_missing_indices(DigestFunction.SHA256, [EMPTY.hash, d.hash], [0, d.size_bytes]) == [1]
    results = await store.read_blobs([EMPTY, d])
    assert results[0] == b"" and isinstance(results[1], NotFound)
    outcomes = await store.write_blobs([(EMPTY, b""), (EMPTY, b"x")])
    assert outcomes[0] is None and isinstance(outcomes[1], DigestMismatch)
    await store.write(EMPTY, single_chunk(b""))
    with pytest.raises(DigestMismatch):
        await store.write(EMPTY, single_chunk(b"not empty"))
    with pytest.raises(InvalidRange):
        await store.read(EMPTY, 1)
    assert await inner.inner.find_missing([EMPTY]) == [EMPTY]  # nothing was stored for it


async def test_a_batch_without_the_empty_blob_is_forwarded_as_it_is():
    inner = Recording(MemoryBlobStore())
    store = EmptyBlobStore(inner)
    items = blobs(5)
    assert await store.write_blobs(items) == [None] * 5
    assert await store.read_blobs([d for d, _ in items]) == [data for _, data in items]
    hashes, sizes = [d.hash for d, _ in items], [d.size_bytes for d, _ in items]
    assert await store.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == []
    assert inner.calls == {"write_blobs": 1, "read_blobs": 1, "find_missing_indices": 1}


# -- the existence cache -------------------------------------------------------------------


async def test_existence_cache_asks_once_per_unknown_digest_in_one_call():
    slow = MemoryBlobStore()
    stored, absent = blobs(3), blobs(2)
    await slow.write_blobs(stored)
    inner = Recording(slow)
    cache = ExistenceCache(inner)
    digests = [d for d, _ in stored + absent]
    assert await cache.find_missing(digests + digests[:1]) == [d for d, _ in absent]
    assert inner.calls == {"find_missing": 1} and len(inner.asked) == 5
    hashes, sizes = [d.hash for d in digests], [d.size_bytes for d in digests]
    assert await cache.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == [3, 4]  # negatives kept too
    assert inner.calls == {"find_missing": 1}
    assert all(cache.known_present(d) for d, _ in stored) and not cache.known_present(absent[0][0])


async def test_existence_cache_reports_a_digest_asked_twice_once_at_its_first_index():
    slow = MemoryBlobStore()
    stored, absent = blobs(2), blobs(2)
    await slow.write_blobs(stored)
    cache = ExistenceCache(slow)
    digests = [d for d, _ in [absent[0], stored[0], absent[1], absent[0], stored[1], absent[1]]]
    hashes, sizes = [d.hash for d in digests], [d.size_bytes for d in digests]
    assert await cache.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == [0, 2]  # asked
    assert await cache.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == [0, 2]  # known


def test_presence_answers_expire_at_their_ttl():
    now = [1000.0]
    index = PresenceIndex(positive_ttl=60.0, negative_ttl=5.0, clock=lambda: now[0])
    (present, _), (absent, _) = blobs(2)
    index.set(present, True)
    index.set(absent, False)
    hashes, sizes = [present.hash, absent.hash], [present.size_bytes, absent.size_bytes]
    assert index.get_many(DigestFunction.SHA256, hashes, sizes) == [True, False]
    now[0] += 4.9
    assert index.get_many(DigestFunction.SHA256, hashes, sizes) == [True, False]
    now[0] += 0.1  # the negative answer is 5 s old: asked again
    assert index.get_many(DigestFunction.SHA256, hashes, sizes) == [True, None]
    assert index.get(absent) is None and len(index) == 1
    now[0] += 55.0
    assert index.get(present) is None and len(index) == 0


def test_presence_lookups_keep_positive_answers_in_use_and_let_negative_ones_age():
    (a, _), (b, _), (c, _) = blobs(3)

    def look(index: PresenceIndex, digest: Digest) -> bool | None:
        return index.get_many(DigestFunction.SHA256, [digest.hash], [digest.size_bytes])[0]

    index = PresenceIndex(max_entries=2)
    index.set(a, True)
    index.set(b, False)
    assert look(index, a) is True  # a use: a is now the newest
    index.set(c, False)  # the oldest makes room
    assert (index.get(a), index.get(b), index.get(c)) == (True, None, False)

    index = PresenceIndex(max_entries=2)
    index.set(b, False)
    index.set(c, False)
    assert look(index, b) is False  # not a use: b stays the oldest
    index.set(a, True)
    assert (index.get(a), index.get(b), index.get(c)) == (True, None, False)

    index = PresenceIndex(max_entries=2)  # the same rule for a lookup of one digest
    index.set(b, False)
    index.set(c, False)
    assert index.get(b) is False
    index.set(a, True)
    assert (index.get(a), index.get(b), index.get(c)) == (True, None, False)


async def test_existence_cache_shares_checks_in_flight():
    inner = Gated(MemoryBlobStore())
    entered, release = inner.entered, inner.release
    cache = ExistenceCache(inner)
    digests = [d for d, _ in blobs(10)]
    callers = [asyncio.ensure_future(cache.find_missing(digests)) for _ in range(3)]
    await entered.wait()  # the first caller is asking; the others (scheduled before it) wait on it
    release.set()
    assert [await c for c in callers] == [digests] * 3
    assert inner.calls == {"find_missing": 1} and len(inner.asked) == 10


async def test_existence_check_outlives_a_caller_that_gives_up_and_is_cached():
    # The request path's budget gives up on a slow bucket; the check goes on, so the next request
    # about the same digests is answered from the cache instead of asking (and waiting) again.
    slow = MemoryBlobStore()
    stored, absent = blobs(2), blobs(2)
    await slow.write_blobs(stored)
    inner = Gated(slow)
    entered, release = inner.entered, inner.release
    cache = ExistenceCache(inner)
    digests = [d for d, _ in stored + absent]
    impatient = asyncio.ensure_future(cache.find_missing(digests))
    await entered.wait()
    impatient.cancel()
    with pytest.raises(asyncio.CancelledError):
        await impatient
    release.set()
    assert await cache.find_missing(digests) == [d for d, _ in absent]  # joins or reads the finished check
    assert inner.calls == {"find_missing": 1}
    assert all(cache.known_present(d) for d, _ in stored)
    await cache.aclose()


async def test_existence_cache_learns_from_writes_and_forgets_corrupt_reads():
    inner = Recording(MemoryBlobStore())
    cache = ExistenceCache(inner)
    (d, data), = blobs(1)  # fmt: skip
    await cache.write(d, single_chunk(data))
    assert cache.known_present(d)

    class CorruptMidStream(ForwardingBlobStore):
        async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
            async def chunks() -> AsyncIterator[bytes]:
                yield b"part"
                raise NotFound("corrupt object")

            return chunks()

    corrupt = ExistenceCache(CorruptMidStream(inner))
    corrupt.index.set(d, True)
    with pytest.raises(NotFound):
        await read_all(corrupt, d)
    assert corrupt.index.get(d) is False  # reported missing: a client uploads it again


# -- fail-open -----------------------------------------------------------------------------


class Broken(ForwardingBlobStore):
    """A slow tier that fails (as botocore lets a reset escape mid-reply) or hangs while `mode` says so."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.mode = "ok"
        self.calls = 0

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        self.calls += 1
        if self.mode == "reset":
            raise urllib3.exceptions.ProtocolError("Connection broken: ConnectionResetError(104)")
        if self.mode == "hang":
            await asyncio.Event().wait()
        return await self.inner.find_missing(digests)


async def test_fail_open_turns_every_failure_into_unavailable_and_fails_fast_while_down():
    inner = Broken(MemoryBlobStore())
    probe_ok = asyncio.Event()

    async def probe() -> None:
        if not probe_ok.is_set():
            raise ConnectionError("still down")

    health = SlowTierHealth(probe, initial_backoff=0.01, max_backoff=0.02)
    store = FailOpenBlobStore(inner, health, budget=0.05, timeout=1.0)
    (d, _), = blobs(1)  # fmt: skip
    assert await store.find_missing([d]) == [d] and health.healthy
    inner.mode = "reset"
    with pytest.raises(Unavailable):
        await store.find_missing([d])
    assert not health.healthy
    calls = inner.calls
    with pytest.raises(Unavailable):
        await store.find_missing([d])
    assert inner.calls == calls  # while down the tier is not asked at all
    with pytest.raises(NotFound):  # a clean answer is not a failure ...
        await FailOpenBlobStore(MemoryBlobStore(), SlowTierHealth(probe), budget=1, timeout=1).read(d)
    inner.mode = "ok"
    probe_ok.set()
    await asyncio.wait_for(health.wait_healthy(), 5)  # ... and the probe brings the tier back
    assert await store.find_missing([d]) == [d]
    await health.close()


async def test_fail_open_gives_request_path_checks_a_time_budget():
    inner = Broken(MemoryBlobStore())
    inner.mode = "hang"
    health = SlowTierHealth(lambda: asyncio.sleep(0))
    store = FailOpenBlobStore(inner, health, budget=0.05, timeout=10.0)
    actions = FailOpenActionStore(MemoryActionStore(), SlowTierHealth(lambda: asyncio.sleep(0)), budget=1, timeout=1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Unavailable, match="in time"):
        await store.find_missing([d for d, _ in blobs(3)])
    assert loop.time() - started < 1.0
    with pytest.raises(NotFound):
        await actions.get("ac", Digest.of(b"none"))
    await health.close()


# -- metrics -------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str, str | None]] = Counter()
        self.lookups: Counter[tuple[str, bool]] = Counter()

    def store_call(self, tier: str, operation: str) -> None:
        self.calls[(tier, operation)] += 1

    def store_read(self, tier: str, protocol: str | None, nbytes: int) -> None:
        self.bytes[(tier, "read", protocol)] += nbytes

    def store_written(self, tier: str, protocol: str | None, nbytes: int) -> None:
        self.bytes[(tier, "written", protocol)] += nbytes

    def store_action_lookup(self, tier: str, protocol: str | None, hit: bool) -> None:
        self.lookups[(tier, hit)] += 1


async def test_metered_stores_count_at_the_boundary_with_the_request_protocol():
    tally = Tally()
    store = MeteredBlobStore(MemoryBlobStore(), tally, "local")
    items = blobs(3)
    REQUEST_PROTOCOL.set("grpc")
    await store.write_blobs(items + [(Digest.of(b"lie"), b"lies")])  # the refused one is not counted
    assert await store.read_blobs([d for d, _ in items]) == [data for _, data in items]
    await read_all(store, items[0][0])
    total = sum(len(data) for _, data in items)
    assert tally.bytes == {("local", "written", "grpc"): total, ("local", "read", "grpc"): total + len(items[0][1])}
    assert tally.calls == {("local", "write_blobs"): 1, ("local", "read_blobs"): 1, ("local", "read"): 1}
    actions = MeteredActionStore(MemoryActionStore(), tally, "local")
    await actions.put("ac", items[0][0], b"entry")
    assert await actions.get("ac", items[0][0]) == b"entry"
    with pytest.raises(NotFound):
        await actions.get("ac", items[1][0])
    assert tally.lookups == {("local", True): 1, ("local", False): 1}
