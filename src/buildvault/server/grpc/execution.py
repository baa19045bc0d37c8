"""Execution over gRPC (Execute, WaitExecution): a thin adapter over `buildvault.execution`.

Streams never end before `done` (the state is repeated every few seconds meanwhile); every
error before queueing is a gRPC status, every error while running is in the response's status.
"""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from buildvault import logs
from buildvault.digest import Digest, DigestFunction, verify_instance_name
from buildvault.execution.executor import Executor, NoMatchingWorker, ShuttingDown
from buildvault.execution.operations import Operation
from buildvault.execution.requests import InvalidRequest
from buildvault.execution.runtime import ExecutionRuntime
from buildvault.remote_apis import re_pb2
from buildvault.server import errors
from buildvault.server.grpc import rpc
from buildvault.server.grpc.registration import WrappingServer

LOOPBACK_ONLY = (
    "execution runs arbitrary commands, so it is served only on loopback listeners; "
    "start the server with --execution open to serve it here"
)


class ExecutionService:
    """build.bazel.remote.execution.v2.Execution."""

    def __init__(self, executor: Executor, *, allowed: bool) -> None:
        self.executor = executor
        self.allowed = allowed  # False: a non-loopback listener without --execution open

    async def _check_permission(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # The one place Execute is authorised. Access control's `execute` permission belongs here.
        if not self.allowed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, LOOPBACK_ONLY)

    @rpc("Execute")
    async def Execute(self, request: re_pb2.ExecuteRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await self._check_permission(context)
        instance = verify_instance_name(request.instance_name)
        digest = Digest.from_proto(request.action_digest, DigestFunction.from_wire(request.digest_function))
        logs.note(instance=instance, action=str(digest))
        try:
            operation = await self.executor.execute(
                instance,
                digest,
                skip_cache_lookup=request.skip_cache_lookup,
                priority=request.execution_policy.priority,
            )
        except InvalidRequest as e:
            raise errors.InvalidArgument(str(e)) from None
        except NoMatchingWorker as e:
            raise errors.FailedPrecondition(str(e)) from None
        except ShuttingDown as e:
            raise errors.ServiceUnavailable(str(e)) from None
        await self._stream(operation, context, from_start=True)

    @rpc("WaitExecution")
    async def WaitExecution(
        self, request: re_pb2.WaitExecutionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await self._check_permission(context)
        operation = await self.executor.lookup(request.name)
        if operation is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no operation named {request.name!r} (unknown or expired)")
        assert operation is not None
        await self._stream(operation, context)

    async def _stream(
        self, operation: Operation, context: grpc.aio.ServicerContext[Any, Any], from_start: bool = False
    ) -> None:
        try:
            # Closed here, not when collected: the stream's tasks end with the call.
            async with contextlib.aclosing(self.executor.follow(operation, from_start)) as messages:
                async for message in messages:
                    await context.write(message)
        except ShuttingDown as e:
            raise errors.ServiceUnavailable(str(e)) from None


def add_execution_services(
    server: WrappingServer, runtime: ExecutionRuntime, listener_address: str, *, access_controlled: bool = False
) -> None:
    """Register Execution and Operations for `runtime` on a listener bound to `listener_address`."""
    from google.longrunning import operations_pb2_grpc  # type: ignore[import-untyped]

    from buildvault.remote_apis import re_grpc
    from buildvault.server.grpc.operations import OperationsService
    from buildvault.server.services import StartupError

    # The local workers' way in when the listener speaks TLS only (see ExecutionRuntime).
    if runtime.worker_socket and not server.add_insecure_port(f"unix:{runtime.worker_socket}"):
        raise StartupError(f"cannot listen on the local workers' socket {runtime.worker_socket}")
    allowed = runtime.allowed_on(listener_address, access_controlled=access_controlled)
    service = ExecutionService(runtime.executor, allowed=allowed)
    re_grpc.add_ExecutionServicer_to_server(service, server)
    operations_pb2_grpc.add_OperationsServicer_to_server(OperationsService(runtime.executor), server)
