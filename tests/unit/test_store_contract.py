"""The BlobStore contract, run against every implementation and every decorator: the memory
store, the disk store, the tiered stack over memory and over the S3 test server (moto on
loopback), the whole stack the builder makes, and each one-behaviour decorator over memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from s3_server import aws_env, create_bucket, s3_endpoint, session  # noqa: F401 - fixtures

from buildvault.config import Settings
from buildvault.digest import Digest, DigestFunction
from buildvault.storage import (
    CHUNK_SIZE,
    ActionStore,
    BlobStore,
    DigestMismatch,
    EmptyBlobStore,
    InvalidRange,
    MeteredBlobStore,
    NotFound,
    fastsum,
)
from buildvault.storage.build import build_object_tier, open_store_stack
from buildvault.storage.chunks import ChunkedBlobStore, ChunkingParams
from buildvault.storage.disk import DiskBlobStore, DiskStorage
from buildvault.storage.fail_open import FailOpenBlobStore, SlowTierHealth
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore
from buildvault.storage.objectstore.journal import UploadJournal
from buildvault.storage.objectstore.presence import ExistenceCache
from buildvault.storage.objectstore.tiered import TieredBlobStore
from buildvault.storage.processes.client import RemoteStoreClient
from buildvault.storage.processes.store_server import StoreServer

# Stores under the empty-blob rule: the empty blob is present before anyone writes it.
INJECT_EMPTY = {"built", "empty-blob"}
STORES = [
    *("memory", "disk", "tiered-memory", "tiered-s3", "built"),
    *("empty-blob", "existence-cache", "fail-open", "metered"),
    *("remote-memory", "remote-disk"),  # a secondary process's store: frames over a Unix socket
    *("chunked-memory", "chunked-disk"),  # large blobs kept as FastCDC chunks (small parameters)
]


class Tally:
    """A StoreRecorder that keeps plain counts."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.read = 0
        self.written = 0

    def store_call(self, tier: str, operation: str) -> None:
        self.calls[(tier, operation)] += 1

    def store_read(self, tier: str, protocol: str | None, nbytes: int) -> None:
        self.read += nbytes

    def store_written(self, tier: str, protocol: str | None, nbytes: int) -> None:
        self.written += nbytes

    def store_action_lookup(self, tier: str, protocol: str | None, hit: bool) -> None:
        pass


def fail_open(inner: BlobStore) -> FailOpenBlobStore:
    return FailOpenBlobStore(inner, SlowTierHealth(lambda: inner.find_missing([])), budget=5.0, timeout=10.0)


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str) -> Iterator[tuple[str, str]]:  # noqa: F811 - the imported fixture
    yield s3_endpoint, create_bucket(s3_endpoint)


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    kind = request.param
    simple = {
        "memory": MemoryBlobStore,
        "empty-blob": lambda: EmptyBlobStore(MemoryBlobStore()),
        "existence-cache": lambda: ExistenceCache(MemoryBlobStore()),
        "fail-open": lambda: fail_open(MemoryBlobStore()),
        "metered": lambda: MeteredBlobStore(MemoryBlobStore(), Tally(), "local"),
    }
    if kind in simple:
        yield simple[kind]()
        return
    if kind == "disk":
        storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
        try:
            yield storage.cas
        finally:
            await storage.close()
        # Whatever the test did, a disk store leaves no temp file behind.
        assert os.listdir(tmp_path / "store" / "tmp") == []
        return
    if kind == "chunked-memory":
        yield ChunkedBlobStore(MemoryBlobStore(), MemoryActionStore(), ChunkingParams(avg_size=4096), threshold=8192)
        return
    if kind == "chunked-disk":
        storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
        try:
            yield ChunkedBlobStore(storage.cas, storage.ac, ChunkingParams(avg_size=4096), threshold=8192)
        finally:
            await storage.close()
        return
    if kind.startswith("remote-"):
        async with remote_store(tmp_path, kind == "remote-disk") as blobs:
            yield blobs
        return
    if kind == "tiered-memory":
        journal = await UploadJournal(tmp_path / "journal").open()
        slow = ExistenceCache(MemoryBlobStore())
        tiered = TieredBlobStore(MemoryBlobStore(), fail_open(slow), journal, known_in_slow=slow.known_present)
        journal.start(tiered.upload)
        try:
            yield tiered
        finally:
            await journal.close()
        return
    if kind == "built":
        stack = await open_store_stack(Settings(dir=tmp_path / "data"), Tally())
        try:
            yield stack.blobs
        finally:
            await stack.aclose()
        return
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    settings = Settings(dir=tmp_path, s3_endpoint=endpoint, s3_bucket=bucket, s3_region="us-east-1")
    tier = build_object_tier(settings, MemoryBlobStore(), MemoryActionStore(), tmp_path, session=session(), budget=5.0)
    assert tier is not None
    await tier.start()
    try:
        yield tier.cas
    finally:
        await tier.aclose()


@contextlib.asynccontextmanager
async def remote_store(tmp_path: Path, disk: bool) -> AsyncIterator[BlobStore]:
    """The store server over a memory or disk store, and the client a secondary process uses."""
    storage = await DiskStorage.open(tmp_path / "store", 1 << 30) if disk else None
    inner: BlobStore = storage.cas if storage is not None else MemoryBlobStore()
    server = StoreServer(inner, MemoryActionStore(), None, str(tmp_path / "store.sock"))
    await server.start()
    client = RemoteStoreClient(server.path, process=1)
    try:
        yield client.blobs
    finally:
        await client.aclose()
        await server.stop()
        if storage is not None:
            await storage.close()


async def chunked(data: bytes, size: int = 16 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]
        await asyncio.sleep(0)


async def read_all(store: BlobStore, digest: Digest, offset: int = 0, limit: int = 0) -> bytes:
    parts = []
    async for chunk in await store.read(digest, offset, limit):
        assert 0 < len(chunk) <= CHUNK_SIZE
        parts.append(chunk)
    return b"".join(parts)


async def test_implements_the_protocols(store: BlobStore, tmp_path: Path) -> None:
    assert isinstance(store, BlobStore)
    if isinstance(store, DiskBlobStore):
        async with await DiskStorage.open(tmp_path / "faces", 1 << 20) as storage:
            assert isinstance(storage.ac, ActionStore)
    assert isinstance(MemoryActionStore(), ActionStore)


@pytest.mark.parametrize("size", [0, 1, 1000, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE + 5])
async def test_round_trip(store: BlobStore, size: int, request: pytest.FixtureRequest) -> None:
    data = os.urandom(size)
    digest = Digest.of(data)
    always_present = size == 0 and request.node.callspec.params["store"] in INJECT_EMPTY
    assert await store.find_missing([digest]) == ([] if always_present else [digest])
    await store.write(digest, chunked(data))
    assert await store.find_missing([digest]) == []
    assert await read_all(store, digest) == data


@pytest.mark.parametrize("function", list(DigestFunction))
async def test_round_trip_each_function(store: BlobStore, function: DigestFunction) -> None:
    data = os.urandom(5000)
    digest = Digest.of(data, function)
    await store.write(digest, chunked(data, 999))
    assert await read_all(store, digest) == data


async def test_offsets_and_limits(store: BlobStore) -> None:
    data = os.urandom(2 * CHUNK_SIZE + 123)
    digest = Digest.of(data)
    await store.write(digest, chunked(data))
    size = len(data)
    ranges = [(0, 0), (0, 1), (1, 0), (5, 10), (CHUNK_SIZE - 1, 2), (CHUNK_SIZE, CHUNK_SIZE + 7)]
    ranges += [(size - 1, 0), (size - 1, 100), (100, size * 2)]
    for offset, limit in ranges:
        expected = data[offset:] if limit == 0 else data[offset : offset + limit]
        assert await read_all(store, digest, offset, limit) == expected, (offset, limit)
    assert await read_all(store, digest, size, 0) == b""
    for offset, limit in [(size + 1, 0), (-1, 0), (0, -1)]:
        with pytest.raises(InvalidRange):
            await store.read(digest, offset, limit)


async def test_not_found_is_raised_before_iterating(store: BlobStore) -> None:
    digest = Digest.of(b"never written")
    with pytest.raises(NotFound):
        await store.read(digest)  # the await itself raises: no iteration needed


@pytest.mark.parametrize("actual", [b"short", b"much longer than declared"])
async def test_size_mismatch_stores_nothing(store: BlobStore, actual: bytes) -> None:
    declared = Digest.of(b"what was declared")
    with pytest.raises(DigestMismatch):
        await store.write(declared, chunked(actual, 3))
    assert await store.find_missing([declared]) == [declared]
    with pytest.raises(NotFound):
        await store.read(declared)


async def test_hash_mismatch_stores_nothing(store: BlobStore) -> None:
    data = os.urandom(3 * CHUNK_SIZE)
    good = Digest.of(data)
    bad = Digest("0" * 64, len(data))
    with pytest.raises(DigestMismatch):
        await store.write(bad, chunked(data))
    assert await store.find_missing([bad, good]) == [bad, good]


async def test_wrong_digest_function_is_a_mismatch(store: BlobStore) -> None:
    data = b"hashed with sha256, declared as blake3"
    sha = Digest.of(data, DigestFunction.SHA256)
    lie = Digest(sha.hash, sha.size_bytes, DigestFunction.BLAKE3)
    with pytest.raises(DigestMismatch):
        await store.write(lie, chunked(data))
    await store.write(sha, chunked(data))
    # The same hex under the other function is another blob, still missing.
    assert await store.find_missing([lie, sha]) == [lie]
    with pytest.raises(NotFound):
        await store.read(lie)


async def test_empty_blob(store: BlobStore) -> None:
    for function in DigestFunction:
        empty = Digest.of(b"", function)
        await store.write(empty, chunked(b""))
        assert await store.find_missing([empty]) == []
        assert await read_all(store, empty) == b""


async def test_find_missing_keeps_order_and_drops_duplicates(store: BlobStore) -> None:
    blobs = [os.urandom(100 + i) for i in range(6)]
    digests = [Digest.of(b) for b in blobs]
    for i in (1, 3):
        await store.write(digests[i], chunked(blobs[i]))
    query = [digests[5], digests[0], digests[1], digests[5], digests[2], digests[0], digests[3], digests[4]]
    assert await store.find_missing(query) == [digests[5], digests[0], digests[2], digests[4]]
    assert await store.find_missing([]) == []


async def test_rewriting_an_existing_blob_succeeds_and_keeps_it_intact(store: BlobStore) -> None:
    data = os.urandom(CHUNK_SIZE + 10)
    digest = Digest.of(data)
    await store.write(digest, chunked(data))
    await store.write(digest, chunked(data))
    with contextlib.suppress(DigestMismatch):  # a lying second writer may be refused or ignored, never corrupt
        await store.write(digest, chunked(os.urandom(len(data))))
    assert await read_all(store, digest) == data


async def test_concurrent_writers_of_one_blob(store: BlobStore) -> None:
    data = os.urandom(3 * CHUNK_SIZE + 17)
    digest = Digest.of(data)
    await asyncio.gather(*(store.write(digest, chunked(data, 64 * 1024)) for _ in range(4)))
    assert await read_all(store, digest) == data
    assert await store.find_missing([digest]) == []


async def test_failing_chunk_iterator_leaves_nothing(store: BlobStore) -> None:
    data = os.urandom(3 * CHUNK_SIZE)
    digest = Digest.of(data)

    async def failing() -> AsyncIterator[bytes]:
        yield data[: 2 * CHUNK_SIZE]  # enough for a disk store to have started writing
        await asyncio.sleep(0)
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await store.write(digest, failing())
    assert await store.find_missing([digest]) == [digest]
    with pytest.raises(NotFound):
        await store.read(digest)
    await store.write(digest, chunked(data))  # and a retry works
    assert await read_all(store, digest) == data


async def test_cancelled_write_leaves_nothing(store: BlobStore) -> None:
    data = os.urandom(3 * CHUNK_SIZE)
    digest = Digest.of(data)
    sent = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield data[: 2 * CHUNK_SIZE]
        yield data[2 * CHUNK_SIZE : 2 * CHUNK_SIZE + 10]
        sent.set()
        await asyncio.Event().wait()  # the client stalls forever
        yield data[2 * CHUNK_SIZE + 10 :]

    task = asyncio.create_task(store.write(digest, stalls()))
    await asyncio.wait_for(sent.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.find_missing([digest]) == [digest]
    with pytest.raises(NotFound):
        await store.read(digest)


@pytest.mark.parametrize("function", list(DigestFunction))
async def test_lookup_by_hash_alone(store: BlobStore, function: DigestFunction) -> None:
    data = os.urandom(3000)
    digest = Digest.of(data, function)
    with pytest.raises(NotFound):
        await store.lookup(function, digest.hash)
    await store.write(digest, chunked(data))
    assert await store.lookup(function, digest.hash) == digest
    assert await store.lookup(function, digest.hash) == digest  # (the disk store's memo)
    other = DigestFunction.BLAKE3 if function is DigestFunction.SHA256 else DigestFunction.SHA256
    with pytest.raises(NotFound):
        await store.lookup(other, digest.hash)
    with pytest.raises(NotFound):
        await store.lookup(function, "not hex")


async def test_disk_lookup_finds_blobs_stored_before_a_restart(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 30)
    data = os.urandom(CHUNK_SIZE + 7)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 1 << 30)
    try:
        assert await storage.cas.lookup(DigestFunction.SHA256, digest.hash) == digest
    finally:
        await storage.close()


async def test_batches_of_whole_blobs(store: BlobStore) -> None:
    """read_blobs / write_blobs: one call per batch, each blob's own outcome."""
    small, other, big = os.urandom(4000), os.urandom(10), os.urandom(CHUNK_SIZE + 3)
    stored = os.urandom(77)
    await store.write(Digest.of(stored), chunked(stored))
    items = [
        (Digest.of(small), small),
        (Digest.of(small), other + small[10:]),  # the same blob again, wrong bytes: refused
        (Digest.of(other), small[:10]),  # wrong bytes
        (Digest.of(big), big),  # large: the one-by-one way
        (Digest.of(stored), stored),  # already stored
        (Digest.of(b"short"), b"shor"),  # size mismatch
    ]
    outcomes = await store.write_blobs(items)
    assert [type(o).__name__ if o else None for o in outcomes] == [
        None, "DigestMismatch", "DigestMismatch", None, None, "DigestMismatch"
    ]
    results = await store.read_blobs([Digest.of(small), Digest.of(other), Digest.of(big), Digest.of(stored)])
    assert results[0] == small and isinstance(results[1], NotFound)
    assert results[2] == big and results[3] == stored
    assert await store.find_missing([d for d, _ in items]) == [Digest.of(other), Digest.of(b"short")]


# The stores whose store_verified skips the hash (the rest verify it like write_blobs).
HASH_TRUSTED = {"disk"}


async def read_refused(store: BlobStore, digest: Digest) -> bool:
    """Whether a whole read of `digest` fails (rather than returning bytes)."""
    try:
        await read_all(store, digest)
    except (NotFound, DigestMismatch):
        return True
    return False


async def test_store_verified(store: BlobStore, request: pytest.FixtureRequest) -> None:
    """store_verified (bytes the caller hashed itself, each with the fast checksum it computed over
    them): stored and readable like write_blobs; a size mismatch always refused; a buggy caller's
    pair (it hashed some bytes, named them by their digest and checksum, and handed over others of
    the same size) either refused now or, by a store that trusts the hash, never served: whole
    reads verify the digest (a record) or the caller's checksum (a file)."""
    trusted = request.node.callspec.params["store"] in HASH_TRUSTED
    tiny, small, big = os.urandom(100), os.urandom(4000), os.urandom(CHUNK_SIZE + 3)
    stored = os.urandom(77)
    await store.write(Digest.of(stored), chunked(stored))
    wrong_small, wrong_mid, wrong_big = os.urandom(4000), os.urandom(100_000), os.urandom(CHUNK_SIZE + 3)

    def handed(data: bytes) -> tuple[Digest, bytes, bytes]:
        return Digest.of(data), data, fastsum.of(data)

    def buggy(hashed: bytes) -> tuple[Digest, bytes, bytes]:
        return Digest.of(hashed), os.urandom(len(hashed)), fastsum.of(hashed)

    items = [
        handed(tiny),
        handed(small),
        handed(big),  # above the coalesced size: streamed
        handed(stored),  # already stored
        (Digest.of(b"short"), b"shor", fastsum.of(b"short")),  # size mismatch
        buggy(wrong_small),  # a buggy caller: right size, wrong bytes (a record on disk)
        buggy(wrong_mid),  # a file written in one trip
        buggy(wrong_big),  # a streamed file
    ]
    outcomes = await store.store_verified(items)
    names = [type(o).__name__ if o else None for o in outcomes]
    wrong = None if trusted else "DigestMismatch"
    assert names == [None, None, None, None, "DigestMismatch", wrong, wrong, wrong]
    for data in (tiny, small, big, stored):
        assert await read_all(store, Digest.of(data)) == data
    assert await store.find_missing([Digest.of(b"short")]) == [Digest.of(b"short")]
    for data in (wrong_small, wrong_mid, wrong_big):
        assert await read_refused(store, Digest.of(data))
        assert not isinstance((await store.read_blobs([Digest.of(data)]))[0], bytes)
