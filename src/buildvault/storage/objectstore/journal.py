"""A durable upload journal: "upload blob X / action entry Y to the bucket", in batch files.

Layout under the journal directory:

    lock                        flock(2)-held by the one process using the journal
    q/{seq}-{count}.jnl         one group commit: `count` JSON lines, oldest `seq` first
    q/*.tmp                     a batch being written; removed on open (never acknowledged)
    bad/                        files with names we never write, moved aside on open

A line is ``["c", fn, hash, size]`` (CAS blob) or ``["a", fn, hash, size, namespace]``
(action entry; the uploader reads its *current* value from the local tier). `seq` is the
wall-clock time of the commit in nanoseconds (made strictly increasing), so name order is age
order and the oldest pending age is exact. The count in the name lets open() rebuild the
backlog from one directory listing, without reading the files.

Durability: adds are group-committed. Every add that arrives while one batch is being made
durable joins the next batch; a batch is written to a temporary file, fsynced, renamed into
`q/` and `q/` is fsynced, and only then are its adds acknowledged. Concurrent writers share
two fsyncs (the measured cost of one durable add is dominated by the fsync, not the entry).
kill -9 at any point loses no acknowledged entry; a torn temporary file is removed on open.

Draining: `start(handler)` runs a feeder and `concurrency` workers. The feeder loads batch
files oldest first into a bounded window (`window` entries; memory does not grow with the
backlog, disk is the only bound). `handler(entry)` returns the bytes it uploaded. An exception
in `global_errors` (default: Unavailable) pauses the whole queue with exponential backoff
(capped); any other exception backs off that entry alone (capped). Nothing is ever dropped:
an entry leaves the journal only when its handler returned (a handler that decides an entry
cannot be uploaded returns normally and accounts for it) or its add was discarded. A batch
file is unlinked (without fsync) once all its entries are done; after a crash the undone
remainder of a partly uploaded batch is uploaded again, which is harmless (uploads are
idempotent); close() rewrites partly done batches so a clean restart redoes nothing.

Adds may *hold* their entry (`hold=True`): the uploader skips it until `release(ticket)` (the
client's write completed) or `discard(ticket)` (the write failed: the entry is dropped
without an upload). This lets the add run concurrently with the local write and still never
upload a blob before it exists locally.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buildvault.digest import Digest, InvalidDigest
from buildvault.storage import StorageError, Unavailable
from buildvault.storage.disk.fileops import fsync_dir
from buildvault.storage.objectstore.journal_files import (
    AC,
    CAS,
    JournalEntry,
    batch_name,
    entry_of,
    parse_batch_name,
    read_lines,
    record_of,
    write_batch_file,
)

__all__ = ["AC", "CAS", "JournalBusy", "JournalEntry", "JournalStats", "Ticket", "UploadJournal"]

logger = logging.getLogger(__name__)

MAX_BATCH_ENTRIES = 4096


@dataclass(slots=True)
class Ticket:
    """What an add returns; pass it to release() or discard() when the add was held."""

    name: str = ""
    settled: bool = False


@dataclass
class JournalStats:
    backlog: int
    oldest_pending_age: float
    uploads_ok: int
    uploads_failed: int
    bytes_uploaded: int
    in_flight: int
    paused: bool
    fsyncs: int


class JournalBusy(StorageError):
    """Another process holds the journal's lock."""


@dataclass(slots=True)
class _PendingAdd:
    record: list[Any]
    hold: bool
    ticket: Ticket
    future: asyncio.Future[None]


class UploadJournal:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        concurrency: int = 16,
        window: int = 4096,
        initial_backoff: float = 0.5,
        max_backoff: float = 60.0,
        entry_max_backoff: float = 300.0,
        global_errors: tuple[type[BaseException], ...] = (Unavailable,),
    ) -> None:
        self.directory = Path(directory)
        self._q = self.directory / "q"
        self._concurrency = max(1, concurrency)
        self._window = max(1, window)
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._entry_max_backoff = entry_max_backoff
        self._global_errors = global_errors
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="buildvault-journal")
        self._lock_fd: int | None = None
        self._open = False
        self._last_seq = 0
        # Every batch file on disk: seq -> (name, entries not done yet). Insertion order = age.
        self._files: dict[int, list[Any]] = {}
        self._unloaded: collections.deque[int] = collections.deque()  # seqs not read yet, oldest first
        self._loaded: dict[int, dict[int, JournalEntry]] = {}  # seq -> index -> entry not done yet
        self._loaded_count = 0
        self._backlog = 0
        self._held: set[str] = set()
        self._discarded: set[str] = set()
        self._deferred: dict[str, JournalEntry] = {}
        self._ready: collections.deque[JournalEntry] = collections.deque()
        self._retry: dict[str, tuple[int, float, JournalEntry]] = {}
        self._in_flight: set[str] = set()
        self._pending: list[_PendingAdd] = []
        self._committer: asyncio.Future[None] | None = None
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Future[None]] = []
        self._queue: asyncio.Queue[JournalEntry] | None = None
        self._handler: Callable[[JournalEntry], Awaitable[int]] | None = None
        self._gate: Callable[[], Awaitable[None]] | None = None
        self._pause_until = 0.0
        self._backoff = initial_backoff
        self.uploads_ok = 0
        self.uploads_failed = 0
        self.bytes_uploaded = 0
        self.fsyncs = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> UploadJournal:
        await self._run(self._open_sync)
        self._open = True
        if self._backlog:
            logger.info("upload journal %s: %d entries pending", self.directory, self._backlog)
        return self

    def _open_sync(self) -> None:
        if not self._q.is_dir():
            self._q.mkdir(parents=True, exist_ok=True)
            for directory in (self.directory, self.directory.parent):  # make q/ itself durable
                fsync_dir(str(directory))
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise JournalBusy(f"upload journal {self.directory} is in use by another process") from None
            raise
        self._lock_fd = fd
        found: dict[int, tuple[str, int]] = {}
        for dirent in os.scandir(self._q):
            if dirent.name.endswith(".tmp"):
                os.unlink(dirent.path)  # a batch that was never acknowledged
                continue
            parsed = parse_batch_name(dirent.name)
            if parsed is None or not dirent.is_file():
                self._quarantine(Path(dirent.path))
                continue
            seq, count = parsed
            if seq in found:
                # close() rewrote a partly done batch and died before removing the original:
                # the rewrite (fewer entries) was durable before the original was removed.
                keep, drop = sorted([found[seq], (dirent.name, count)], key=lambda item: item[1])
                os.unlink(self._q / drop[0])
                found[seq] = keep
                continue
            found[seq] = (dirent.name, count)
        for seq in sorted(found):
            name, count = found[seq]
            self._files[seq] = [name, count]
            self._unloaded.append(seq)
            self._backlog += count
        self._last_seq = max(found, default=0)

    def _quarantine(self, path: Path) -> None:
        bad = self.directory / "bad"
        bad.mkdir(exist_ok=True)
        target = bad / f"{path.name}-{uuid.uuid4().hex[:8]}"
        logger.warning("upload journal: moving unexpected %s to %s", path, target)
        os.replace(path, target)

    async def close(self) -> None:
        """Stop draining, finish pending adds, rewrite partly done batches, release the lock."""
        await self.stop()
        if self._committer is not None:
            await asyncio.gather(self._committer, return_exceptions=True)
        self._open = False
        partial = {seq: entries for seq, entries in self._loaded.items() if seq in self._files and entries}
        if partial:
            try:
                await self._run(self._rewrite, partial)
            except OSError as exc:  # the originals are intact: they will be redone, that is all
                logger.warning("upload journal: could not rewrite partly uploaded batches: %s", exc)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self._executor.shutdown(wait=True)

    def _rewrite(self, partial: dict[int, dict[int, JournalEntry]]) -> None:
        replaced = []
        for seq, entries in partial.items():
            name = self._files[seq][0]
            parsed = parse_batch_name(name)
            if parsed is None or len(entries) >= parsed[1]:
                continue
            records = [record_of(e.kind, e.digest, e.namespace) for _, e in sorted(entries.items())]
            new_name = batch_name(seq, len(records))
            self._write_file(self._q / new_name, records)
            replaced.append(name)
        if replaced:
            fsync_dir(str(self._q))
            for name in replaced:
                os.unlink(self._q / name)

    def _write_file(self, path: Path, records: list[list[Any]]) -> None:
        write_batch_file(path, records)
        self.fsyncs += 1

    # -- adding -----------------------------------------------------------------------------

    async def add_blob(self, digest: Digest, *, hold: bool = False) -> Ticket:
        """Durably record "upload this blob"; returns once the entry is on disk (fsync)."""
        return await self._add(record_of(CAS, digest, None), hold)

    async def add_action(self, namespace: str, digest: Digest, *, hold: bool = False) -> Ticket:
        """Durably record "upload this action entry" (the uploader reads its current value)."""
        return await self._add(record_of(AC, digest, namespace), hold)

    async def _add(self, record: list[Any], hold: bool) -> Ticket:
        if not self._open:
            raise StorageError("upload journal is not open")
        ticket = Ticket(settled=not hold)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_PendingAdd(record, hold, ticket, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.ensure_future(self._commit_loop())
        await asyncio.shield(future)
        return ticket

    def _next_seq(self) -> int:
        self._last_seq = max(self._last_seq + 1, time.time_ns())
        return self._last_seq

    async def _commit_loop(self) -> None:
        while self._pending:
            pending, self._pending = self._pending, []
            batches = []
            for start in range(0, len(pending), MAX_BATCH_ENTRIES):
                batch = pending[start : start + MAX_BATCH_ENTRIES]
                seq = self._next_seq()
                for index, add in enumerate(batch):
                    add.ticket.name = f"{seq}:{index}"
                    if add.hold:  # before the batch is visible to the feeder
                        self._held.add(add.ticket.name)
                batches.append((seq, batch))
            try:
                await self._run(self._write_batches, [(seq, [a.record for a in batch]) for seq, batch in batches])
            except BaseException as exc:
                for _, batch in batches:
                    for add in batch:
                        self._held.discard(add.ticket.name)
                        add.ticket.settled = True
                        if not add.future.done():
                            add.future.set_exception(StorageError(f"upload journal: add failed: {exc!r}"))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for seq, batch in batches:
                self._files[seq] = [batch_name(seq, len(batch)), len(batch)]
                self._unloaded.append(seq)
                self._backlog += len(batch)
                for add in batch:
                    if not add.future.done():
                        add.future.set_result(None)
            self._notify()
            self._wake.set()

    def _write_batches(self, batches: list[tuple[int, list[list[Any]]]]) -> None:
        written = []
        try:
            for seq, records in batches:
                path = self._q / batch_name(seq, len(records))
                self._write_file(path, records)
                written.append(path)
            fsync_dir(str(self._q))
            self.fsyncs += 1
        except BaseException:
            for path in written:  # not acknowledged: do not leave it to be uploaded later
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise

    def release(self, ticket: Ticket) -> None:
        """The held entry's local write succeeded: the uploader may take it."""
        if ticket.settled:
            return
        ticket.settled = True
        self._held.discard(ticket.name)
        entry = self._deferred.pop(ticket.name, None)
        if entry is not None:
            self._ready.append(entry)
            self._wake.set()

    async def discard(self, ticket: Ticket) -> None:
        """The held entry's local write failed: drop the entry without uploading it."""
        if ticket.settled:
            return
        ticket.settled = True
        self._held.discard(ticket.name)
        entry = self._deferred.pop(ticket.name, None)
        if entry is not None:
            await self._done(entry)
        else:
            self._discarded.add(ticket.name)  # done without an upload when the feeder reaches it
            self._wake.set()

    # -- state ------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Entries on disk not uploaded yet (including held and in-flight ones)."""
        return self._backlog

    @property
    def oldest_pending_age(self) -> float:
        """Seconds since the oldest pending entry was committed; 0 when there is none."""
        for seq in self._files:
            return max(0.0, time.time() - seq / 1e9)
        return 0.0

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._pause_until

    def stats(self) -> JournalStats:
        return JournalStats(
            backlog=self.backlog,
            oldest_pending_age=self.oldest_pending_age,
            uploads_ok=self.uploads_ok,
            uploads_failed=self.uploads_failed,
            bytes_uploaded=self.bytes_uploaded,
            in_flight=len(self._in_flight),
            paused=self.paused,
            fsyncs=self.fsyncs,
        )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[UploadJournal], bool], timeout: float) -> bool:
        """Wait (event-driven, no polling) until predicate(self) holds; False on timeout."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return predicate(self)
        return True

    async def wait_drained(self, timeout: float) -> bool:
        return await self.wait_until(lambda j: j.backlog == 0, timeout)

    def wake(self) -> None:
        """Try again now (e.g. uploads were resumed or the bucket came back)."""
        self._pause_until = 0.0
        self._wake.set()

    # -- draining ---------------------------------------------------------------------------

    def start(
        self,
        handler: Callable[[JournalEntry], Awaitable[int]],
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start draining: `handler(entry)` uploads one entry; `gate()` is awaited before each
        attempt (e.g. "the bucket is healthy and uploads are enabled")."""
        if self._tasks:
            raise RuntimeError("upload journal is already draining")
        if not self._open:
            raise StorageError("upload journal is not open")
        self._handler = handler
        self._gate = gate
        self._queue = asyncio.Queue(maxsize=self._concurrency)
        self._ready = collections.deque(e for seq in sorted(self._loaded) for _, e in sorted(self._loaded[seq].items()))
        self._tasks = [asyncio.ensure_future(self._feeder())]
        self._tasks += [asyncio.ensure_future(self._worker()) for _ in range(self._concurrency)]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Loaded entries stay loaded (start() queues them again); in-memory queues are rebuilt.
        self._ready.clear()
        self._deferred.clear()
        self._retry.clear()
        self._in_flight.clear()
        self._queue = None

    async def _wait_ready(self) -> None:
        while True:
            if self._gate is not None:
                await self._gate()
            delay = self._pause_until - time.monotonic()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    async def _feeder(self) -> None:
        assert self._queue is not None
        while True:
            try:
                await self._wait_ready()
                self._wake.clear()
                now = time.monotonic()
                for name, (_, due, entry) in list(self._retry.items()):
                    if due <= now:
                        del self._retry[name]
                        self._ready.append(entry)
                if len(self._ready) < self._concurrency and self._unloaded and self._loaded_count < self._window:
                    await self._load(self._unloaded.popleft())
                    continue
                if not self._ready:
                    dues = [due for _, due, _ in self._retry.values()]
                    timeout = max(0.0, min(dues) - now) if dues else None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    continue
                entry = self._ready.popleft()
                if entry.name in self._discarded:
                    self._discarded.discard(entry.name)
                    await self._done(entry)
                elif entry.name in self._held:
                    self._deferred[entry.name] = entry
                else:
                    self._in_flight.add(entry.name)
                    await self._queue.put(entry)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the uploader die: log, pause, carry on
                logger.exception("upload journal: feeder failed")
                await asyncio.sleep(1.0)

    async def _load(self, seq: int) -> None:
        name, _ = self._files[seq]
        try:
            lines = await self._run(read_lines, self._q / name)
        except OSError as exc:
            self._unloaded.appendleft(seq)
            raise StorageError(f"upload journal: cannot read {name}: {exc}") from exc
        entries: dict[int, JournalEntry] = {}
        for index, line in enumerate(lines):
            try:
                entries[index] = entry_of(json.loads(line), seq, index)
            except (ValueError, TypeError, IndexError, InvalidDigest) as exc:
                logger.error("upload journal: %s line %d is not an entry (%s); skipping it", name, index + 1, exc)
        skipped = self._files[seq][1] - len(entries)
        self._loaded[seq] = entries
        self._loaded_count += len(entries)
        self._ready.extend(entries.values())
        if skipped:  # unreadable lines cannot be uploaded; account for them once
            self._files[seq][1] -= skipped
            self._backlog -= skipped
            if not entries:
                await asyncio.shield(self._batch_done(seq))
            self._notify()

    async def _worker(self) -> None:
        assert self._queue is not None and self._handler is not None
        queue = self._queue
        while True:
            entry = await queue.get()
            try:
                await self._wait_ready()
                await self._attempt(entry)
            finally:
                self._in_flight.discard(entry.name)
                self._notify()

    async def _attempt(self, entry: JournalEntry) -> None:
        assert self._handler is not None
        try:
            uploaded = await self._handler(entry)
        except asyncio.CancelledError:
            raise
        except self._global_errors as exc:
            self.uploads_failed += 1
            now = time.monotonic()
            if now >= self._pause_until:
                delay = self._backoff * random.uniform(0.8, 1.2)
                self._pause_until = now + delay
                self._backoff = min(self._backoff * 2, self._max_backoff)
                logger.debug("upload journal: pausing %.2fs after %s", delay, exc)
            self._ready.appendleft(entry)
            self._wake.set()
            return
        except Exception as exc:
            self.uploads_failed += 1
            attempts = self._retry.get(entry.name, (0, 0.0, entry))[0]
            delay = min(self._initial_backoff * 2**attempts, self._entry_max_backoff) * random.uniform(0.8, 1.2)
            self._retry[entry.name] = (attempts + 1, time.monotonic() + delay, entry)
            logger.warning(
                "upload of %s %s failed (attempt %d, retry in %.1fs): %s",
                entry.kind,
                entry.digest,
                attempts + 1,
                delay,
                exc,
            )
            self._wake.set()
            return
        self._backoff = self._initial_backoff
        self.uploads_ok += 1
        self.bytes_uploaded += int(uploaded or 0)
        await self._done(entry)

    async def _done(self, entry: JournalEntry) -> None:
        entries = self._loaded.get(entry.seq)
        if entries is None or entries.pop(int(entry.name.rsplit(":", 1)[1]), None) is None:
            return
        self._loaded_count -= 1
        self._files[entry.seq][1] -= 1
        try:
            if not entries:  # unlink first, so "backlog 0" means nothing is left on disk
                await asyncio.shield(self._batch_done(entry.seq))
        finally:
            self._backlog -= 1
            self._notify()
            self._wake.set()

    async def _batch_done(self, seq: int) -> None:
        name, _ = self._files[seq]
        with contextlib.suppress(FileNotFoundError):
            await self._run(os.unlink, self._q / name)
        self._files.pop(seq, None)
        self._loaded.pop(seq, None)

    # -- plumbing ---------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))
