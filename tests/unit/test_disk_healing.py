"""The disk store drops an entry whose file a read finds gone or damaged (wrong size or content),
so it is reported missing and stored again by the next write; lookups by hash alone that find no
file make the next FindMissing or write re-check the entry."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_consistent, blob_path, chunked, either_layout, files_only, read_all

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import NotFound
from buildvault.storage.disk import DiskStorage

MiB = 1 << 20

# Tests that work on files directly (remove, damage, count them) run with the file layout
# (files_only); the others with both layouts (either_layout). test_disk_records.py covers records.
__all__ = ["either_layout", "files_only"]  # fixtures


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


async def stored(storage: DiskStorage, size: int) -> tuple[Digest, bytes]:
    data = os.urandom(size)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))
    return digest, data


@pytest.mark.usefixtures("files_only")
@pytest.mark.parametrize("batch", [False, True], ids=["read", "read_blobs"])
async def test_a_flipped_byte_in_a_small_blob_is_never_served(tmp_path: Path, batch: bool) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage, 5000)
        flip(blob_path(tmp_path, digest))
        if batch:
            [result] = await storage.cas.read_blobs([digest])
            assert isinstance(result, NotFound)
        else:
            with pytest.raises(NotFound):
                await storage.cas.read(digest)
        assert await storage.cas.find_missing([digest]) == [digest]
        await storage.wait_idle()
        assert not blob_path(tmp_path, digest).exists()  # the damaged file is deleted
        await storage.cas.write(digest, chunked(data))
        assert await read_all(storage, digest) == data
        assert_consistent(storage)


@pytest.mark.usefixtures("either_layout")
async def test_a_flipped_byte_in_a_streamed_blob_fails_before_the_last_chunk(tmp_path: Path) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage, 3 * MiB + 5)
        flip(blob_path(tmp_path, digest))
        received = []
        with pytest.raises(NotFound):
            async for chunk in await storage.cas.read(digest):
                received.append(chunk)
        assert 0 < sum(map(len, received)) < digest.size_bytes
        assert await storage.cas.find_missing([digest]) == [digest]
        await storage.cas.write(digest, chunked(data))
        assert await read_all(storage, digest) == data
        # A ranged read is not verified (it does not see the whole blob), but is served from the file.
        assert b"".join([c async for c in await storage.cas.read(digest, 10, 100)]) == data[10:110]
        await storage.wait_idle()
        assert_consistent(storage)


@pytest.mark.usefixtures("files_only")
async def test_a_removed_file_leaves_the_index_at_its_first_read(tmp_path: Path) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        small, small_data = await stored(storage, 100)
        large, _ = await stored(storage, 2 * MiB)
        for digest in (small, large):
            blob_path(tmp_path, digest).unlink()
            assert await storage.cas.find_missing([digest]) == []  # nothing has looked yet
            with pytest.raises(NotFound):
                await storage.cas.read(digest)
        assert await storage.cas.find_missing([small, large]) == [small, large]
        await storage.cas.write_blobs([(small, small_data)])
        assert blob_path(tmp_path, small).read_bytes() == small_data
        assert_consistent(storage)


@pytest.mark.usefixtures("files_only")
@pytest.mark.parametrize("then", ["find_missing", "find_missing_indices", "write", "write_blobs"])
async def test_a_lookup_that_finds_no_file_makes_the_next_call_recheck(tmp_path: Path, then: str) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        digest, data = await stored(storage, 300)
        kept, _ = await stored(storage, 400)
        blob_path(tmp_path, digest).unlink()
        with pytest.raises(NotFound):  # the listing of its directory does not name it: no size known
            await storage.cas.lookup(DigestFunction.SHA256, digest.hash)
        trips = storage.pool_trips
        if then == "find_missing":
            assert await storage.cas.find_missing([digest, kept]) == [digest]
        elif then == "find_missing_indices":
            sizes = [digest.size_bytes, kept.size_bytes]
            assert await storage.cas.find_missing_indices(DigestFunction.SHA256, [digest.hash, kept.hash], sizes) == [0]
        elif then == "write":
            await storage.cas.write(digest, chunked(data))
        else:
            assert await storage.cas.write_blobs([(digest, data)]) == [None]
        assert storage.pool_trips > trips  # the file was looked at
        if then.startswith("write"):
            assert blob_path(tmp_path, digest).read_bytes() == data
        trips = storage.pool_trips
        assert await storage.cas.find_missing([kept]) == []
        assert storage.pool_trips == trips  # re-checked once: FindMissing is back to memory only
        assert_consistent(storage)
