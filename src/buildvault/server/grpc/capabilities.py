"""Capabilities: what this cache offers (no execution yet)."""

from __future__ import annotations

from typing import cast

from buildvault.digest import DigestFunction, verify_instance_name
from buildvault.remote_apis import re_pb2, semver_pb2
from buildvault.server.grpc import MAX_BATCH_TOTAL_SIZE, Context, rpc

LOW_API_VERSION = (2, 0)
HIGH_API_VERSION = (2, 3)


def cache_capabilities(max_cas_blob_size: int = 0) -> re_pb2.CacheCapabilities:
    # IDENTITY is implied by the spec; listing it too helps clients that look for it.
    compressors = [re_pb2.Compressor.IDENTITY, re_pb2.Compressor.ZSTD]
    return re_pb2.CacheCapabilities(
        digest_functions=[cast("re_pb2.DigestFunction.Value", function.wire) for function in DigestFunction],
        action_cache_update_capabilities=re_pb2.ActionCacheUpdateCapabilities(update_enabled=True),
        max_batch_total_size_bytes=MAX_BATCH_TOTAL_SIZE,
        symlink_absolute_path_strategy=re_pb2.SymlinkAbsolutePathStrategy.ALLOWED,
        supported_compressors=compressors,
        supported_batch_update_compressors=compressors,
        max_cas_blob_size_bytes=max_cas_blob_size,
    )


def server_capabilities(max_cas_blob_size: int = 0) -> re_pb2.ServerCapabilities:
    return re_pb2.ServerCapabilities(
        cache_capabilities=cache_capabilities(max_cas_blob_size),
        low_api_version=semver_pb2.SemVer(major=LOW_API_VERSION[0], minor=LOW_API_VERSION[1]),
        high_api_version=semver_pb2.SemVer(major=HIGH_API_VERSION[0], minor=HIGH_API_VERSION[1]),
    )


class CapabilitiesService:
    """build.bazel.remote.execution.v2.Capabilities."""

    def __init__(self, max_cas_blob_size: int = 0) -> None:
        self._response = server_capabilities(max_cas_blob_size)

    @rpc("GetCapabilities")
    async def GetCapabilities(
        self, request: re_pb2.GetCapabilitiesRequest, context: Context
    ) -> re_pb2.ServerCapabilities:
        verify_instance_name(request.instance_name)
        return self._response
