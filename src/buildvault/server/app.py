"""Process assembly: stores from Settings, the listeners in front of them, start and stop.

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
import time
from typing import Any

from buildvault import logs
from buildvault.actions import ActionCache, entry_is_intact
from buildvault.config import Settings
from buildvault.server.grpc import MAX_MESSAGE_SIZE
from buildvault.server.grpc.bytestream import DEFAULT_UPLOAD_GRACE, Uploads
from buildvault.server.grpc.listener import GrpcListener
from buildvault.server.http import HttpListener
from buildvault.server.metrics import Metrics
from buildvault.server.services import Listener, Services, StartupError
from buildvault.storage import ActionStore, BlobStore, StorageError

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
        self._store_label = ""
        self.started_at: float | None = None
        # Owned by this App (not the global registry): two servers in one process count apart.
        self.metrics = Metrics(version=VERSION)
        self._storage_stats: Any = None

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
                metrics=self.metrics,
                version=VERSION,
                max_cas_blob_size=self._max_blob_size(),
                storage_stats=self._storage_stats or getattr(self._given[0], "stats", None),
            )
            self.listeners = self._build_listeners(self.services)
            for listener in self.listeners:
                await listener.start()
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
            listeners.append(HttpListener.from_services(self.settings.http_address, services))
        return listeners

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, give in-flight requests `grace` seconds, abort unfinished uploads, close stores."""
        await asyncio.gather(*(listener.stop(grace) for listener in self.listeners), return_exceptions=True)
        if self.services is not None:
            await self.services.uploads.close()
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                await close()
            except Exception:  # keep closing the rest
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
            storage = await DiskStorage.open(directory, self.settings.max_size, validate_entry=entry_is_intact)
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
        lines.append(f"  log    {self.settings.log_level}")
        logs.banner(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
