"""File operations that run in the store's worker threads, never on the event loop.

Whole small entries (verify + temp file + rename, unlinks) in as few syscalls as possible
(reading files back, verified, is filereads.py), the streaming temp file of large writes
(`TempFile`) and the ordered hash-then-write stages its batches go through (`Pipeline`), the
durable replacement of a small metadata file (`replace_durably`), and the mapping of OSErrors
to storage errors.

The fast checksum of a blob file (storage/fastsum.py, XXH3-64) is an extended attribute of the
file (`FAST_XATTR`), set on the temp file before its rename, so it is in place exactly when the
file is: computed in the same pass as the digest a write verifies, or the one a `store_verified`
caller computed over the bytes it hashed. Reads verify it (filereads.py).

Functions are looked up through this module at call time, so a test can inject
a fault (ENOSPC, a slow rename) by replacing one of them.

They run in the store's pool, small ones coalesced into one trip (core.py: `CountingPool`,
`Coalescer`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

from buildvault.digest import Digest, Hasher, new_hasher
from buildvault.storage import StorageError, StorageFull, check_content, fastsum

log = logging.getLogger("buildvault.storage.disk")

# Outcome of reading a whole small file.
OK, MISSING, DAMAGED = range(3)
FAILED = -1  # read_many: the OSError is in place of the bytes
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

# The extended attribute holding a blob file's fast checksum (fastsum.SIZE bytes).
FAST_XATTR = "user.buildvault.xxh3"

# Pieces one writev takes at most (the system's limit; POSIX guarantees 16).
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16)
# A batch of pieces this large on average is hashed and written piece by piece (writev) instead
# of being joined first; smaller ones are joined (one hash call instead of many short ones).
_JOIN_BELOW = 64 << 10

_temp_names = itertools.count()
_TEMP_PREFIX = secrets.token_hex(6)


def storage_error(e: OSError, what: str) -> StorageError:
    """StorageFull for a full device or quota, else StorageError, naming `what` was being done."""
    if e.errno in NO_SPACE:
        return StorageFull(f"{what}: {os.strerror(e.errno)}")
    return StorageError(f"{what}: {e}")


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until done."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def writev_all(fd: int, parts: list[bytes]) -> None:
    """os.writev of `parts` in order until done (no joined copy of them)."""
    views = [memoryview(part) for part in parts if part]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        done = 0
        while done < len(views) and written >= len(views[done]):
            written -= len(views[done])
            done += 1
        views = views[done:]
        if written:
            views[0] = views[0][written:]


def unlink_quiet(path: str) -> None:
    """Remove a file; a missing one is fine, any other failure is only logged (the file leaks)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # eviction must not fail a write; the file is only leaked
        log.warning("could not delete %s: %s", path, e)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename(tmp: str, final: str) -> None:
    """Publish `tmp` as `final` atomically, making the (AC) directory on demand."""
    try:
        os.replace(tmp, final)
    except FileNotFoundError:
        if not os.path.exists(tmp):
            raise
        os.makedirs(os.path.dirname(final), exist_ok=True)  # AC dirs are made on demand
        os.replace(tmp, final)


def recorded_sum(fd: int) -> bytes | None:
    """The fast checksum recorded with an open blob file, or None (none recorded, or no xattrs here)."""
    try:
        value = os.getxattr(fd, FAST_XATTR)
    except OSError:  # ENODATA: none recorded; ENOTSUP: a filesystem without user xattrs
        return None
    return value if len(value) == fastsum.SIZE else None


def record_sum(fd: int, value: bytes) -> None:
    """Record a blob file's fast checksum; where that is impossible, its reads verify the digest."""
    try:
        os.setxattr(fd, FAST_XATTR, value)
    except OSError as e:  # no user xattrs on this filesystem, a read-only store, a full disk
        log.debug("fast checksum not recorded: %s", e)


def check_hash(data: bytes, digest: Digest) -> None:
    """Raise DigestMismatch unless `data` is the blob `digest` names (in a worker thread)."""
    hasher = new_hasher(digest.function)
    hasher.update(data)
    check_content(digest, len(data), hasher)


def write_small(tmp_dir: str, final: str, data: bytes, digest: Digest | None, fast: bytes | None = None) -> None:
    """One whole small entry: verify (CAS), write a temp file with the fast checksum, rename it into
    place. `digest`: verify the bytes against it and record their checksum; `fast` (a blob whose
    caller hashed it, store_verified): the checksum the caller computed, recorded as it is; neither
    (an action entry): no checksum."""
    if digest is not None:
        check_hash(data, digest)
        fast = fastsum.of(data)
    tmp = f"{tmp_dir}/{_TEMP_PREFIX}{next(_temp_names)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            write_all(fd, data)
            if fast is not None:
                record_sum(fd, fast)
        finally:
            os.close(fd)
        rename(tmp, final)
    except BaseException:
        unlink_quiet(tmp)
        raise


def write_many(items: list[tuple[str, str, bytes, Digest | None, bytes | None]]) -> list[Exception | None]:
    """write_small for each item, in one trip: None or the exception, each."""
    results: list[Exception | None] = []
    for item in items:
        try:
            write_small(*item)
            results.append(None)
        except Exception as e:  # that item's outcome
            results.append(e)
    return results


class TempFile:
    """A write in progress. Its methods run in worker threads, one at a time (except that
    `digest_part` and `append` may overlap: they touch disjoint state)."""

    __slots__ = ("directory", "path", "fd", "hasher", "fast", "checksum")

    def __init__(self, directory: str, hasher: Hasher | None, checksum: bytes | None = None) -> None:
        """`hasher`: the digest the bytes are verified against (a CAS blob): their fast checksum
        is computed beside it and recorded; `checksum` (a blob whose caller hashed it): the
        checksum to record as it is; neither (an action entry, a metadata file): none."""
        self.directory = directory
        self.path: str | None = None
        self.fd: int | None = None
        self.hasher = hasher
        self.fast = fastsum.new() if hasher is not None else None
        self.checksum = checksum

    def write(self, parts: list[bytes]) -> None:
        self.append(self.digest_part(parts))

    def digest_part(self, parts: list[bytes]) -> list[bytes]:
        """Hash the next part, given as pieces; return the pieces to `append` (never touches the
        file: may run beside `append`). Large pieces are hashed one by one, never joined (a
        copy); small ones are joined first (one hash call each)."""
        if len(parts) > 1 and sum(map(len, parts)) < _JOIN_BELOW * len(parts):
            parts = [b"".join(parts)]
        if self.hasher is not None:
            assert self.fast is not None
            for part in parts:
                if part:
                    self.hasher.update(part)
                    self.fast.update(part)
        return parts

    def append(self, parts: list[bytes]) -> None:
        """Write the next part, given as pieces (never touches the hasher: may run beside `digest_part`)."""
        if self.fd is None:
            path = os.path.join(self.directory, secrets.token_hex(12) + ".tmp")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            self.path = path
        if len(parts) == 1:
            if parts[0]:
                write_all(self.fd, parts[0])
        elif parts:
            writev_all(self.fd, parts)

    def finish(self, parts: list[bytes], sync: bool = False) -> str | None:
        """Write the rest, close (fsync first if `sync`); return the hex digest."""
        self.write(parts)
        assert self.fd is not None
        checksum = self.fast.digest() if self.fast is not None else self.checksum
        if checksum is not None:  # a mismatching digest: the caller removes the file
            record_sum(self.fd, checksum)
        if sync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        return self.hasher.hexdigest() if self.hasher is not None else None

    def abort(self, *pending: concurrent.futures.Future[Any] | None) -> None:
        """Remove the temp file; first wait for work still running on it, so the fd is never reused."""
        running = [cf for cf in pending if cf is not None]
        if running:
            concurrent.futures.wait(running)
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.path is not None:
            unlink_quiet(self.path)
            self.path = None


# Batches one run of a Pipeline stage takes at most before it goes to the back of the pool's
# queue: a long upload holds a worker for a few milliseconds at a time, not for its whole length,
# and reads and other writes get their turn between.
STAGE_RUN = 4


class _Stage:
    """One stage of a Pipeline: its queue of (batch, bytes), the work each batch gets, whether a
    run of it is in the pool, and what follows a batch's work (under no lock)."""

    __slots__ = ("queue", "work", "then", "running")

    def __init__(self, work: Callable[[list[bytes]], Any], then: Callable[[Any, int], None]) -> None:
        self.queue: collections.deque[tuple[list[bytes], int]] = collections.deque()
        self.work = work
        self.then = then
        self.running = False


class Pipeline:
    """The batches of one streamed write, hashed then written in order by the store's workers
    without the event loop waiting for each: `put` queues a batch and returns at once; a hashing
    stage (`TempFile.digest_part`) hands each batch to a writing stage (`TempFile.append`), each a
    run of the pool's work items that takes the next batch as soon as the previous one is done
    (up to STAGE_RUN batches, then its next run queues behind other work), so neither waits for
    the loop to hand over. The loop waits only when `held` (bytes queued, not written yet) passes
    its bound (`wait`), and for the end (`wait(0)`); the first stage error stops both stages and
    is in `error`. `stop` drops the batches not started; its future is done
    once no stage runs (only then may the temp file be closed: its fd could be reused).

    Thread-safe: `put`, `wait` and `stop` are called from the event loop, the stages run in the pool.
    """

    __slots__ = (
        "temp", "executor", "held", "error", "_lock", "_hash", "_write", "_stopped", "_waiter", "_most", "_quiet",
    )  # fmt: skip

    def __init__(self, temp: TempFile, executor: concurrent.futures.Executor) -> None:
        self.temp = temp
        self.executor = executor
        self.held = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._hash = _Stage(temp.digest_part, self._hashed)
        self._write = _Stage(temp.append, self._written)
        self._stopped = False
        self._waiter: concurrent.futures.Future[None] | None = None
        self._most = 0
        self._quiet: concurrent.futures.Future[None] | None = None

    def put(self, parts: list[bytes], nbytes: int) -> None:
        """Queue the next batch (`nbytes` in `parts`) to be hashed, then written."""
        with self._lock:
            if self._stopped or self.error is not None:
                return
            self.held += nbytes
            start = self._queue(self._hash, parts, nbytes)
        if start:
            self._start(self._hash)

    def wait(self, most: int) -> concurrent.futures.Future[None] | None:
        """None if at most `most` bytes are held (or a stage failed); else a future done once that is so."""
        with self._lock:
            if self.error is not None or self.held <= most:
                return None
            self._most = most
            self._waiter = concurrent.futures.Future()
            return self._waiter

    def stop(self) -> concurrent.futures.Future[None]:
        """Drop the batches not started; the future is done once no stage runs."""
        quiet: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._stopped = True
            self._hash.queue.clear()
            self._write.queue.clear()
            if self._hash.running or self._write.running:
                self._quiet = quiet
                return quiet
        quiet.set_result(None)
        return quiet

    @staticmethod
    def _queue(stage: _Stage, parts: list[bytes], nbytes: int) -> bool:
        """Under the lock: queue a batch to `stage`; whether a run of it must be started."""
        stage.queue.append((parts, nbytes))
        start = not stage.running
        stage.running = True
        return start

    def _start(self, stage: _Stage) -> None:
        try:
            self.executor.submit(self._run, stage)
        except BaseException as e:  # the pool is shut down
            with self._lock:
                stage.running = False
                self._fail(e)
            self._wake()

    def _fail(self, error: BaseException) -> None:
        """Under the lock: the first error stops both stages."""
        if self.error is None:
            self.error = error
        self._hash.queue.clear()
        self._write.queue.clear()

    def _wake(self) -> None:
        """Resolve the loop's wait and stop's future if their condition holds now."""
        done = []
        with self._lock:
            if self._waiter is not None and (self.error is not None or self.held <= self._most):
                done.append(self._waiter)
                self._waiter = None
            if self._quiet is not None and not (self._hash.running or self._write.running):
                done.append(self._quiet)
                self._quiet = None
        for future in done:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # the loop gave up waiting
                future.set_result(None)

    def _run(self, stage: _Stage) -> None:
        """One run of a stage in the pool: up to STAGE_RUN batches, in order."""
        for _ in range(STAGE_RUN):
            with self._lock:
                if self._stopped or self.error is not None or not stage.queue:
                    stage.running = False
                    break
                parts, nbytes = stage.queue.popleft()
            try:
                done = stage.work(parts)
            except BaseException as e:
                with self._lock:
                    self._fail(e)
                continue
            finally:
                del parts  # a written batch is freed now, not when the next one is taken
            stage.then(done, nbytes)
            del done
        else:  # still running: to the back of the pool's queue
            self._start(stage)
            return
        self._wake()

    def _hashed(self, parts: list[bytes], nbytes: int) -> None:
        """After a batch's hash: to the writing stage."""
        with self._lock:
            if self._stopped or self.error is not None:
                return
            start = self._queue(self._write, parts, nbytes)
        if start:
            self._start(self._write)

    def _written(self, _: None, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
            wake = self._waiter is not None and self.held <= self._most
        if wake:
            self._wake()


def replace_durably(tmp_dir: str, final: str, parts: list[bytes]) -> None:
    """Write `parts` to a temp file, fsync it, rename it over `final` and fsync the directory."""
    tmp = TempFile(tmp_dir, None)
    try:
        tmp.finish(parts, sync=True)
        assert tmp.path is not None
        os.replace(tmp.path, final)
        tmp.path = None
        fsync_dir(os.path.dirname(final))
    finally:
        tmp.abort(None)


# -- the pool these run in, and one trip per event-loop iteration for small operations ----------
