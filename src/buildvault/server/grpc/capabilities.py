"""Capabilities: what this cache offers, and remote execution when it is enabled."""

from __future__ import annotations

from typing import cast

from buildvault.digest import DigestFunction, verify_instance_name
from buildvault.remote_apis import re_pb2, semver_pb2
from buildvault.server.grpc import MAX_BATCH_TOTAL_SIZE, Context, rpc
from buildvault.storage.chunks import ChunkedBlobStore

LOW_API_VERSION = (2, 0)
HIGH_API_VERSION = (2, 12)  # v2.12: SplitBlob / SpliceBlob with FastCDC 2020


def cache_capabilities(max_cas_blob_size: int = 0, chunks: ChunkedBlobStore | None = None) -> re_pb2.CacheCapabilities:
    # IDENTITY is implied by the spec; listing it too helps clients that look for it.
    compressors = [re_pb2.Compressor.IDENTITY, re_pb2.Compressor.ZSTD]
    chunking = (
        re_pb2.FastCdc2020Params(avg_chunk_size_bytes=chunks.params.avg_size, seed=chunks.params.seed)
        if chunks is not None
        else None
    )
    return re_pb2.CacheCapabilities(
        split_blob_support=chunks is not None,
        splice_blob_support=chunks is not None,
        fast_cdc_2020_params=chunking,
        digest_functions=[cast("re_pb2.DigestFunction.Value", function.wire) for function in DigestFunction],
        action_cache_update_capabilities=re_pb2.ActionCacheUpdateCapabilities(update_enabled=True),
        max_batch_total_size_bytes=MAX_BATCH_TOTAL_SIZE,
        symlink_absolute_path_strategy=re_pb2.SymlinkAbsolutePathStrategy.ALLOWED,
        supported_compressors=compressors,
        supported_batch_update_compressors=compressors,
        max_cas_blob_size_bytes=max_cas_blob_size,
    )


def execution_capabilities(priority_range: tuple[int, int]) -> re_pb2.ExecutionCapabilities:
    # Bazel 4.2.3 refuses remote execution without the singular (deprecated) digest_function.
    return re_pb2.ExecutionCapabilities(
        digest_function=re_pb2.DigestFunction.SHA256,
        digest_functions=[re_pb2.DigestFunction.SHA256],
        exec_enabled=True,
        execution_priority_capabilities=re_pb2.PriorityCapabilities(
            priorities=[
                re_pb2.PriorityCapabilities.PriorityRange(
                    min_priority=priority_range[0], max_priority=priority_range[1]
                )
            ]
        ),
    )


def server_capabilities(
    max_cas_blob_size: int = 0,
    priority_range: tuple[int, int] | None = None,
    chunks: ChunkedBlobStore | None = None,
) -> re_pb2.ServerCapabilities:
    """`priority_range` set: execution is offered, with that ExecutionPolicy.priority range;
    `chunks` set: SplitBlob and SpliceBlob, with its FastCDC 2020 parameters."""
    return re_pb2.ServerCapabilities(
        cache_capabilities=cache_capabilities(max_cas_blob_size, chunks),
        execution_capabilities=execution_capabilities(priority_range) if priority_range else None,
        low_api_version=semver_pb2.SemVer(major=LOW_API_VERSION[0], minor=LOW_API_VERSION[1]),
        high_api_version=semver_pb2.SemVer(major=HIGH_API_VERSION[0], minor=HIGH_API_VERSION[1]),
    )


class CapabilitiesService:
    """build.bazel.remote.execution.v2.Capabilities."""

    def __init__(
        self,
        max_cas_blob_size: int = 0,
        priority_range: tuple[int, int] | None = None,
        chunks: ChunkedBlobStore | None = None,
    ) -> None:
        self._response = server_capabilities(max_cas_blob_size, priority_range, chunks)

    @rpc("GetCapabilities")
    async def GetCapabilities(
        self, request: re_pb2.GetCapabilitiesRequest, context: Context
    ) -> re_pb2.ServerCapabilities:
        verify_instance_name(request.instance_name)
        return self._response
