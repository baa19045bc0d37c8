"""The gRPC front end: one grpc.aio server carrying Capabilities, CAS, ActionCache and ByteStream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from buildvault.execution.executor import PRIORITY_RANGE
from buildvault.remote_apis import ra_grpc, re_grpc
from buildvault.server.auth.grpc_auth import checked
from buildvault.server.auth.health import add_health_service
from buildvault.server.auth.tls import TlsError
from buildvault.server.grpc import bytestream, server_options
from buildvault.server.grpc.action_cache import ActionCacheService
from buildvault.server.grpc.build_events import add_build_event_service
from buildvault.server.grpc.bytestream import ByteStreamService
from buildvault.server.grpc.capabilities import CapabilitiesService
from buildvault.server.grpc.cas import CasService
from buildvault.server.grpc.execution import add_execution_services
from buildvault.server.grpc.fetch import FetchService
from buildvault.server.grpc.push import PushService
from buildvault.server.grpc.recorded import recorded
from buildvault.server.grpc.registration import WrappingServer
from buildvault.server.grpc.request_metrics import metered
from buildvault.server.services import Services, StartupError, format_address

__all__ = ["GrpcListener"]

# The generated `add_*_to_server` functions carry no annotations: typed here, once.
_Register = Callable[[Any, WrappingServer], None]
_add_capabilities: _Register = re_grpc.add_CapabilitiesServicer_to_server
_add_cas: _Register = re_grpc.add_ContentAddressableStorageServicer_to_server
_add_action_cache: _Register = re_grpc.add_ActionCacheServicer_to_server
_add_bytestream: _Register = bytestream.add_to_server  # Read's responses framed by hand
_add_fetch: _Register = ra_grpc.add_FetchServicer_to_server
_add_push: _Register = ra_grpc.add_PushServicer_to_server

# What the health service reports on (grpc.health.v1; always open, even under `require`).
_SERVICE_NAMES = (
    "build.bazel.remote.execution.v2.Capabilities",
    "build.bazel.remote.execution.v2.ContentAddressableStorage",
    "build.bazel.remote.execution.v2.ActionCache",
    "google.bytestream.ByteStream",
)


class GrpcListener:
    """The REAPI v2 cache services (Capabilities, CAS, ActionCache) and ByteStream on `address`.

    Port 0 binds any free port; `address` then reports the bound one."""

    name = "grpc"

    def __init__(self, address: str, services: Services, *, reuseport: bool = False) -> None:
        self.requested = address
        self.services = services
        self.reuseport = reuseport  # several processes share the port (server/processes/supervisor.py)
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None

    @property
    def address(self) -> str | None:
        return self._address

    async def start(self) -> None:
        s = self.services
        metrics, auth = s.metrics, s.auth
        checking = auth if auth is not None and auth.enabled else None

        history = s.history

        def wrap(method: str, handler: Any) -> Any:
            if history is not None:  # inside the check: a refused call is not recorded
                handler = recorded(history, method, handler)
            if checking is not None:
                handler = checked(checking, method, handler)
            return metered(metrics, method, handler)  # outside the check: refusals count as requests too

        grpc_server = grpc.aio.server(options=server_options(self.reuseport))
        server = WrappingServer(grpc_server, wrap)
        # Remote execution: Capabilities advertise it where it is served; Execution + Operations serve it.
        execution = s.execution
        controlled = auth is not None and auth.enabled
        served = execution is not None and execution.allowed_on(self.requested, access_controlled=controlled)
        priorities = PRIORITY_RANGE if served else None
        if execution is not None:
            add_execution_services(server, execution, self.requested, access_controlled=controlled)
        _add_capabilities(CapabilitiesService(s.max_cas_blob_size, priorities, s.chunks), server)
        _add_cas(CasService(s.blobs, chunks=s.chunks), server)
        _add_action_cache(ActionCacheService(s.action_cache), server)
        _add_bytestream(ByteStreamService(s.blobs, s.uploads), server)
        if s.assets is not None:
            _add_fetch(FetchService(s.assets, auth), server)
            _add_push(PushService(s.assets, auth), server)
        add_build_event_service(server, s.history, auth)  # Bazel's --bes_backend (the build pages)
        assets = ("build.bazel.remote.asset.v1.Fetch", "build.bazel.remote.asset.v1.Push") if s.assets else ()
        await add_health_service(server, [*_SERVICE_NAMES, *assets])
        host, _, _ = self.requested.rpartition(":")
        try:
            if auth is not None and auth.tls is not None:
                port = grpc_server.add_secure_port(self.requested, auth.tls.grpc_credentials())
            else:
                port = grpc_server.add_insecure_port(self.requested)
        except TlsError as e:
            raise StartupError(str(e)) from None
        except RuntimeError as e:
            raise StartupError(f"cannot listen on {self.requested} (gRPC): {e}") from None
        if not port:
            raise StartupError(f"cannot listen on {self.requested} (gRPC)")
        await grpc_server.start()
        self._server = grpc_server
        self._address = format_address(host, port)

    async def stop(self, grace: float) -> None:
        # May be called again with a shorter grace while a first stop is waiting.
        if self._server is not None:
            await self._server.stop(grace)
