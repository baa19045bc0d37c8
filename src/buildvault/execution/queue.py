"""The seam between Execute's behaviour (executor.py) and where jobs wait and run.

Two implementations, one package each:

- `local/`  the in-process priority queue and the server's own worker processes
            (`--local-workers`); identical in-flight actions share a job within this server.
- `redis/`  Redis Streams read by `buildvault worker`s (`--queue redis://`); operations, job
            states and the in-flight index are shared by every server on the same Redis.

The executor builds its queue through a `QueueFactory` (runtime.py picks one from the settings),
hands it every job it queues, and asks it about operations this server does not hold. It never
asks which implementation it has.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from google.longrunning import operations_pb2  # type: ignore[import-untyped]

from buildvault.execution.operations import Job, Operation, OperationTable
from buildvault.execution.platform import MatchRules, Properties
from buildvault.remote_apis import re_pb2

# What runs before a job reports done (the ActionCache write): given the worker's response, the
# response the job's operations end with.
Finished = Callable[[Job, re_pb2.ExecuteResponse], Awaitable[re_pb2.ExecuteResponse]]


def unwatched(grace: float) -> str:
    """The status message of a job cancelled because no client waited for it."""
    return f"no client waited for the result for {grace:g}s"


class WorkerView(Protocol):
    """A worker as the status page shows it."""

    @property
    def name(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def properties(self) -> Properties: ...


class SchedulerView(Protocol):
    """What a scheduler tells the executor and the status page (execution.stats.snapshot)."""

    rules: MatchRules
    retries: int
    lost_workers: int
    # Called when a job this server queued starts running (queue-time statistics).
    on_started: Callable[[Job], None] | None

    @property
    def workers(self) -> Sequence[WorkerView]: ...
    def could_run(self, requirements: Properties) -> bool:
        """True when some worker, busy or not, satisfies `requirements`."""
        ...

    def queued(self) -> Sequence[Job]: ...
    def running(self) -> Sequence[tuple[WorkerView, Job]]: ...
    def idle_workers(self) -> Sequence[WorkerView]: ...


class JobQueue(Protocol):
    @property
    def scheduler(self) -> SchedulerView: ...

    async def start(self) -> None:
        """Connect and follow what other servers publish (nothing to do in process)."""

    async def submit(self, job: Job) -> tuple[Operation, bool]:
        """An operation on `job`, queued; or on an identical job already in flight, which the
        operation then joins (True)."""
        ...

    async def record_hit(self, operation: Operation) -> None:
        """`operation` was answered from the ActionCache (other servers may be asked about it)."""

    async def find(self, name: str) -> Operation | None:
        """An operation this server's table does not hold (another server created it), adopted
        into the table; None: unknown or expired."""
        ...

    async def elsewhere(self, known: set[str]) -> dict[str, operations_pb2.Operation]:
        """Other servers' operations not in `known`, read as they are (for ListOperations)."""
        ...

    async def watching(self, operation: Operation) -> None:
        """A client follows `operation` (again)."""

    async def abandon(self, job: Job, grace: float) -> None:
        """No client of this server watched `job` for `grace` seconds: stop counting its
        operations here, and stop the job when nobody anywhere waits for it."""

    async def cancelled(self, operation: Operation) -> None:
        """A client cancelled `operation` (already marked): wake its watchers, and stop its job
        when no live operation is left on it."""

    async def close(self) -> None: ...


# The executor's operation table and its Finished hook -> the queue it uses.
QueueFactory = Callable[[OperationTable, Finished], JobQueue]
