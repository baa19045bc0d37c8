"""The server's own worker processes (`--local-workers`), one job at a time each.

Each `LocalWorker` is a `python -m buildvault.execution.worker.main` child fed job frames on its
stdin (execution.wire). The process starts on its first job (a server that never executes
anything pays nothing) and again after it died; a death mid-job is `WorkerLost`, so the
scheduler runs the job elsewhere. Closing the worker closes its stdin: it cancels what it runs
and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from pathlib import Path

from google.rpc import code_pb2  # type: ignore[import-untyped]

from buildvault.execution import wire
from buildvault.execution.local.scheduler import WorkerLost
from buildvault.execution.operations import Job
from buildvault.execution.platform import PoolSpec, Properties, host_properties
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.execution")

# Seconds a closing worker gets to answer its running jobs and exit before it is killed.
CLOSE_GRACE = 5.0
# Frames can carry large Commands: the reader's line limit.
LINE_LIMIT = 64 << 20


class LocalWorker:
    def __init__(self, name: str, pool: str, properties: Properties, work_dir: Path, sandbox: str) -> None:
        self.name = name
        self.pool = pool
        self.properties = properties
        self.work_dir = work_dir
        self.sandbox_mode = sandbox
        self.sandbox = ""  # what the process reported it really uses ("bwrap" or "none")
        self.server = ""  # the gRPC address of the CAS, set once the listener is bound
        self.token: str | None = None  # its bearer token under access control (client/remote.py reads it)
        self.process: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Lock = asyncio.Lock()
        self._waiting: dict[str, asyncio.Future[wire.ResultFrame]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.started = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None

    async def _ensure_process(self) -> asyncio.subprocess.Process:
        async with self._starting:
            if self._closed:
                raise WorkerLost(self.name, "it is closed (the server is shutting down)")
            if self.process is not None and self.process.returncode is None:
                return self.process
            if not self.server:
                raise WorkerLost(self.name, "the server's gRPC address is not known yet")
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "buildvault.execution.worker.main",
                "--server", self.server,
                "--name", self.name,
                "--work-dir", str(self.work_dir),
                "--sandbox", self.sandbox_mode,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=LINE_LIMIT,
                env=self._environment(),
            )
            assert process.stdout is not None
            hello = await process.stdout.readline()
            try:
                self.sandbox = str(json.loads(hello)["sandbox"])
            except (ValueError, KeyError, TypeError):
                await process.wait()
                raise WorkerLost(
                    self.name, f"the worker process did not start (exit code {process.returncode})"
                ) from None
            self.process = process
            self.started += 1
            self._reader = asyncio.create_task(self._read(process), name=f"worker {self.name} reader")
            return process

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("BUILDVAULT_TOKEN", "BUILDVAULT_TOKEN_FILE")}
        if self.token is not None:
            env["BUILDVAULT_TOKEN"] = self.token
        return env

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        try:
            while line := await process.stdout.readline():
                try:
                    frame = wire.decode(line)
                except wire.WireError as e:
                    log.error("worker %s: %s", self.name, e)
                    continue
                if isinstance(frame, wire.ResultFrame):
                    future = self._waiting.pop(frame.id, None)
                    if future is not None and not future.done():
                        future.set_result(frame)
        finally:
            code = await process.wait()
            waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                if not future.done():
                    future.set_exception(WorkerLost(self.name, f"its process exited with code {code}"))

    async def run(self, job: Job) -> re_pb2.ExecuteResponse:
        process = await self._ensure_process()
        assert process.stdin is not None
        future: asyncio.Future[wire.ResultFrame] = asyncio.get_running_loop().create_future()
        self._waiting[job.id] = future
        frame = wire.JobFrame(job.id, job.instance, job.action, job.command, job.timeout, job.queued_at)
        try:
            process.stdin.write(frame.encode())
            await process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            self._waiting.pop(job.id, None)
            raise WorkerLost(self.name, f"cannot send it the job: {e}") from None
        answer = await future
        response = re_pb2.ExecuteResponse(result=answer.result, status=answer.status)
        if answer.status.code != code_pb2.OK and answer.server_logs:
            response.message = answer.server_logs
        return response

    async def cancel(self, job: Job) -> None:
        process = self.process
        if process is None or process.stdin is None or process.returncode is not None:
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            process.stdin.write(wire.CancelFrame(job.id).encode())
            await process.stdin.drain()

    async def close(self) -> None:
        """Close the process, one still starting included (a job's first `run` may be awaiting its
        hello); no process starts after this."""
        self._closed = True
        async with self._starting:
            process = self.process
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), CLOSE_GRACE)
        except TimeoutError:
            process.kill()
            await process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def build_local_workers(pools: list[PoolSpec], work_root: Path, sandbox: str) -> list[LocalWorker]:
    """The workers of every pool, named `<host>/local-<pool>-<n>[<properties>]` so a result's
    `execution_metadata.worker` names the pool it ran in."""
    host = socket.gethostname()
    workers: list[LocalWorker] = []
    for pool_index, pool in enumerate(pools):
        properties = {**host_properties(), **pool.properties}
        for n in range(pool.count):
            name = f"{host}/local-{pool_index}-{n}[{pool.label}]"
            workers.append(
                LocalWorker(name, pool.label, properties, work_root / f"pool{pool_index}-w{n}", sandbox)
            )
    return workers
