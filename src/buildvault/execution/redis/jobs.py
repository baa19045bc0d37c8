"""The executor's side of shared state (Redis mode): jobs it owns published, others' followed.

    shared = SharedJobs(SharedState(redis, keep_finished), server_id)
    shared.track(job)                         # an owned job: every change goes to Redis, in order
    job = await shared.job_for(job_id, ...)   # an owned job, or a copy kept current from events

Copies (`Job.owned` False) change only through `_apply`, from `bv:events` or from a re-read of
the job's hash every few seconds. A job whose owner stopped (its heartbeat expired) is not
found (Bazel then Executes again), and a copy of it ends UNAVAILABLE (Bazel retries).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.digest import Digest
from buildvault.execution.operations import Job
from buildvault.execution.redis import keys
from buildvault.execution.redis.state import JobState, SharedState
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.execution")

# Copies are re-read this often: a missed event costs at most this much delay.
REFRESH = 5.0
# A blocking read waits at most this long: below redis-py's socket timeout.
BLOCK_MS = 2000


def _history(stage: int) -> list[int]:
    if stage == re_pb2.ExecutionStage.EXECUTING:
        return [re_pb2.ExecutionStage.QUEUED, re_pb2.ExecutionStage.EXECUTING]
    return [re_pb2.ExecutionStage.QUEUED]


class SharedJobs:
    def __init__(self, state: SharedState, server_id: str) -> None:
        self.state = state
        self.server_id = server_id
        self._owned: dict[str, Job] = {}  # queued here, not done yet
        self._copies: dict[str, Job] = {}  # queued elsewhere, not done yet
        self._outbox: asyncio.Queue[tuple[Job, JobState]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        # Called with the name of an operation a client cancelled through any server.
        self.on_cancelled: Callable[[str], Awaitable[None]] | None = None

    async def start(self) -> None:
        last = await self.state.last_event()
        await self.state.heartbeat(self.server_id)
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name="server heartbeat"),
            asyncio.create_task(self._publish(), name="publish job states"),
            asyncio.create_task(self._follow(last), name="follow job states"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.state.stop_heartbeat(self.server_id)
        except Exception:
            log.exception("cannot remove this server's heartbeat from Redis")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(keys.SERVER_TTL / 3)
            try:
                await self.state.heartbeat(self.server_id)
            except Exception:
                log.exception("cannot refresh this server's heartbeat in Redis")

    # -- owned jobs -----------------------------------------------------------------------

    def track(self, job: Job) -> None:
        job.on_change = self._changed
        self._owned[job.id] = job

    def _changed(self, job: Job) -> None:
        job.seq += 1
        self._outbox.put_nowait((job, JobState(job.seq, job.stage, job.worker, job.response)))
        if job.done:
            self._owned.pop(job.id, None)

    async def _publish(self) -> None:
        # One task, so the changes of a job reach Redis in the order they happened.
        while True:
            job, state = await self._outbox.get()
            try:
                await self.state.publish(job.id, state, job.dedup_key)
            except Exception:
                log.exception("cannot publish the state of job %s to Redis", job.id)

    # -- copies ---------------------------------------------------------------------------

    async def job_for(
        self, job_id: str, instance: str, action_digest: Digest, known: JobState | None = None
    ) -> Job | None:
        """The job `job_id`: owned here, an existing copy, or a new copy (None: its state expired)."""
        job = self._owned.get(job_id) or self._copies.get(job_id)
        if job is not None:
            return job
        job = Job(
            id=job_id, instance=instance, action_digest=action_digest, action=re_pb2.Action(),
            command=re_pb2.Command(), requirements={}, timeout=0.0, priority=0, cacheable=True,
            dedup_key=None, owned=False, seq=-1,
        )  # fmt: skip
        # Registered before the read: an event arriving meanwhile is applied, not lost.
        self._copies[job_id] = job
        if known is not None:
            self._apply(job, known)
        state = await self.state.job_state(job_id)
        if (state is None or state.owner_gone) and not job.done:
            self._copies.pop(job_id, None)
            return None
        if state is not None:
            self._apply(job, state)
        return job

    def _apply(self, job: Job, state: JobState) -> None:
        if state.seq <= job.seq:
            return
        first = job.seq < 0
        job.seq = state.seq
        job.worker = state.worker
        if first:
            job.stage = state.stage
            job.history = _history(state.stage)
        if state.response is not None:
            self._copies.pop(job.id, None)
            job.finish(state.response)
        elif state.stage != job.stage:
            job.set_stage(state.stage)

    async def _follow(self, last: str) -> None:
        loop = asyncio.get_running_loop()
        refreshed = loop.time()
        while True:
            try:
                last, events, cancelled = await self.state.read_events(last, block_ms=BLOCK_MS)
                for job_id, state in events:
                    job = self._copies.get(job_id)
                    if job is not None:
                        self._apply(job, state)
                for name in cancelled:
                    if self.on_cancelled is not None:
                        await self.on_cancelled(name)
                if loop.time() - refreshed >= REFRESH:
                    refreshed = loop.time()
                    await self._refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("following job states in Redis")
                await asyncio.sleep(1.0)

    async def _refresh(self) -> None:
        for job in list(self._copies.values()):
            state = await self.state.job_state(job.id)
            if state is not None and not state.owner_gone:
                self._apply(job, state)
            elif not job.done:
                self._copies.pop(job.id, None)
                why = "its state expired in Redis" if state is None else "the server that queued it stopped"
                status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=f"the job was lost: {why}; ask again")
                job.finish(re_pb2.ExecuteResponse(status=status))
