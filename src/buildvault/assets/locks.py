"""One download of an asset across the server's processes (`--processes N`): an exclusive
`flock` on a lock file per download in the spool directory, which every process shares.

The holder downloads; another process wanting the same download waits for the lock (polling it
without blocking, so a waiting caller can give up) and then looks in the index again, where it
finds what the holder stored. A holder that dies releases its lock with its last descriptor.
The holder removes the file while it still holds the lock; a waiter that then gets the lock on
the removed file sees that the path no longer names it and starts over, so two processes never
both hold the lock of one name.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

__all__ = ["LOCK_PREFIX", "DownloadLocks"]

LOCK_PREFIX = "lock-"
_FIRST_POLL = 0.005


def _try_lock(path: Path) -> int | None:
    """A descriptor holding the lock of `path`, or None when another holds it (or just removed it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _release(path: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
    os.close(fd)


class DownloadLocks:
    def __init__(self, directory: Path, max_poll: float = 0.1) -> None:
        self.directory = directory
        self.max_poll = max_poll

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """Hold the lock `name` (hex) for the body; waits while another process holds it."""
        path = self.directory / f"{LOCK_PREFIX}{name}"
        delay = _FIRST_POLL
        while True:
            attempt = asyncio.ensure_future(asyncio.to_thread(_try_lock, path))
            try:
                fd = await asyncio.shield(attempt)
            except asyncio.CancelledError:  # the attempt may still get the lock: give it back
                attempt.add_done_callback(lambda done: _abandon(path, done))
                raise
            if fd is not None:
                break
            await asyncio.sleep(delay)  # polled: a waiter that gives up holds no thread
            delay = min(delay * 2, self.max_poll)
        try:
            yield
        finally:
            await asyncio.to_thread(_release, path, fd)  # runs to the end even if cancelled


def _abandon(path: Path, done: asyncio.Future[int | None]) -> None:
    if not done.cancelled() and done.exception() is None:
        fd = done.result()
        if fd is not None:
            _release(path, fd)
