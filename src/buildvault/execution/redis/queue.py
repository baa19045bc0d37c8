"""The Redis JobQueue: jobs go to Redis Streams; operations, job states and the in-flight index
are shared by every server on the same Redis.

    queue = RedisQueue(url, rules, operations, on_finished)
    await queue.start()        # connect, heartbeat, follow the other servers' job states

An Execute joins the job any server runs for the same action; WaitExecution, GetOperation and
CancelOperation answer on any server for any server's operation. A job stops when no server has
a live operation on it (all cancelled, or unwatched for the grace period on every server).
"""

from __future__ import annotations

import logging

from google.longrunning import operations_pb2  # type: ignore[import-untyped]

from buildvault.execution.operations import (
    KEEP_FINISHED,
    Job,
    Operation,
    OperationTable,
    Stage,
    new_operation_name,
    operation_message,
)
from buildvault.execution.platform import MatchRules
from buildvault.execution.queue import Finished, unwatched
from buildvault.execution.redis.jobs import SharedJobs
from buildvault.execution.redis.scheduler import RedisScheduler
from buildvault.execution.redis.state import SharedState

log = logging.getLogger("buildvault.execution")


class RedisQueue:
    def __init__(self, url: str, rules: MatchRules, operations: OperationTable, on_finished: Finished) -> None:
        self.operations = operations
        self.scheduler = RedisScheduler(url, rules, on_finished)
        self.state = SharedState(self.scheduler.redis, KEEP_FINISHED)
        self.jobs = SharedJobs(self.state, self.scheduler.server_id)
        self.jobs.on_cancelled = self._cancelled_elsewhere

    async def start(self) -> None:
        await self.scheduler.start()
        await self.jobs.start()

    async def submit(self, job: Job) -> tuple[Operation, bool]:
        """Join the job another Execute (on any server) runs for this action, or queue."""
        key = job.dedup_key
        name = new_operation_name()
        # The common case, no identical job in flight, is this one round trip.
        claimed = await self.state.create_job(job.id, key, self.jobs.server_id, (name, job.action_digest))
        if not claimed and key is not None:
            other = await self.state.claim_in_flight(key, job.id)
            if other is not None:
                joined = await self.state.join(other)
                running = None
                if joined is not None:
                    running = await self.jobs.job_for(other, job.instance, job.action_digest, joined)
                if running is not None:
                    await self.state.drop_job(job.id)
                    await self.state.save_operation(name, job.action_digest, other, None)
                    return self.operations.adopt(name, running, job.action_digest), True
                # The job the index named ended or was cancelled: this one replaces it.
                await self.state.take_over_in_flight(key, job.id)
        self.jobs.track(job)
        operation = self.operations.adopt(name, job, job.action_digest)
        self.scheduler.submit(job)
        return operation, False

    async def record_hit(self, operation: Operation) -> None:
        await self.state.save_operation(operation.name, operation.action_digest, "", operation.response)

    async def find(self, name: str) -> Operation | None:
        """A copy here counts as one more live operation of its job until abandoned."""
        record = await self.state.load_operation(name)
        if record is None:
            return None
        job = None
        if record.response is None:
            job = await self.jobs.job_for(record.job_id, "", record.action_digest)
            if job is None:
                return None
        operation = self.operations.get(name)  # another lookup may have adopted it meanwhile
        if operation is not None:
            return operation
        operation = self.operations.adopt(name, job, record.action_digest, record.response)
        if job is not None and not job.done:
            await self.state.add_operation(job.id)
        return operation

    async def elsewhere(self, known: set[str]) -> dict[str, operations_pb2.Operation]:
        listed: dict[str, operations_pb2.Operation] = {}
        for name in await self.state.operation_names():
            if name in known:
                continue
            record = await self.state.load_operation(name)
            if record is None:
                continue
            if record.response is not None:
                listed[name] = operation_message(name, Stage("COMPLETED"), record.action_digest, record.response)
                continue
            job = await self.state.job_state(record.job_id)
            if job is not None and (job.response is not None or not job.owner_gone):
                listed[name] = operation_message(name, job.stage, record.action_digest, job.response)
        return listed

    async def watching(self, operation: Operation) -> None:
        """An operation that stopped counting (abandoned) counts again."""
        if operation.abandoned and operation.job is not None:
            operation.abandoned = False
            await self.state.add_operation(operation.job.id)

    async def abandon(self, job: Job, grace: float) -> None:
        """This server's unwatched operations stop counting; the job stops when no server has a
        live operation on it."""
        unwatched_here = [op for op in job.live_operations() if not op.abandoned and not op.watchers]
        for op in unwatched_here:
            op.abandoned = True
        if unwatched_here and await self.state.release(job.id, len(unwatched_here)) <= 0:
            log.info("job %s: no client on any server waited for %gs, cancelling it", job.id, grace)
            await self._stop(job, unwatched(grace))

    async def cancelled(self, operation: Operation) -> None:
        """Every server's copy of `operation` ends CANCELLED too."""
        await self._cancel(operation, announce=True)

    async def _cancel(self, operation: Operation, announce: bool) -> None:
        await self.state.save_operation(operation.name, operation.action_digest, "", operation.response)
        if announce:
            await self.state.announce_cancel(operation.name)
        job = operation.job
        if job is not None:
            job.notify()
            counted = 0 if operation.abandoned else 1
            if await self.state.release(job.id, counted) <= 0:
                await self._stop(job, "every operation waiting for this job was cancelled")

    async def _cancelled_elsewhere(self, name: str) -> None:
        """A client cancelled operation `name` through another server: this server's copy ends too."""
        operation = self.operations.get(name)
        if operation is not None and not operation.done:
            operation.cancel()
            await self._cancel(operation, announce=False)

    async def _stop(self, job: Job, message: str) -> None:
        if job.owned:
            await self.scheduler.cancel(job, message)
        else:
            await self.scheduler.cancel_elsewhere(job.id)

    async def close(self) -> None:
        await self.jobs.close()
        await self.scheduler.close()
