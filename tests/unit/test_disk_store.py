"""Disk-store behaviour beyond the BlobStore contract: layout, atomicity, LRU, space, fds, the
event loop and cancellation. Restarts and durability: test_disk_store_restart.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import random
import threading
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disk_helpers import (
    assert_consistent,
    blob_path,
    chunked,
    either_layout,
    files_only,
    files_under,
    fill,
    fill_one,
    read_all,
    wait_until,
)

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.storage import (
    CHUNK_SIZE,
    CapacityExceeded,
    NotFound,
    StorageFull,
    ac_namespace,
)
from buildvault.storage.disk import SMALL_OP, WRITE_BATCH, DiskStorage, core, fileops, filereads
from buildvault.storage.disk.writes import UPLOAD_BUFFER_BUDGET

# Tests that work on files directly (remove, damage, count them) run with the file layout
# (files_only); the others with both layouts (either_layout). test_disk_records.py covers records.
__all__ = ["either_layout", "files_only"]  # fixtures


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[DiskStorage]:
    storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
    yield storage
    await storage.close()


# -- layout and atomic publishing ----------------------------------------------------------


@pytest.mark.usefixtures("files_only")
async def test_layout_is_sharded_by_function_and_hash(storage: DiskStorage) -> None:
    data = b"layout"
    for function in DigestFunction:
        digest = Digest.of(data, function)
        await storage.cas.write(digest, chunked(data))
        assert blob_path(storage.root, digest).read_bytes() == data
        assert storage.path_of(digest) == str(blob_path(storage.root, digest))


@pytest.mark.usefixtures("either_layout")
async def test_publish_is_atomic(storage: DiskStorage) -> None:
    data = os.urandom(2 * WRITE_BATCH + 100)
    digest = Digest.of(data)
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield data[:WRITE_BATCH]  # a batch is written while the next one is hashed
        yield data[WRITE_BATCH : 2 * WRITE_BATCH]
        yield b""
        await release.wait()
        yield data[2 * WRITE_BATCH :]

    task = asyncio.create_task(storage.cas.write(digest, slow()))
    tmp = storage.root / "tmp"

    def first_batch_on_disk() -> bool:
        temps = list(tmp.iterdir())
        return bool(temps) and temps[0].stat().st_size >= WRITE_BATCH

    await wait_until(first_batch_on_disk, 10, "the first batch to reach the temp file")
    assert not blob_path(storage.root, digest).exists()
    assert await storage.cas.find_missing([digest]) == [digest]
    with pytest.raises(NotFound):
        await storage.cas.read(digest)
    release.set()
    await task
    assert blob_path(storage.root, digest).read_bytes() == data
    assert list(tmp.iterdir()) == []


@pytest.mark.usefixtures("either_layout")
async def test_concurrent_writers_leave_one_file_and_no_temp(storage: DiskStorage) -> None:
    data = os.urandom(3 * WRITE_BATCH + 1)
    digest = Digest.of(data)
    await asyncio.gather(*(storage.cas.write(digest, chunked(data, 100_000)) for _ in range(5)))
    assert files_under(storage.root / "cas") == [blob_path(storage.root, digest)]
    assert os.listdir(storage.root / "tmp") == []
    assert storage.stats().used_bytes == len(data)
    assert storage.stats().blob_count == 1


@pytest.mark.usefixtures("either_layout")
async def test_existing_blob_is_not_read_again(storage: DiskStorage) -> None:
    data = b"already here"
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))

    async def must_not_be_read() -> AsyncIterator[bytes]:
        raise AssertionError("stream consumed")
        yield b""

    await storage.cas.write(digest, must_not_be_read())
    assert await read_all(storage, digest) == data


@pytest.mark.usefixtures("files_only")
async def test_a_damaged_or_vanished_blob_becomes_not_found(storage: DiskStorage) -> None:
    truncated, deleted = await fill(storage, 2, 1000)
    with open(blob_path(storage.root, truncated), "r+b") as f:
        f.truncate(10)
    blob_path(storage.root, deleted).unlink()
    for digest in (truncated, deleted):
        with pytest.raises(NotFound):
            await storage.cas.read(digest)
    assert await storage.cas.find_missing([truncated, deleted]) == [truncated, deleted]
    await storage.wait_idle()  # the deletion of the damaged file
    assert_consistent(storage)
    await storage.cas.write(truncated, chunked((0).to_bytes(4, "big") * 250))  # healed by a new upload
    assert await read_all(storage, truncated) == (0).to_bytes(4, "big") * 250


@pytest.mark.usefixtures("files_only")
async def test_batch_reads_find_damaged_and_vanished_files(storage: DiskStorage) -> None:
    good, longer, shorter, gone = [await fill_one(storage, bytes([n]) * 300) for n in range(4)]
    blob_path(storage.root, longer).write_bytes(bytes(301))
    blob_path(storage.root, shorter).write_bytes(bytes(299))
    blob_path(storage.root, gone).unlink()
    results = await storage.cas.read_blobs([good, longer, shorter, gone])
    assert results[0] == bytes([0]) * 300
    assert [type(r).__name__ for r in results[1:]] == ["NotFound"] * 3
    await storage.wait_idle()  # the deletions of the damaged files
    assert await storage.cas.find_missing([good, longer, shorter, gone]) == [longer, shorter, gone]
    assert_consistent(storage)


# -- LRU and space -------------------------------------------------------------------------


@pytest.mark.usefixtures("files_only")
async def test_lru_evicts_least_recently_used_first(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    digests = await fill(storage, 10, 100)
    assert storage.stats().used_bytes == 1000

    def evicted() -> list[int]:  # looks at the files only: find_missing would refresh recency
        return [i for i, d in enumerate(digests) if not blob_path(tmp_path, d).exists()]

    await read_all(storage, digests[0])  # reads refresh recency
    await storage.cas.find_missing([digests[1]])  # so do FindMissing hits
    await storage.cas.write(digests[2], chunked(b"ignored"))  # and rewrites of stored blobs
    new = await fill_one(storage, b"n" * 100)
    assert evicted() == [3]
    await fill_one(storage, b"m" * 150)
    assert evicted() == [3, 4, 5]
    await storage.cas.find_missing([digests[7]])
    await fill_one(storage, b"o" * 200)
    assert evicted() == [3, 4, 5, 6, 8]
    stats = storage.stats()
    assert stats.evictions_total == 5
    assert stats.used_bytes == 950 <= stats.max_bytes
    assert blob_path(tmp_path, new).exists()
    assert await storage.cas.find_missing(digests) == [digests[i] for i in evicted()]
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_blob_larger_than_the_store_is_refused_before_reading(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    kept = await fill(storage, 5, 100)
    started = False

    async def stream() -> AsyncIterator[bytes]:
        nonlocal started
        started = True
        yield b"x" * 1001

    with pytest.raises(CapacityExceeded):
        await storage.cas.write(Digest.of(b"x" * 1001), stream())
    assert not started
    assert await storage.cas.find_missing(kept) == []  # nothing was evicted for it
    assert os.listdir(tmp_path / "tmp") == []
    with pytest.raises(CapacityExceeded):
        await storage.ac.put("ac", kept[0], b"y" * 1001)
    exactly = await fill_one(storage, b"z" * 1000)  # a blob the size of the store fits
    assert await storage.cas.find_missing([exactly]) == []
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_space_held_by_writes_in_progress_is_not_promised_twice(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    first = b"a" * 800
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield first[:400]
        await release.wait()
        yield first[400:]

    task = asyncio.create_task(storage.cas.write(Digest.of(first), slow()))
    await wait_until(lambda: storage.reserved_bytes == 800, 10, "the first write to hold its space")
    with pytest.raises(StorageFull):
        await storage.cas.write(Digest.of(b"b" * 800), chunked(b"b" * 800))
    release.set()
    await task
    await fill_one(storage, b"b" * 800)  # now the first one can be evicted
    assert storage.stats().used_bytes == 800
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_total_stays_under_max_with_concurrent_writers_and_readers(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 20_000, hold_seconds=0)
    rng = random.Random(7)
    blobs = [rng.randbytes(rng.randint(0, 3000)) for _ in range(40)]
    digests = [Digest.of(b) for b in blobs]
    peak = 0

    async def worker(seed: int) -> None:
        nonlocal peak
        rng = random.Random(seed)
        for _ in range(60):
            i = rng.randrange(len(blobs))
            if rng.random() < 0.6:
                with contextlib.suppress(StorageFull):  # 8 writers of up to 3 KB can hold more than the 20 KB cap
                    await storage.cas.write(digests[i], chunked(blobs[i], 512))
            else:
                with contextlib.suppress(NotFound):
                    assert await read_all(storage, digests[i]) == blobs[i]
            peak = max(peak, storage.stats().used_bytes + storage.reserved_bytes)

    await asyncio.gather(*(worker(s) for s in range(8)))
    assert peak <= 20_000
    assert storage.stats().evictions_total > 0
    await storage.wait_idle()
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_reader_survives_eviction(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 4 * CHUNK_SIZE, hold_seconds=0)
    data = os.urandom(3 * CHUNK_SIZE + 5)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data, CHUNK_SIZE))
    chunks = await storage.cas.read(digest)
    parts = [await anext(chunks)]
    await fill_one(storage, os.urandom(3 * CHUNK_SIZE))  # evicts the blob being read
    assert not blob_path(tmp_path, digest).exists()
    assert await storage.cas.find_missing([digest]) == [digest]
    parts += [chunk async for chunk in chunks]
    assert b"".join(parts) == data
    await storage.close()


def open_fds() -> int:
    """Open regular files and directories of this process: not the epoll and eventfd descriptors
    that an earlier test's gRPC server or channel closes later, in a thread of its own."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, gone by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/")
    return count


@pytest.mark.usefixtures("either_layout")
async def test_readers_close_their_fds(storage: DiskStorage) -> None:
    data = os.urandom(4 * CHUNK_SIZE)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data, CHUNK_SIZE))
    gc.collect()  # a store an earlier test left open would close its fds (LMDB's) at some later collection
    baseline = open_fds()
    assert await read_all(storage, digest) == data
    assert open_fds() == baseline
    chunks = await storage.cas.read(digest)
    await anext(chunks)
    assert open_fds() == baseline + 1
    await chunks.aclose()  # type: ignore[attr-defined]
    # a read ahead still running closes the fd when it ends
    await wait_until(lambda: open_fds() == baseline, 10, "the reader's fd to be closed")
    chunks = await storage.cas.read(digest)  # never iterated, then dropped
    del chunks
    gc.collect()
    await wait_until(lambda: open_fds() == baseline, 10, "the dropped reader's fd to be closed")


@pytest.mark.usefixtures("files_only")
async def test_enospc_becomes_storage_full_and_leaves_nothing(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, data: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    data = os.urandom(3 * WRITE_BATCH)
    digest = Digest.of(data)
    with monkeypatch.context() as m:
        m.setattr(fileops, "write_all", no_space)
        with pytest.raises(StorageFull):
            await storage.cas.write(digest, chunked(data))
        with pytest.raises(StorageFull):
            await storage.cas.write(Digest.of(b"small"), chunked(b"small"))
        with pytest.raises(StorageFull):
            await storage.ac.put("ac", digest, b"entry")
    assert os.listdir(storage.root / "tmp") == []
    assert storage.reserved_bytes == 0 and storage.stats().used_bytes == 0
    assert await storage.cas.find_missing([digest]) == [digest]
    await storage.cas.write(digest, chunked(data))  # the space came back
    assert await read_all(storage, digest) == data


@pytest.mark.usefixtures("files_only")
async def test_large_pieces_are_written_unjoined_and_short_writes_resumed(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces_per_call: list[int] = []
    writev = os.writev

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        pieces_per_call.append(len(buffers))
        return writev(fd, [b"".join(buffers)[:100_000]])  # cut inside a piece or at its edge

    data = os.urandom(3 * WRITE_BATCH + 1000)
    digest = Digest.of(data)
    monkeypatch.setattr(fileops.os, "writev", short_writev)
    await storage.cas.write(digest, chunked(data, 256 * 1024))
    monkeypatch.undo()
    assert await read_all(storage, digest) == data
    assert pieces_per_call and max(pieces_per_call) > 1, "the pieces of a batch were joined before being written"


def test_a_streamed_read_asks_for_sequential_read_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((fd, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    data = os.urandom(3 * CHUNK_SIZE)
    path = tmp_path / "blob"
    path.write_bytes(data)
    status, fd, first = filereads.open_range(str(path), len(data), 0, CHUNK_SIZE, len(data), None)
    assert status == fileops.OK and fd is not None and first == data[:CHUNK_SIZE]
    try:
        assert advised == [(fd, os.POSIX_FADV_SEQUENTIAL)]
    finally:
        os.close(fd)
    advised.clear()  # read in one go: no file stays open, nothing to advise
    status, fd, whole = filereads.open_range(str(path), len(data), 0, len(data), len(data), None)
    assert (status, fd, whole, advised) == (fileops.OK, None, data, [])


# -- keys kept apart -----------------------------------------------------------------------


@pytest.mark.usefixtures("files_only")
async def test_sha256_and_blake3_with_the_same_hex_are_different_blobs(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    sha_data = b"the sha256 blob"
    sha = Digest.of(sha_data)
    await storage.cas.write(sha, chunked(sha_data))
    await storage.close()
    # No real collision exists, so plant a "BLAKE3 blob" with the same hex directly in the layout.
    blake_data = b"a different, longer blake3 blob"
    blake = Digest(sha.hash, len(blake_data), DigestFunction.BLAKE3)
    path = blob_path(tmp_path, blake)
    assert path != blob_path(tmp_path, sha)
    path.write_bytes(blake_data)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.stats().blob_count == 2
    assert await read_all(storage, sha) == sha_data
    same_size = Digest(sha.hash, sha.size_bytes, DigestFunction.BLAKE3)
    assert await storage.cas.find_missing([same_size, sha, blake]) == [same_size]
    # The planted file is indexed under its own key, but a read verifies content: it is refused.
    with pytest.raises(NotFound):
        await read_all(storage, blake)
    assert await storage.cas.find_missing([blake, sha]) == [blake]
    await storage.ac.put("ac", sha, b"sha entry")
    with pytest.raises(NotFound):
        await storage.ac.get("ac", same_size)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_action_namespaces_are_kept_apart(storage: DiskStorage) -> None:
    digest = Digest.of(b"an action")
    namespaces = [
        ac_namespace(""),
        ac_namespace("foo"),
        ac_namespace("foo/bar"),
        ac_namespace("foo", "raw"),
        ac_namespace(digest.hash),  # an instance named like a hash cannot clash with a file
        ac_namespace(f"sha256/{digest.hash[:2]}"),
    ]
    for namespace in namespaces:
        with pytest.raises(NotFound):
            await storage.ac.get(namespace, digest)
        await storage.ac.put(namespace, digest, namespace.encode())
    for namespace in namespaces:
        assert await storage.ac.get(namespace, digest) == namespace.encode()
    with pytest.raises(NotFound):
        await storage.ac.get("ac", Digest(digest.hash, digest.size_bytes, DigestFunction.BLAKE3))
    with pytest.raises(NotFound):  # an AC entry is not a CAS blob
        await storage.cas.read(digest)
    assert storage.stats().ac_entries == len(namespaces)
    for bad in ["../etc", "ac/../x", "ac//x", "ac/a b", "/ac"]:
        with pytest.raises(InvalidDigest):
            await storage.ac.put(bad, digest, b"x")


@pytest.mark.usefixtures("files_only")
async def test_action_entries_are_replaced_and_survive_restart(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digest = Digest.of(b"action")
    await storage.ac.put("ac/ci", digest, b"first version")
    await storage.ac.put("ac/ci", digest, b"v2")
    assert await storage.ac.get("ac/ci", digest) == b"v2"
    assert storage.stats().used_bytes == 2
    await asyncio.gather(*(storage.ac.put("ac/ci", digest, bytes([n]) * n) for n in range(1, 9)))
    final = await storage.ac.get("ac/ci", digest)
    assert final == bytes([len(final)]) * len(final)
    assert storage.stats().used_bytes == len(final)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert await storage.ac.get("ac/ci", digest) == final
    assert storage.stats().ac_entries == 1
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_action_entries_share_the_cap_and_lru(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    action = Digest.of(b"action")
    await storage.ac.put("ac", action, b"r" * 300)
    blobs = await fill(storage, 7, 100)  # 1000 bytes in total: full
    await fill_one(storage, b"q" * 100)  # the AC entry is the least recently used
    with pytest.raises(NotFound):
        await storage.ac.get("ac", action)
    assert await storage.cas.find_missing(blobs) == []
    assert storage.stats().ac_entries == 0
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_action_entries_are_served_from_memory_and_stay_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    digest = Digest.of(b"action")
    await storage.ac.put("ac", digest, b"first")
    reads: list[str] = []
    read_file = filereads.read_file

    def counted(path: str) -> bytes | None:
        reads.append(path)
        return read_file(path)

    monkeypatch.setattr(filereads, "read_file", counted)
    assert await storage.ac.get("ac", digest) == b"first"
    assert reads == []  # written just now: in memory
    await storage.ac.put("ac", digest, b"second")
    assert await storage.ac.get("ac", digest) == b"second"
    storage.ac_memory.clear()
    assert await storage.ac.get("ac", digest) == b"second" and len(reads) == 1
    assert await storage.ac.get("ac", digest) == b"second" and len(reads) == 1  # cached by the read
    assert len(storage.ac_memory) == 1
    await fill_one(storage, b"e" * 1000)  # evicts the entry: neither the index nor the memory has it
    assert len(storage.ac_memory) == 0 and storage.ac_memory.nbytes == 0
    with pytest.raises(NotFound):
        await storage.ac.get("ac", digest)
    assert len(reads) == 1
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_the_action_cache_in_memory_is_bounded(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "AC_CACHE_BYTES", 64 * 100)
    for n in range(200):
        await storage.ac.put("ac", Digest.of(b"%d" % n), bytes(100))
    memory = storage.ac_memory
    assert memory.nbytes <= 64 * 100 and len(memory) == 64
    assert memory.held_bytes() == memory.nbytes
    assert await storage.ac.get("ac", Digest.of(b"0")) == bytes(100)


# -- not blocking the loop ------------------------------------------------------------------


@pytest.mark.usefixtures("either_layout")
async def test_small_chunks_are_batched_into_few_thread_hops(storage: DiskStorage) -> None:
    data = os.urandom(16 * WRITE_BATCH)
    digest = Digest.of(data)
    before = storage.pool_trips
    await storage.cas.write(digest, chunked(data, 16 * 1024))  # 1,024 chunks
    # per batch at most one hop hashes it and another writes it (a stage takes queued batches in one hop)
    assert 0 < storage.pool_trips - before <= 2 * 16 + 3
    before = storage.pool_trips
    assert len([c async for c in await storage.cas.read(digest)]) == 16
    assert 0 < storage.pool_trips - before <= 16 + 1


@pytest.mark.usefixtures("either_layout")
async def test_small_operations_of_one_loop_iteration_share_one_trip(storage: DiskStorage) -> None:
    blobs = [os.urandom(100 + n) for n in range(50)]
    before = storage.pool_trips
    await asyncio.gather(*(storage.cas.write(Digest.of(b), chunked(b)) for b in blobs))
    assert storage.pool_trips - before == 1
    before = storage.pool_trips
    assert await storage.cas.read_blobs([Digest.of(b) for b in blobs]) == blobs
    assert storage.pool_trips - before == 1


@pytest.mark.usefixtures("either_layout")
async def test_find_missing_makes_no_syscalls(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    digests = await fill(storage, 3, 10)
    absent = Digest.of(b"absent")

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("syscall in find_missing")

    trips = storage.pool_trips
    with monkeypatch.context() as m:
        for name in ("stat", "open", "listdir", "scandir", "lstat", "access"):
            m.setattr(os, name, forbidden)
        assert await storage.cas.find_missing([*digests, absent]) == [absent]
        hashes, sizes = [d.hash for d in (*digests, absent)], [d.size_bytes for d in (*digests, absent)]
        assert await storage.cas.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == [3]
    assert storage.pool_trips == trips


@pytest.mark.usefixtures("files_only")
async def test_stats(tmp_path: Path) -> None:
    clock = [1_000_000.0]
    storage = await DiskStorage.open(tmp_path, 1 << 30, clock=lambda: clock[0])
    assert storage.stats().lru_age_seconds == 0
    a = await fill_one(storage, b"a")
    clock[0] += 10
    b = await fill_one(storage, b"bb")
    await storage.ac.put("ac", a, b"ccc")
    clock[0] += 5
    stats = storage.stats()
    assert (stats.used_bytes, stats.blob_count, stats.ac_entries, stats.evictions_total) == (6, 2, 1, 0)
    assert stats.max_bytes == 1 << 30
    assert stats.lru_age_seconds == 15
    await storage.cas.find_missing([a])  # now b is the oldest
    assert storage.stats().lru_age_seconds == 5
    assert await storage.cas.find_missing([b]) == []
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_find_missing_indices_matches_find_missing(storage: DiskStorage) -> None:
    stored = await fill(storage, 4, 40)
    absent = [Digest.of(b"absent %d" % n) for n in range(3)]
    digests = [absent[0], stored[0], absent[1], stored[1], absent[0], absent[2], stored[0]]
    hashes, sizes = [d.hash for d in digests], [d.size_bytes for d in digests]
    assert await storage.cas.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == [0, 2, 5]
    assert await storage.cas.find_missing_indices(DigestFunction.BLAKE3, hashes[:2], sizes[:2]) == [0, 1]
    huge = [stored[2].hash, "zz" * 32, stored[3].hash]
    huge_sizes = [1 << 60, 3, stored[3].size_bytes]
    assert await storage.cas.find_missing_indices(DigestFunction.SHA256, huge, huge_sizes) == [0, 1]
    assert storage.entry_paths()[-1] == str(blob_path(storage.root, stored[3]))  # hits count as uses


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.usefixtures("either_layout")
async def test_cancelling_around_a_slow_publish_keeps_everything_consistent(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    renaming, release = threading.Event(), threading.Event()
    rename = fileops.rename

    def held_rename(tmp: str, final: str) -> None:
        renaming.set()
        release.wait(10)
        rename(tmp, final)

    monkeypatch.setattr(fileops, "rename", held_rename)
    data = os.urandom(SMALL_OP + 50_000)  # the streaming path: received into a temp file first
    digest = Digest.of(data)
    first = asyncio.create_task(storage.cas.write(digest, chunked(data)))
    await wait_until(renaming.is_set, 10, "the first write's rename to start")
    second = asyncio.create_task(storage.cas.write(digest, chunked(data)))  # waits for the first's rename
    tmp = storage.root / "tmp"
    await wait_until(lambda: len(os.listdir(tmp)) >= 2, 10, "the second write to be received")
    assert storage.in_flight and not first.done()
    second.cancel()
    first.cancel()  # too late for the first: its rename is under way
    release.set()
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task
    await storage.wait_idle()
    assert await storage.cas.find_missing([digest]) == []  # the first one's publish completed
    assert await read_all(storage, digest) == data
    assert storage.reserved_bytes == 0 and storage.stats().used_bytes == len(data)
    assert os.listdir(tmp) == []
    assert_consistent(storage)


@pytest.mark.usefixtures("files_only")
async def test_cancelling_small_writes_in_a_coalesced_trip_keeps_everything_consistent(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    write_small = fileops.write_small

    def held_write_small(*args: object) -> None:
        release.wait(10)
        write_small(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(fileops, "write_small", held_write_small)
    blobs = [os.urandom(1000 + n) for n in range(5)]
    tasks = [asyncio.create_task(storage.cas.write(Digest.of(b), chunked(b))) for b in blobs]
    await wait_until(lambda: storage.in_flight == 5, 10, "the five writes to be claimed")
    again = asyncio.create_task(storage.cas.write(Digest.of(blobs[0]), chunked(blobs[0])))  # waits for the slot
    held = sum(map(len, blobs)) + len(blobs[0])
    await wait_until(lambda: storage.reserved_bytes == held, 10, "the repeated write to wait for its slot")
    for task in (*tasks[:3], again):
        task.cancel()
    release.set()
    results = await asyncio.gather(*tasks, again, return_exceptions=True)
    assert [isinstance(r, asyncio.CancelledError) for r in results] == [True, True, True, False, False, True]
    await storage.wait_idle()
    assert await storage.cas.find_missing([Digest.of(b) for b in blobs]) == []  # cancelled too late: published
    for data in blobs:
        assert await read_all(storage, Digest.of(data)) == data
    assert storage.reserved_bytes == 0 and storage.stats().used_bytes == sum(map(len, blobs))
    assert os.listdir(storage.root / "tmp") == []
    assert_consistent(storage)


async def test_many_uploads_at_once_share_a_bounded_buffer(storage: DiskStorage) -> None:
    """40 uploads in progress at once, each sent 2.5 MiB and then quiet: together they hold less
    than UPLOAD_BUFFER_BUDGET (with a fixed 1 MiB batch each held ~1.5 MiB: 60 MiB)."""
    data = os.urandom(4 * WRITE_BATCH)
    go, quiet = asyncio.Event(), []
    tasks = []

    async def part_then_quiet(fed: asyncio.Event) -> AsyncIterator[bytes]:
        await go.wait()
        for start in range(0, 2 * WRITE_BATCH + WRITE_BATCH // 2, 64 * 1024):
            yield data[start : start + 64 * 1024]
        fed.set()
        await asyncio.Event().wait()  # the client went quiet

    tracemalloc.start()
    try:
        for _ in range(40):
            fed = asyncio.Event()
            quiet.append(fed)
            tasks.append(asyncio.ensure_future(storage.cas.write(Digest.of(data), part_then_quiet(fed))))
        await asyncio.sleep(0)
        go.set()
        await asyncio.wait_for(asyncio.gather(*(fed.wait() for fed in quiet)), 60)
        await storage.cas.find_missing([Digest.of(b"x")])  # a round trip: every submitted batch is done
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert held < UPLOAD_BUFFER_BUDGET, f"40 quiet uploads hold {held} bytes"
    assert await storage.cas.find_missing([Digest.of(b"y")]) != []  # the store still answers
    assert os.listdir(storage.root / "tmp") == []
    assert_consistent(storage)


async def test_a_cancelled_write_holds_none_of_its_batches(storage: DiskStorage) -> None:
    """A cancelled upload's traceback keeps the writer's frames, and an abandoned upload's objects
    form a cycle the collector may reach late: until then, none of its batches may stay alive."""
    data = os.urandom(4 * WRITE_BATCH)
    digest = Digest.of(data)
    tasks = []
    tracemalloc.start()
    try:
        for _ in range(8):
            fed = asyncio.Event()

            async def half(fed: asyncio.Event = fed) -> AsyncIterator[bytes]:
                for start in range(0, 2 * WRITE_BATCH + WRITE_BATCH // 2, 64 * 1024):
                    yield data[start : start + 64 * 1024]
                fed.set()
                await asyncio.Event().wait()  # the client went quiet

            task = asyncio.ensure_future(storage.cas.write(digest, half()))
            await asyncio.wait_for(fed.wait(), 30)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            tasks.append(task)  # kept, as a cancelled upload's task is kept by its cycle
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(task.cancelled() for task in tasks)
    # Each write had received 2.5 batches; before the fix about 2 of them stayed per write.
    assert held < 2 * WRITE_BATCH, f"{held} bytes still held by 8 cancelled writes"
    assert_consistent(storage)
