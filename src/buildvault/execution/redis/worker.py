"""`buildvault worker`: runs jobs from the Redis queue, on any machine that reaches the server.

    buildvault worker --server grpc://HOST:9092 --queue redis://HOST:6379/0 \\
        --platform soc=ascend910b1,cann=8.0.RC3 --concurrency 2

Inputs and outputs go only through the server's gRPC CAS (no bucket credentials, no shared
disk). The worker reads the job streams whose requirement set its properties satisfy (consumer
group `workers`), the most urgent priority band first, and skips jobs cancelled while queued. It
keeps its running jobs' leases fresh (XCLAIM every few seconds) and takes back jobs another
worker left pending longer than the lease (XAUTOCLAIM); a job delivered more than
MAX_DELIVERIES times ends UNAVAILABLE naming the worker that last had it.

Nothing it started outlives it: on SIGTERM or SIGINT it kills its running actions' process
groups and leaves their jobs pending, so another worker takes them back after the lease; a job
whose server is gone (its heartbeat expired: nobody can read the result any more) is stopped and
dropped, and a queued one is not started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.execution import wire
from buildvault.execution.platform import MatchRules, Properties, host_properties, parse_properties
from buildvault.execution.redis import keys
from buildvault.execution.worker import process, sandbox
from buildvault.execution.worker.main import CasClients
from buildvault.execution.worker.runner import Runner
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.worker")

# XREADGROUP band by band (KEYS: the streams, ARGV: group, consumer, count, then how many streams
# each band has), returning the first band's entries: one round trip instead of one per band.
_TAKE = """
local at = 1
for i = 4, #ARGV do
  local n = tonumber(ARGV[i])
  local streams = {}
  for j = at, at + n - 1 do streams[#streams + 1] = KEYS[j] end
  for j = 1, n do streams[#streams + 1] = '>' end
  local answer = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', unpack(streams))
  if answer then
    for _, stream in ipairs(answer) do
      if #stream[2] > 0 then return answer end
    end
  end
  at = at + n
end
return false
"""


@dataclass
class RunningJob:
    stream: str
    entry_id: str
    server: str  # the id of the server that queued it, whose results stream gets the answer
    cancel: process.Cancel


class RedisWorker:
    def __init__(
        self,
        *,
        server: str,
        queue: str,
        properties: Properties,
        rules: MatchRules,
        concurrency: int,
        work_dir: Path,
        sandbox_kind: str,
        name: str,
        lease: float = 30.0,
    ) -> None:
        import redis.asyncio as redis

        self.redis: Any = redis.from_url(queue)  # redis-py's stubs type replies as unions
        self.cas = CasClients(server)
        self.properties = properties
        self.rules = rules
        self.concurrency = concurrency
        self.work_dir = work_dir
        self.sandbox_kind = sandbox_kind
        self.name = name
        self.lease = lease
        self.running: dict[str, RunningJob] = {}  # by job id
        self._stopping = False  # serve() is ending: running jobs are killed and left for other workers
        self._orphaned: set[str] = set()  # running jobs whose server is gone: killed, acknowledged, no result
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()
        self._grouped: set[str] = set()  # streams whose consumer group exists
        self._take_script = self.redis.register_script(_TAKE)

    async def _bands(self) -> list[list[str]]:
        """The job streams this worker serves, by priority band, most urgent first."""
        platforms = [p.decode() for p in await self.redis.smembers(keys.PLATFORMS)]
        mine = []
        for platform in sorted(platforms):
            name = "" if platform == "any" else platform
            if self.rules.satisfies(self.properties, parse_properties(name)):
                mine.append(name)
        return [[keys.jobs_stream(name, band) for name in mine] for band in range(keys.BANDS)] if mine else []

    async def _streams(self) -> list[str]:
        return [stream for band in await self._bands() for stream in band]

    async def _take(self, bands: list[list[str]], free: int) -> list[tuple[Any, list[Any]]]:
        """Up to `free` jobs, from the most urgent band that has any; else wait for the first."""
        streams = [s for band in bands for s in band]
        answer = await self._take_script(keys=streams, args=[keys.GROUP, self.name, free, *(len(b) for b in bands)])
        if answer:
            # A script's reply is raw: entries' fields come as flat [name, value, ...] lists.
            return [
                (stream, [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in entries])
                for stream, entries in answer
            ]
        # Every band was empty: whichever job comes first is the most urgent one there is.
        everything = {s: ">" for band in bands for s in band}
        return list(await self.redis.xreadgroup(keys.GROUP, self.name, everything, count=1, block=1000) or [])

    async def _register(self) -> None:
        info = {"properties": self.properties, "seen": time.time(), "running": len(self.running)}
        await self.redis.hset(keys.WORKERS, self.name, json.dumps(info))

    async def serve(self) -> None:
        from redis import exceptions as redis_errors

        await self.redis.ping()
        await self._register()
        housekeeping = asyncio.create_task(self._housekeeping())
        cancels = asyncio.create_task(self._follow_cancels())
        try:
            while True:
                free = self.concurrency - len(self.running)
                if free <= 0:
                    # Woken by the next job's end; the timeout only bounds a missed wake-up.
                    self._slot_free.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._slot_free.wait(), 5.0)
                    continue
                bands = await self._bands()
                if not bands:
                    await asyncio.sleep(0.5)  # no job stream exists yet anywhere: nothing to block on
                    continue
                for stream in (s for band in bands for s in band):
                    if stream not in self._grouped:
                        with contextlib.suppress(Exception):
                            await self.redis.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
                        self._grouped.add(stream)
                try:
                    taken = await self._take(bands, free)
                except redis_errors.ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    self._grouped.clear()  # Redis lost its data (restarted): create the groups again
                    continue
                for stream, entries in taken:
                    for entry_id, fields in entries:
                        self._start(stream.decode(), entry_id.decode(), fields, attempt=1)
        finally:
            self._stopping = True
            housekeeping.cancel()
            cancels.cancel()
            for job in self.running.values():
                job.cancel.set()
            await asyncio.gather(*self._tasks, housekeeping, cancels, return_exceptions=True)
            await self.redis.hdel(keys.WORKERS, self.name)
            await self.redis.aclose()
            self.cas.close()

    def _start(self, stream: str, entry_id: str, fields: dict[bytes, bytes], attempt: int) -> None:
        frame = wire.decode(fields[b"frame"])
        assert isinstance(frame, wire.JobFrame)
        server = fields[b"server"].decode()
        cancel = process.Cancel()
        self.running[frame.id] = RunningJob(stream, entry_id, server, cancel)
        task = asyncio.create_task(self._run(stream, entry_id, server, frame, cancel, attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, stream: str, entry_id: str, server: str, job: wire.JobFrame, cancel: process.Cancel, attempt: int
    ) -> None:
        results = keys.RESULTS + server
        try:
            if await self.redis.hget(keys.JOB + job.id, "cancelled") == b"1":
                log.info("skipping job %s: it was cancelled while queued", job.id)
                status = status_pb2.Status(code=code_pb2.CANCELLED, message="the job was cancelled while queued")
                skipped = wire.ResultFrame(job.id, re_pb2.ActionResult(), status)
                await self.redis.xadd(results, {"type": "result", "id": job.id, "frame": skipped.encode()})
                await self.redis.xack(stream, keys.GROUP, entry_id)
                return
            if not await self._server_alive(server):
                log.info("skipping job %s: the server that queued it is gone", job.id)
                await self.redis.xack(stream, keys.GROUP, entry_id)
                return
            await self.redis.hset(keys.OWNERS, entry_id, self.name)
            await self.redis.xadd(
                results, {"type": "started", "id": job.id, "worker": self.name, "attempt": str(attempt)}
            )
            runner = Runner(self.cas.get(job.instance), self.work_dir, sandbox_kind=self.sandbox_kind, name=self.name)
            result, status, logs = await asyncio.to_thread(runner.run, job, cancel)
            if self._stopping:
                return  # killed by this worker's stop: the job stays pending, another worker takes it back
            if job.id in self._orphaned:
                await self.redis.xack(stream, keys.GROUP, entry_id)
                await self.redis.hdel(keys.OWNERS, entry_id)
                return
            frame = wire.ResultFrame(job.id, result, status, logs)
            await self.redis.xadd(results, {"type": "result", "id": job.id, "frame": frame.encode()})
            await self.redis.xack(stream, keys.GROUP, entry_id)
            await self.redis.hdel(keys.OWNERS, entry_id)
        finally:
            self.running.pop(job.id, None)
            self._orphaned.discard(job.id)
            self._slot_free.set()

    async def _server_alive(self, server: str) -> bool:
        return bool(await self.redis.exists(keys.SERVER + server))

    async def _stop_orphans(self) -> None:
        """Kill running jobs whose server stopped: their operations are gone, so is their reader."""
        for job_id, job in list(self.running.items()):
            if job_id not in self._orphaned and not await self._server_alive(job.server):
                log.warning("stopping job %s: the server that queued it is gone", job_id)
                self._orphaned.add(job_id)
                job.cancel.set()

    async def _housekeeping(self) -> None:
        """Heartbeat, keep own leases fresh, take back jobs of lost workers."""
        while True:
            await asyncio.sleep(min(2.0, self.lease / 3))
            try:
                await self._register()
                for job in list(self.running.values()):
                    await self.redis.xclaim(job.stream, keys.GROUP, self.name, 0, [job.entry_id], justid=True)
                await self._stop_orphans()
                free = self.concurrency - len(self.running)
                if free > 0:
                    await self._reclaim(free)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker housekeeping")

    async def _reclaim(self, free: int) -> None:
        for stream in await self._streams():
            _, claimed, _ = await self.redis.xautoclaim(
                stream, keys.GROUP, self.name, int(self.lease * 1000), "0-0", count=free
            )
            for entry_id, fields in claimed:
                if not fields:
                    continue
                entry = entry_id.decode()
                pending = await self.redis.xpending_range(stream, keys.GROUP, entry, entry, 1)
                deliveries = int(pending[0]["times_delivered"]) if pending else 1
                previous = (await self.redis.hget(keys.OWNERS, entry) or b"an unknown worker").decode()
                log.warning("took back job %s from a lost worker (delivery %d)", entry, deliveries)
                if deliveries > keys.MAX_DELIVERIES:
                    await self._give_up(stream, entry, fields, deliveries, previous)
                else:
                    self._start(stream, entry, fields, attempt=deliveries)
                free -= 1
                if free <= 0:
                    return

    async def _give_up(self, stream: str, entry: str, fields: dict[bytes, bytes], deliveries: int, who: str) -> None:
        frame = wire.decode(fields[b"frame"])
        assert isinstance(frame, wire.JobFrame)
        status = status_pb2.Status(
            code=code_pb2.UNAVAILABLE, message=f"the job's worker was lost {deliveries - 1} times (last: {who})"
        )
        result = wire.ResultFrame(frame.id, re_pb2.ActionResult(), status)
        await self.redis.xadd(keys.RESULTS + fields[b"server"].decode(), {"type": "result", "id": frame.id,
                                                                         "frame": result.encode()})  # fmt: skip
        await self.redis.xack(stream, keys.GROUP, entry)
        await self.redis.hdel(keys.OWNERS, entry)

    async def _follow_cancels(self) -> None:
        last = "$"
        while True:
            answer = await self.redis.xread({keys.CANCEL: last}, block=2000, count=100)
            for _, entries in answer or []:
                for entry_id, fields in entries:
                    last = entry_id
                    running = self.running.get(fields.get(b"id", b"").decode())
                    if running is not None:
                        running.cancel.set()


def run_worker(args: Any) -> int:
    """The `buildvault worker` command (args from cli.py)."""
    from buildvault.client.remote import parse_remote
    from buildvault.config import Settings

    logging.basicConfig(level=logging.INFO, format="worker: %(message)s")
    try:
        kind = sandbox.choose(args.sandbox)
    except sandbox.SandboxError as e:
        log.error("--sandbox bwrap: %s", e)
        return 2
    properties = {**host_properties(), **parse_properties(args.platform)}
    name = args.name or f"{socket.gethostname()}/worker[{','.join(f'{k}={v}' for k, v in sorted(properties.items()))}]"
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    worker = RedisWorker(
        server=parse_remote(args.server),
        queue=args.queue,
        properties=properties,
        rules=MatchRules.from_settings(Settings(dir=work_dir)),
        concurrency=args.concurrency,
        work_dir=work_dir,
        sandbox_kind=kind,
        name=name,
        lease=args.lease,
    )
    print(f"buildvault worker ready: {name} sandbox={kind}", flush=True)
    asyncio.run(_serve_until_signalled(worker))
    return 0


async def _serve_until_signalled(worker: RedisWorker) -> None:
    serving = asyncio.ensure_future(worker.serve())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, serving.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await serving
