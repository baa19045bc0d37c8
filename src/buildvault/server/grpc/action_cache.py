"""ActionCache over gRPC: a thin adapter over `buildvault.actions.ActionCache`."""

from __future__ import annotations

from buildvault import logs
from buildvault.actions import ActionCache
from buildvault.digest import Digest, DigestFunction
from buildvault.remote_apis import re_pb2
from buildvault.server.grpc import Context, rpc


def _action(request: re_pb2.GetActionResultRequest | re_pb2.UpdateActionResultRequest) -> tuple[str, Digest]:
    """The request's instance name and action digest (noted in the request log); the digest is
    checked here, the instance name by the ActionCache, once."""
    instance_name = request.instance_name
    digest = Digest.from_proto(request.action_digest, DigestFunction.from_wire(request.digest_function))
    logs.note(instance=instance_name, action=str(digest))
    return instance_name, digest


class ActionCacheService:
    """build.bazel.remote.execution.v2.ActionCache."""

    def __init__(self, cache: ActionCache) -> None:
        self.cache = cache

    @rpc("GetActionResult")
    async def GetActionResult(
        self, request: re_pb2.GetActionResultRequest, context: Context
    ) -> re_pb2.ActionResult:
        instance_name, digest = _action(request)
        return await self.cache.get(
            instance_name,
            digest,
            inline_stdout=request.inline_stdout,
            inline_stderr=request.inline_stderr,
            inline_output_files=request.inline_output_files,
            counted=True,
        )

    @rpc("UpdateActionResult")
    async def UpdateActionResult(
        self, request: re_pb2.UpdateActionResultRequest, context: Context
    ) -> re_pb2.ActionResult:
        instance_name, digest = _action(request)
        return await self.cache.update(instance_name, digest, request.action_result)
