"""What remote execution has done and is doing, for /metrics and the status page.

`ExecutionStats` counts as jobs end (outcomes, queue and execution seconds); `snapshot()` reads
the scheduler's present state (pools, workers, queued and running jobs with their ages). Both
are plain data: server/metrics.py and server/http.py render them.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import Any

from google.rpc import code_pb2  # type: ignore[import-untyped]

from buildvault.execution.operations import Job
from buildvault.remote_apis import re_pb2

SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


class Timings:
    """A histogram of seconds (cumulative buckets as Prometheus wants them)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.counts[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def as_dict(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for bound, n in zip((*SECONDS_BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}


def outcome(response: re_pb2.ExecuteResponse) -> str:
    code = response.status.code
    if code == code_pb2.OK:
        return "ok" if response.result.exit_code == 0 else "exit_nonzero"
    return {
        code_pb2.DEADLINE_EXCEEDED: "timeout",
        code_pb2.CANCELLED: "cancelled",
        code_pb2.UNAVAILABLE: "unavailable",
    }.get(code, "error")


class ExecutionStats:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.dedup_merges = 0
        self.queue_seconds = Timings()
        self.execution_seconds = Timings()

    def started(self, job: Job) -> None:
        job.started_at = time.time()
        self.queue_seconds.observe(job.started_at - job.queued_at)

    def finished(self, job: Job) -> None:
        assert job.response is not None
        self.outcomes[outcome(job.response)] += 1
        if job.started_at is not None:
            self.execution_seconds.observe(time.time() - job.started_at)

    def cache_hit(self) -> None:
        self.outcomes["cache_hit"] += 1


def snapshot(executor: Any, sandbox: str) -> dict[str, Any]:
    """The present state and the tallies, as JSON-ready data."""
    scheduler = executor.queue.scheduler
    stats: ExecutionStats = executor.stats
    now = time.time()
    idle = {worker.name for worker in scheduler.idle_workers()}
    running = {worker.name: job for worker, job in scheduler.running()}
    pools: dict[str, dict[str, Any]] = {}
    workers = []
    for worker in scheduler.workers:
        pool = pools.setdefault(
            worker.pool,
            {"pool": worker.pool, "properties": dict(worker.properties), "workers": 0, "busy": 0, "idle": 0,
             "queued": 0, "oldest_queued_age_seconds": 0.0},
        )  # fmt: skip
        pool["workers"] += 1
        job = running.get(worker.name)
        state = "busy" if job is not None else "idle" if worker.name in idle else "starting"
        pool[state if state != "starting" else "busy"] += 1
        workers.append({
            "name": worker.name, "pool": worker.pool, "state": state, "pid": getattr(worker, "pid", None),
            "action": str(job.action_digest) if job is not None else None,
            "running_seconds": round(now - job.started_at, 3) if job is not None and job.started_at else None,
        })  # fmt: skip
    queued = []
    for job in scheduler.queued():
        pool_label = next(
            (w.pool for w in scheduler.workers if scheduler.rules.satisfies(w.properties, job.requirements)), ""
        )
        age = now - job.queued_at
        queued.append({"action": str(job.action_digest), "pool": pool_label, "age_seconds": round(age, 3),
                       "operations": [op.name for op in job.live_operations()]})  # fmt: skip
        if pool_label in pools:
            pools[pool_label]["queued"] += 1
            pools[pool_label]["oldest_queued_age_seconds"] = max(pools[pool_label]["oldest_queued_age_seconds"], age)
    return {
        "sandbox": sandbox,
        "pools": list(pools.values()),
        "workers": workers,
        "queued": queued,
        "running": [
            {"action": str(job.action_digest), "worker": name, "attempt": job.attempts,
             "age_seconds": round(now - job.queued_at, 3), "operations": [op.name for op in job.live_operations()]}
            for name, job in running.items()
        ],  # fmt: skip
        "outcomes": dict(stats.outcomes),
        "retries": scheduler.retries,
        "lost_workers": scheduler.lost_workers,
        "dedup_merges": stats.dedup_merges,
        "queue_seconds": stats.queue_seconds.as_dict(),
        "execution_seconds": stats.execution_seconds.as_dict(),
    }
