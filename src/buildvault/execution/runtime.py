"""Remote execution as one piece of a server process: built from Settings, bound, closed.

    runtime = await ExecutionRuntime.create(settings, blobs, action_cache)   # None: execution off
    runtime.bind("127.0.0.1:9092")   # where the local workers reach the CAS
    await runtime.close()            # cancel what runs, stop the worker processes

`--local-workers 0` turns execution off. `--sandbox bwrap` where bubblewrap cannot run is a
start-up error (`ExecutionSetupError`), not a failure of every action later.

With TLS on the gRPC listener (`--tls-cert-file`) the local workers do not dial it: its name in
the certificate, its CA and a client certificate are the client's business. They reach the same
gRPC server through `worker_socket` instead, a Unix socket in a directory only the server's user
can enter (mkdtemp makes it 0700), under the same access control.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from buildvault.actions import ActionCache
from buildvault.config import Settings
from buildvault.execution.executor import ExecutionConfig, Executor
from buildvault.execution.local.queue import LocalQueue
from buildvault.execution.local.workers import LocalWorker, build_local_workers
from buildvault.execution.operations import OperationTable
from buildvault.execution.platform import MatchRules, PlatformError, parse_pools
from buildvault.execution.queue import Finished, JobQueue, QueueFactory
from buildvault.execution.redis.queue import RedisQueue
from buildvault.execution.stats import snapshot
from buildvault.execution.worker import sandbox
from buildvault.private_socket import private_socket, remove_private_socket
from buildvault.storage import BlobStore

log = logging.getLogger("buildvault.execution")


class ExecutionSetupError(RuntimeError):
    """Execution is configured in a way that cannot work here (bad pools, no bubblewrap)."""


def _connectable(address: str) -> str:
    """A listener address a local process can dial (a wildcard host becomes loopback)."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _queue_factory(url: str, rules: MatchRules, workers: list[LocalWorker]) -> QueueFactory:
    """The one choice between the two queues (execution/queue.py): Redis with `--queue`, else local."""

    def open_queue(operations: OperationTable, on_finished: Finished) -> JobQueue:
        if url:
            return RedisQueue(url, rules, operations, on_finished)
        return LocalQueue(list(workers), rules, operations, on_finished)

    return open_queue


class ExecutionRuntime:
    def __init__(
        self,
        settings: Settings,
        executor: Executor,
        workers: list[LocalWorker],
        sandbox_kind: str,
        worker_socket: str | None = None,
    ) -> None:
        self.settings = settings
        self.executor = executor
        self.workers = workers
        self.sandbox_kind = sandbox_kind
        # The Unix socket the gRPC listener also serves, for local workers (TLS listener only).
        self.worker_socket = worker_socket

    @classmethod
    async def create(cls, settings: Settings, blobs: BlobStore, action_cache: ActionCache) -> ExecutionRuntime | None:
        try:
            pools = [] if settings.queue else parse_pools(settings.local_workers)
        except PlatformError as e:
            raise ExecutionSetupError(str(e)) from None
        if not pools and not settings.queue:
            return None
        try:
            kind = await asyncio.to_thread(sandbox.choose, settings.sandbox)
        except sandbox.SandboxError as e:
            raise ExecutionSetupError(f"--sandbox bwrap: {e}") from None
        work_root = Path(settings.dir) / "exec"
        # Left-overs of a previous run are never inputs of this one.
        await asyncio.to_thread(shutil.rmtree, work_root, True)
        workers = build_local_workers(pools, work_root, settings.sandbox)
        rules = MatchRules.from_settings(settings)
        config = ExecutionConfig(
            rules=rules,
            default_timeout=settings.action_timeout,
            max_timeout=settings.max_action_timeout,
            grace=settings.execution_grace,
        )
        executor = Executor(config, blobs, action_cache, _queue_factory(settings.queue, rules, list(workers)))
        try:
            await executor.start()
        except Exception as e:
            raise ExecutionSetupError(f"--queue {settings.queue}: {e}") from None
        socket = None
        if workers and settings.tls_cert_file:
            socket = await private_socket("workers.sock")
        return cls(settings, executor, workers, kind, socket)

    def allowed_on(self, listener_address: str, *, access_controlled: bool = False) -> bool:
        """Whether Execute is served on a listener bound to `listener_address`: anywhere with
        `--execution open` or under access control (callers then need the `execute` permission,
        checked by server/auth), else only on loopback."""
        return self.settings.execution == "open" or access_controlled or is_loopback(listener_address)

    def bind(self, grpc_address: str, token: str | None = None) -> None:
        """Point the local workers at the bound gRPC listener; `token`: their bearer token when the
        server has access control (server/auth issues it)."""
        server = f"unix:{self.worker_socket}" if self.worker_socket else _connectable(grpc_address)
        for worker in self.workers:
            worker.server = server
            worker.token = token

    def banner(self) -> str:
        pools: dict[str, int] = {}
        for worker in self.workers:
            pools[worker.pool] = pools.get(worker.pool, 0) + 1
        listed = "; ".join(f"{n}x {label}" for label, n in pools.items())
        if self.settings.queue:
            return f"queue {self.settings.queue} (buildvault worker processes), execution {self.settings.execution}"
        return (
            f"{len(self.workers)} local workers ({listed}), sandbox {self.sandbox_kind}, "
            f"execution {self.settings.execution}"
        )

    def status(self) -> dict[str, Any]:
        """Pools, workers, queued and running jobs, and the tallies (execution.stats.snapshot)."""
        return snapshot(self.executor, self.sandbox_kind)

    async def close(self) -> None:
        await self.executor.close()
        if self.worker_socket:
            await remove_private_socket(self.worker_socket)
