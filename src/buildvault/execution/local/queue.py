"""The local JobQueue: jobs wait in this process's scheduler and run on its worker processes.

    queue = LocalQueue(workers, rules, operations, on_finished)

Identical in-flight actions (same instance and action digest, cacheable) share one job; a job
stops when every operation on it was cancelled, or when none had a watching client for the
grace period.
"""

from __future__ import annotations

import logging

from google.longrunning import operations_pb2  # type: ignore[import-untyped]

from buildvault.execution.local.scheduler import Scheduler, Worker
from buildvault.execution.operations import Job, Operation, OperationTable
from buildvault.execution.platform import MatchRules
from buildvault.execution.queue import Finished, unwatched
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.execution")


class LocalQueue:
    def __init__(
        self, workers: list[Worker], rules: MatchRules, operations: OperationTable, on_finished: Finished
    ) -> None:
        self.operations = operations
        self.on_finished = on_finished
        self.scheduler = Scheduler(workers, rules, self._finished)
        self._in_flight: dict[tuple[str, str], Job] = {}

    async def start(self) -> None:
        pass

    async def submit(self, job: Job) -> tuple[Operation, bool]:
        key = job.dedup_key
        if key is not None:
            running = self._in_flight.get(key)
            if running is not None and not running.done:
                return self.operations.create(running, job.action_digest), True
            self._in_flight[key] = job
        operation = self.operations.create(job, job.action_digest)
        self.scheduler.submit(job)
        return operation, False

    async def _finished(self, job: Job, response: re_pb2.ExecuteResponse) -> re_pb2.ExecuteResponse:
        if job.dedup_key is not None and self._in_flight.get(job.dedup_key) is job:
            del self._in_flight[job.dedup_key]
        return await self.on_finished(job, response)

    async def record_hit(self, operation: Operation) -> None:
        pass

    async def find(self, name: str) -> Operation | None:
        return None  # every operation of this server is in its table

    async def elsewhere(self, known: set[str]) -> dict[str, operations_pb2.Operation]:
        return {}

    async def watching(self, operation: Operation) -> None:
        pass

    async def abandon(self, job: Job, grace: float) -> None:
        log.info("job %s: no client waited for %gs, cancelling it", job.id, grace)
        await self.scheduler.cancel(job, unwatched(grace))

    async def cancelled(self, operation: Operation) -> None:
        job = operation.job
        if job is not None:
            job.notify()
            if not job.live_operations():
                await self.scheduler.cancel(job, "every operation waiting for this job was cancelled")

    async def close(self) -> None:
        await self.scheduler.close()
