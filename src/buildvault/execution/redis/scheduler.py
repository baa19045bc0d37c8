"""The scheduler of `--queue redis://...`: jobs go to Redis Streams, `buildvault worker`s run them.

Jobs are XADDed to the stream of their priority band and requirement set; workers whose
properties satisfy it read it through the `workers` consumer group, more urgent bands first, so
any number of servers share one queue. A worker reports `started` and then `result` on the
submitting server's results stream. A lost worker's job stays pending in the group; another
worker takes it back with XAUTOCLAIM (see execution.redis.worker), up to MAX_DELIVERIES
runs. A cancelled job is stopped where it runs (`bv:cancel`) or skipped when a worker reaches it
(its shared state says cancelled, execution.redis.state).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.execution import wire
from buildvault.execution.operations import Job, cancelled_response
from buildvault.execution.platform import MatchRules, Properties, format_properties
from buildvault.execution.queue import Finished
from buildvault.execution.redis import keys
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.execution")

# After start-up, platforms no registered worker offers are still queued for this long.
STARTUP_GRACE = 10.0


class RemoteWorkerView:
    """A registered `buildvault worker`, as the status page shows it."""

    def __init__(self, name: str, properties: Properties) -> None:
        self.name = name
        self.pool = format_properties(properties)
        self.properties = properties


class RedisScheduler:
    def __init__(self, url: str, rules: MatchRules, on_finished: Finished) -> None:
        import redis.asyncio as redis

        self.redis: Any = redis.from_url(url)  # redis-py's stubs type replies as unions
        self.rules = rules
        self.on_finished = on_finished
        self.server_id = uuid.uuid4().hex
        self.started_at = time.monotonic()
        self._jobs: dict[str, Job] = {}
        self._reader: asyncio.Task[None] | None = None
        self._enqueuing: set[asyncio.Task[None]] = set()
        self._workers: list[RemoteWorkerView] = []
        self._workers_read = 0.0
        self.retries = 0
        self.lost_workers = 0
        self.on_started: Callable[[Job], None] | None = None

    @property
    def workers(self) -> list[RemoteWorkerView]:
        return self._workers

    async def start(self) -> None:
        await self.redis.ping()
        await self.refresh_workers()
        self._reader = asyncio.create_task(self._read_results(), name="redis results")

    async def refresh_workers(self) -> None:
        entries = await self.redis.hgetall(keys.WORKERS)
        now = time.time()
        fresh = []
        for name, value in entries.items():
            info = json.loads(value)
            if now - float(info["seen"]) <= keys.WORKER_STALE:
                fresh.append(RemoteWorkerView(name.decode(), dict(info["properties"])))
        self._workers = sorted(fresh, key=lambda w: w.name)
        self._workers_read = time.monotonic()

    def could_run(self, requirements: Properties) -> bool:
        if time.monotonic() - self.started_at < STARTUP_GRACE:
            return True
        return self.rules.any_satisfies((w.properties for w in self._workers), requirements)

    def queued(self) -> list[Job]:
        return [job for job in self._jobs.values() if job.stage == re_pb2.ExecutionStage.QUEUED]

    def running(self) -> list[tuple[Any, Job]]:
        views = {w.name: w for w in self._workers}
        return [
            (views.get(job.worker) or RemoteWorkerView(job.worker, {}), job)
            for job in self._jobs.values()
            if job.stage == re_pb2.ExecutionStage.EXECUTING
        ]

    def idle_workers(self) -> list[RemoteWorkerView]:
        busy = {job.worker for job in self._jobs.values() if job.stage == re_pb2.ExecutionStage.EXECUTING}
        return [w for w in self._workers if w.name not in busy]

    def submit(self, job: Job) -> None:
        job.set_stage(re_pb2.ExecutionStage.QUEUED)
        self._jobs[job.id] = job
        task = asyncio.get_running_loop().create_task(self._enqueue(job))
        self._enqueuing.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._enqueuing.discard)

    async def _enqueue(self, job: Job) -> None:
        try:
            await self._xadd_job(job)
        except Exception as e:
            log.exception("cannot queue job %s in Redis", job.id)
            self._jobs.pop(job.id, None)
            job.finish(
                re_pb2.ExecuteResponse(
                    status=status_pb2.Status(code=code_pb2.UNAVAILABLE, message=f"the execution queue failed: {e}")
                )
            )

    async def _xadd_job(self, job: Job) -> None:
        platform = format_properties(job.requirements)
        stream = keys.jobs_stream(platform, keys.band_of(job.priority))
        frame = wire.JobFrame(job.id, job.instance, job.action, job.command, job.timeout, job.queued_at)
        with contextlib.suppress(Exception):
            await self.redis.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
        await self.redis.sadd(keys.PLATFORMS, platform or "any")
        await self.redis.xadd(stream, {"server": self.server_id, "frame": frame.encode()})

    async def cancel(self, job: Job, message: str) -> None:
        if job.done:
            return
        if job.stage == re_pb2.ExecutionStage.QUEUED:
            job.finish(cancelled_response(message))
        await self.cancel_elsewhere(job.id)

    async def cancel_elsewhere(self, job_id: str) -> None:
        """Tell the workers to stop job `job_id` (queued by this server or another)."""
        await self.redis.xadd(keys.CANCEL, {"id": job_id}, maxlen=10_000, approximate=True)

    async def _read_results(self) -> None:
        stream = keys.RESULTS + self.server_id
        last = "$"
        while True:
            try:
                answer = await self.redis.xread({stream: last}, block=2000, count=100)
                if time.monotonic() - self._workers_read > 2.0:
                    await self.refresh_workers()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading execution results from Redis")
                await asyncio.sleep(1.0)
                continue
            for _, entries in answer:
                for entry_id, fields in entries:
                    last = entry_id
                    await self._handle(fields)

    async def _handle(self, fields: dict[bytes, bytes]) -> None:
        kind = fields.get(b"type", b"").decode()
        job = self._jobs.get(fields.get(b"id", b"").decode())
        if job is None:
            return
        if job.done:  # cancelled while queued: the worker's answer only ends the bookkeeping
            if kind == "result":
                del self._jobs[job.id]
            return
        if kind == "started":
            attempt = int(fields.get(b"attempt", b"1"))
            if attempt > 1:
                self.retries += 1
                self.lost_workers += 1
            job.attempts = attempt
            job.worker = fields.get(b"worker", b"").decode()
            job.set_stage(re_pb2.ExecutionStage.EXECUTING)
            if self.on_started is not None:
                self.on_started(job)
        elif kind == "result":
            frame = wire.decode(fields[b"frame"])
            assert isinstance(frame, wire.ResultFrame)
            response = re_pb2.ExecuteResponse(result=frame.result, status=frame.status)
            if frame.server_logs and frame.status.code != 0:
                response.message = frame.server_logs
            del self._jobs[job.id]
            job.finish(await self.on_finished(job, response))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.redis.aclose()
