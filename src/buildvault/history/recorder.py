"""The server's side of the history: calls are queued on the event loop (a tuple appended to a
list, nothing else) and written by one thread in batches, one transaction each.

A request never waits for the database and never fails because of it: a write that fails (disk
full, a damaged file, a lock held too long by another process) is logged, its batch dropped and
counted, and the next batch tried again; a database that cannot be opened leaves recording off,
logged once. When the queue is longer than `max_pending` (the thread cannot keep up), new
records are dropped and counted rather than held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from buildvault.config import Settings
from buildvault.history.metadata import Metadata, parse_metadata
from buildvault.history.store import HistoryStore

__all__ = ["DEFAULT_MAX_SIZE", "DEFAULT_RETENTION", "Record", "Recorder", "history_path", "recorder_from_settings"]

log = logging.getLogger("buildvault.history")

# The settings' defaults, for a recorder built outside the server (tests, tools).
DEFAULT_RETENTION = Settings.history_retention
DEFAULT_MAX_SIZE = Settings.history_max_size
# The writer thread's Python work (a row's conversion, its totals) holds the GIL; a long stretch
# of it makes the event loop wait up to the interpreter's switch interval (5 ms) for a request.
# Yielding every few rows keeps those stalls to microseconds (measured: GetActionResult at c1
# 0.91 of the rate without history when a second's batch was converted in one go).
YIELD_EVERY = 32
# A queued call: `store.COLUMNS` up to `bytes`, then its Metadata or its raw metadata pairs.
Record = tuple[Any, ...]


class Recorder:
    """Records calls into the HistoryStore at `path`; `start` on the loop, `close` at the end."""

    def __init__(
        self,
        path: Path,
        *,
        retention: float = DEFAULT_RETENTION,
        max_size: int = DEFAULT_MAX_SIZE,
        flush_interval: float = 1.0,
        prune_interval: float = 60.0,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.time,
        prune: bool = True,
    ) -> None:
        self.store = HistoryStore(path)
        self.retention = retention
        self.max_size = max_size
        self.flush_interval = flush_interval
        self.prune_interval = prune_interval
        self.max_pending = max_pending
        self.clock = clock
        self.prune_enabled = prune  # a secondary process records but leaves retention to the primary
        self.enabled = True
        self.dropped = 0  # records lost to a full queue or a failed write
        self.failures = 0  # failed writes
        self._pending: list[Record] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buildvault-history")
        self._task: asyncio.Task[None] | None = None
        self._last_prune = 0.0
        self._last_warning = 0.0
        self._opened = False

    # -- on the event loop -------------------------------------------------------------------

    def record(
        self,
        protocol: str,
        method: str,
        instance: str,
        digest: str,
        outcome: str,
        code: str,
        size: int,
        started: float,
        duration: float,
        meta: Metadata | list[tuple[str, Any]] | tuple[tuple[str, Any], ...] | None,
    ) -> None:
        """Queue one call (cheap: no I/O, no lock). `started` is wall-clock time. `meta` may be the
        call's raw metadata pairs: the header is then parsed in the writer thread, off the loop."""
        if not self.enabled:
            return
        pending = self._pending
        if len(pending) >= self.max_pending:
            self.dropped += 1
            return
        pending.append((started, duration, protocol, method, instance, digest, outcome, code, size, meta))

    async def start(self) -> None:
        """Open the database in the writer thread and start the periodic flush; a database that
        cannot be opened turns recording off (logged), never stops the server."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._thread, self.store.open)
            self._opened = True
        except (sqlite3.Error, OSError) as e:
            log.error("history database %s cannot be opened (%s): recording is off", self.store.path, e)
            self.enabled = False
            return
        self._task = asyncio.create_task(self._run(), name="history-recorder")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            await self.flush()

    async def flush(self) -> None:
        """Write what is queued now (and prune when due), in the writer thread."""
        batch, self._pending = self._pending, []
        if not self._opened:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._write, batch)

    async def run_in_writer(self, work: Callable[[HistoryStore], Any]) -> Any:
        """Run `work(store)` in the writer thread (the build event service's writes); failures are
        logged and give None."""
        if not self._opened:
            return None
        loop = asyncio.get_running_loop()

        def guarded() -> Any:
            try:
                return work(self.store)
            except (sqlite3.Error, OSError) as e:
                self.failures += 1
                log.warning("history write failed (%s): skipped", e)
                return None

        return await loop.run_in_executor(self._thread, guarded)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.flush()
        finally:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._thread, self.store.close)
            self._thread.shutdown(wait=True)

    # -- in the writer thread ----------------------------------------------------------------

    def _write(self, batch: list[Record]) -> None:
        try:
            rows = []
            for n, item in enumerate(batch, 1):
                rows.append(_row(item))
                if n % YIELD_EVERY == 0:
                    time.sleep(0)  # hand the GIL to the event loop (see YIELD_EVERY)
            self.store.write(rows)
        except (sqlite3.Error, OSError) as e:
            self.failures += 1
            self.dropped += len(batch)
            now = time.monotonic()
            if now - self._last_warning >= 60.0 or self.failures == 1:  # a full disk fails every batch: once a minute
                self._last_warning = now
                log.warning("history write of %d records failed (%s): skipped (%d failed writes, %d records dropped)",
                            len(batch), e, self.failures, self.dropped)  # fmt: skip
        now = self.clock()
        if self.prune_enabled and now - self._last_prune >= self.prune_interval:
            self._last_prune = now
            self.prune_now(now)

    def prune_now(self, now: float) -> int:
        try:
            return self.store.prune(now, self.retention, self.max_size)
        except (sqlite3.Error, OSError) as e:
            self.failures += 1
            log.warning("history retention failed (%s): skipped", e)
            return 0


def _row(item: Record) -> tuple[Any, ...]:
    """A queued call as the store's row (store.COLUMNS), its metadata parsed here, in the thread."""
    *head, meta = item
    if not isinstance(meta, Metadata):
        meta = parse_metadata(meta)
    return (*head, meta.invocation, meta.correlated, meta.action_id, meta.mnemonic, meta.target, meta.configuration,
            meta.tool, meta.tool_version, 1 if meta.malformed else 0)  # fmt: skip


def history_path(data_dir: Path) -> Path:
    """Where the history database lives in a data directory."""
    return data_dir / "history" / "history.sqlite"


def recorder_from_settings(settings: Any, *, primary: bool = True) -> Recorder | None:
    """The recorder `settings` ask for (None: `--history false`). Only the primary prunes."""
    if not settings.history:
        return None
    return Recorder(
        history_path(Path(settings.dir)),
        retention=settings.history_retention,
        max_size=settings.history_max_size,
        prune=primary,
    )
