"""Small blobs and action entries as LMDB records (storage/disk/records.py): damage detected and
healed, eviction that frees space within the cap in LRU order, a full map or disk refused with
StorageFull while reads go on, restart after a clean stop, after an abandoned one (kill -9) and
after a reboot, action entries moving between a record and a file, small files of an older
store moved into records."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import lmdb
import pytest
from disk_helpers import assert_consistent, read_all

from buildvault.digest import Digest
from buildvault.storage import NotFound, StorageFull, single_chunk
from buildvault.storage.disk import DiskStorage, durability, records
from buildvault.storage.disk.core import cas_key

KiB = 1 << 10


def blob(n: int, size: int = 4 * KiB) -> tuple[Digest, bytes]:
    data = os.urandom(16) + n.to_bytes(8, "big") * ((size - 16) // 8)
    data = data[:size].ljust(size, b"\x00")
    return Digest.of(data), data


def flip_byte_of(storage: DiskStorage, data: bytes) -> None:
    """Flip one bit of every copy of `data` in LMDB's data file, in place (bit rot; stale copies of
    leaf pages stay in free pages, so every copy is flipped to hit the live one)."""
    with open(storage.root / "records" / "data.mdb", "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        at = mapped.find(data)
        assert at >= 0
        while at >= 0:
            mapped[at + len(data) // 2] ^= 0x01
            at = mapped.find(data, at + len(data))


def data_file_bytes(storage: DiskStorage) -> int:
    return (storage.root / "records" / "data.mdb").stat().st_blocks * 512


async def test_small_blobs_are_records_and_large_ones_files(tmp_path: Path) -> None:
    async with await DiskStorage.open(tmp_path, 64 << 20) as storage:
        small, small_data = blob(1, 3000)
        large, large_data = blob(2, records.RECORD_LIMIT + 1)
        assert await storage.cas.write_blobs([(small, small_data), (large, large_data)]) == [None, None]
        assert storage.is_record(small) and not storage.is_record(large)
        assert not os.path.exists(storage.path_of(small)) and os.path.exists(storage.path_of(large))
        assert storage.record_keys() == [cas_key(small)]
        assert await read_all(storage, small) == small_data
        assert await storage.cas.read_blobs([small, large]) == [small_data, large_data]
        assert await storage.cas.lookup(small.function, small.hash) == small
        ranged = b"".join([chunk async for chunk in await storage.cas.read(small, 100, 50)])
        assert ranged == small_data[100:150]
        assert_consistent(storage)


@pytest.mark.parametrize("reader", ["read", "read_blobs", "action"])
async def test_a_flipped_byte_in_a_record_is_detected_never_served_and_healed(tmp_path: Path, reader: str) -> None:
    async with await DiskStorage.open(tmp_path, 64 << 20) as storage:
        digest, data = blob(7, 5000)
        await storage.cas.write(digest, single_chunk(data))
        if reader == "action":
            entry = os.urandom(16) + b"an action entry, CRC-checked" * 20
            action = Digest.of(b"action")
            await storage.ac.put("ac", action, entry)
            storage.ac_memory.clear()
            flip_byte_of(storage, entry)
            with pytest.raises(NotFound):
                await storage.ac.get("ac", action)
            with pytest.raises(NotFound):  # it left the index: no second read of the record
                await storage.ac.get("ac", action)
            await storage.ac.put("ac", action, entry)
            storage.ac_memory.clear()
            assert await storage.ac.get("ac", action) == entry
            await storage.wait_idle()
            assert_consistent(storage)
            return
        flip_byte_of(storage, data)
        if reader == "read":
            with pytest.raises(NotFound):
                await read_all(storage, digest)
        else:
            (got,) = await storage.cas.read_blobs([digest])
            assert isinstance(got, NotFound)
        assert await storage.cas.find_missing([digest]) == [digest]  # reported missing at once
        await storage.wait_idle()
        assert cas_key(digest) not in storage.stored_records()  # the damaged record is deleted
        await storage.cas.write(digest, single_chunk(data))  # the next upload stores it
        assert await storage.cas.find_missing([digest]) == []
        assert await read_all(storage, digest) == data
        assert_consistent(storage)


async def test_a_record_removed_behind_the_store_leaves_the_index_at_its_first_read(tmp_path: Path) -> None:
    async with await DiskStorage.open(tmp_path, 64 << 20) as storage:
        digest, data = blob(3)
        await storage.cas.write(digest, single_chunk(data))
        records.delete_many(storage._core.records, [cas_key(digest)])  # verify --repair, in another process
        with pytest.raises(NotFound):
            await read_all(storage, digest)
        assert await storage.cas.find_missing([digest]) == [digest]
        assert_consistent(storage)


async def test_a_lookup_by_hash_that_finds_no_record_makes_find_missing_recheck(tmp_path: Path) -> None:
    async with await DiskStorage.open(tmp_path, 64 << 20) as storage:
        digest, data = blob(4)
        await storage.cas.write(digest, single_chunk(data))
        records.delete_many(storage._core.records, [cas_key(digest)])
        with pytest.raises(NotFound):
            await storage.cas.lookup(digest.function, digest.hash)
        assert await storage.cas.find_missing([digest]) == [digest]
        assert_consistent(storage)


async def test_eviction_deletes_records_in_lru_order_and_the_data_file_stays_within_the_cap(tmp_path: Path) -> None:
    cap = 4 << 20
    storage = await DiskStorage.open(tmp_path, cap, hold_seconds=0, sync_interval=None)
    try:
        kept, kept_data = blob(0)
        await storage.cas.write(kept, single_chunk(kept_data))
        written = []
        for start in range(0, 4000, 100):  # 19 MiB of 4 KiB blobs (and some of 12 KiB) through a 4 MiB cap
            batch = [blob(n, 12 * KiB if n % 10 == 0 else 4 * KiB) for n in range(start + 1, start + 101)]
            assert await storage.cas.write_blobs(batch) == [None] * len(batch)
            written += [d for d, _ in batch]
            assert await storage.cas.find_missing([kept]) == []  # used: moved to the newest end
            assert storage.stats().used_bytes <= cap
            assert data_file_bytes(storage) <= cap  # LMDB reuses the pages freed
        await storage.wait_idle()
        assert storage.stats().evictions_total > 3000
        missing = set(await storage.cas.find_missing(written))
        # LRU: what was written first is gone, the newest is there, and the one kept in use too.
        assert set(written[:1000]) <= missing and not missing & set(written[-200:])
        assert await read_all(storage, kept) == kept_data
        assert_consistent(storage)
    finally:
        await storage.close()


async def test_a_full_map_or_disk_is_storage_full_and_reads_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await DiskStorage.open(tmp_path, 64 << 20) as storage:
        stored, stored_data = blob(1)
        await storage.cas.write(stored, single_chunk(stored_data))
        await storage.ac.put("ac", Digest.of(b"a"), b"entry")

        def full(recs: records.Records, pairs: list[tuple[bytes, bytes]]) -> None:
            raise lmdb.MapFullError("mdb_put", -30792)

        with monkeypatch.context() as m:
            m.setattr(records, "commit", full)
            digest, data = blob(2)
            with pytest.raises(StorageFull):
                await storage.cas.write(digest, single_chunk(data))
            outcomes = await storage.cas.write_blobs([blob(3), blob(4)])
            assert all(isinstance(e, StorageFull) for e in outcomes)
            with pytest.raises(StorageFull):
                await storage.ac.put("ac", Digest.of(b"b"), b"entry")
            m.setattr(records, "commit", lambda *_: (_ for _ in ()).throw(lmdb.DiskError("mdb_txn_commit", 28)))
            with pytest.raises(StorageFull):
                await storage.cas.write(digest, single_chunk(data))
            assert await read_all(storage, stored) == stored_data  # reads keep working
            storage.ac_memory.clear()
            assert await storage.ac.get("ac", Digest.of(b"a")) == b"entry"
        assert await storage.cas.find_missing([digest, stored]) == [digest]
        assert storage.reserved_bytes == 0
        await storage.cas.write(digest, single_chunk(data))  # room again: stored
        assert_consistent(storage)


async def test_restart_after_a_clean_stop_keeps_records_and_their_order_without_walking_them(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    blobs = [blob(n) for n in range(20)]
    await storage.cas.write_blobs(blobs)
    await storage.cas.find_missing([blobs[0][0]])  # the oldest becomes the newest
    await storage.ac.put("ac", Digest.of(b"x"), b"entry")
    order = storage.record_keys()
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    try:
        assert storage.load_info["records_walked"] == 0 and storage.load_info["clean_shutdown"]
        assert storage.record_keys() == order
        assert await storage.cas.read_blobs([d for d, _ in blobs]) == [data for _, data in blobs]
        assert await storage.ac.get("ac", Digest.of(b"x")) == b"entry"
        assert_consistent(storage)
    finally:
        await storage.close()


async def test_restart_after_kill_9_finds_every_acknowledged_record(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    before = [blob(n) for n in range(10)]
    await storage.cas.write_blobs(before)
    await storage.checkpoint()
    after = [blob(n) for n in range(10, 30)]  # written after the snapshot: found by walking LMDB
    await storage.cas.write_blobs(after)
    await storage.ac.put("ac", Digest.of(b"y"), b"late entry")
    evicted = before[0][0]
    records.delete_many(storage._core.records, [cas_key(evicted)])  # as an eviction after the snapshot
    storage.abandon()
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    try:
        assert not storage.load_info["clean_shutdown"] and storage.load_info["records_walked"] == 30
        assert storage.load_info["records_verified"] == 0  # same boot: LMDB's commits are whole
        assert await storage.cas.find_missing([d for d, _ in before + after]) == [evicted]
        assert await storage.cas.read_blobs([d for d, _ in after]) == [data for _, data in after]
        assert await storage.ac.get("ac", Digest.of(b"y")) == b"late entry"
        assert_consistent(storage)
    finally:
        await storage.close()


async def test_after_a_reboot_every_record_is_verified_and_damaged_ones_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = await DiskStorage.open(tmp_path, 64 << 20, validate_entry=lambda kind, data: data != b"torn")
    blobs = [blob(n) for n in range(10)]
    await storage.cas.write_blobs(blobs)
    await storage.ac.put("ac", Digest.of(b"z"), b"torn")  # what the validator calls broken
    await storage.sync()
    flip_byte_of(storage, blobs[3][1])
    storage.abandon()
    monkeypatch.setattr(durability, "boot_id", lambda: b"another boot....")
    storage = await DiskStorage.open(tmp_path, 64 << 20, validate_entry=lambda kind, data: data != b"torn")
    try:
        assert storage.load_info["records_verified"] == 11 and storage.load_info["records_damaged"] == 2
        assert await storage.cas.find_missing([d for d, _ in blobs]) == [blobs[3][0]]
        with pytest.raises(NotFound):
            await storage.ac.get("ac", Digest.of(b"z"))
        assert_consistent(storage)
    finally:
        await storage.close()


async def test_an_action_entry_moves_between_a_record_and_a_file_with_its_size(tmp_path: Path) -> None:
    action = Digest.of(b"action")
    big = os.urandom(records.RECORD_LIMIT + 100)
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    await storage.ac.put("raw", action, b"small entry")
    await storage.ac.put("raw", action, big)
    await storage.wait_idle()
    assert storage.stored_records() == {} and len(storage.entry_paths()) == 1
    storage.ac_memory.clear()
    assert await storage.ac.get("raw", action) == big
    await storage.ac.put("raw", action, b"small again")
    await storage.wait_idle()
    assert storage.entry_paths() == [] and len(storage.stored_records()) == 1
    assert_consistent(storage)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    try:
        assert await storage.ac.get("raw", action) == b"small again"
        assert_consistent(storage)
    finally:
        await storage.close()


async def test_small_files_of_an_older_store_are_moved_into_records(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 64 << 20, record_limit=0)  # every entry a file, as before
    blobs = [blob(n) for n in range(5)]
    large = blob(9, records.RECORD_LIMIT * 2)
    await storage.cas.write_blobs([*blobs, large])
    await storage.ac.put("ac", Digest.of(b"old"), b"old entry")
    await storage.close()
    (tmp_path / "index.lru").unlink()  # a snapshot of the older format is ignored the same way
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    try:
        assert len(storage.stored_records()) == 6 and storage.entry_paths() == [storage.path_of(large[0])]
        assert await storage.cas.read_blobs([d for d, _ in [*blobs, large]]) == [data for _, data in [*blobs, large]]
        assert await storage.ac.get("ac", Digest.of(b"old")) == b"old entry"
        assert_consistent(storage)
    finally:
        await storage.close()


async def test_an_environment_lmdb_reports_damaged_is_dropped_and_the_files_stay(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    small, small_data = blob(1)
    large, large_data = blob(2, records.RECORD_LIMIT * 2)
    await storage.cas.write_blobs([(small, small_data), (large, large_data)])
    await storage.close()
    with open(tmp_path / "records" / "data.mdb", "r+b") as f:  # both meta pages gone
        f.write(b"\x00" * 2 * records.PAGE)
    storage = await DiskStorage.open(tmp_path, 64 << 20)
    try:
        assert await storage.cas.find_missing([small, large]) == [small]  # never served from garbage
        assert await read_all(storage, large) == large_data
        await storage.cas.write(small, single_chunk(small_data))  # the new environment works
        assert await read_all(storage, small) == small_data
        assert_consistent(storage)
    finally:
        await storage.close()
