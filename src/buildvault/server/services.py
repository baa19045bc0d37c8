"""What every front end is built from, and what it promises the App.

`Services` carries the shared stores and the semantics layered over them; a `Listener` is one
front end (gRPC, HTTP) serving them; `StartupError` is how a listener (or the App) says the
server cannot start. Both listeners import this module and nothing else of the App's, so the
App can import the listeners without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from buildvault.actions import ActionCache
from buildvault.assets.service import Assets
from buildvault.execution.runtime import ExecutionRuntime
from buildvault.history import Recorder
from buildvault.server.auth import Auth
from buildvault.server.grpc.bytestream import Uploads
from buildvault.server.metrics import Metrics
from buildvault.storage import ActionStore, BlobStore
from buildvault.storage.chunks import ChunkedBlobStore

__all__ = ["Listener", "PinsSource", "Services", "StartupError", "StatsSource", "format_address"]

# Returns a store stats object or mapping (for /status and the storage gauges), or an awaitable of one.
StatsSource = Callable[[], Any]
PinsSource = Callable[[], list[dict[str, str]]]  # pins as the status pages list them


class StartupError(RuntimeError):
    """The server could not start (address in use, data dir locked, ...)."""


class Listener(Protocol):
    """A front end serving the shared stores: bound by `start`, released by `stop`."""

    name: str

    @property
    def address(self) -> str | None:
        """The bound `host:port` once started (a requested port 0 is resolved), else None."""
        ...

    async def start(self) -> None:
        """Bind and start serving; StartupError if the address cannot be used."""
        ...

    async def stop(self, grace: float) -> None:
        """Stop accepting; in-flight requests get `grace` seconds. A second call may shorten it."""
        ...


@dataclass
class Services:
    """What every front end serves: the stores, the semantics layered over them, the metrics."""

    blobs: BlobStore
    actions: ActionStore
    action_cache: ActionCache
    uploads: Uploads
    metrics: Metrics
    version: str
    # The largest blob the store accepts (advertised by Capabilities, enforced by HTTP PUT); 0: no limit.
    max_cas_blob_size: int = 0
    storage_stats: StatsSource | None = None
    pins: PinsSource | None = None  # the pinned versions, for the status pages (server/pins.py)
    auth: Auth | None = None  # access control and TLS (server/auth); None: open, plaintext
    execution: ExecutionRuntime | None = None  # remote execution (buildvault.execution); None: off
    history: Recorder | None = None  # request metadata for the build pages (buildvault.history); None: off
    secret_patterns: tuple[str, ...] = ()  # environment names the build pages mask
    chunks: ChunkedBlobStore | None = None  # SplitBlob/SpliceBlob (storage/chunks); None: chunking off
    assets: Assets | None = None  # Remote Asset Fetch and Push (buildvault.assets); None: not served


def format_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    host = host.strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"
