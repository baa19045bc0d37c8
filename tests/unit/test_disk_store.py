"""Disk-store behaviour beyond the BlobStore contract: layout, atomicity, restart, LRU, space, fds."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import random
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.storage import (
    CHUNK_SIZE,
    CapacityExceeded,
    NotFound,
    StorageError,
    StorageFull,
    ac_namespace,
)
from buildvault.storage import disk
from buildvault.storage.disk import WRITE_BATCH, DiskStorage


async def chunked(data: bytes, size: int = 16 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def read_all(storage: DiskStorage, digest: Digest) -> bytes:
    return b"".join([chunk async for chunk in await storage.cas.read(digest)])


def blob_path(root: Path, digest: Digest) -> Path:
    return root / "cas" / digest.function.label / digest.hash[:2] / f"{digest.hash}-{digest.size_bytes}"


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def crash(storage: DiskStorage) -> None:
    """Stop a store the way a killed process would: no snapshot, nothing flushed."""
    for task in (storage._checkpointer, storage._syncer):
        if task is not None:
            task.cancel()
    storage._executor.shutdown(wait=True)
    storage._sync_executor.shutdown(wait=True)
    assert storage._lock_fd is not None
    os.close(storage._lock_fd)
    storage._lock_fd = None
    storage._closed = True


def assert_consistent(storage: DiskStorage) -> None:
    """Index and disk agree, and the accounting matches the files."""
    on_disk = {str(p): p.stat().st_size for p in files_under(storage.root / "cas") + files_under(storage.root / "ac")}
    indexed = {storage._path(key) for key in storage._index}
    assert set(on_disk) == indexed
    assert storage.stats().used_bytes == sum(on_disk.values()) <= storage.max_size
    assert os.listdir(storage.root / "tmp") == [] or storage._reserved


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[DiskStorage]:
    storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
    yield storage
    await storage.close()


async def fill(storage: DiskStorage, count: int, size: int) -> list[Digest]:
    digests = []
    for i in range(count):
        data = i.to_bytes(4, "big") * (size // 4)
        digest = Digest.of(data)
        await storage.cas.write(digest, chunked(data))
        digests.append(digest)
    return digests


# -- layout and atomic publishing ----------------------------------------------------------


async def test_layout_is_sharded_by_function_and_hash(storage: DiskStorage) -> None:
    data = b"layout"
    for function in DigestFunction:
        digest = Digest.of(data, function)
        await storage.cas.write(digest, chunked(data))
        assert blob_path(storage.root, digest).read_bytes() == data


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
    for _ in range(500):  # wait until the first batch is really on disk, in the temp dir
        temps = list(tmp.iterdir())
        if temps and temps[0].stat().st_size >= WRITE_BATCH:
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the first batch never reached the temp file")
    assert not blob_path(storage.root, digest).exists()
    assert await storage.cas.find_missing([digest]) == [digest]
    with pytest.raises(NotFound):
        await storage.cas.read(digest)
    release.set()
    await task
    assert blob_path(storage.root, digest).read_bytes() == data
    assert list(tmp.iterdir()) == []


async def test_stale_temp_files_are_removed_at_start_up(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    (tmp_path / "tmp" / "deadbeef.tmp").write_bytes(b"half a blob")
    (tmp_path / "tmp" / "other").write_bytes(b"x")
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert os.listdir(tmp_path / "tmp") == []
    assert storage.load_info["stale_temp_files"] == 2
    assert storage.stats().used_bytes == 0
    await storage.close()


async def test_concurrent_writers_leave_one_file_and_no_temp(storage: DiskStorage) -> None:
    data = os.urandom(3 * WRITE_BATCH + 1)
    digest = Digest.of(data)
    await asyncio.gather(*(storage.cas.write(digest, chunked(data, 100_000)) for _ in range(5)))
    assert files_under(storage.root / "cas") == [blob_path(storage.root, digest)]
    assert os.listdir(storage.root / "tmp") == []
    assert storage.stats().used_bytes == len(data)
    assert storage.stats().blob_count == 1


async def test_writes_are_not_fsynced_one_by_one(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Durability comes from sync points, not from an fsync per entry."""
    events: list[str] = []
    fsync, syncfs = os.fsync, disk._syncfs
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(disk, "_syncfs", lambda fd: (events.append("syncfs"), syncfs(fd))[1])
    await storage.cas.write(Digest.of(b"durable"), chunked(b"durable"))
    big = os.urandom(WRITE_BATCH + 1)
    await storage.cas.write(Digest.of(big), chunked(big))
    await storage.ac.put("ac", Digest.of(b"durable"), b"result")
    assert events == []
    before = time.time_ns()
    await storage.sync()
    assert events[0] == "syncfs"  # then the SYNC file itself is fsync'ed
    assert storage._read_sync_marker() is not None
    clean, point = storage._read_sync_marker()
    assert not clean and before <= point <= time.time_ns()


async def test_the_syncer_runs_only_after_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    syncfs = disk._syncfs
    monkeypatch.setattr(disk, "_syncfs", lambda fd: (calls.append(fd), syncfs(fd))[1])
    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=0.02)
    calls.clear()  # open() makes one sync point
    await asyncio.sleep(0.15)
    assert calls == []
    await fill_one(storage, b"changed")
    for _ in range(100):
        if calls:
            break
        await asyncio.sleep(0.01)
    assert len(calls) == 1
    await storage.close()
    clean, _point = storage._read_sync_marker()
    assert clean


async def test_unclean_restart_deletes_entries_torn_since_the_sync_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss can leave files written after the last sync point torn or zero-filled:
    after an unclean shutdown they are verified and the bad ones removed, never served."""
    monkeypatch.setattr(disk, "SYNC_MARGIN_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=None)
    old = await fill_one(storage, b"synced before the crash")
    await asyncio.sleep(0.05)  # file times come from a coarse clock
    await storage.sync()
    await asyncio.sleep(0.05)
    torn, zeroed, fine = [await fill_one(storage, bytes([n]) * 5000) for n in (1, 2, 3)]
    action = Digest.of(b"action")
    await storage.ac.put("ac", action, re_pb2.ActionResult(exit_code=1).SerializeToString())
    await storage.ac.put("raw", action, b"opaque ccache entry")
    crash(storage)
    with open(blob_path(tmp_path, torn), "r+b") as f:
        f.truncate(100)
        f.truncate(torn.size_bytes)  # same size, zeros past 100: only the hash can tell
    blob_path(tmp_path, zeroed).write_bytes(bytes(zeroed.size_bytes))
    ac_file = tmp_path / "ac" / "ac" / "@sha256" / action.hash[:2] / action.hash
    ac_file.write_bytes(bytes(7))

    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=None)
    assert storage.load_info["clean_shutdown"] is False
    assert storage.load_info["verified"] == 5  # the entries written after the sync point
    assert storage.load_info["damaged"] == 3
    assert await storage.cas.find_missing([old, torn, zeroed, fine]) == [torn, zeroed]
    assert not blob_path(tmp_path, torn).exists() and not ac_file.exists()
    with pytest.raises(NotFound):
        await read_all(storage, torn)
    with pytest.raises(NotFound):
        await storage.ac.get("ac", action)
    assert await storage.ac.get("raw", action) == b"opaque ccache entry"
    assert await read_all(storage, fine) == bytes([3]) * 5000
    assert_consistent(storage)
    await storage.close()


async def test_clean_restart_verifies_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "SYNC_MARGIN_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digest = await fill_one(storage, b"x" * 3000)
    await storage.close()
    await asyncio.sleep(0.05)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["clean_shutdown"] is True
    assert storage.load_info["verified"] == 0
    assert await storage.cas.find_missing([digest]) == []
    crash(storage)
    storage = await DiskStorage.open(tmp_path, 1 << 20)  # unclean, but nothing changed since open's sync point
    assert storage.load_info["clean_shutdown"] is False
    assert storage.load_info["verified"] == 0
    await storage.close()


async def test_existing_blob_is_not_read_again(storage: DiskStorage) -> None:
    data = b"already here"
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))

    async def must_not_be_read() -> AsyncIterator[bytes]:
        raise AssertionError("stream consumed")
        yield b""

    await storage.cas.write(digest, must_not_be_read())
    assert await read_all(storage, digest) == data


async def test_a_damaged_or_vanished_blob_becomes_not_found(storage: DiskStorage) -> None:
    truncated, deleted = await fill(storage, 2, 1000)
    with open(blob_path(storage.root, truncated), "r+b") as f:
        f.truncate(10)
    blob_path(storage.root, deleted).unlink()
    for digest in (truncated, deleted):
        with pytest.raises(NotFound):
            await storage.cas.read(digest)
    assert await storage.cas.find_missing([truncated, deleted]) == [truncated, deleted]
    await asyncio.sleep(0.05)
    assert_consistent(storage)
    await storage.cas.write(truncated, chunked((0).to_bytes(4, "big") * 250))  # healed by a new upload
    assert await read_all(storage, truncated) == (0).to_bytes(4, "big") * 250


# -- restart -------------------------------------------------------------------------------


async def test_index_survives_restart(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 30)
    digests = await fill(storage, 20, 1000)
    blake = Digest.of(b"blake", DigestFunction.BLAKE3)
    await storage.cas.write(blake, chunked(b"blake"))
    await storage.ac.put(ac_namespace("ci"), digests[0], b"action result")
    before = storage.stats()
    await storage.close()

    storage = await DiskStorage.open(tmp_path, 1 << 30)
    after = storage.stats()
    assert (after.used_bytes, after.blob_count, after.ac_entries) == (before.used_bytes, 21, 1)
    assert storage.load_info["stat_calls"] == 0  # the snapshot gave the order: no stat per blob
    assert storage.load_info["scanned_dirs"] == 0  # and no directory changed: none was listed
    assert await storage.cas.find_missing(digests + [blake]) == []
    assert await read_all(storage, digests[7]) == (7).to_bytes(4, "big") * 250
    assert await storage.ac.get(ac_namespace("ci"), digests[0]) == b"action result"
    assert_consistent(storage)
    await storage.close()


async def test_lru_order_survives_restart(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
    digests = await fill(storage, 10, 100)
    await read_all(storage, digests[0])  # 0 is now the most recently used
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 1000)
    await fill_one(storage, b"x" * 100)
    assert await storage.cas.find_missing(digests) == [digests[1]]
    await storage.close()


async def fill_one(storage: DiskStorage, data: bytes) -> Digest:
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))
    return digest


async def test_after_a_crash_the_order_comes_from_mtimes(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 300)
    a, b, c = [await fill_one(storage, bytes([n]) * 100) for n in range(3)]
    crash(storage)
    assert not (tmp_path / "index.lru").exists()
    now = time.time()
    for digest, age in ((a, 100), (b, 300), (c, 200)):
        os.utime(blob_path(tmp_path, digest), (now - age, now - age))
    storage = await DiskStorage.open(tmp_path, 300)
    assert storage.load_info["stat_calls"] == 3
    await fill_one(storage, b"new" * 33 + b"!")
    assert await storage.cas.find_missing([a, b, c]) == [b]  # the oldest mtime went first
    assert_consistent(storage)
    await storage.close()


async def test_stale_snapshot_is_merged_with_the_disk(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    a = await fill_one(storage, b"a" * 10)
    b = await fill_one(storage, b"b" * 10)
    await storage.checkpoint()
    c = await fill_one(storage, b"c" * 10)  # after the snapshot
    crash(storage)
    blob_path(tmp_path, b).unlink()  # in the snapshot, gone from disk
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["from_snapshot"] == 1
    assert storage.load_info["stat_calls"] == 1
    assert await storage.cas.find_missing([a, b, c]) == [b]
    assert list(storage._index) == [disk._cas_key(a), disk._cas_key(c)]
    assert_consistent(storage)
    await storage.close()


async def test_changes_made_while_stopped_are_found(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    kept, removed = await fill(storage, 2, 64)
    await storage.ac.put("ac", kept, b"entry")
    await storage.close()
    await asyncio.sleep(0.05)  # past the filesystem clock tick of the last change
    blob_path(tmp_path, removed).unlink()
    added_data = b"copied in by hand"
    added = Digest.of(added_data)
    blob_path(tmp_path, added).write_bytes(added_data)
    (blob_path(tmp_path, kept).parent / "notes.txt").write_text("stray")
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert 1 <= storage.load_info["scanned_dirs"] <= 3  # only the directories that changed
    assert storage.load_info["stray_files"] == 1
    assert await storage.cas.find_missing([kept, removed, added]) == [removed]
    assert await read_all(storage, added) == added_data
    assert await storage.ac.get("ac", kept) == b"entry"
    assert storage.stats().used_bytes == 64 + len(added_data) + 5
    await storage.close()


async def test_checkpoint_then_crash_rescans_only_changed_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "RACY_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    before = await fill(storage, 30, 64)
    await storage.checkpoint()
    await asyncio.sleep(0.05)
    after = await fill_one(storage, b"written after the checkpoint")
    crash(storage)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["scanned_dirs"] == 1
    assert storage.load_info["stat_calls"] == 1
    assert await storage.cas.find_missing(before + [after]) == []
    assert_consistent(storage)
    await storage.close()


async def test_recently_changed_dirs_are_not_trusted(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 3, 64)
    await storage.checkpoint()  # taken within RACY_NS of the writes
    crash(storage)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["scanned_dirs"] >= 1
    assert await storage.cas.find_missing(digests) == []
    await storage.close()


async def test_changes_during_a_checkpoint_mark_their_dirs_untrusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys are copied first, the directory times read later: whatever changed in between
    (here a write and the eviction it causes) must not be trusted at the next start."""
    monkeypatch.setattr(disk, "RACY_NS", 0)
    storage = await DiskStorage.open(tmp_path, 300)
    a, b, c = [await fill_one(storage, bytes([n]) * 100) for n in range(3)]
    await asyncio.sleep(0.05)
    entered, proceed = threading.Event(), threading.Event()
    leaf_dirs = storage._leaf_dirs

    def paused(racy_ns: int) -> dict[bytes, tuple[str, int]]:
        entered.set()
        proceed.wait(10)
        return leaf_dirs(racy_ns)

    monkeypatch.setattr(storage, "_leaf_dirs", paused)
    checkpoint = asyncio.create_task(storage.checkpoint())
    while not entered.is_set():
        await asyncio.sleep(0.005)
    d = await fill_one(storage, b"d" * 100)  # evicts a
    assert not blob_path(tmp_path, a).exists()
    proceed.set()
    await checkpoint
    crash(storage)
    storage = await DiskStorage.open(tmp_path, 300)
    assert await storage.cas.find_missing([a, b, c, d]) == [a]
    assert_consistent(storage)
    await storage.close()


async def test_without_a_snapshot_a_big_store_skips_the_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "STAT_ORDER_LIMIT", 3)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 4, 64)
    crash(storage)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["stat_calls"] == 0
    assert await storage.cas.find_missing(digests) == []
    assert_consistent(storage)
    await storage.close()


@pytest.mark.parametrize("garbage", [b"", b"BVLRU\x00\x00\x01" + b"\xff" * 40, os.urandom(100)])
async def test_corrupt_snapshot_falls_back_to_mtimes(tmp_path: Path, garbage: bytes) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 5, 64)
    await storage.close()
    (tmp_path / "index.lru").write_bytes(garbage)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["stat_calls"] == 5
    assert await storage.cas.find_missing(digests) == []
    assert_consistent(storage)
    await storage.close()


async def test_truncated_snapshot_is_ignored(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 5, 64)
    await storage.close()
    snapshot = tmp_path / "index.lru"
    snapshot.write_bytes(snapshot.read_bytes()[:-3])
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["from_snapshot"] == 0
    assert await storage.cas.find_missing(digests) == []
    await storage.close()


async def test_lowering_max_size_evicts_at_open(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
    digests = await fill(storage, 10, 100)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 500)
    assert storage.stats().used_bytes <= 500
    assert await storage.cas.find_missing(digests) == digests[:5]
    assert_consistent(storage)
    await storage.close()


async def test_a_root_is_used_by_one_store_at_a_time(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    with pytest.raises(StorageError, match="in use"):
        await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    again = await DiskStorage.open(tmp_path, 1 << 20)  # released by close()
    await again.close()


async def test_reopen_after_close(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    with pytest.raises(StorageError):
        await storage.cas.write(Digest.of(b"x"), chunked(b"x"))


# -- LRU and space -------------------------------------------------------------------------


async def test_lru_evicts_least_recently_used_first(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
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


async def test_blob_larger_than_the_store_is_refused_before_reading(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
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


async def test_space_held_by_writes_in_progress_is_not_promised_twice(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
    first = b"a" * 800
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield first[:400]
        await release.wait()
        yield first[400:]

    task = asyncio.create_task(storage.cas.write(Digest.of(first), slow()))
    await asyncio.sleep(0.01)
    with pytest.raises(StorageFull):
        await storage.cas.write(Digest.of(b"b" * 800), chunked(b"b" * 800))
    release.set()
    await task
    await fill_one(storage, b"b" * 800)  # now the first one can be evicted
    assert storage.stats().used_bytes == 800
    assert_consistent(storage)
    await storage.close()


async def test_total_stays_under_max_with_concurrent_writers_and_readers(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 20_000)
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
                try:
                    await storage.cas.write(digests[i], chunked(blobs[i], 512))
                except StorageFull:  # 8 writers of up to 3 KB can hold more than the 20 KB cap
                    pass
            else:
                try:
                    assert await read_all(storage, digests[i]) == blobs[i]
                except NotFound:
                    pass
            peak = max(peak, storage.stats().used_bytes + storage._reserved)

    await asyncio.gather(*(worker(s) for s in range(8)))
    assert peak <= 20_000
    assert storage.stats().evictions_total > 0
    await asyncio.sleep(0.05)
    assert_consistent(storage)
    await storage.close()


async def test_reader_survives_eviction(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 4 * CHUNK_SIZE)
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
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
async def test_readers_close_their_fds(storage: DiskStorage) -> None:
    data = os.urandom(4 * CHUNK_SIZE)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data, CHUNK_SIZE))
    baseline = open_fds()
    assert await read_all(storage, digest) == data
    assert open_fds() == baseline
    chunks = await storage.cas.read(digest)
    await anext(chunks)
    assert open_fds() == baseline + 1
    await chunks.aclose()
    await asyncio.sleep(0.05)  # a read ahead still running closes the fd when it ends
    assert open_fds() == baseline
    chunks = await storage.cas.read(digest)  # never iterated, then dropped
    del chunks
    gc.collect()
    await asyncio.sleep(0.05)
    assert open_fds() == baseline


async def test_enospc_becomes_storage_full_and_leaves_nothing(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, data: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    data = os.urandom(3 * WRITE_BATCH)
    digest = Digest.of(data)
    with monkeypatch.context() as m:
        m.setattr(disk, "_write_all", no_space)
        with pytest.raises(StorageFull):
            await storage.cas.write(digest, chunked(data))
        with pytest.raises(StorageFull):
            await storage.cas.write(Digest.of(b"small"), chunked(b"small"))
        with pytest.raises(StorageFull):
            await storage.ac.put("ac", digest, b"entry")
    assert os.listdir(storage.root / "tmp") == []
    assert storage._reserved == 0 and storage.stats().used_bytes == 0
    assert await storage.cas.find_missing([digest]) == [digest]
    await storage.cas.write(digest, chunked(data))  # the space came back
    assert await read_all(storage, digest) == data


# -- keys kept apart -----------------------------------------------------------------------


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
    assert await read_all(storage, blake) == blake_data
    same_size = Digest(sha.hash, sha.size_bytes, DigestFunction.BLAKE3)
    assert await storage.cas.find_missing([same_size, sha, blake]) == [same_size]
    await storage.ac.put("ac", sha, b"sha entry")
    with pytest.raises(NotFound):
        await storage.ac.get("ac", same_size)
    await storage.close()


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


async def test_action_entries_share_the_cap_and_lru(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
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


# -- not blocking the loop ------------------------------------------------------------------


async def test_small_chunks_are_batched_into_few_thread_hops(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(16 * WRITE_BATCH)
    digest = Digest.of(data)
    calls = 0
    submit = storage._executor.submit

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return submit(*args, **kwargs)

    monkeypatch.setattr(storage._executor, "submit", counting)
    await storage.cas.write(digest, chunked(data, 16 * 1024))  # 1,024 chunks
    assert calls <= 2 * 16 + 3  # per batch: one hop hashes it, another writes it
    calls = 0
    assert len([c async for c in await storage.cas.read(digest)]) == 16
    assert calls <= 16 + 1


async def test_find_missing_makes_no_syscalls(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    digests = await fill(storage, 3, 10)
    absent = Digest.of(b"absent")

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("syscall in find_missing")

    with monkeypatch.context() as m:
        for name in ("stat", "open", "listdir", "scandir", "lstat", "access"):
            m.setattr(os, name, forbidden)
        m.setattr(storage._executor, "submit", forbidden)
        assert await storage.cas.find_missing(digests + [absent]) == [absent]


async def test_stats(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_000_000.0]
    monkeypatch.setattr(disk.time, "time", lambda: clock[0])
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
    del b


async def test_cancelling_around_a_slow_publish_keeps_everything_consistent(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    rename = disk._rename

    def slow_rename(tmp: str, final: str) -> None:
        time.sleep(0.2)
        rename(tmp, final)

    monkeypatch.setattr(disk, "_rename", slow_rename)
    data = os.urandom(disk.SMALL_OP + 50_000)  # the streaming path: received into a temp file first
    digest = Digest.of(data)
    first = asyncio.create_task(storage.cas.write(digest, chunked(data)))
    while not storage._publishing:
        await asyncio.sleep(0.005)
    second = asyncio.create_task(storage.cas.write(digest, chunked(data)))  # waits for the first's rename
    while len(os.listdir(storage.root / "tmp")) < 2:  # both received: the second now waits
        await asyncio.sleep(0.005)
    assert storage._publishing and not first.done()
    second.cancel()
    first.cancel()  # too late for the first: its rename is under way
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task
    while storage._tasks:
        await asyncio.sleep(0.01)
    assert await storage.cas.find_missing([digest]) == []  # the first one's publish completed
    assert await read_all(storage, digest) == data
    assert storage._reserved == 0 and storage.stats().used_bytes == len(data)
    assert os.listdir(storage.root / "tmp") == []
    assert_consistent(storage)


async def test_cancelling_small_writes_in_a_coalesced_trip_keeps_everything_consistent(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_small = disk._write_small

    def slow_write_small(*args: object) -> None:
        time.sleep(0.1)
        write_small(*args)

    monkeypatch.setattr(disk, "_write_small", slow_write_small)
    blobs = [os.urandom(1000 + n) for n in range(5)]
    tasks = [asyncio.create_task(storage.cas.write(Digest.of(b), chunked(b))) for b in blobs]
    while len(storage._publishing) < 5:  # all five in one trip
        await asyncio.sleep(0.005)
    again = asyncio.create_task(storage.cas.write(Digest.of(blobs[0]), chunked(blobs[0])))  # waits for the slot
    await asyncio.sleep(0.01)
    for task in (*tasks[:3], again):
        task.cancel()
    results = await asyncio.gather(*tasks, again, return_exceptions=True)
    assert [isinstance(r, asyncio.CancelledError) for r in results] == [True, True, True, False, False, True]
    while storage._publishing:
        await asyncio.sleep(0.01)
    assert await storage.cas.find_missing([Digest.of(b) for b in blobs]) == []  # cancelled too late: published
    for data in blobs:
        assert await read_all(storage, Digest.of(data)) == data
    assert storage._reserved == 0 and storage.stats().used_bytes == sum(map(len, blobs))
    assert os.listdir(storage.root / "tmp") == []
    assert_consistent(storage)


async def test_find_missing_indices_matches_find_missing(storage: DiskStorage) -> None:
    stored = await fill(storage, 4, 40)
    absent = [Digest.of(b"absent %d" % n) for n in range(3)]
    digests = [absent[0], stored[0], absent[1], stored[1], absent[0], absent[2], stored[0]]
    hashes, sizes = [d.hash for d in digests], [d.size_bytes for d in digests]
    assert await storage.cas.find_missing_indices(DigestFunction.SHA256, hashes, sizes) == [0, 2, 5]
    assert await storage.cas.find_missing_indices(DigestFunction.BLAKE3, hashes[:2], sizes[:2]) == [0, 1]
    huge = [stored[2].hash, "zz" * 32, stored[3].hash]
    assert await storage.cas.find_missing_indices(DigestFunction.SHA256, huge, [1 << 60, 3, stored[3].size_bytes]) == [0, 1]
    assert list(storage._index)[-1] == disk._cas_key(stored[3])  # hits count as uses


async def test_action_entries_are_served_from_memory_and_stay_current(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = Digest.of(b"action")
    await storage.ac.put("ac", digest, b"first")
    reads: list[str] = []
    read_file = disk._read_file
    monkeypatch.setattr(disk, "_read_file", lambda path: (reads.append(path), read_file(path))[1])
    assert await storage.ac.get("ac", digest) == b"first"
    assert reads == []  # written just now: in memory
    await storage.ac.put("ac", digest, b"second")
    assert await storage.ac.get("ac", digest) == b"second"
    storage._ac_cache.clear()
    storage._ac_cache_bytes = 0
    assert await storage.ac.get("ac", digest) == b"second" and len(reads) == 1
    assert await storage.ac.get("ac", digest) == b"second" and len(reads) == 1  # cached by the read
    storage._forget(storage._ac_key("ac", digest))  # evicted: neither the index nor the cache has it
    assert storage._ac_cache == {}
    with pytest.raises(NotFound):
        await storage.ac.get("ac", digest)


async def test_the_action_cache_in_memory_is_bounded(storage: DiskStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "AC_CACHE_BYTES", 64 * 100)
    for n in range(200):
        await storage.ac.put("ac", Digest.of(b"%d" % n), bytes(100))
    assert storage._ac_cache_bytes <= 64 * 100 and len(storage._ac_cache) == 64
    assert sum(map(len, storage._ac_cache.values())) == storage._ac_cache_bytes
    assert await storage.ac.get("ac", Digest.of(b"0")) == bytes(100)


async def test_batch_reads_find_damaged_and_vanished_files(storage: DiskStorage) -> None:
    good, longer, shorter, gone = [await fill_one(storage, bytes([n]) * 300) for n in range(4)]
    blob_path(storage.root, longer).write_bytes(bytes(301))
    blob_path(storage.root, shorter).write_bytes(bytes(299))
    blob_path(storage.root, gone).unlink()
    results = await storage.cas.read_blobs([good, longer, shorter, gone])
    assert results[0] == bytes([0]) * 300
    assert [type(r).__name__ for r in results[1:]] == ["NotFound"] * 3
    await asyncio.sleep(0.05)  # the deletions of the damaged files
    assert await storage.cas.find_missing([good, longer, shorter, gone]) == [longer, shorter, gone]
    assert_consistent(storage)
