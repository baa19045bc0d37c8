"""Whole blob files read by `read_blobs` (a chunked blob's batches of chunks, BatchReadBlobs):
the ones the page cache holds, of reads.LOOP_READ_MIN bytes or more, up to reads.LOOP_READ bytes
a call, are read on the event loop (no worker trip); the rest, and anything not plainly right
(damaged, no checksum recorded), in the worker threads, which report it as before.

The first test asks the real kernel; the others play the page cache with `page_cache`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import blob_path, chunked

from buildvault.digest import Digest
from buildvault.storage import NotFound
from buildvault.storage.disk import DiskStorage, fileops, filereads, pagecache, reads

KiB = 1 << 10
MiB = 1 << 20
SIZE = 700 * KiB  # a file, not a record, read whole by read_blobs


@pytest.fixture
def worker_reads(monkeypatch: pytest.MonkeyPatch) -> list[Digest]:
    """The blobs read_blobs read in the worker threads."""
    read: list[Digest] = []
    real = filereads.read_many

    def counting(items: list[tuple[str, Digest]]) -> list[tuple[int, bytes | OSError]]:
        read.extend(digest for _, digest in items)
        return real(items)

    monkeypatch.setattr(filereads, "read_many", counting)
    return read


@pytest.fixture
def nothing_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagecache, "holds_whole", lambda fd, size: False)


async def stored(storage: DiskStorage, count: int, size: int = SIZE) -> list[tuple[Digest, bytes]]:
    blobs = []
    for _ in range(count):
        data = os.urandom(size)
        digest = Digest.of(data)
        await storage.cas.write(digest, chunked(data, 256 * KiB))
        blobs.append((digest, data))
    return blobs


async def test_cached_files_are_read_on_the_loop(tmp_path: Path, worker_reads: list[Digest]) -> None:
    """The real kernel's answer: files just written are in the page cache."""
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        blobs = await stored(storage, 3)
        assert await storage.cas.read_blobs([d for d, _ in blobs]) == [data for _, data in blobs]
        assert worker_reads == []


async def test_files_not_cached_are_read_in_the_workers(
    tmp_path: Path, worker_reads: list[Digest], nothing_cached: None
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        blobs = await stored(storage, 2)
        assert await storage.cas.read_blobs([d for d, _ in blobs]) == [data for _, data in blobs]
        assert worker_reads == [d for d, _ in blobs]


async def test_past_the_loop_budget_the_rest_goes_to_the_workers(tmp_path: Path, worker_reads: list[Digest]) -> None:
    size = 1536 * KiB
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        blobs = await stored(storage, 4, size)
        assert await storage.cas.read_blobs([d for d, _ in blobs]) == [data for _, data in blobs]
        on_loop = reads.LOOP_READ // size
        assert worker_reads == [d for d, _ in blobs[on_loop:]]


async def test_small_files_stay_in_the_one_worker_trip(tmp_path: Path, worker_reads: list[Digest]) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        small = await stored(storage, 2, reads.LOOP_READ_MIN - 1)  # files still: above the record limit
        large = await stored(storage, 1)
        blobs = small + large
        assert await storage.cas.read_blobs([d for d, _ in blobs]) == [data for _, data in blobs]
        assert worker_reads == [d for d, _ in small]


async def test_a_damaged_file_is_found_by_the_workers_and_reported_missing(
    tmp_path: Path, worker_reads: list[Digest]
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        (damaged, data), (kept, kept_data) = await stored(storage, 2)
        with open(blob_path(tmp_path, damaged), "r+b") as f:  # changed in place: it keeps its checksum
            f.seek(1000)
            f.write(bytes([data[1000] ^ 0x01]))
        found = await storage.cas.read_blobs([damaged, kept])
        assert isinstance(found[0], NotFound)
        assert found[1] == kept_data
        assert worker_reads == [damaged]
        assert await storage.cas.find_missing([damaged, kept]) == [damaged]


async def test_a_file_without_its_checksum_is_verified_in_the_workers_once(
    tmp_path: Path, worker_reads: list[Digest]
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        [(digest, data)] = await stored(storage, 1)
        path = blob_path(tmp_path, digest)
        os.removexattr(path, fileops.FAST_XATTR)  # as a file written before checksums were recorded
        assert await storage.cas.read_blobs([digest]) == [data]
        assert worker_reads == [digest]
        assert os.getxattr(path, fileops.FAST_XATTR)  # recorded once the digest matched
        assert await storage.cas.read_blobs([digest]) == [data]
        assert worker_reads == [digest]  # the second read: on the loop
