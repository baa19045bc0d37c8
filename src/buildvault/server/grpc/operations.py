"""google.longrunning.Operations over the execution operations: Get, List, Cancel.

DeleteOperation is UNIMPLEMENTED (operations expire by themselves a few minutes after they end).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
from google.longrunning import operations_pb2  # type: ignore[import-untyped]
from google.protobuf import empty_pb2

from buildvault.execution.executor import Executor, ShuttingDown
from buildvault.server import errors
from buildvault.server.grpc import rpc

MAX_PAGE = 1000


class OperationsService:
    """google.longrunning.Operations."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    @rpc("GetOperation")
    async def GetOperation(
        self, request: operations_pb2.GetOperationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> operations_pb2.Operation:
        operation = await self.executor.lookup(request.name)
        if operation is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no operation named {request.name!r} (unknown or expired)")
        assert operation is not None
        return operation.message()

    @rpc("ListOperations")
    async def ListOperations(
        self, request: operations_pb2.ListOperationsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> operations_pb2.ListOperationsResponse:
        if request.filter:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ListOperations filters are not supported")
        operations = await self.executor.list_operations()
        names = sorted(operations)
        start = 0
        if request.page_token:
            start = next((i for i, name in enumerate(names) if name > request.page_token), len(names))
        size = min(request.page_size or MAX_PAGE, MAX_PAGE)
        page = names[start : start + size]
        response = operations_pb2.ListOperationsResponse()
        response.operations.extend(operations[name] for name in page)
        if start + size < len(names):
            response.next_page_token = page[-1]
        return response

    @rpc("CancelOperation")
    async def CancelOperation(
        self, request: operations_pb2.CancelOperationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> empty_pb2.Empty:
        if not await self.executor.cancel(request.name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no operation named {request.name!r} (unknown or expired)")
        return empty_pb2.Empty()

    @rpc("WaitOperation")
    async def WaitOperation(
        self, request: operations_pb2.WaitOperationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> operations_pb2.Operation:
        """The operation once done, or its state when `timeout` (default: the call's deadline) passes."""
        operation = await self.executor.lookup(request.name)
        if operation is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no operation named {request.name!r} (unknown or expired)")
        assert operation is not None
        limit = request.timeout.ToTimedelta().total_seconds() if request.HasField("timeout") else None

        async def last() -> operations_pb2.Operation:
            last_seen = operation.message()
            async with contextlib.aclosing(self.executor.follow(operation)) as messages:
                async for message in messages:
                    last_seen = message
            return last_seen

        try:
            return await asyncio.wait_for(last(), limit)
        except TimeoutError:
            return operation.message()
        except ShuttingDown as e:
            raise errors.ServiceUnavailable(str(e)) from None

    @rpc("DeleteOperation")
    async def DeleteOperation(
        self, request: operations_pb2.DeleteOperationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> empty_pb2.Empty:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "operations expire by themselves; DeleteOperation is not offered"
        )
        return empty_pb2.Empty()
