"""Process assembly: the store stack (built whole by storage/build.py), the listeners in front
of it, start and stop.

    app = App(settings)
    await app.start()          # open stores, bind listeners (port 0 allowed), log the banner
    app.grpc_address           # "127.0.0.1:43121": the bound address
    await app.stop(grace=10)   # stop accepting, let in-flight RPCs finish, close stores

Each front end is a `Listener` (start / stop / address, server/services.py) built from the
shared `Services`: `GrpcListener` (server/grpc/listener.py) and `HttpListener`
(server/http/listener.py), assembled in `App._build_listeners`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

from buildvault import logs
from buildvault.actions import ActionCache, entry_is_intact
from buildvault.assets import build_assets
from buildvault.config import Settings, parse_list
from buildvault.execution.runtime import ExecutionRuntime, ExecutionSetupError
from buildvault.history import Recorder, recorder_from_settings
from buildvault.private_socket import private_socket, remove_private_socket
from buildvault.server.auth import Auth, AuthStartupError
from buildvault.server.grpc import MAX_MESSAGE_SIZE
from buildvault.server.grpc.bytestream import DEFAULT_UPLOAD_GRACE, Uploads
from buildvault.server.grpc.listener import GrpcListener
from buildvault.server.heap_trim import HeapTrimmer
from buildvault.server.http import HttpListener
from buildvault.server.metrics import Metrics
from buildvault.server.pins import PinRegistry
from buildvault.server.processes.relay import RelayReceiver
from buildvault.server.processes.supervisor import Secondaries, process_count
from buildvault.server.services import Listener, Services, StartupError
from buildvault.storage import ActionStore, BlobStore
from buildvault.storage.build import StackError, StoreStack, open_store_stack
from buildvault.storage.processes.store_server import StoreServer

__all__ = ["VERSION", "App", "Listener", "Services", "StartupError"]

log = logging.getLogger("buildvault.app")

try:
    from importlib.metadata import version as _dist_version

    VERSION = _dist_version("buildvault")
except Exception:  # running from a bare checkout
    VERSION = "dev"


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
        self.stack: StoreStack | None = None
        self.started_at: float | None = None
        # Owned by this App (not the global registry): two servers in one process count apart.
        self.metrics = Metrics(version=VERSION)
        self.auth: Auth | None = None
        self.execution: ExecutionRuntime | None = None
        # Several processes (server/processes/supervisor.py): the store served to the secondaries, and them.
        self.processes = 1
        self.store_server: StoreServer | None = None
        self.secondaries: Secondaries | None = None
        self.heap_trimmer = HeapTrimmer()

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
            try:  # a bad certificate, key or auth file stops the start, naming the setting
                self.auth = Auth.from_settings(self.settings, self.metrics)
            except AuthStartupError as e:
                raise StartupError(str(e)) from None
            self.processes = process_count(self.settings)
            self.stack = stack = await self._open_stores()
            blobs, actions = stack.blobs, stack.actions
            self.services = Services(
                blobs=blobs,
                actions=actions,
                action_cache=ActionCache(blobs, actions, message_limit=MAX_MESSAGE_SIZE, recorder=self.metrics),
                uploads=Uploads(blobs, grace=self.upload_grace),
                metrics=self.metrics,
                version=VERSION,
                max_cas_blob_size=stack.max_blob_size,
                storage_stats=stack.local_stats,
                pins=stack.pins.listing if stack.pins is not None else None,
                auth=self.auth,
                history=await self._open_history(),
                secret_patterns=parse_list(self.settings.history_secret_patterns),
                chunks=stack.chunks,
                assets=build_assets(self.settings, blobs, actions, self.metrics),
            )
            # Remote execution: the scheduler and local workers, before the listeners that serve them.
            try:
                self.execution = await ExecutionRuntime.create(self.settings, blobs, self.services.action_cache)
            except ExecutionSetupError as e:
                raise StartupError(str(e)) from None
            if self.execution is not None:
                self.services.execution = self.execution
                self.metrics.watch_execution(self.execution.status)
            self.listeners = self._build_listeners(self.services)
            for listener in self.listeners:
                await listener.start()
            if self.execution is not None and self.grpc_address:
                controlled = self.auth is not None and self.auth.enabled
                token = self.auth.issue_internal_token() if self.auth is not None and controlled else None
                self.execution.bind(self.grpc_address, token)
            if self.processes > 1:
                await self._start_secondaries(self.services)
        except BaseException:
            await self.stop(grace=0)
            raise
        self.heap_trimmer.start()
        self.started_at = time.time()
        self._banner()

    async def _start_secondaries(self, services: Services) -> None:
        """Serve the store on a private socket, then start the secondaries on the bound gRPC port."""
        assert self.grpc_address is not None
        path = await private_socket("store.sock")
        self.store_server = StoreServer(services.blobs, services.actions, RelayReceiver(self.metrics), path)
        await self.store_server.start()
        self.secondaries = Secondaries(
            self.settings, self.processes - 1, self.grpc_address, path, services.max_cas_blob_size, VERSION
        )
        await self.secondaries.start()

    async def _open_history(self) -> Recorder | None:
        """The history behind the build pages; a database that cannot be opened leaves it off (logged)."""
        recorder = recorder_from_settings(self.settings)
        if recorder is None:
            return None
        await recorder.start()
        self._closers.append(recorder.close)
        return recorder

    def _build_listeners(self, services: Services) -> list[Listener]:
        listeners: list[Listener] = []
        if self.settings.grpc_address:
            listeners.append(GrpcListener(self.settings.grpc_address, services, reuseport=self.processes > 1))
        if self.settings.http_address:
            listeners.append(HttpListener.from_services(self.settings.http_address, services))
        return listeners

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, give in-flight requests `grace` seconds, abort unfinished uploads, close stores."""
        await self.heap_trimmer.stop()
        if self.execution is not None:  # remote execution (issue 12): end jobs and streams first
            execution, self.execution = self.execution, None
            await execution.close()
        stopping = [listener.stop(grace) for listener in self.listeners]
        if self.secondaries is not None:  # their in-flight calls still reach the store server
            stopping.append(self.secondaries.stop(grace))
        await asyncio.gather(*stopping, return_exceptions=True)
        self.secondaries = None
        if self.store_server is not None:
            store_server, self.store_server = self.store_server, None
            await store_server.stop()
            await remove_private_socket(store_server.path)
        if self.services is not None:
            await self.services.uploads.close()
            if self.services.assets is not None:
                await self.services.assets.close()
        if self.auth is not None:  # the audit log's last lines, after the last request
            await self.auth.close()
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                await close()
            except Exception:  # keep closing the rest
                log.exception("error while closing a store")

    async def reload(self) -> bool:
        """SIGHUP: reread certificates and the auth files; False (logged) keeps the old settings."""
        if self.secondaries is not None:  # they reread the same files themselves
            self.secondaries.signal(signal.SIGHUP)
        return await self.auth.reload() if self.auth is not None else True

    async def hurry(self) -> None:
        """Cut a running `stop`'s grace period short: cancel in-flight requests now."""
        if self.secondaries is not None:
            await self.secondaries.hurry()
        await asyncio.gather(*(listener.stop(0) for listener in self.listeners), return_exceptions=True)

    async def serve(self, stop: asyncio.Event, grace: float = 10.0) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop(grace)

    # -- stores ---------------------------------------------------------------------------

    async def _open_stores(self) -> StoreStack:
        blobs, actions = self._given
        try:
            stack = await open_store_stack(
                self.settings,
                self.metrics,
                blobs=blobs,
                actions=actions,
                validate_entry=entry_is_intact,
                pins=PinRegistry,  # golden versions: the local tier's eviction skips what they reach
            )
        except StackError as e:
            raise StartupError(str(e)) from None
        self._closers.append(stack.aclose)
        self.metrics.watch_object_tier(stack.object_tier_stats)
        self.metrics.watch_chunking(stack.chunks.stats if stack.chunks is not None else None)
        return stack

    def _banner(self) -> None:
        addresses = " ".join(f"{name}={self.address(name) or 'off'}" for name in ("grpc", "http"))
        lines = [f"{logs.READY_PREFIX} {addresses}", f"  buildvault {VERSION}"]
        for listener in self.listeners:
            lines.append(f"  {listener.name:<6} {listener.address}")
        lines.append(f"  store  {self.stack.label if self.stack is not None else 'none'}")
        if self.secondaries is not None:
            pids = " ".join(str(pid) for pid in self.secondaries.pids)
            lines.append(f"  procs  {self.processes} sharing the gRPC port (secondaries: pids {pids})")
        if self.execution is not None:
            lines.append(f"  exec   {self.execution.banner()}")
        lines.append(f"  log    {self.settings.log_level}")
        logs.banner(lines)
