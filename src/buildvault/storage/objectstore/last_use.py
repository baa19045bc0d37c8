"""Keep the bucket's record of when an action entry was last used current, cheaply.

`buildvault gc` ages action entries out by their object's LastModified. A server that keeps
serving an entry from its local disk never writes it again, so without this the bucket would
see it as unused and gc would delete an entry builds still hit. `LastUseRefresher.served` is
called on every action-cache hit (an in-memory check, nothing else on the event loop); an
entry not refreshed by this process within `interval` (a day) is queued, and queued entries
are refreshed together after `delay` seconds by the object store's own threads, a few at a
time, while the bucket is healthy. What fails is forgotten, so the next hit tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

from buildvault.digest import Digest
from buildvault.storage import StorageError

log = logging.getLogger(__name__)

REFRESH_INTERVAL = 86400.0  # gc's --max-age must be longer than this (docs/operating.md)
BATCH_DELAY = 2.0
PARALLEL = 4  # the object store's pool also serves requests: leave it most of its threads
MAX_REMEMBERED = 500_000  # (namespace, digest) pairs; older ones are forgotten first

Key = tuple[str, Digest]
Refresh = Callable[[str, Digest], Awaitable[bool]]  # True refreshed, False not in the bucket


class LastUseRefresher:
    def __init__(
        self,
        refresh: Refresh,
        healthy: Callable[[], bool] = lambda: True,
        *,
        interval: float = REFRESH_INTERVAL,
        delay: float = BATCH_DELAY,
        parallel: int = PARALLEL,
        clock: Callable[[], float] = time.monotonic,
        max_remembered: int = MAX_REMEMBERED,
    ) -> None:
        self._refresh = refresh
        self._healthy = healthy
        self.interval = interval
        self.delay = delay
        self._parallel = parallel
        self._clock = clock
        self._max_remembered = max_remembered
        self._last: OrderedDict[Key, float] = OrderedDict()  # oldest refresh first
        self._pending: set[Key] = set()
        self._task: asyncio.Task[None] | None = None
        self.counters = {"refreshed": 0, "absent": 0, "failed": 0, "skipped_unhealthy": 0}

    def served(self, namespace: str, digest: Digest) -> None:
        """An entry was served: queue its refresh unless this process refreshed it within `interval`."""
        key = (namespace, digest)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            return
        self._last[key] = now
        self._last.move_to_end(key)
        self._pending.add(key)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_later())

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _flush_later(self) -> None:
        while True:
            await asyncio.sleep(self.delay)  # gather one batch: hits come in bursts
            try:
                await self.flush()
            except Exception:  # never lose the task: the next batch may go through
                log.warning("refreshing last uses failed", exc_info=True)
            if not self._pending:  # nothing noted meanwhile: the next hit starts a new task
                self._task = None
                return

    async def flush(self) -> None:
        """Refresh everything queued now."""
        batch, self._pending = self._pending, set()
        if not batch:
            return
        if not self._healthy():
            self.counters["skipped_unhealthy"] += len(batch)
            self._forget(batch)
            return
        gate = asyncio.Semaphore(self._parallel)

        async def one(key: Key) -> None:
            async with gate:
                try:
                    found = await self._refresh(*key)
                except StorageError as e:
                    self.counters["failed"] += 1
                    self._forget([key])
                    log.debug("could not refresh the last use of %s in %r: %s", key[1], key[0], e)
                    return
                self.counters["refreshed" if found else "absent"] += 1

        await asyncio.gather(*(one(key) for key in batch))
        self._prune()

    def _forget(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self._last.pop(key, None)

    def _prune(self) -> None:
        """Forget refresh times past the interval, and the oldest beyond `max_remembered`."""
        horizon = self._clock() - self.interval
        while self._last:
            key, when = next(iter(self._last.items()))
            if len(self._last) <= self._max_remembered and when >= horizon:
                break
            self._last.popitem(last=False)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
