"""Remote Asset Push over gRPC: a thin adapter over `buildvault.assets.service.Assets`.

Push needs `write` on the instance (server/auth/grpc_auth.py's rule table); the content must
already be in the CAS, else FAILED_PRECONDITION names the missing digests.
"""

from __future__ import annotations

from buildvault.assets.errors import InvalidAssetRequest
from buildvault.assets.service import Assets
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import ra_pb2, re_pb2
from buildvault.server.auth import Auth
from buildvault.server.grpc import Context, rpc
from buildvault.server.grpc.fetch import request_of, timestamp_seconds

__all__ = ["PushService"]


def _digest(
    message: re_pb2.Digest, field: str, request: ra_pb2.PushBlobRequest | ra_pb2.PushDirectoryRequest
) -> Digest:
    try:
        return Digest.from_proto(message, DigestFunction.from_wire(request.digest_function))
    except InvalidDigest as e:
        raise InvalidAssetRequest([(field, str(e))]) from None


class PushService:
    """build.bazel.remote.asset.v1.Push."""

    def __init__(self, assets: Assets, auth: Auth | None = None) -> None:
        self.assets = assets
        self.auth = auth

    @rpc("PushBlob")
    async def PushBlob(self, request: ra_pb2.PushBlobRequest, context: Context) -> ra_pb2.PushBlobResponse:
        parsed = request_of(request)
        digest = _digest(request.blob_digest, "blob_digest", request)
        expire_at = timestamp_seconds(request.expire_at, "expire_at")
        await self.assets.push_blob(parsed, digest, expire_at)
        return ra_pb2.PushBlobResponse()

    @rpc("PushDirectory")
    async def PushDirectory(
        self, request: ra_pb2.PushDirectoryRequest, context: Context
    ) -> ra_pb2.PushDirectoryResponse:
        parsed = request_of(request)
        digest = _digest(request.root_directory_digest, "root_directory_digest", request)
        expire_at = timestamp_seconds(request.expire_at, "expire_at")
        await self.assets.push_directory(parsed, digest, expire_at)
        return ra_pb2.PushDirectoryResponse()
