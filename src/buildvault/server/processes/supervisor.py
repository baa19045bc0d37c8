"""Several server processes (`--processes N`): the primary starts and supervises N-1 secondaries.

    count = process_count(settings)                 # 1: today's single process
    secondaries = Secondaries(settings, count - 1, grpc_address, store_socket, max_blob_size)
    await secondaries.start()       # every one listens before this returns (StartupError if not)
    secondaries.pids                # their process ids
    secondaries.signal(SIGHUP)      # reload reaches them
    await secondaries.stop(grace)   # SIGTERM, grace, then SIGKILL; none is left behind

The primary owns the whole store (disk index, eviction, bucket tier, journal, pins) and the HTTP
listener, /metrics and the status page; it serves the gRPC cache services itself too. Each
secondary (server/processes/secondary.py) serves the gRPC cache services on the same port (SO_REUSEPORT:
the kernel spreads new connections over the processes) and sends every store call to the
primary's store server (storage/processes/store_server.py) over a private Unix socket. A secondary that
dies (killed, crashed) is started again (after `RESTART_DELAY` if it died within a second of
starting, so a secondary that cannot start does not spin); one that stops cleanly (SIGTERM to
it or to the whole process group, as a service manager stops a service) is not. Secondaries end
with the primary, however it ends.

Execution is not served by secondaries: with SO_REUSEPORT a connection may land on any process,
so `--processes` above 1 needs execution off (`--local-workers 0`, no `--queue`); `--processes 0`
(the default) means one process per core when execution is off, else 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time

from buildvault.config import Settings
from buildvault.execution.platform import PlatformError, parse_pools
from buildvault.server.processes.secondary import READY, settings_values
from buildvault.server.services import StartupError

__all__ = ["Secondaries", "process_count"]

log = logging.getLogger("buildvault.processes")

START_TIMEOUT = 60.0  # seconds a secondary may take to listen
RESTART_DELAY = 1.0
STOP_MARGIN = 5.0  # seconds past the grace before a secondary is killed


def _execution_on(settings: Settings) -> bool:
    if settings.queue:
        return True
    try:
        return bool(parse_pools(settings.local_workers))
    except PlatformError:
        return True  # a bad pool list is execution's start-up error to report


def process_count(settings: Settings) -> int:
    """How many server processes serve the gRPC port: 1 is the single process of old."""
    wanted = settings.processes
    if wanted == 0:
        if _execution_on(settings) or not settings.grpc_address:
            return 1
        return max(1, os.cpu_count() or 1)
    if wanted > 1 and _execution_on(settings):
        raise StartupError(
            f"--processes {wanted}: secondary processes serve the cache services only; with execution on "
            "(local workers or --queue) use --processes 1, or turn execution off with --local-workers 0"
        )
    if wanted > 1 and not settings.grpc_address:
        raise StartupError(f"--processes {wanted}: the processes share the gRPC listener, which is off")
    return wanted


class Secondaries:
    def __init__(
        self, settings: Settings, count: int, address: str, store: str, max_blob_size: int, version: str = ""
    ) -> None:
        self.settings = settings
        self.count = count
        self.address = address
        self.store = store
        self.max_blob_size = max_blob_size
        self.version = version
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.returncode is None]

    async def start(self) -> None:
        try:
            started = await asyncio.gather(*(self._spawn(i) for i in range(1, self.count + 1)))
        except BaseException:
            await self.stop(0)
            raise
        for index, process in zip(range(1, self.count + 1), started, strict=True):
            self._watch(index, process)

    def _config(self, index: int) -> bytes:
        config = {
            "settings": settings_values(self.settings),
            "address": self.address,
            "store": self.store,
            "index": index,
            "max_blob_size": self.max_blob_size,
            "parent": os.getpid(),
            "version": self.version,
        }
        return json.dumps(config).encode() + b"\n"

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "buildvault.server.processes.secondary",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.processes[index] = process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(self._config(index))
            await process.stdin.drain()
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        except (TimeoutError, OSError):
            line = b""
        if line.strip() != READY.encode():
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            code = await process.wait()
            raise StartupError(f"secondary server process {index} did not start (exit status {code})")
        return process

    def _watch(self, index: int, process: asyncio.subprocess.Process) -> None:
        self._watchers[index] = asyncio.create_task(self._supervise(index, process), name=f"secondary {index}")

    async def _supervise(self, index: int, process: asyncio.subprocess.Process) -> None:
        started = time.monotonic()
        while True:
            code = await process.wait()
            if self._stopping:
                return
            if code == 0:  # it was told to stop (a SIGTERM to the process group, as a service manager sends)
                log.warning("secondary server process %d (pid %d) stopped; not restarted", index, process.pid)
                return
            log.warning(
                "secondary server process %d (pid %d) exited with %s; starting it again", index, process.pid, code
            )
            if time.monotonic() - started < 1.0:
                await asyncio.sleep(RESTART_DELAY)  # it died at once: do not spin
            while not self._stopping:
                try:
                    process = await self._spawn(index)
                    break
                except StartupError as e:
                    log.error("%s", e)
                    await asyncio.sleep(RESTART_DELAY)
            if self._stopping:
                return
            started = time.monotonic()
            self.restarts += 1
            log.info("secondary server process %d restarted as pid %d", index, process.pid)

    def signal(self, signum: int) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    async def hurry(self) -> None:
        """A second SIGTERM: the secondaries cancel what is still in flight."""
        self.signal(signal.SIGTERM)

    async def stop(self, grace: float) -> None:
        self._stopping = True
        for watcher in self._watchers.values():
            watcher.cancel()
        self._watchers.clear()
        self.signal(signal.SIGTERM)
        waits = [p.wait() for p in self.processes.values()]
        if not waits:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*waits), grace + STOP_MARGIN)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in self.processes.values()))
