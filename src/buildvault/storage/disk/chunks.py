"""The iterators `read` returns: a whole small blob already in memory, or an open file read
one chunk ahead in the worker threads (hashed on the way when the whole blob is read: the last
chunk is handed out only once the content is known to match its digest)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable

from buildvault.digest import Hasher
from buildvault.storage import CHUNK_SIZE, NotFound, StorageError
from buildvault.storage.disk.fileops import pread_hashed, storage_error


class Verification:
    """The running hash of a whole-blob read, what it must come to, and what to do if it does not."""

    __slots__ = ("hasher", "expected", "damaged")

    def __init__(self, hasher: Hasher, expected: str, damaged: Callable[[], None]) -> None:
        self.hasher = hasher
        self.expected = expected
        self.damaged = damaged  # drops the entry from the index (and deletes its file)


class FileChunks:
    """Chunks of [offset, end) of an open file, one chunk read ahead so disk and consumer overlap.

    Holding the fd is what keeps an evicted (unlinked) blob readable. The fd is closed at the end,
    on aclose(), or when the iterator is collected; never while a read on it is still running.
    """

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        fd: int | None,
        first: bytes,
        pos: int,
        end: int,
        what: str,
        verification: Verification | None = None,
    ) -> None:
        self._executor = executor
        self._verification = verification
        self._fd = fd
        self._first: bytes | None = first
        self._pos = pos
        self._end = end
        self._what = what
        self._ahead: concurrent.futures.Future[bytes] | None = None
        self._ahead_len = 0

    def __aiter__(self) -> FileChunks:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            data, self._first = self._first, None
            self._read_ahead()
            if data:
                return data
        cf = self._ahead
        if cf is None:
            self._close()
            raise StopAsyncIteration
        try:
            data = await asyncio.wrap_future(cf)
        except BaseException as e:
            self._close()
            if isinstance(e, OSError):
                raise storage_error(e, f"reading {self._what}") from e
            raise
        self._ahead = None
        if len(data) != self._ahead_len:
            self._close()
            if self._verification is not None:
                self._verification.damaged()
            raise StorageError(f"{self._what} is shorter on disk than its size")
        self._pos += len(data)
        verification = self._verification
        if verification is not None and self._pos >= self._end:  # the last chunk: check before handing it out
            self._close()
            if verification.hasher.hexdigest() != verification.expected:
                verification.damaged()
                raise NotFound(f"{self._what} is damaged on disk (its content does not match its digest)")
        self._read_ahead()
        return data

    def _read_ahead(self) -> None:
        if self._fd is not None and self._pos < self._end:
            self._ahead_len = min(CHUNK_SIZE, self._end - self._pos)
            hasher = self._verification.hasher if self._verification is not None else None
            self._ahead = self._executor.submit(pread_hashed, self._fd, self._ahead_len, self._pos, hasher)
        else:
            self._close()

    def _close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is None:
            return
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.cancel() and not ahead.done():
            ahead.add_done_callback(lambda _f: os.close(fd))
        else:
            os.close(fd)

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()


class WholeChunks:
    """The bytes of a small read, as the iterator `read` returns (chunks of at most CHUNK_SIZE)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> WholeChunks:
        return self

    async def __anext__(self) -> bytes:
        data = self._data
        if not data:
            self._data = None
            raise StopAsyncIteration
        if len(data) <= CHUNK_SIZE:
            self._data = None
            return data
        self._data = data[CHUNK_SIZE:]
        return data[:CHUNK_SIZE]

    async def aclose(self) -> None:
        self._data = None
