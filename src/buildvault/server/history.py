"""A ring buffer of the server's recent state, for the status page's charts.

One `Sample` every `interval` seconds (and at most one a second on demand, when the page is
asked for), the last `capacity` kept: cumulative AC hits and misses, CAS bytes in and out,
disk use and cap, object-store upload backlog. Memory is bounded: capacity samples of eight
numbers. Reading counters goes through the app's Prometheus registry, so the numbers are the
ones /metrics shows.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from buildvault.server.background import cancel_and_wait
from buildvault.server.metrics import PREFIX, Metrics

DEFAULT_INTERVAL = 10.0
DEFAULT_CAPACITY = 360  # an hour at the default interval


@dataclass(frozen=True, slots=True)
class Sample:
    time: float
    ac_hits: int
    ac_misses: int
    bytes_in: int
    bytes_out: int
    used_bytes: int | None
    max_bytes: int | None
    upload_backlog: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _total(metrics: Metrics, name: str) -> int | None:
    found = None
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                found = (found or 0) + sample.value
    return None if found is None else int(found)


class History:
    """The ring buffer and the task that fills it."""

    def __init__(
        self,
        metrics: Metrics,
        refresh: Callable[[], Awaitable[None]],
        interval: float = DEFAULT_INTERVAL,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.metrics = metrics
        self.refresh = refresh  # updates metrics.storage from the store
        self.interval = interval
        self.samples: collections.deque[Sample] = collections.deque(maxlen=capacity)
        self._task: asyncio.Task[None] | None = None

    async def sample(self, min_gap: float = 0.0) -> None:
        """Record one sample now, unless the last one is younger than `min_gap` seconds."""
        now = time.time()
        if self.samples and now - self.samples[-1].time < min_gap:
            return
        await self.refresh()
        m, s = self.metrics, self.metrics.storage
        counts = m.ac_counts()
        self.samples.append(
            Sample(
                time=now,
                ac_hits=counts["hits"]["total"],
                ac_misses=counts["misses"]["total"],
                bytes_in=_total(m, f"{PREFIX}_cas_written_bytes_total") or 0,
                bytes_out=_total(m, f"{PREFIX}_cas_read_bytes_total") or 0,
                used_bytes=s.used_bytes,
                max_bytes=s.max_bytes,
                upload_backlog=_total(m, f"{PREFIX}_upload_journal_backlog"),
            )
        )

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="buildvault-history")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
