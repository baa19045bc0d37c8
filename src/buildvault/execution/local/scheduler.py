"""The in-process scheduler: a priority queue of jobs and the workers that take them.

A worker takes the first queued job (lowest `priority` value, then oldest) whose requirements
it satisfies. A worker that dies mid-job (`WorkerLost`) sends the job back to QUEUED, up to
MAX_ATTEMPTS runs in all; then the job ends UNAVAILABLE naming the worker. Everything here runs
on the event loop; the work itself happens in the worker processes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from typing import Protocol

from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.execution.operations import Job, cancelled_response
from buildvault.execution.platform import MatchRules, Properties
from buildvault.execution.queue import Finished
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.execution")

MAX_ATTEMPTS = 3


class WorkerLost(Exception):
    """The worker running a job went away (its process died, its connection broke)."""

    def __init__(self, worker: str, why: str) -> None:
        super().__init__(f"worker {worker} was lost: {why}")
        self.worker = worker


class Worker(Protocol):
    """What the scheduler needs of a worker (local process or, later, remote)."""

    name: str
    pool: str
    properties: Properties

    async def run(self, job: Job) -> re_pb2.ExecuteResponse:
        """Run `job` to its response; raise WorkerLost if the worker dies first."""
        ...

    async def cancel(self, job: Job) -> None:
        """Ask the worker to stop `job` (its `run` then answers CANCELLED)."""
        ...

    async def close(self) -> None: ...


class Scheduler:
    def __init__(self, workers: list[Worker], rules: MatchRules, on_finished: Finished) -> None:
        self.workers = workers
        self.rules = rules
        self.on_finished = on_finished
        self._queue: list[tuple[int, int, Job]] = []
        self._order = itertools.count()
        self._idle: list[Worker] = list(workers)
        self._running: dict[str, tuple[Worker, Job, asyncio.Task[None]]] = {}
        self._closed = False
        self.retries = 0
        self.lost_workers = 0
        self.on_started: Callable[[Job], None] | None = None

    # -- questions ------------------------------------------------------------------------

    def could_run(self, requirements: Properties) -> bool:
        """True when some worker, busy or not, satisfies `requirements`."""
        return self.rules.any_satisfies((w.properties for w in self.workers), requirements)

    def queued(self) -> list[Job]:
        return [job for _, _, job in sorted(self._queue) if not job.done]

    def running(self) -> list[tuple[Worker, Job]]:
        return [(worker, job) for worker, job, _ in self._running.values()]

    def idle_workers(self) -> list[Worker]:
        return list(self._idle)

    # -- changes --------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        job.set_stage(re_pb2.ExecutionStage.QUEUED)
        heapq.heappush(self._queue, (job.priority, next(self._order), job))
        self._dispatch()

    async def cancel(self, job: Job, message: str) -> None:
        """Stop `job` wherever it is; its operations end CANCELLED."""
        if job.done:
            return
        running = self._running.get(job.id)
        if running is None:
            job.finish(cancelled_response(message))  # still queued: dropped when reached
            return
        await running[0].cancel(job)

    def _dispatch(self) -> None:
        if self._closed:
            return
        while self._idle and self._queue:
            assigned = False
            kept: list[tuple[int, int, Job]] = []
            while self._queue:
                entry = heapq.heappop(self._queue)
                job = entry[2]
                if job.done:
                    continue
                worker = self._take_worker(job)
                if worker is None:
                    kept.append(entry)
                    continue
                self._start(worker, job)
                assigned = True
                break
            for entry in kept:
                heapq.heappush(self._queue, entry)
            if not assigned:
                return

    def _take_worker(self, job: Job) -> Worker | None:
        for index, worker in enumerate(self._idle):
            if self.rules.satisfies(worker.properties, job.requirements):
                return self._idle.pop(index)
        return None

    def _start(self, worker: Worker, job: Job) -> None:
        job.attempts += 1
        job.worker = worker.name
        job.set_stage(re_pb2.ExecutionStage.EXECUTING)
        if self.on_started is not None:
            self.on_started(job)
        task = asyncio.create_task(self._execute(worker, job), name=f"job {job.id}")
        self._running[job.id] = (worker, job, task)

    async def _execute(self, worker: Worker, job: Job) -> None:
        try:
            try:
                response = await worker.run(job)
            except WorkerLost as lost:
                self.lost_workers += 1
                log.warning("%s (job %s, attempt %d)", lost, job.id, job.attempts)
                if job.done:
                    return
                if job.attempts < MAX_ATTEMPTS and not self._closed:
                    self.retries += 1
                    self._running.pop(job.id, None)
                    self.submit(job)
                    return
                response = re_pb2.ExecuteResponse(
                    status=status_pb2.Status(
                        code=code_pb2.UNAVAILABLE, message=f"{lost} ({job.attempts} attempts)"
                    )
                )
            if not job.done:
                job.finish(await self.on_finished(job, response))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("job %s failed in the scheduler", job.id)
            job.finish(re_pb2.ExecuteResponse(status=status_pb2.Status(code=code_pb2.INTERNAL, message=str(e))))
        finally:
            if self._running.get(job.id, (None,))[0] is worker:
                self._running.pop(job.id, None)
            self._idle.append(worker)
            self._dispatch()

    async def close(self) -> None:
        """Stop dispatching, stop the workers, end every job UNAVAILABLE (their watchers have been
        told already: Executor.close)."""
        self._closed = True
        for _, _, job in self._queue:
            job.finish(_shutting_down())
        self._queue.clear()
        running = list(self._running.values())
        await asyncio.gather(*(worker.close() for worker in self.workers), return_exceptions=True)
        for _, job, task in running:
            task.cancel()
            job.finish(_shutting_down())
        await asyncio.gather(*(task for _, _, task in running), return_exceptions=True)


def _shutting_down() -> re_pb2.ExecuteResponse:
    return re_pb2.ExecuteResponse(
        status=status_pb2.Status(code=code_pb2.UNAVAILABLE, message="the server is shutting down")
    )
