"""Process assembly: stores from Settings, the listeners in front of them, start and stop.

    app = App(settings)
    await app.start()          # open stores, bind listeners (port 0 allowed), log the banner
    app.grpc_address           # "127.0.0.1:43121": the bound address
    await app.stop(grace=10)   # stop accepting, let in-flight RPCs finish, close stores

Each front end is a `Listener` (start / stop / address) built from the shared `Services`;
the HTTP front end is added to `App._build_listeners` next to the gRPC one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from buildvault import logs
from buildvault.actions import ActionCache
from buildvault.config import Settings
from buildvault.execution.executor import PRIORITY_RANGE  # remote execution (issue 12)
from buildvault.execution.runtime import ExecutionRuntime, ExecutionSetupError  # remote execution (issue 12)
from buildvault.remote_apis import bs_grpc, re_grpc
from buildvault.server.grpc import MAX_MESSAGE_SIZE, server_options
from buildvault.server.grpc.action_cache import ActionCacheService
from buildvault.server.grpc.bytestream import DEFAULT_UPLOAD_GRACE, ByteStreamService, Uploads
from buildvault.server.grpc.capabilities import CapabilitiesService
from buildvault.server.grpc.cas import CasService
from buildvault.server.grpc.execution import add_execution_services  # remote execution (issue 12)
from buildvault.server.http import HttpListener
from buildvault.server.metrics import Metrics
from buildvault.storage import ActionStore, BlobStore, StorageError

log = logging.getLogger("buildvault.app")

try:
    from importlib.metadata import version as _dist_version

    VERSION = _dist_version("buildvault")
except Exception:
    VERSION = "dev"


class StartupError(RuntimeError):
    """The server could not start (address in use, data dir locked, ...)."""


class Listener(Protocol):
    """A front end serving the shared stores."""

    name: str

    @property
    def address(self) -> str | None: ...

    async def start(self) -> None: ...

    async def stop(self, grace: float) -> None: ...


@dataclass
class Services:
    """What every front end serves: the stores and the semantics layered over them."""

    blobs: BlobStore
    actions: ActionStore
    action_cache: ActionCache
    uploads: Uploads
    max_cas_blob_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class GrpcListener:
    """The REAPI v2 cache services (Capabilities, CAS, ActionCache) and ByteStream."""

    name = "grpc"

    def __init__(self, address: str, services: Services) -> None:
        self.requested = address
        self.services = services
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None

    @property
    def address(self) -> str | None:
        return self._address

    async def start(self) -> None:
        s = self.services
        metrics = s.extra.get("metrics")
        interceptors = [metrics.grpc_interceptor()] if metrics is not None else []
        server = grpc.aio.server(options=server_options(), interceptors=interceptors)
        # --- remote execution (issue 12): Capabilities advertise it, Execution + Operations serve it.
        execution = s.extra.get("execution")
        priorities = PRIORITY_RANGE if execution is not None and execution.allowed_on(self.requested) else None
        if execution is not None:
            add_execution_services(server, execution, self.requested)
        # --- end remote execution
        re_grpc.add_CapabilitiesServicer_to_server(CapabilitiesService(s.max_cas_blob_size, priorities), server)
        re_grpc.add_ContentAddressableStorageServicer_to_server(CasService(s.blobs), server)
        re_grpc.add_ActionCacheServicer_to_server(ActionCacheService(s.action_cache), server)
        bs_grpc.add_ByteStreamServicer_to_server(ByteStreamService(s.blobs, s.uploads), server)
        host, _, _ = self.requested.rpartition(":")
        try:
            port = server.add_insecure_port(self.requested)
        except RuntimeError as e:
            raise StartupError(f"cannot listen on {self.requested} (gRPC): {e}") from None
        if not port:
            raise StartupError(f"cannot listen on {self.requested} (gRPC)")
        await server.start()
        self._server = server
        self._address = _format_address(host.strip("[]"), port)

    async def stop(self, grace: float) -> None:
        # May be called again with a shorter grace while a first stop is waiting.
        if self._server is not None:
            await self._server.stop(grace)


class App:
    """The whole server process: stores, services, listeners."""

    def __init__(
        self,
        settings: Settings,
        *,
        blobs: BlobStore | None = None,
        actions: ActionStore | None = None,
        upload_grace: float = DEFAULT_UPLOAD_GRACE,
    ) -> None:
        self.settings = settings
        self._given = (blobs, actions)
        self.upload_grace = upload_grace
        self.services: Services | None = None
        self.listeners: list[Listener] = []
        self._closers: list[Any] = []
        self._store_label = ""
        self.started_at: float | None = None
        # Owned by this App (not the global registry): two servers in one process count apart.
        self.metrics = Metrics(version=VERSION)
        self._storage_stats: Any = None
        self.execution: ExecutionRuntime | None = None  # remote execution (issue 12)

    # -- addresses ------------------------------------------------------------------------

    def address(self, name: str) -> str | None:
        for listener in self.listeners:
            if listener.name == name:
                return listener.address
        return None

    @property
    def grpc_address(self) -> str | None:
        return self.address("grpc")

    @property
    def http_address(self) -> str | None:
        return self.address("http")

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            blobs, actions = await self._open_stores()
            self.services = Services(
                blobs=blobs,
                actions=actions,
                action_cache=ActionCache(blobs, actions, message_limit=MAX_MESSAGE_SIZE),
                uploads=Uploads(blobs, grace=self.upload_grace),
                max_cas_blob_size=self._max_blob_size(),
                extra={"metrics": self.metrics},
            )
            # --- remote execution (issue 12): scheduler + local workers, before the listeners
            try:
                self.execution = await ExecutionRuntime.create(
                    self.settings, blobs, self.services.action_cache
                )
            except ExecutionSetupError as e:
                raise StartupError(str(e)) from None
            if self.execution is not None:
                self.services.extra["execution"] = self.execution
                self.metrics.watch_execution(self.execution.status)
            # --- end remote execution
            self.listeners = self._build_listeners(self.services)
            for listener in self.listeners:
                await listener.start()
            if self.execution is not None and self.grpc_address:  # remote execution (issue 12)
                self.execution.bind(self.grpc_address)
        except BaseException:
            await self.stop(grace=0)
            raise
        self.started_at = time.time()
        self._banner()

    def _build_listeners(self, services: Services) -> list[Listener]:
        listeners: list[Listener] = []
        if self.settings.grpc_address:
            listeners.append(GrpcListener(self.settings.grpc_address, services))
        if self.settings.http_address:
            stats = self._storage_stats or getattr(self._given[0], "stats", None)
            listeners.append(
                HttpListener.from_services(self.settings.http_address, services, self.metrics, VERSION, stats=stats)
            )
        return listeners

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, give in-flight requests `grace` seconds, abort unfinished uploads, close stores."""
        if self.execution is not None:  # remote execution (issue 12): end jobs and streams first
            execution, self.execution = self.execution, None
            await execution.close()
        await asyncio.gather(*(listener.stop(grace) for listener in self.listeners), return_exceptions=True)
        if self.services is not None:
            await self.services.uploads.close()
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                await close()
            except Exception:
                log.exception("error while closing a store")

    async def hurry(self) -> None:
        """Cut a running `stop`'s grace period short: cancel in-flight requests now."""
        await asyncio.gather(*(listener.stop(0) for listener in self.listeners), return_exceptions=True)

    async def serve(self, stop: asyncio.Event, grace: float = 10.0) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop(grace)

    # -- stores ---------------------------------------------------------------------------

    def _max_blob_size(self) -> int:
        return self.settings.max_size if self._store_label.startswith("disk") else 0

    async def _open_stores(self) -> tuple[BlobStore, ActionStore]:
        blobs, actions = self._given
        if blobs is not None and actions is not None:
            self._store_label = f"given ({type(blobs).__name__})"
            return blobs, actions
        from buildvault.storage.disk import DiskStorage

        directory = self.settings.dir
        try:
            storage = await DiskStorage.open(directory, self.settings.max_size)
            self._storage_stats = storage.stats
        except (OSError, StorageError) as e:
            raise StartupError(f"cannot open the data directory {directory}: {e}") from None
        self._closers.append(storage.close)
        self._store_label = f"disk {directory} (max {_size(self.settings.max_size)})"
        blobs, actions = storage.cas, storage.ac
        if self.settings.s3_bucket:
            from buildvault.storage.tiered import build_object_tier

            tier = build_object_tier(self.settings, blobs, actions)
            if tier is not None:
                await tier.start()
                self._closers.append(tier.aclose)
                self.metrics.watch_object_tier(tier.stats)
                blobs, actions = tier.cas, tier.ac
                where = self.settings.s3_endpoint or "AWS"
                self._store_label += f" + bucket {self.settings.s3_bucket} at {where}"
        return blobs, actions

    def _banner(self) -> None:
        addresses = " ".join(f"{name}={self.address(name) or 'off'}" for name in ("grpc", "http"))
        lines = [f"{logs.READY_PREFIX} {addresses}", f"  buildvault {VERSION}"]
        for listener in self.listeners:
            lines.append(f"  {listener.name:<6} {listener.address}")
        lines.append(f"  store  {self._store_label}")
        if self.execution is not None:  # remote execution (issue 12)
            lines.append(f"  exec   {self.execution.banner()}")
        lines.append(f"  log    {self.settings.log_level}")
        logs.banner(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
