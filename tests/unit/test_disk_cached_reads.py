"""Streamed reads of a blob file: the chunks the page cache holds are read on the event loop
(no worker trip each); from the first chunk that is not all cached on, the rest is read in the
worker threads; either way the whole blob is verified before its last chunk.

The kernel's answer to "is this range cached?" is played by `page_cache` (cached up to a given
offset), so every run sees the same cache; the first test asks the real kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import blob_path, chunked, read_all

from buildvault.digest import Digest
from buildvault.storage import NotFound
from buildvault.storage.disk import DiskStorage, fileops, filereads, pagecache

MiB = 1 << 20
SIZE = 4 * MiB + 5  # opened with its first 1 MiB chunk, then 1 MiB, 1 MiB, 1 MiB and 5 bytes


@pytest.fixture
def worker_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets of the streamed chunks read in the worker threads, in order."""
    offsets: list[int] = []
    real = filereads.pread_checked

    def counting(fd: int, length: int, offset: int, check: filereads.Check | None, last: bool) -> bytes:
        offsets.append(offset)
        return real(fd, length, offset, check, last)

    monkeypatch.setattr(filereads, "pread_checked", counting)
    return offsets


class PageCache:
    """The page cache as pagecache.Residency reports it: a range is cached when it ends at or
    before `cached_up_to`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cached_up_to = SIZE

        def holds(residency: pagecache.Residency, offset: int, length: int) -> bool:
            return offset + length <= self.cached_up_to

        monkeypatch.setattr(pagecache.Residency, "holds", holds)


@pytest.fixture
def page_cache(monkeypatch: pytest.MonkeyPatch) -> PageCache:
    return PageCache(monkeypatch)


async def stored(storage: DiskStorage) -> tuple[Digest, bytes]:
    data = os.urandom(SIZE)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data, MiB))
    return digest, data


async def test_a_cached_file_is_streamed_without_a_worker_trip_per_chunk(
    tmp_path: Path, worker_reads: list[int]
) -> None:
    """The real kernel's answer: a file just written is in the page cache."""
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage)
        assert await read_all(storage, digest) == data
        assert b"".join([c async for c in await storage.cas.read(digest, 10, 3 * MiB)]) == data[10 : 10 + 3 * MiB]
        assert worker_reads == []


@pytest.mark.parametrize(
    ("cached_up_to", "in_workers"),
    [
        (2 * MiB + 1, [2 * MiB, 3 * MiB, 4 * MiB]),  # not cached past 2 MiB
        (0, [MiB, 2 * MiB, 3 * MiB, 4 * MiB]),  # nothing cached (or a file the kernel will not answer for)
    ],
)
async def test_from_the_first_chunk_the_page_cache_does_not_give_the_rest_is_read_in_the_workers(
    tmp_path: Path,
    worker_reads: list[int],
    page_cache: PageCache,
    cached_up_to: int,
    in_workers: list[int],
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage)
        page_cache.cached_up_to = cached_up_to
        assert await read_all(storage, digest) == data  # verified across loop and worker chunks
        assert worker_reads == in_workers


@pytest.mark.parametrize("cached_up_to", [SIZE, 2 * MiB + 1])
async def test_a_damaged_file_fails_before_its_last_chunk_wherever_its_chunks_are_read(
    tmp_path: Path, worker_reads: list[int], page_cache: PageCache, cached_up_to: int
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage)
        path = blob_path(tmp_path, digest)
        with open(path, "r+b") as f:  # one byte changed in place: the file keeps its checksum
            f.seek(3 * MiB + 7)
            f.write(bytes([data[3 * MiB + 7] ^ 0x40]))
        page_cache.cached_up_to = cached_up_to
        received = 0
        with pytest.raises(NotFound):
            async for chunk in await storage.cas.read(digest):
                received += len(chunk)
        assert received == 4 * MiB  # all but the last chunk
        assert worker_reads == ([] if cached_up_to == SIZE else [2 * MiB, 3 * MiB, 4 * MiB])
        assert await storage.cas.find_missing([digest]) == [digest]


async def test_a_file_checked_by_its_digest_is_read_in_the_workers(
    tmp_path: Path, worker_reads: list[int], page_cache: PageCache
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage)
        path = blob_path(tmp_path, digest)
        os.removexattr(path, fileops.FAST_XATTR)  # as a file written before checksums were recorded
        assert await read_all(storage, digest) == data
        assert worker_reads == [MiB, 2 * MiB, 3 * MiB, 4 * MiB]
        assert os.getxattr(path, fileops.FAST_XATTR)  # recorded once the digest matched
        worker_reads.clear()
        assert await read_all(storage, digest) == data
        assert worker_reads == []
