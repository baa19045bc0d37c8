"""Execute's behaviour without gRPC: checks, the ActionCache, watchers and grace, cancel.

    executor = Executor(config, blobs, action_cache, open_queue)   # a queue.QueueFactory
    operation = await executor.execute(instance, action_digest, skip_cache_lookup=False, priority=0)
    async for message in executor.follow(operation): ...      # counts the client as a watcher
    await executor.cancel(operation.name)

Errors raised before anything is queued: `MissingBlobs` (FAILED_PRECONDITION with one MISSING
violation per blob), `InvalidRequest` (INVALID_ARGUMENT: a bad timeout, priority or platform
key), `NoMatchingWorker` (FAILED_PRECONDITION naming the platform). Errors while running are
in the response's status. A successful, cacheable result (exit code 0, status OK, not
`do_not_cache`) is in the ActionCache before its operation reports done.

Where jobs wait and run, and how identical actions in flight are shared, is the queue's business
(execution.queue: local/ in process, redis/ across servers); the executor calls it the same way
whichever it is.
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
from buildvault.execution.operations import Job, Operation, OperationTable
from buildvault.execution.platform import MatchRules, PlatformError, format_properties
from buildvault.execution.queue import QueueFactory
from buildvault.execution.requests import InvalidRequest, load_action
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
        open_queue: QueueFactory,
    ) -> None:
        self.config = config
        self.blobs = blobs
        self.action_cache = action_cache
        self.operations = OperationTable()
        self.queue = open_queue(self.operations, self._finished)
        self._orphan_checks: dict[str, asyncio.TimerHandle] = {}
        self._closing = asyncio.Event()
        self._cancelling: set[asyncio.Task[None]] = set()
        self.stats = ExecutionStats()
        self.queue.scheduler.on_started = self.stats.started

    async def start(self) -> None:
        await self.queue.start()

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
        if not self.queue.scheduler.could_run(requirements):
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
                await self.queue.record_hit(hit)
                return hit
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
            dedup_key=(instance, action_digest.key) if cacheable else None,
            on_done=self.stats.finished,
        )
        operation, joined = await self.queue.submit(job)
        if joined:
            self.stats.dedup_merges += 1
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
        """Before the job reports done: the worker's log stored, the ActionCache entry written."""
        if response.message:
            await self._attach_log(response)
        if job.cacheable and response.status.code == code_pb2.OK and response.result.exit_code == 0:
            try:
                await self.action_cache.update(job.instance, job.action_digest, response.result)
            except Exception:
                log.exception("cannot store the result of %s in the action cache", job.action_digest)
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
            re_pb2.LogFile(digest=digest.to_proto(re_pb2.Digest), human_readable=True)
        )

    # -- watching, cancelling -------------------------------------------------------------

    def get(self, name: str) -> Operation | None:
        """An operation this server holds (see `lookup` for every server's)."""
        return self.operations.get(name)

    async def list_operations(self) -> dict[str, operations_pb2.Operation]:
        """Every operation by name: this server's, and those of every server sharing its queue
        (read as they are: listing one does not make it live here)."""
        listed = {op.name: op.message() for op in self.operations.all()}
        listed.update(await self.queue.elsewhere(set(listed)))
        return listed

    async def lookup(self, name: str) -> Operation | None:
        """The operation `name`, this server's or one another server sharing the queue created
        (None: unknown or expired)."""
        operation = self.operations.get(name)
        if operation is not None:
            return operation
        return await self.queue.find(name)

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
        await self.queue.watching(operation)
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
            task = asyncio.get_running_loop().create_task(self.queue.abandon(job, self.config.grace))
            self._cancelling.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._cancelling.discard)

    async def cancel(self, name: str) -> bool:
        """Cancel one operation (False: unknown name). Its job stops when no live operation is left
        on it (on any server sharing the queue)."""
        operation = await self.lookup(name)
        if operation is None:
            return False
        if not operation.done:
            operation.cancel()
            await self.queue.cancelled(operation)
        return True

    async def close(self) -> None:
        self._closing.set()
        for handle in self._orphan_checks.values():
            handle.cancel()
        self._orphan_checks.clear()
        await self.queue.close()


async def _stop_following(
    messages: AsyncGenerator[operations_pb2.Operation, None], *tasks: asyncio.Future[Any]
) -> None:
    """Cancel `tasks` and wait for them, retrieving what they raised (a task whose exception is
    never read is reported on stderr when collected), then close `messages`."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await messages.aclose()
