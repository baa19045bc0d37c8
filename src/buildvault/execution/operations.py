"""Jobs (one execution of an action) and the operations clients watch (one per Execute call).

Identical in-flight actions share one `Job`; every Execute gets its own `Operation` on it, so a
client can cancel its own operation without stopping the others' work. A job is cancelled when
all its operations are cancelled, or when none has had a watching client for the grace period.

`Operation.message()` is the google.longrunning.Operation a client sees; `watch()` yields it at
every change and at least every `keepalive` seconds, and ends after the one with `done`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from google.longrunning import operations_pb2  # type: ignore[import-untyped]
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

Stage = re_pb2.ExecutionStage.Value


def operation_message(
    name: str, stage: int, action_digest: Digest, response: re_pb2.ExecuteResponse | None
) -> operations_pb2.Operation:
    """The google.longrunning.Operation clients see: `done` with the response, else the stage."""
    metadata = re_pb2.ExecuteOperationMetadata(
        stage=stage,  # type: ignore[arg-type]
        action_digest=action_digest.to_proto(re_pb2.Digest),
    )
    operation = operations_pb2.Operation(name=name)
    operation.metadata.Pack(metadata)
    if response is not None:
        operation.done = True
        operation.response.Pack(response)
    return operation


# How long finished operations stay answerable (WaitExecution, GetOperation).
KEEP_FINISHED = 300.0
# A stream repeats the current state at least this often (the issue: at least every 20 s).
KEEPALIVE = 10.0


@dataclass
class Job:
    """One execution of an action, shared by the operations that asked for it."""

    id: str
    instance: str
    action_digest: Digest
    action: re_pb2.Action
    command: re_pb2.Command
    requirements: dict[str, str]
    timeout: float
    priority: int
    cacheable: bool
    dedup_key: tuple[str, str] | None
    queued_at: float = field(default_factory=time.time)
    stage: int = re_pb2.ExecutionStage.QUEUED
    response: re_pb2.ExecuteResponse | None = None
    attempts: int = 0
    worker: str = ""
    started_at: float | None = None
    operations: list[Operation] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Every stage the job entered, in order (a retried job goes QUEUED, EXECUTING, QUEUED, ...).
    history: list[int] = field(default_factory=list)
    on_done: Callable[[Job], None] | None = None
    # Redis mode: every change is published (execution.redis.jobs); `owned` False: a copy of a
    # job another server queued, kept current from its events; `seq` orders those changes.
    on_change: Callable[[Job], None] | None = None
    owned: bool = True
    seq: int = 0

    @property
    def done(self) -> bool:
        return self.response is not None

    def notify(self) -> None:
        """Wake every watcher; the next change gets a fresh event."""
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def set_stage(self, stage: int) -> None:
        self.stage = stage
        self.history.append(stage)
        if self.on_change is not None:
            self.on_change(self)
        self.notify()

    def finish(self, response: re_pb2.ExecuteResponse) -> None:
        if self.response is None:
            self.response = response
            self.stage = re_pb2.ExecutionStage.COMPLETED
            if self.on_done is not None:
                self.on_done(self)
            if self.on_change is not None:
                self.on_change(self)
            self.notify()

    def live_operations(self) -> list[Operation]:
        return [op for op in self.operations if not op.cancelled]


def new_operation_name() -> str:
    return f"operations/{uuid.uuid4()}"


def cancelled_response(message: str) -> re_pb2.ExecuteResponse:
    return re_pb2.ExecuteResponse(status=status_pb2.Status(code=code_pb2.CANCELLED, message=message))


@dataclass
class Operation:
    """What one Execute call (or a cache hit) is answered with."""

    name: str
    job: Job | None
    action_digest: Digest
    response: re_pb2.ExecuteResponse | None = None  # set for cache hits and cancelled operations
    cancelled: bool = False
    watchers: int = 0
    finished_at: float | None = None
    # Redis mode: no client watched it for the grace period, so it no longer counts as live
    # (execution.redis.state `ops`); a client that comes back makes it count again.
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return self.current_response() is not None

    def cancel(self) -> None:
        """A client cancelled this operation: it ends CANCELLED (its job may run on for others)."""
        self.cancelled = True
        self.response = cancelled_response("the operation was cancelled")

    def current_response(self) -> re_pb2.ExecuteResponse | None:
        if self.response is not None:
            return self.response
        return self.job.response if self.job is not None else None

    def stage(self) -> int:
        if self.done:
            return re_pb2.ExecutionStage.COMPLETED
        assert self.job is not None
        return self.job.stage

    def message(self, stage: int | None = None) -> operations_pb2.Operation:
        """The Operation now; `stage` names an earlier stage this operation went through instead."""
        if stage is not None:
            return operation_message(self.name, stage, self.action_digest, None)
        return operation_message(self.name, self.stage(), self.action_digest, self.current_response())

    async def watch(
        self, from_start: bool = False, keepalive: float = KEEPALIVE
    ) -> AsyncGenerator[operations_pb2.Operation, None]:
        """Every stage in order, then the done Operation; the current state is repeated every
        `keepalive` seconds meanwhile. `from_start` (an Execute call): from CACHE_CHECK on;
        otherwise (WaitExecution) from the current state."""
        job = self.job
        history: list[int] = job.history if job is not None else []
        if from_start:
            yield self.message(re_pb2.ExecutionStage.CACHE_CHECK)
            sent = 0
        elif self.done:
            sent = len(history)
        else:
            yield self.message()
            sent = len(history)
        while True:
            event = job.changed if job is not None else None
            while sent < len(history) and not self.done:
                yield self.message(history[sent])
                sent += 1
            while sent < len(history) and history[sent] != re_pb2.ExecutionStage.COMPLETED:
                yield self.message(history[sent])
                sent += 1
            if self.done or event is None:
                yield self.message()
                return
            try:
                await asyncio.wait_for(event.wait(), keepalive)
            except TimeoutError:
                if sent == len(history) and not self.done:
                    yield self.message()


class OperationTable:
    """Operations by name; finished ones are forgotten after KEEP_FINISHED seconds."""

    def __init__(self, keep_finished: float = KEEP_FINISHED, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_finished = keep_finished
        self.clock = clock
        self._operations: dict[str, Operation] = {}

    def create(
        self, job: Job | None, action_digest: Digest, response: re_pb2.ExecuteResponse | None = None
    ) -> Operation:
        return self.adopt(new_operation_name(), job, action_digest, response)

    def adopt(
        self, name: str, job: Job | None, action_digest: Digest, response: re_pb2.ExecuteResponse | None = None
    ) -> Operation:
        """An operation under a given name (Redis mode: one another server created)."""
        self.expire()
        operation = Operation(name=name, job=job, action_digest=action_digest, response=response)
        if job is not None:
            job.operations.append(operation)
        self._operations[operation.name] = operation
        return operation

    def get(self, name: str) -> Operation | None:
        self.expire()
        return self._operations.get(name)

    def all(self) -> list[Operation]:
        self.expire()
        return list(self._operations.values())

    def remove(self, name: str) -> bool:
        return self._operations.pop(name, None) is not None

    def expire(self) -> None:
        now = self.clock()
        for name, operation in list(self._operations.items()):
            if operation.done:
                if operation.finished_at is None:
                    operation.finished_at = now
                elif now - operation.finished_at > self.keep_finished:
                    del self._operations[name]
