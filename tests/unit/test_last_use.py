"""storage/objectstore/last_use.py: a served entry's bucket refresh is queued at most once per interval,
batched, bounded in parallel, skipped while the bucket is down, and retried after a failure."""

from __future__ import annotations

import asyncio

from buildvault.digest import Digest
from buildvault.storage import Unavailable
from buildvault.storage.objectstore.last_use import LastUseRefresher

A, B, C = (Digest.of(f"entry {i}".encode()) for i in range(3))


class Bucket:
    def __init__(self) -> None:
        self.refreshed: list[tuple[str, Digest]] = []
        self.absent: set[Digest] = set()
        self.failing: set[Digest] = set()
        self.in_flight = self.most_in_flight = 0

    async def refresh(self, namespace: str, digest: Digest) -> bool:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)  # let the other refreshes of the batch start
        self.in_flight -= 1
        if digest in self.failing:
            raise Unavailable("bucket down")
        if digest in self.absent:
            return False
        self.refreshed.append((namespace, digest))
        return True


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_served_entries_refresh_once_per_interval_in_one_batch() -> None:
    bucket, clock = Bucket(), Clock()
    refresher = LastUseRefresher(bucket.refresh, interval=100.0, delay=0.0, parallel=2, clock=clock)
    for _ in range(5):
        refresher.served("ac", A)
        refresher.served("ac/team", A)
        refresher.served("ac", B)
    assert refresher.pending == 3
    await refresher.flush()
    assert len(bucket.refreshed) == 3 and set(bucket.refreshed) == {("ac", A), ("ac/team", A), ("ac", B)}
    assert bucket.most_in_flight == 2 and refresher.pending == 0
    clock.now += 99
    refresher.served("ac", A)
    assert refresher.pending == 0  # refreshed within the interval: nothing to do
    clock.now += 2
    refresher.served("ac", A)
    assert refresher.pending == 1
    await refresher.flush()
    assert bucket.refreshed.count(("ac", A)) == 2
    await refresher.aclose()


async def test_failed_refresh_is_retried_on_the_next_hit_and_absent_entries_are_counted() -> None:
    bucket = Bucket()
    bucket.failing.add(A)
    bucket.absent.add(C)
    refresher = LastUseRefresher(bucket.refresh, delay=0.0)
    refresher.served("ac", A)
    refresher.served("ac", C)
    await refresher.flush()
    assert refresher.counters["failed"] == 1 and refresher.counters["absent"] == 1
    bucket.failing.clear()
    refresher.served("ac", A)  # forgotten after the failure: queued again
    refresher.served("ac", C)  # absent is an answer: not asked again within the interval
    assert refresher.pending == 1
    await refresher.flush()
    assert bucket.refreshed == [("ac", A)]
    await refresher.aclose()


async def test_nothing_is_sent_while_the_bucket_is_down() -> None:
    bucket, healthy = Bucket(), [False]
    refresher = LastUseRefresher(bucket.refresh, lambda: healthy[0], delay=0.0)
    refresher.served("ac", A)
    await refresher.flush()
    assert bucket.refreshed == [] and refresher.counters["skipped_unhealthy"] == 1
    healthy[0] = True
    refresher.served("ac", A)
    await refresher.flush()
    assert bucket.refreshed == [("ac", A)]
    await refresher.aclose()


async def test_the_batch_is_flushed_by_itself_after_the_delay() -> None:
    bucket = Bucket()
    refresher = LastUseRefresher(bucket.refresh, delay=0.01)
    refresher.served("ac", A)
    refresher.served("ac", B)
    for _ in range(500):  # bounded: the flush task runs once the delay has passed
        if len(bucket.refreshed) == 2:
            break
        await asyncio.sleep(0.01)
    assert set(bucket.refreshed) == {("ac", A), ("ac", B)}
    await refresher.aclose()


async def test_remembered_times_are_bounded() -> None:
    bucket, clock = Bucket(), Clock()
    refresher = LastUseRefresher(bucket.refresh, delay=0.0, clock=clock, max_remembered=2)
    for d in (A, B, C):
        clock.now += 1
        refresher.served("ac", d)
    await refresher.flush()
    refresher.served("ac", A)  # the oldest was forgotten: queued again
    refresher.served("ac", C)
    assert refresher.pending == 1
    await refresher.aclose()
