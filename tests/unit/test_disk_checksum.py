"""The fast checksum (XXH3-64, storage/fastsum.py) a blob file records when its bytes are written
and their digest verified, and what whole reads verify instead of re-hashing with the digest
function: a file written with one is read without the digest function running; a file without
one (written before it was recorded) is verified by its digest, and records it once that matched;
a mismatch either way reports the blob missing and removes the file; `buildvault verify` still
re-hashes with the digest function."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from disk_helpers import assert_consistent, blob_path, chunked, read_all

from buildvault.admin.verify import verify
from buildvault.digest import Digest, Hasher
from buildvault.storage import NotFound, fastsum
from buildvault.storage.disk import DiskStorage, fileops, filereads, writes

MiB = 1 << 20
# A file written and read whole in one coalesced trip, and one streamed in chunks.
SIZES = [100_000, 3 * MiB + 5]


def recorded(path: Path) -> bytes | None:
    try:
        return os.getxattr(path, fileops.FAST_XATTR)
    except OSError:
        return None


def flip(path: Path) -> None:
    """Change one byte in place (the same inode: its attributes stay)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture
def digest_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the disk store's reads and writes started the digest function (one item each)."""
    runs: list[int] = []
    real: Callable[..., Hasher] = fileops.new_hasher

    def counting(function: object) -> Hasher:
        runs.append(1)
        return real(function)

    monkeypatch.setattr(fileops, "new_hasher", counting)
    monkeypatch.setattr(filereads, "new_hasher", counting)
    monkeypatch.setattr(writes, "new_hasher", counting)
    return runs


async def read_whole(storage: DiskStorage, digest: Digest, batch: bool) -> bytes:
    if batch:
        [result] = await storage.cas.read_blobs([digest])
        if isinstance(result, Exception):
            raise result
        return result
    return await read_all(storage, digest)


@pytest.mark.parametrize("size", SIZES)
async def test_a_verified_write_records_the_checksum_of_its_bytes(tmp_path: Path, size: int) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        streamed, batched = os.urandom(size), os.urandom(size)
        await storage.cas.write(Digest.of(streamed), chunked(streamed))
        assert await storage.cas.write_blobs([(Digest.of(batched), batched)]) == [None]
        for data in (streamed, batched):
            assert recorded(blob_path(tmp_path, Digest.of(data))) == fastsum.of(data)


async def write_random(storage: DiskStorage, size: int) -> tuple[bytes, Digest]:
    """A new random blob of `size` bytes, written through the store's streaming write."""
    data = os.urandom(size)
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))
    return data, digest


@pytest.mark.parametrize("size", SIZES)
async def test_a_store_verified_file_records_the_callers_checksum(tmp_path: Path, size: int) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        data = os.urandom(size)
        caller_sum = fastsum.of(data)
        assert await storage.cas.store_verified([(Digest.of(data), data, caller_sum)]) == [None]
        assert recorded(blob_path(tmp_path, Digest.of(data))) == caller_sum


@pytest.mark.parametrize("batch", [False, True], ids=["read", "read_blobs"])
@pytest.mark.parametrize("size", SIZES)
async def test_whole_reads_check_the_checksum_without_the_digest_function(
    tmp_path: Path, size: int, batch: bool, digest_runs: list[int]
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        data, digest = await write_random(storage, size)
        written = len(digest_runs)
        assert written >= 1  # the write verified the digest
        for _ in range(3):
            assert await read_whole(storage, digest, batch) == data
        assert len(digest_runs) == written


@pytest.mark.parametrize("batch", [False, True], ids=["read", "read_blobs"])
@pytest.mark.parametrize("size", SIZES)
async def test_a_file_without_a_checksum_is_verified_by_its_digest_then_records_one(
    tmp_path: Path, size: int, batch: bool, digest_runs: list[int]
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        data, digest = await write_random(storage, size)
        path = blob_path(tmp_path, digest)
        os.removexattr(path, fileops.FAST_XATTR)  # as a file written before checksums were recorded
        before = len(digest_runs)
        assert await read_whole(storage, digest, batch) == data
        assert len(digest_runs) == before + 1
        assert recorded(path) == fastsum.of(data)
        assert await read_whole(storage, digest, batch) == data
        assert len(digest_runs) == before + 1  # from now on the checksum


@pytest.mark.parametrize("size", SIZES)
async def test_a_damaged_file_without_a_checksum_is_never_served(tmp_path: Path, size: int) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        data, digest = await write_random(storage, size)
        path = blob_path(tmp_path, digest)
        os.removexattr(path, fileops.FAST_XATTR)
        flip(path)
        with pytest.raises(NotFound):
            await read_all(storage, digest)
        assert await storage.cas.find_missing([digest]) == [digest]
        await storage.wait_idle()
        assert not path.exists()
        assert_consistent(storage)


@pytest.mark.parametrize("batch", [False, True], ids=["read", "read_blobs"])
@pytest.mark.parametrize("size", SIZES)
async def test_a_checksum_mismatch_reports_the_blob_missing_and_removes_it(
    tmp_path: Path, size: int, batch: bool
) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        data, digest = await write_random(storage, size)
        path = blob_path(tmp_path, digest)
        os.setxattr(path, fileops.FAST_XATTR, fastsum.of(data + b"x"))  # right bytes, a checksum of others
        with pytest.raises(NotFound):
            await read_whole(storage, digest, batch)
        assert await storage.cas.find_missing([digest]) == [digest]
        await storage.wait_idle()
        assert not path.exists()
        await storage.cas.write(digest, chunked(data))  # the next upload stores it again
        assert await read_all(storage, digest) == data
        assert_consistent(storage)


@pytest.mark.parametrize("size", SIZES)
async def test_a_checksum_of_another_length_counts_as_none(tmp_path: Path, size: int) -> None:
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        data, digest = await write_random(storage, size)
        path = blob_path(tmp_path, digest)
        os.setxattr(path, fileops.FAST_XATTR, b"short")
        assert await read_all(storage, digest) == data  # verified by its digest
        assert recorded(path) == fastsum.of(data)


async def test_verify_rehashes_with_the_digest_function(tmp_path: Path) -> None:
    """A file whose bytes changed together with its checksum (which reads trust) is still found
    corrupt by `buildvault verify`, which re-hashes every blob with its digest function."""
    data = os.urandom(2 * MiB)
    digest = Digest.of(data)
    async with await DiskStorage.open(tmp_path, 64 * MiB) as storage:
        await storage.cas.write(digest, chunked(data))
    path = blob_path(tmp_path, digest)
    flip(path)
    os.setxattr(path, fileops.FAST_XATTR, fastsum.of(path.read_bytes()))
    findings = verify(tmp_path, show_progress=False)
    assert [Path(p).name for p in findings.corrupt_blobs] == [path.name]
