"""Execute's behaviour without gRPC: checks, the ActionCache, dedup, the scheduler, cancel.

    executor = Executor(config, blobs, action_cache, workers)
    operation = await executor.execute(instance, action_digest, skip_cache_lookup=False, priority=0)
    async for message in executor.follow(operation): ...      # counts the client as a watcher
    await executor.cancel(operation.name)

Errors raised before anything is queued: `MissingBlobs` (FAILED_PRECONDITION with one MISSING
violation per blob), `InvalidRequest` (INVALID_ARGUMENT: a bad timeout, priority or platform
key), `NoMatchingWorker` (FAILED_PRECONDITION naming the platform). Errors while running are
in the response's status. A successful, cacheable result (exit code 0, status OK, not
`do_not_cache`) is in the ActionCache before its operation reports done.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from google.longrunning import operations_pb2  # type: ignore[import-untyped]
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.actions import ActionCache
from buildvault.digest import Digest, DigestFunction, verify_instance_name
from buildvault.execution.operations import (
    KEEP_FINISHED,
    Job,
    Operation,
    OperationTable,
    Stage,
    cancelled_response,
    new_operation_name,
    operation_message,
)
from buildvault.execution.platform import MatchRules, PlatformError, format_properties
from buildvault.execution.redis_scheduler import RedisScheduler
from buildvault.execution.requests import InvalidRequest, load_action
from buildvault.execution.scheduler import Scheduler, Worker
from buildvault.execution.shared_jobs import SharedJobs
from buildvault.execution.shared_state import SharedState
from buildvault.execution.stats import ExecutionStats
from buildvault.remote_apis import re_pb2
from buildvault.storage import BlobStore, NotFound, single_chunk

log = logging.getLogger("buildvault.execution")

PRIORITY_RANGE = (-1000, 1000)


class ShuttingDown(Exception):
    """The server is closing: the stream ends without a result (UNAVAILABLE)."""


class NoMatchingWorker(Exception):
    """No worker pool could ever run an action with this platform (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class ExecutionConfig:
    rules: MatchRules
    default_timeout: float = 600.0
    max_timeout: float = 7200.0
    grace: float = 60.0


class Executor:
    def __init__(
        self,
        config: ExecutionConfig,
        blobs: BlobStore,
        action_cache: ActionCache,
        workers: list[Worker],
        queue_url: str = "",
    ) -> None:
        self.config = config
        self.blobs = blobs
        self.action_cache = action_cache
        self.operations = OperationTable()
        self.scheduler: Scheduler | RedisScheduler
        # Redis mode: operations, job states and the in-flight index are shared by every server.
        self.shared: SharedJobs | None = None
        if queue_url:
            self.scheduler = RedisScheduler(queue_url, config.rules, self._finished)
            self.shared = SharedJobs(SharedState(self.scheduler.redis, KEEP_FINISHED), self.scheduler.server_id)
            self.shared.on_cancelled = self._cancelled_elsewhere
        else:
            self.scheduler = Scheduler(workers, config.rules, self._finished)
        self._in_flight: dict[tuple[str, str], Job] = {}
        self._orphan_checks: dict[str, asyncio.TimerHandle] = {}
        self._closing = asyncio.Event()
        self._cancelling: set[asyncio.Task[None]] = set()
        self.stats = ExecutionStats()
        self.scheduler.on_started = self.stats.started

    async def start(self) -> None:
        """Redis mode: connect, and follow the job states other servers publish."""
        if isinstance(self.scheduler, RedisScheduler):
            await self.scheduler.start()
        if self.shared is not None:
            await self.shared.start()

    # -- Execute --------------------------------------------------------------------------

    async def execute(
        self, instance: str, action_digest: Digest, *, skip_cache_lookup: bool = False, priority: int = 0
    ) -> Operation:
        verify_instance_name(instance)
        if self._closing.is_set():
            raise ShuttingDown("the server is shutting down; ask again")
        if action_digest.function is not DigestFunction.SHA256:
            raise InvalidRequest(
                f"execution supports the SHA256 digest function only, not {action_digest.function.label}"
            )
        low, high = PRIORITY_RANGE
        if not low <= priority <= high:
            raise InvalidRequest(f"priority {priority} is outside the supported range [{low}, {high}]")
        loaded = await load_action(self.blobs, action_digest)
        action, command = loaded.action, loaded.command
        timeout = self._timeout(action)
        try:
            requirements = self.config.rules.requirements(
                command.platform if command.HasField("platform") else None,
                action.platform if action.HasField("platform") else None,
            )
        except PlatformError as e:
            raise InvalidRequest(str(e)) from None
        if not self.scheduler.could_run(requirements):
            raise NoMatchingWorker(f"no worker pool offers the platform {{{format_properties(requirements)}}}")
        cacheable = not action.do_not_cache
        if cacheable and not skip_cache_lookup:
            try:
                cached = await self.action_cache.get(instance, action_digest)
            except NotFound:
                pass
            else:
                self.stats.cache_hit()
                response = re_pb2.ExecuteResponse(result=cached, cached_result=True, status=status_pb2.Status())
                hit = self.operations.create(None, action_digest, response)
                if self.shared is not None:
                    await self.shared.state.save_operation(hit.name, action_digest, "", response)
                return hit
        key = (instance, action_digest.key) if cacheable else None
        if key is not None and self.shared is None:
            shared = self._in_flight.get(key)
            if shared is not None and not shared.done:
                self.stats.dedup_merges += 1
                return self.operations.create(shared, action_digest)
        job = Job(
            id=uuid.uuid4().hex,
            instance=instance,
            action_digest=action_digest,
            action=action,
            command=command,
            requirements=requirements,
            timeout=timeout,
            priority=priority,
            cacheable=cacheable,
            dedup_key=key,
            on_done=self.stats.finished,
        )
        if self.shared is not None:
            return await self._submit_shared(self.shared, job)
        if key is not None:
            self._in_flight[key] = job
        operation = self.operations.create(job, action_digest)
        self.scheduler.submit(job)
        return operation

    async def _submit_shared(self, shared: SharedJobs, job: Job) -> Operation:
        """Redis mode: join the job another Execute (on any server) runs for this action, or queue."""
        key = job.dedup_key
        name = new_operation_name()
        # The common case, no identical job in flight, is this one round trip.
        claimed = await shared.state.create_job(job.id, key, shared.server_id, (name, job.action_digest))
        if not claimed and key is not None:
            other = await shared.state.claim_in_flight(key, job.id)
            if other is not None:
                joined = await shared.state.join(other)
                running = None
                if joined is not None:
                    running = await shared.job_for(other, job.instance, job.action_digest, joined)
                if running is not None:
                    await shared.state.drop_job(job.id)
                    await shared.state.save_operation(name, job.action_digest, other, None)
                    self.stats.dedup_merges += 1
                    return self.operations.adopt(name, running, job.action_digest)
                # The job the index named ended or was cancelled: this one replaces it.
                await shared.state.take_over_in_flight(key, job.id)
        shared.track(job)
        operation = self.operations.adopt(name, job, job.action_digest)
        self.scheduler.submit(job)
        return operation

    def _timeout(self, action: re_pb2.Action) -> float:
        if not action.HasField("timeout"):
            return self.config.default_timeout
        seconds = action.timeout.ToTimedelta().total_seconds()
        if seconds < 0:
            raise InvalidRequest(f"timeout {seconds:g}s is negative")
        if seconds == 0:
            return self.config.default_timeout
        if seconds > self.config.max_timeout:
            raise InvalidRequest(f"timeout {seconds:g}s is above the maximum of {self.config.max_timeout:g}s")
        return seconds

    async def _finished(self, job: Job, response: re_pb2.ExecuteResponse) -> re_pb2.ExecuteResponse:
        """Before the job reports done: the ActionCache entry, and the in-flight entry dropped."""
        if job.dedup_key is not None and self._in_flight.get(job.dedup_key) is job:
            del self._in_flight[job.dedup_key]
        if response.message:
            await self._attach_log(response)
        if job.cacheable and response.status.code == code_pb2.OK and response.result.exit_code == 0:
            try:
                await self.action_cache.update(job.instance, job.action_digest, response.result)
            except Exception:
                log.exception("cannot store the result of %s in the action cache", job.action_digest)
        # Redis mode: the job leaves the in-flight index when its done state is published, after
        # this ActionCache write (an Execute in between joins it and gets the same result).
        return response

    async def _attach_log(self, response: re_pb2.ExecuteResponse) -> None:
        data = response.message.encode()
        digest = Digest.of(data)
        try:
            await self.blobs.write(digest, single_chunk(data))
        except Exception:
            log.exception("cannot store a worker log")
            return
        response.server_logs["worker"].CopyFrom(
            re_pb2.LogFile(digest=re_pb2.Digest(hash=digest.hash, size_bytes=digest.size_bytes), human_readable=True)
        )

    # -- watching, cancelling -------------------------------------------------------------

    def get(self, name: str) -> Operation | None:
        """An operation this server knows (see `lookup` for every server's)."""
        return self.operations.get(name)

    async def list_operations(self) -> dict[str, operations_pb2.Operation]:
        """Every operation by name: this server's, and in Redis mode every other server's too (read
        as they are: listing one does not make it live here)."""
        listed = {op.name: op.message() for op in self.operations.all()}
        if self.shared is None:
            return listed
        state = self.shared.state
        for name in await state.operation_names():
            if name in listed:
                continue
            record = await state.load_operation(name)
            if record is None:
                continue
            if record.response is not None:
                listed[name] = operation_message(name, Stage("COMPLETED"), record.action_digest, record.response)
                continue
            job = await state.job_state(record.job_id)
            if job is not None and (job.response is not None or not job.owner_gone):
                listed[name] = operation_message(name, job.stage, record.action_digest, job.response)
        return listed

    async def lookup(self, name: str) -> Operation | None:
        """The operation `name`; in Redis mode also one another server created (None: unknown or
        expired). A copy here counts as one more live operation of its job until abandoned."""
        operation = self.operations.get(name)
        if operation is not None or self.shared is None:
            return operation
        record = await self.shared.state.load_operation(name)
        if record is None:
            return None
        job = None
        if record.response is None:
            job = await self.shared.job_for(record.job_id, "", record.action_digest)
            if job is None:
                return None
        operation = self.operations.get(name)  # another lookup may have adopted it meanwhile
        if operation is not None:
            return operation
        operation = self.operations.adopt(name, job, record.action_digest, record.response)
        if job is not None and not job.done:
            await self.shared.state.add_operation(job.id)
        return operation

    async def follow(
        self, operation: Operation, from_start: bool = False
    ) -> AsyncGenerator[operations_pb2.Operation, None]:
        """`operation.watch()` while counting the caller as a watcher (see `execution_grace`).

        Raises ShuttingDown, without a done Operation, when the server closes: a client then
        asks again (WaitExecution, NOT_FOUND at a restarted server, Execute again)."""
        if self._closing.is_set():
            raise ShuttingDown("the server is shutting down; ask again")
        operation.watchers += 1
        self._cancel_orphan_check(operation.job)
        if operation.abandoned and self.shared is not None and operation.job is not None:
            operation.abandoned = False
            await self.shared.state.add_operation(operation.job.id)
        messages = operation.watch(from_start)
        closing = asyncio.ensure_future(self._closing.wait())
        following: asyncio.Future[operations_pb2.Operation] = closing  # replaced before it is read
        try:
            while True:
                following = asyncio.ensure_future(anext(messages))
                await asyncio.wait({following, closing}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    raise ShuttingDown("the server is shutting down; ask again")
                try:
                    message = following.result()
                except StopAsyncIteration:
                    return
                yield message
        finally:
            operation.watchers -= 1
            self._maybe_orphaned(operation.job)
            # Whatever ended the stream (the caller went away, the server closes), its tasks end
            # with it, their outcomes read. Shielded: gRPC may cancel a going call more than once.
            await asyncio.shield(_stop_following(messages, following, closing))

    def _cancel_orphan_check(self, job: Job | None) -> None:
        if job is not None:
            handle = self._orphan_checks.pop(job.id, None)
            if handle is not None:
                handle.cancel()

    def _maybe_orphaned(self, job: Job | None) -> None:
        if job is None or job.done or any(op.watchers for op in job.live_operations()):
            return
        self._cancel_orphan_check(job)
        loop = asyncio.get_running_loop()
        self._orphan_checks[job.id] = loop.call_later(self.config.grace, self._orphan_check, job)

    def _orphan_check(self, job: Job) -> None:
        self._orphan_checks.pop(job.id, None)
        if not job.done and not any(op.watchers for op in job.live_operations()):
            message = f"no client waited for the result for {self.config.grace:g}s"
            if self.shared is not None:
                stop = self._abandon(self.shared, job, message)
            else:
                log.info("job %s: no client waited for %gs, cancelling it", job.id, self.config.grace)
                stop = self.scheduler.cancel(job, message)
            task = asyncio.get_running_loop().create_task(stop)
            self._cancelling.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._cancelling.discard)

    async def _abandon(self, shared: SharedJobs, job: Job, message: str) -> None:
        """Redis mode: this server's unwatched operations stop counting; the job stops when no
        server has a live operation on it."""
        unwatched = [op for op in job.live_operations() if not op.abandoned and not op.watchers]
        for op in unwatched:
            op.abandoned = True
        if unwatched and await shared.state.release(job.id, len(unwatched)) <= 0:
            log.info("job %s: no client on any server waited for %gs, cancelling it", job.id, self.config.grace)
            await self._stop(job, message)

    async def _stop(self, job: Job, message: str) -> None:
        if job.owned or not isinstance(self.scheduler, RedisScheduler):
            await self.scheduler.cancel(job, message)
        else:
            await self.scheduler.cancel_elsewhere(job.id)

    async def cancel(self, name: str, announce: bool = True) -> bool:
        """Cancel one operation (False: unknown name). Its job stops when no live operation is left
        (in Redis mode: on any server, and every server's copy of the operation ends CANCELLED)."""
        operation = await self.lookup(name)
        if operation is None:
            return False
        if operation.done:
            return True
        operation.cancelled = True
        operation.response = cancelled_response("the operation was cancelled")
        job = operation.job
        if self.shared is not None:
            await self.shared.state.save_operation(name, operation.action_digest, "", operation.response)
            if announce:
                await self.shared.state.announce_cancel(name)
        if job is not None:
            job.notify()
            message = "every operation waiting for this job was cancelled"
            if self.shared is not None:
                counted = 0 if operation.abandoned else 1
                if await self.shared.state.release(job.id, counted) <= 0:
                    await self._stop(job, message)
            elif not job.live_operations():
                await self.scheduler.cancel(job, message)
        return True

    async def _cancelled_elsewhere(self, name: str) -> None:
        """A client cancelled operation `name` through another server: this server's copy ends too."""
        operation = self.operations.get(name)
        if operation is not None and not operation.done:
            await self.cancel(name, announce=False)

    async def close(self) -> None:
        self._closing.set()
        for handle in self._orphan_checks.values():
            handle.cancel()
        self._orphan_checks.clear()
        if self.shared is not None:
            await self.shared.close()
        await self.scheduler.close()


async def _stop_following(
    messages: AsyncGenerator[operations_pb2.Operation, None], *tasks: asyncio.Future[Any]
) -> None:
    """Cancel `tasks` and wait for them, retrieving what they raised (a task whose exception is
    never read is reported on stderr when collected), then close `messages`."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await messages.aclose()
