"""Remote Asset Fetch over gRPC: a thin adapter over `buildvault.assets.service.Assets`.

Misses and failures are gRPC errors, never an inline `status` (Bazel 4.2.3 ignores an inline
NOT_FOUND and fails later on the empty blob's checksum): NOT_FOUND names each URI tried and its
origin's answer, INVALID_ARGUMENT carries BadRequest details, DEADLINE_EXCEEDED is a timeout.
"""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2

from buildvault import logs
from buildvault.assets.errors import InvalidAssetRequest
from buildvault.assets.request import AssetRequest, parse_request, uri_host
from buildvault.assets.service import Assets, Found
from buildvault.remote_apis import ra_pb2, re_pb2
from buildvault.server.auth import Auth
from buildvault.server.auth.grants import Permission
from buildvault.server.auth.grpc_auth import caller_may
from buildvault.server.grpc import Context, rpc

__all__ = ["FetchService", "request_of", "timestamp_seconds"]

MAX_TIMEOUT = 24 * 3600.0


def timestamp_seconds(message: timestamp_pb2.Timestamp | None, field: str) -> float | None:
    """A set Timestamp as seconds since the epoch; None when unset."""
    if message is None or (message.seconds == 0 and message.nanos == 0):
        return None
    if not 0 <= message.nanos < 1_000_000_000 or not 0 <= message.seconds < 253402300800:
        raise InvalidAssetRequest([(field, "not a valid timestamp")])
    return message.seconds + message.nanos / 1e9


def _timeout(message: duration_pb2.Duration) -> float | None:
    if message.seconds == 0 and message.nanos == 0:
        return None
    seconds = message.seconds + message.nanos / 1e9
    if seconds <= 0 or not -1_000_000_000 < message.nanos < 1_000_000_000:
        raise InvalidAssetRequest([("timeout", "must be a positive duration")])
    return min(seconds, MAX_TIMEOUT)


def request_of(
    request: ra_pb2.FetchBlobRequest
    | ra_pb2.FetchDirectoryRequest
    | ra_pb2.PushBlobRequest
    | ra_pb2.PushDirectoryRequest,
) -> AssetRequest:
    parsed = parse_request(
        request.instance_name, list(request.uris), [(q.name, q.value) for q in request.qualifiers],
        request.digest_function,
    )  # fmt: skip
    hosts = sorted({uri_host(uri) for uri in parsed.uris})
    logs.note(instance=parsed.instance_name, hosts=hosts[:8])  # hosts only: never paths, headers or tokens
    return parsed


def _qualifiers(pairs: list[tuple[str, str]]) -> list[ra_pb2.Qualifier]:
    return [ra_pb2.Qualifier(name=name, value=value) for name, value in pairs]


def _expires(found: Found) -> timestamp_pb2.Timestamp | None:
    if found.entry.expires_at is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(found.entry.expires_at * 1e9))
    return stamp


class FetchService:
    """build.bazel.remote.asset.v1.Fetch."""

    def __init__(self, assets: Assets, auth: Auth | None = None) -> None:
        self.assets = assets
        self.auth = auth

    @rpc("FetchBlob")
    async def FetchBlob(self, request: ra_pb2.FetchBlobRequest, context: Context) -> ra_pb2.FetchBlobResponse:
        parsed = request_of(request)
        oldest = timestamp_seconds(request.oldest_content_accepted, "oldest_content_accepted")
        timeout = _timeout(request.timeout)
        may_write = caller_may(self.auth, Permission.WRITE, parsed.instance_name)
        found = await self.assets.fetch_blob(parsed, may_write=may_write, oldest=oldest, timeout=timeout)
        logs.note(blob=str(found.entry.digest))
        return ra_pb2.FetchBlobResponse(
            uri=found.uri,
            qualifiers=_qualifiers(parsed.qualifiers()),
            expires_at=_expires(found),
            blob_digest=found.entry.digest.to_proto(re_pb2.Digest),
            digest_function=parsed.digest_function.proto,
        )

    @rpc("FetchDirectory")
    async def FetchDirectory(
        self, request: ra_pb2.FetchDirectoryRequest, context: Context
    ) -> ra_pb2.FetchDirectoryResponse:
        parsed = request_of(request)
        oldest = timestamp_seconds(request.oldest_content_accepted, "oldest_content_accepted")
        _timeout(request.timeout)
        found = await self.assets.fetch_directory(parsed, oldest=oldest)
        return ra_pb2.FetchDirectoryResponse(
            uri=found.uri,
            qualifiers=_qualifiers(parsed.qualifiers()),
            expires_at=_expires(found),
            root_directory_digest=found.entry.digest.to_proto(re_pb2.Digest),
            digest_function=parsed.digest_function.proto,
        )
