"""Content-defined chunking: the FastCDC 2020 chunker against the specification's vectors, and the
chunked store's dedup, SplitBlob and SpliceBlob rules over the memory and disk stores."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disk_helpers import wait_until

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import CHUNK_SIZE, DigestMismatch, NotFound, StorageFull, close_chunks, fastsum, single_chunk
from buildvault.storage.chunks import ChunkedBlobStore, ChunkingParams, MissingChunks, cut
from buildvault.storage.chunks import store as chunk_store
from buildvault.storage.chunks.chunker import Piece, StreamCutter
from buildvault.storage.chunks.store import NAMESPACE
from buildvault.storage.disk import DiskStorage
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

DATA = Path(__file__).resolve().parents[1] / "data" / "fastcdc2020"
SMALL = ChunkingParams(avg_size=4096)  # min 1 KiB, max 16 KiB: many chunks from little data


def vectors() -> dict[int, list[tuple[int, int, str]]]:
    """The published boundaries: seed -> [(offset, length, sha256)]."""
    table: dict[int, list[tuple[int, int, str]]] = {}
    seed = None
    for line in (DATA / "fastcdc2020_test_vectors.txt").read_text().splitlines():
        if line.startswith("# Seed:"):
            seed = int(line.split(":")[1])
            table[seed] = []
        elif line and not line.startswith("#") and seed is not None:
            offset, length, sha, _ = line.split("\t")
            table[seed].append((int(offset), int(length), sha))
    return table


@pytest.mark.parametrize("seed", [0, 666])
def test_the_chunker_reproduces_the_specifications_vectors(seed: int) -> None:
    image = (DATA / "SekienAkashita.jpg").read_bytes()
    assert hashlib.sha256(image).hexdigest() == "d9e749d9367fc908876749d6502eb212fee88c9a94892fb07da5ef3ba8bc39ed"
    expected = vectors()[seed]
    assert len(expected) == 6
    chunks = cut(image, ChunkingParams(avg_size=16384, seed=seed))
    got = []
    offset = 0
    for view in chunks:
        got.append((offset, len(view), hashlib.sha256(view).hexdigest()))
        offset += len(view)
    assert got == expected


async def pieces_of(data: bytes, sizes: list[int]) -> AsyncIterator[bytes]:
    at = 0
    for size in sizes:
        yield data[at : at + size]
        at += size
    yield data[at:]


@pytest.mark.parametrize("piece", [1, 777, 16384, 100_000])
@pytest.mark.parametrize("batch", [1, 5_000, 40_000])
def test_streamed_cutting_gives_the_boundaries_and_hash_of_cutting_whole(piece: int, batch: int) -> None:
    """Messages of `piece` bytes handed over in batches of at least `batch` bytes (a batch shorter
    than the max chunk size, one of several, one of many messages)."""
    data = random.Random(piece).randbytes(300_000)
    whole = [bytes(v) for v in cut(data, SMALL)]
    cutter = StreamCutter(SMALL, DigestFunction.SHA256)
    streamed: list[Piece] = []
    parts: list[bytes] = []
    messages = [data[at : at + piece] for at in range(0, len(data), piece)]
    held = 0  # bytes in `parts` (a running sum: 300,000 one-byte messages)
    for n, message in enumerate(messages):
        parts.append(message)
        held += len(message)
        final = n == len(messages) - 1
        if final or held >= batch:
            held = 0
            buffer, start = cutter.join(parts)
            assert parts == []
            cutter.hash_blob(buffer, start)
            streamed.extend(cutter.cut(buffer, final))
    assert [p.data for p in streamed] == whole
    assert [p.digest for p in streamed] == [Digest.of(c) for c in whole]
    assert [p.fast for p in streamed] == [fastsum.of(c) for c in whole]
    assert b"".join(p.data for p in streamed) == data
    assert cutter.hexdigest() == hashlib.sha256(data).hexdigest()
    assert max(len(c) for c in whole) <= SMALL.max_size


def chunked_memory(threshold: int = 8192) -> ChunkedBlobStore:
    return ChunkedBlobStore(MemoryBlobStore(), MemoryActionStore(), SMALL, threshold=threshold)


async def read_all(store: ChunkedBlobStore, digest: Digest, offset: int = 0, limit: int = 0) -> bytes:
    return b"".join([data async for data in await store.read(digest, offset, limit)])


async def test_two_blobs_sharing_content_store_it_once() -> None:
    store = chunked_memory()
    base = random.Random(1).randbytes(200_000)
    changed = bytearray(base)
    changed[100_000:100_010] = b"0123456789"  # one small edit in the middle
    for data in (base, bytes(changed)):
        await store.write(Digest.of(data), single_chunk(data))
    inner = store.inner
    assert isinstance(inner, MemoryBlobStore)
    stored = sum(len(v) for v in inner._blobs.values())  # bytes the inner store holds
    # The second version adds only the chunks around the edit (a few max-size chunks at most).
    assert len(base) < stored <= len(base) + 3 * SMALL.max_size
    assert await read_all(store, Digest.of(bytes(changed))) == bytes(changed)
    assert await read_all(store, Digest.of(base)) == base


async def test_batches_store_large_blobs_as_chunks_and_read_them_back() -> None:
    store = chunked_memory()
    large, small = random.Random(2).randbytes(100_000), b"small"
    wrong = Digest(hashlib.sha256(b"other").hexdigest(), 50_000)  # a large blob whose bytes do not match
    items = [(Digest.of(large), large), (Digest.of(small), small), (wrong, random.Random(3).randbytes(50_000))]
    outcomes = await store.write_blobs(items)
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], DigestMismatch)
    assert await store.lists.get(NAMESPACE, Digest.of(large))  # the chunk list: stored as chunks
    inner = store.inner
    assert isinstance(inner, MemoryBlobStore) and Digest.of(large) not in inner._blobs
    read = await store.read_blobs([Digest.of(large), Digest.of(small), wrong])
    assert read[:2] == [large, small] and isinstance(read[2], NotFound)


@pytest.mark.parametrize("offset,limit", [(0, 0), (1, 0), (5000, 1), (4095, 20_000), (199_999, 0), (200_000, 0)])
async def test_ranges_of_a_chunked_blob_read_the_right_bytes(offset: int, limit: int) -> None:
    store = chunked_memory()
    data = random.Random(2).randbytes(200_000)
    await store.write(Digest.of(data), single_chunk(data))
    end = len(data) if limit == 0 else offset + limit
    assert await read_all(store, Digest.of(data), offset, limit) == data[offset:end]


async def test_a_mismatching_upload_leaves_no_chunk_list() -> None:
    store = chunked_memory()
    data = random.Random(3).randbytes(50_000)
    wrong = Digest(hashlib.sha256(b"other").hexdigest(), len(data))
    with pytest.raises(DigestMismatch):
        await store.write(wrong, single_chunk(data))
    assert await store.find_missing([wrong]) == [wrong]
    with pytest.raises(NotFound):
        await store.lists.get(NAMESPACE, wrong)


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked writes hand their bytes over in batches of 5,000 bytes: many batches per blob."""
    monkeypatch.setattr(chunk_store, "CUT_BATCH", 5_000)
    monkeypatch.setattr(chunk_store, "MIN_CUT_BATCH", 5_000)


@pytest.mark.usefixtures("small_batches")
@pytest.mark.parametrize("piece", [777, 16_384])
async def test_a_blob_streamed_in_many_batches_is_kept_as_the_chunks_of_cutting_it_whole(piece: int) -> None:
    store = chunked_memory()
    data = random.Random(piece).randbytes(200_000)
    digest = Digest.of(data)
    await store.write(digest, pieces_of(data, [piece] * (len(data) // piece)))
    assert await store.chunk_list(digest) == [Digest.of(bytes(v)) for v in cut(data, SMALL)]
    assert await read_all(store, digest) == data


async def failing_after(data: bytes, piece: int, count: int) -> AsyncIterator[bytes]:
    for at in range(0, count * piece, piece):
        yield data[at : at + piece]
    raise ConnectionError("the client went away")


@pytest.mark.usefixtures("small_batches")
@pytest.mark.parametrize("case", ["wrong hash", "one byte more", "one byte less", "source fails", "cancelled"])
async def test_a_streamed_write_that_fails_anywhere_leaves_no_chunk_list(case: str) -> None:
    store = chunked_memory()
    data = random.Random(5).randbytes(100_000)
    digest = Digest.of(data)
    source: AsyncIterator[bytes]
    if case == "wrong hash":
        digest = Digest(hashlib.sha256(b"other").hexdigest(), len(data))
        source = pieces_of(data, [1000] * 100)
    elif case == "one byte more":
        source = pieces_of(data + b"x", [1000] * 100)
    elif case == "one byte less":
        source = pieces_of(data[:-1], [1000] * 99)
    else:
        source = failing_after(data, 1000, 60)
    if case == "cancelled":
        stalled = asyncio.Event()

        async def stalling() -> AsyncIterator[bytes]:
            for at in range(0, 60_000, 1000):
                yield data[at : at + 1000]
            stalled.set()
            await asyncio.Event().wait()  # the client stops sending; the upload is then abandoned
            yield b""

        task = asyncio.create_task(store.write(digest, stalling()))
        await stalled.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises(ConnectionError if case == "source fails" else DigestMismatch):
            await store.write(digest, source)
    assert await store.chunk_list(digest) is None
    assert await store.find_missing([digest]) == [digest]
    assert store._writing == 0
    # The chunks already stored are valid blobs of their own; the blob itself is written afterwards.
    await store.write(Digest.of(data), single_chunk(data))
    assert await read_all(store, Digest.of(data)) == data


async def test_a_blob_whose_chunk_is_gone_is_missing_and_not_readable() -> None:
    store = chunked_memory()
    data = random.Random(4).randbytes(60_000)
    digest = Digest.of(data)
    await store.write(digest, single_chunk(data))
    chunks = await store.split(digest)
    assert len(chunks) > 2
    inner = store.inner
    assert isinstance(inner, MemoryBlobStore)
    assert inner.evict([chunks[1]]) == 1  # what eviction of one chunk does
    assert await store.find_missing([digest]) == [digest]
    assert await store.find_missing_indices(DigestFunction.SHA256, [digest.hash], [digest.size_bytes]) == [0]
    with pytest.raises(NotFound):
        await store.read(digest)


async def test_split_chunks_a_blob_stored_whole_and_every_chunk_is_readable() -> None:
    inner = MemoryBlobStore()
    data = random.Random(5).randbytes(70_000)
    digest = Digest.of(data)
    await inner.write(digest, single_chunk(data))  # stored before chunking was on
    store = ChunkedBlobStore(inner, MemoryActionStore(), SMALL, threshold=8192)
    chunks = await store.split(digest)
    assert [bytes(v) for v in cut(data, SMALL)] == [b"".join([d async for d in await inner.read(c)]) for c in chunks]
    assert await store.split(digest) == chunks  # answered from the list now


async def test_splice_makes_the_blob_from_its_chunks() -> None:
    store = chunked_memory()
    data = random.Random(6).randbytes(90_000)
    views = [bytes(v) for v in cut(data, SMALL)]
    digests = [Digest.of(v) for v in views]
    for d, v in zip(digests, views, strict=True):
        await store.write(d, single_chunk(v))
    await store.splice(Digest.of(data), digests)
    assert await read_all(store, Digest.of(data)) == data


async def test_splice_refuses_missing_chunks_and_a_wrong_result_storing_nothing() -> None:
    store = chunked_memory()
    a, b = os.urandom(10_000), os.urandom(12_000)
    da, db = Digest.of(a), Digest.of(b)
    await store.write(da, single_chunk(a))
    whole = Digest.of(a + b)
    with pytest.raises(MissingChunks) as missing:
        await store.splice(whole, [da, db])
    assert missing.value.missing == [db]
    await store.write(db, single_chunk(b))
    wrong = Digest(hashlib.sha256(b"x").hexdigest(), whole.size_bytes)
    with pytest.raises(DigestMismatch):
        await store.splice(wrong, [da, db])
    with pytest.raises(DigestMismatch):
        await store.splice(Digest(whole.hash, whole.size_bytes + 1), [da, db])
    assert await store.find_missing([wrong, whole]) == [wrong, whole]


async def test_splice_refuses_too_many_chunks() -> None:
    store = chunked_memory()
    tiny = Digest.of(b"a")
    with pytest.raises(ValueError, match="at most"):
        await store.splice(Digest.of(b"a" * 100_000), [tiny] * 100_000)


async def test_chunks_survive_a_restart_of_the_disk_store(tmp_path: Path) -> None:
    data = random.Random(7).randbytes(150_000)
    digest = Digest.of(data)
    storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
    try:
        await ChunkedBlobStore(storage.cas, storage.ac, SMALL, threshold=8192).write(digest, single_chunk(data))
    finally:
        await storage.close()
    storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
    try:
        store = ChunkedBlobStore(storage.cas, storage.ac, SMALL, threshold=8192)
        assert await store.find_missing([digest]) == []
        assert await read_all(store, digest) == data
        assert await storage.cas.find_missing([digest]) == [digest]  # kept as chunks, not whole
    finally:
        await storage.close()


async def test_a_blob_larger_than_the_disk_store_is_refused_not_listed(tmp_path: Path) -> None:
    """Its last chunks evict its first (no eviction hold): no list may name them, StorageFull."""
    data = random.Random(8).randbytes(5 << 20)  # the advertised parameters: chunks up to 2 MiB
    digest = Digest.of(data)
    async with await DiskStorage.open(tmp_path / "store", 4 << 20, hold_seconds=0) as storage:
        store = ChunkedBlobStore(storage.cas, storage.ac)
        with pytest.raises(StorageFull):
            await store.write(digest, single_chunk(data))
        assert await store.chunk_list(digest) is None
        assert await store.find_missing([digest]) == [digest]


async def test_the_dedup_figures_count_each_distinct_chunk_once_however_it_arrived() -> None:
    store = chunked_memory()
    base = random.Random(11).randbytes(120_000)
    await store.write(Digest.of(base), single_chunk(base))
    assert store.stats()["logical_bytes"] == store.stats()["stored_bytes"] == len(base)
    # The same blob again, and a client's splice of a blob sharing all but its tail.
    await store.write(Digest.of(base), single_chunk(base))
    views = [bytes(v) for v in cut(base + b"tail" * 10_000, SMALL)]
    for view in views:
        await store.inner.write(Digest.of(view), single_chunk(view))  # uploaded as ordinary blobs
    await store.splice(Digest.of(base + b"tail" * 10_000), [Digest.of(v) for v in views])
    stats = store.stats()
    assert stats["logical_bytes"] == 3 * len(base) + 40_000
    assert len(base) < stats["stored_bytes"] < len(base) + 40_000 + 2 * SMALL.max_size
    assert stats["dedup_ratio"] == stats["logical_bytes"] / stats["stored_bytes"] > 2


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_an_abandoned_read_of_a_chunked_blob_leaves_no_file_open(tmp_path: Path) -> None:
    """A read given up midway (after the first bytes, after a few chunks) leaves no chunk file open."""
    data = random.Random(9).randbytes(12 << 20)  # the advertised parameters: chunks up to 2 MiB, files
    digest = Digest.of(data)
    async with await DiskStorage.open(tmp_path / "store", 1 << 30) as storage:
        store = ChunkedBlobStore(storage.cas, storage.ac)
        await store.write(digest, single_chunk(data))
        assert len(await store.split(digest)) > 4
        before = open_fds()
        for stop_after in (1, 3 << 20):
            stream = await store.read(digest)
            got = 0
            async for piece in stream:
                got += len(piece)
                if got >= stop_after:
                    break
            await close_chunks(stream)
            await wait_until(lambda: open_fds() == before, 10, "the chunk files to be closed")
        assert await read_all(store, digest) == data


async def test_a_damaged_chunk_fails_the_read_and_makes_the_blob_missing(tmp_path: Path) -> None:
    data = random.Random(10).randbytes(8 << 20)
    digest = Digest.of(data)
    async with await DiskStorage.open(tmp_path / "store", 1 << 30) as storage:
        store = ChunkedBlobStore(storage.cas, storage.ac)
        await store.write(digest, single_chunk(data))
        chunks = await store.split(digest)
        victim = chunks[len(chunks) // 2]
        path = tmp_path / "store" / "cas" / "sha256" / victim.hash[:2] / f"{victim.hash}-{victim.size_bytes}"
        damaged = bytearray(path.read_bytes())
        damaged[7] ^= 1
        path.write_bytes(bytes(damaged))  # in place: its recorded checksum stays
        received = 0
        with pytest.raises(NotFound):
            async for piece in await store.read(digest):
                received += len(piece)
        assert received < len(data)
        assert await store.find_missing([digest]) == [digest]


async def test_a_read_yields_at_most_a_read_piece_even_of_larger_chunks() -> None:
    """Chunks of the advertised parameters reach 2 MiB; a read still hands out at most CHUNK_SIZE
    bytes at a time (the BlobStore contract), whether the chunk came by read_blobs or a stream."""
    store = ChunkedBlobStore(MemoryBlobStore(), MemoryActionStore(), ChunkingParams(), threshold=8192)
    noise = random.Random(3).randbytes(3 << 20)
    data = noise + bytes(8 << 20) + noise  # no cut point in the zeros: chunks of the max size there
    digest = Digest.of(data)
    await store.write(digest, single_chunk(data))
    listed = await store.chunk_list(digest)
    assert listed is not None
    assert any(CHUNK_SIZE < c.size_bytes <= chunk_store.READ_BATCH for c in listed)  # the case under test
    pieces = [piece async for piece in await store.read(digest)]
    assert b"".join(pieces) == data
    assert max(map(len, pieces)) <= CHUNK_SIZE
    ranged = [piece async for piece in await store.read(digest, 1, len(data) - 2)]
    assert b"".join(ranged) == data[1:-1]
    assert max(map(len, ranged)) <= CHUNK_SIZE


def whole_file(root: Path, digest: Digest) -> Path:
    return root / "cas" / "sha256" / digest.hash[:2] / f"{digest.hash}-{digest.size_bytes}"


@contextlib.asynccontextmanager
async def converting_store(root: Path, **options: int) -> AsyncIterator[tuple[DiskStorage, ChunkedBlobStore]]:
    """A disk store under a chunk store that chunks after the write (given `discard`)."""
    async with await DiskStorage.open(root, 1 << 30) as storage:
        store = ChunkedBlobStore(storage.cas, storage.ac, SMALL, threshold=8192, discard=storage.cas.discard, **options)
        try:
            yield storage, store
        finally:
            await store.aclose()


async def test_chunked_after_the_write_the_whole_copy_goes_once_the_list_is_written(tmp_path: Path) -> None:
    """With `discard` (the disk tier alone) a write stores the blob whole and answers; the
    background conversion writes its chunks and list, then drops the whole copy."""
    data = random.Random(21).randbytes(200_000)
    digest = Digest.of(data)
    async with converting_store(tmp_path / "store") as (storage, store):
        await store.write(digest, pieces_of(data, [1000] * 50))
        assert store.stats()["backlog_bytes"] in (0, len(data))
        await store.settled()
        assert store.stats()["backlog_blobs"] == store.stats()["backlog_bytes"] == 0
        chunks = await store.chunk_list(digest)
        assert chunks is not None and len(chunks) > 4
        assert not whole_file(tmp_path / "store", digest).exists()
        assert await storage.cas.find_missing(chunks) == []
        assert await store.find_missing([digest]) == []
        assert await read_all(store, digest) == data
        assert await read_all(store, digest, 12_345, 60_000) == data[12_345:72_345]
        assert store.stats()["logical_bytes"] == len(data)


async def test_a_read_begun_on_the_whole_copy_survives_its_conversion(tmp_path: Path) -> None:
    data = random.Random(22).randbytes(3 << 20)
    digest = Digest.of(data)
    async with converting_store(tmp_path / "store") as (storage, store):
        await store.write(digest, single_chunk(data))
        stream = await store.read(digest)  # the whole copy, unless already converted
        await store.settled()
        assert not whole_file(tmp_path / "store", digest).exists()
        got = b"".join([piece async for piece in stream])
        assert got == data


async def test_split_of_a_blob_waiting_to_be_chunked_converts_it_once(tmp_path: Path) -> None:
    data = random.Random(23).randbytes(300_000)
    digest = Digest.of(data)
    async with converting_store(tmp_path / "store") as (storage, store):
        await store.write(digest, single_chunk(data))
        first, second = await asyncio.gather(store.split(digest), store.split(digest))
        assert first == second == [Digest.of(bytes(v)) for v in cut(data, SMALL)]
        await store.settled()
        assert store.stats()["logical_bytes"] == len(data)  # converted once, counted once
        assert not whole_file(tmp_path / "store", digest).exists()
        assert await read_all(store, digest) == data


async def test_beyond_the_backlog_blobs_are_cut_as_they_arrive(tmp_path: Path) -> None:
    blobs = [random.Random(30 + i).randbytes(100_000) for i in range(3)]
    async with converting_store(tmp_path / "store", backlog=150_000) as (storage, store):
        release = asyncio.Event()
        blocked = asyncio.Event()
        convert = store._convert

        async def held(digest: Digest, **options: bool) -> list[Digest] | None:
            blocked.set()
            await release.wait()
            return await convert(digest, **options)

        store._convert = held  # type: ignore[method-assign]  # hold the first conversion
        await store.write(Digest.of(blobs[0]), single_chunk(blobs[0]))
        await blocked.wait()
        assert store.stats()["backlog_bytes"] == 100_000
        await store.write(Digest.of(blobs[1]), single_chunk(blobs[1]))  # over 150,000: cut now
        assert await store.chunk_list(Digest.of(blobs[1])) is not None
        assert not whole_file(tmp_path / "store", Digest.of(blobs[1])).exists()
        assert store.stats()["backlog_blobs"] == 1
        release.set()
        await store.settled()
        for blob in blobs[:2]:
            assert await read_all(store, Digest.of(blob)) == blob
            assert not whole_file(tmp_path / "store", Digest.of(blob)).exists()


async def test_no_backlog_cuts_every_blob_as_it_arrives(tmp_path: Path) -> None:
    data = random.Random(24).randbytes(100_000)
    digest = Digest.of(data)
    async with converting_store(tmp_path / "store", backlog=0) as (_, store):
        await store.write(digest, single_chunk(data))
        assert store.stats()["backlog_blobs"] == 0
        assert await store.chunk_list(digest) is not None
        assert not whole_file(tmp_path / "store", digest).exists()


async def test_a_pinned_whole_copy_is_kept_beside_its_chunks(tmp_path: Path) -> None:
    data = random.Random(25).randbytes(100_000)
    digest = Digest.of(data)
    async with converting_store(tmp_path / "store") as (storage, store):
        await storage.cas.write(digest, single_chunk(data))
        storage.protect([digest], [])
        await store.write(digest, single_chunk(data))
        await store.settled()
        assert await store.chunk_list(digest) is not None
        assert whole_file(tmp_path / "store", digest).exists()
        assert await read_all(store, digest) == data


async def test_closing_leaves_the_blobs_waiting_whole_and_readable(tmp_path: Path) -> None:
    blobs = [random.Random(40 + i).randbytes(150_000) for i in range(4)]
    async with await DiskStorage.open(tmp_path / "store", 1 << 30) as storage:
        store = ChunkedBlobStore(storage.cas, storage.ac, SMALL, threshold=8192, discard=storage.cas.discard)
        for blob in blobs:
            await store.write(Digest.of(blob), single_chunk(blob))
        await store.aclose()
        assert store.stats()["backlog_blobs"] == 0
        await store.settled()
        reopened = ChunkedBlobStore(storage.cas, storage.ac, SMALL, threshold=8192)
        for blob in blobs:
            assert await read_all(reopened, Digest.of(blob)) == blob


async def test_the_conversion_waits_while_a_large_read_is_served(tmp_path: Path) -> None:
    """Background work takes the CPU the requests leave: nothing is converted while a read of a
    large blob is in progress, and the conversion goes on once it is done."""
    first, second = (random.Random(50 + i).randbytes(100_000) for i in range(2))
    async with converting_store(tmp_path / "store") as (storage, store):
        await store.write(Digest.of(first), single_chunk(first))
        await store.settled()
        stream = await store.read(Digest.of(first))
        got = [await anext(stream)]  # the read is under way
        await store.write(Digest.of(second), single_chunk(second))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.settled(), 1.0)
        assert await store.chunk_list(Digest.of(second)) is None
        got += [piece async for piece in stream]
        assert b"".join(got) == first
        await store.settled()
        assert await store.chunk_list(Digest.of(second)) is not None
        assert await read_all(store, Digest.of(second)) == second


async def test_the_conversion_waits_until_a_large_read_has_been_over_for_the_idle_time(tmp_path: Path) -> None:
    """A client reading blob after blob pauses between its reads: the idle time counts from the end
    of the last large request, not its start, so a read that took longer than IDLE_AFTER does not
    let the conversion start the moment it ends."""
    first, second = (random.Random(60 + i).randbytes(100_000) for i in range(2))
    now = [1000.0]
    async with await DiskStorage.open(tmp_path / "store", 1 << 30) as storage:
        store = ChunkedBlobStore(
            storage.cas, storage.ac, SMALL, threshold=8192, discard=storage.cas.discard, clock=lambda: now[0]
        )
        try:
            await store.write(Digest.of(first), single_chunk(first))
            now[0] += 1.0
            await store.settled()
            stream = await store.read(Digest.of(first))
            got = [await anext(stream)]  # the read is under way
            await store.write(Digest.of(second), single_chunk(second))
            now[0] += 10 * chunk_store.IDLE_AFTER  # the read lasts long past the idle time
            got += [piece async for piece in stream]  # ...and ends now
            assert b"".join(got) == first
            with pytest.raises(TimeoutError):  # the clock stands still: never idle for long enough
                await asyncio.wait_for(store.settled(), 4 * chunk_store.IDLE_AFTER)
            assert await store.chunk_list(Digest.of(second)) is None
            now[0] += chunk_store.IDLE_AFTER
            await store.settled()
            assert await store.chunk_list(Digest.of(second)) is not None
            assert await read_all(store, Digest.of(second)) == second
        finally:
            await store.aclose()
