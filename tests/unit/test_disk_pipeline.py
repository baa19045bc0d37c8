"""The pipeline of a streamed disk write (fileops.Pipeline): batches hashed, then written, in
order, by the store's workers without the event loop waiting for each; bounded; stopped cleanly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hashlib
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from disk_helpers import read_all, wait_until

from buildvault.digest import Digest, DigestFunction, new_hasher
from buildvault.storage import StorageFull
from buildvault.storage.disk import WRITE_BATCH, DiskStorage, fileops
from buildvault.storage.disk.writes import PIPELINE_DEPTH

BATCH = 64 << 10


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


def new_temp(directory: Path) -> fileops.TempFile:
    return fileops.TempFile(str(directory), new_hasher(DigestFunction.SHA256))


class HeldWrites:
    """TempFile.append held back: `entered` once a write starts, which waits for `release`;
    `written` lists the sizes of the first piece of each batch written."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.written: list[int] = []


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> HeldWrites:
    state = HeldWrites()
    append = fileops.TempFile.append

    def held_back(self: fileops.TempFile, parts: list[bytes]) -> None:
        state.entered.set()
        assert state.release.wait(30)
        append(self, parts)
        state.written.append(len(parts[0]))

    monkeypatch.setattr(fileops.TempFile, "append", held_back)
    return state


def test_batches_are_hashed_and_written_in_order(tmp_path: Path, pool: concurrent.futures.Executor) -> None:
    temp = new_temp(tmp_path)
    pipeline = fileops.Pipeline(temp, pool)
    batches = [[os.urandom(BATCH - n), os.urandom(n + 1)] for n in range(200)]
    for parts in batches:
        pipeline.put(parts, sum(map(len, parts)))
    waiting = pipeline.wait(0)
    if waiting is not None:
        waiting.result(timeout=30)
    assert pipeline.held == 0 and pipeline.error is None
    tail = os.urandom(10)
    assert temp.finish([tail]) == hashlib.sha256(b"".join(b"".join(p) for p in batches) + tail).hexdigest()
    assert temp.path is not None
    assert Path(temp.path).read_bytes() == b"".join(b"".join(p) for p in batches) + tail


def test_wait_is_done_once_the_pipeline_holds_at_most_that_much(
    tmp_path: Path, pool: concurrent.futures.Executor, held: HeldWrites
) -> None:
    entered, release = held.entered, held.release
    temp = new_temp(tmp_path)
    pipeline = fileops.Pipeline(temp, pool)
    for _ in range(3):
        pipeline.put([os.urandom(BATCH)], BATCH)
    assert entered.wait(30)
    assert pipeline.wait(3 * BATCH) is None  # nothing written yet, and that is within the bound
    waiting = pipeline.wait(BATCH)
    assert waiting is not None and not waiting.done()
    release.set()
    waiting.result(timeout=30)
    assert pipeline.held <= BATCH
    finished = pipeline.wait(0)
    if finished is not None:
        finished.result(timeout=30)
    assert pipeline.held == 0
    temp.abort()


def test_stop_drops_what_was_not_started_and_is_done_once_no_stage_runs(
    tmp_path: Path, pool: concurrent.futures.Executor, held: HeldWrites
) -> None:
    entered, release, writes = held.entered, held.release, held.written
    temp = new_temp(tmp_path)
    pipeline = fileops.Pipeline(temp, pool)
    for _ in range(5):
        pipeline.put([os.urandom(BATCH)], BATCH)
    assert entered.wait(30)
    quiet = pipeline.stop()
    assert not quiet.done()  # a batch is being written: the file must stay open until it is
    release.set()
    quiet.result(timeout=30)
    assert writes == [BATCH]  # the batches queued behind it were dropped
    pipeline.put([os.urandom(BATCH)], BATCH)  # ignored once stopped
    assert pipeline.stop().done() and writes == [BATCH]
    temp.abort()
    assert os.listdir(tmp_path) == []


def test_the_first_error_stops_both_stages(
    tmp_path: Path, pool: concurrent.futures.Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[int] = []

    def no_space(self: fileops.TempFile, parts: list[bytes]) -> None:
        attempts.append(len(parts))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileops.TempFile, "append", no_space)
    temp = new_temp(tmp_path)
    pipeline = fileops.Pipeline(temp, pool)
    for _ in range(8):
        pipeline.put([os.urandom(BATCH)], BATCH)
    waiting = pipeline.wait(0)
    if waiting is not None:
        waiting.result(timeout=30)  # done by the error, with bytes still held
    assert isinstance(pipeline.error, OSError) and pipeline.error.errno == errno.ENOSPC
    pipeline.stop().result(timeout=30)
    assert attempts == [1]  # nothing after the failed write was written
    assert pipeline.wait(0) is None


def test_a_long_write_takes_turns_with_other_work_in_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage run takes at most STAGE_RUN batches, then queues behind what came meanwhile: with
    one worker, a job submitted during a long write runs before the write's remaining batches."""
    go = threading.Event()
    hashed: list[int] = []
    digest_part = fileops.TempFile.digest_part

    def counted(self: fileops.TempFile, parts: list[bytes]) -> list[bytes]:
        assert go.wait(30)
        hashed.append(1)
        return digest_part(self, parts)

    monkeypatch.setattr(fileops.TempFile, "digest_part", counted)
    count = 4 * fileops.STAGE_RUN
    with concurrent.futures.ThreadPoolExecutor(1) as one:
        temp = new_temp(tmp_path)
        pipeline = fileops.Pipeline(temp, one)
        for _ in range(count):
            pipeline.put([os.urandom(BATCH)], BATCH)  # the first run starts and waits for `go`
        other = one.submit(lambda: len(hashed))
        go.set()
        assert other.result(timeout=30) == fileops.STAGE_RUN
        finished = pipeline.wait(0)
        if finished is not None:
            finished.result(timeout=30)
        assert len(hashed) == count and pipeline.held == 0
        temp.abort()


# -- through the store ------------------------------------------------------------------------


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[DiskStorage]:
    storage = await DiskStorage.open(tmp_path / "store", 1 << 30)
    yield storage
    await storage.close()


async def test_the_receive_runs_ahead_of_a_stalled_hash_by_the_pipeline_depth(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop does not wait for each batch's hash: with the hash stalled it takes
    PIPELINE_DEPTH batches, and it takes the next one only once the pipeline has room."""
    release = threading.Event()
    hashed: list[int] = []
    digest_part = fileops.TempFile.digest_part

    def stalled(self: fileops.TempFile, parts: list[bytes]) -> list[bytes]:
        assert release.wait(30)
        result = digest_part(self, parts)
        hashed.append(1)
        return result

    monkeypatch.setattr(fileops.TempFile, "digest_part", stalled)
    count = 3 * PIPELINE_DEPTH
    data = os.urandom(count * WRITE_BATCH)
    taken: list[int] = []
    ahead: list[int] = []  # per batch taken: batches taken before it and not hashed yet

    async def body() -> AsyncIterator[bytes]:
        for n in range(count):
            ahead.append(n - len(hashed))
            taken.append(n)
            yield data[n * WRITE_BATCH : (n + 1) * WRITE_BATCH]

    task = asyncio.ensure_future(storage.cas.write(Digest.of(data), body()))
    await wait_until(lambda: len(taken) == PIPELINE_DEPTH, 30, "the receive to run ahead of the stalled hash")
    release.set()
    await asyncio.wait_for(task, 60)
    assert taken == list(range(count))
    assert max(ahead) < PIPELINE_DEPTH, ahead
    assert await read_all(storage, Digest.of(data)) == data


async def test_a_failed_write_in_the_pipeline_leaves_nothing(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, parts: list[bytes]) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    data = os.urandom(4 * WRITE_BATCH)
    digest = Digest.of(data)

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 256 << 10):  # batches of several pieces: one writev each
            yield data[start : start + (256 << 10)]

    with monkeypatch.context() as m:
        m.setattr(fileops, "writev_all", no_space)
        with pytest.raises(StorageFull):
            await storage.cas.write(digest, pieces())
    assert os.listdir(storage.root / "tmp") == []
    assert storage.reserved_bytes == 0 and await storage.cas.find_missing([digest]) == [digest]
    await storage.cas.write(digest, pieces())
    assert await read_all(storage, digest) == data


async def test_a_failed_write_ends_the_upload_at_the_next_batch(
    storage: DiskStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a batch fails to be written, the store takes no more than one more batch of the body
    (not the rest of a large upload) before it answers with the error."""
    failed = threading.Event()

    def no_space(fd: int, parts: list[bytes]) -> None:
        failed.set()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    batches = 32
    data = os.urandom(batches * WRITE_BATCH)
    pulled = 0

    async def pieces() -> AsyncIterator[bytes]:  # two pieces a batch: one writev each
        nonlocal pulled
        for start in range(0, len(data), WRITE_BATCH // 2):
            if pulled == 2:  # the first batch is in the pipeline: let its write fail first
                assert await asyncio.to_thread(failed.wait, 30)
            pulled += 1
            yield data[start : start + WRITE_BATCH // 2]

    with monkeypatch.context() as m:
        m.setattr(fileops, "writev_all", no_space)
        with pytest.raises(StorageFull):
            await storage.cas.write(Digest.of(data), pieces())
    assert pulled == 4  # the second batch, then the error
    assert os.listdir(storage.root / "tmp") == []
