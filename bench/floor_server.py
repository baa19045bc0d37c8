#!/usr/bin/env python3
"""The transport floor: the REAPI cache calls bench/harness.py makes, answered from a dict in memory.

    .venv/bin/python bench/floor_server.py --mode aio --port 0     # grpc.aio, one event loop
    .venv/bin/python bench/floor_server.py --mode sync --port 0    # grpc's thread-pool server

No disk, no hashing, no checks, no limits: what grpcio and Python charge for each call shape on
this machine, with the same client. buildvault serves with grpc.aio; BuildGrid with the
thread-pool server. bench/floors.py runs the harness against both beside buildvault. Prints
`floor ready: grpc=127.0.0.1:PORT` once it listens. Not a cache: nothing is verified.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2, semver_pb2  # noqa: E402

READ_CHUNK = 1 << 20  # buildvault's ByteStream.Read chunk
OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]


class Memory:
    """The calls' work, shared by both server kinds: plain dict look-ups."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[str, int], bytes] = {}
        self.actions: dict[tuple[str, int], re_pb2.ActionResult] = {}

    def capabilities(self) -> re_pb2.ServerCapabilities:
        # what Bazel needs to read and write a remote cache
        return re_pb2.ServerCapabilities(
            cache_capabilities=re_pb2.CacheCapabilities(
                digest_functions=[re_pb2.DigestFunction.SHA256], max_batch_total_size_bytes=4 << 20,
                action_cache_update_capabilities=re_pb2.ActionCacheUpdateCapabilities(update_enabled=True),
            ),
            low_api_version=semver_pb2.SemVer(major=2), high_api_version=semver_pb2.SemVer(major=2, minor=3),
        )

    def find_missing(self, request: re_pb2.FindMissingBlobsRequest) -> re_pb2.FindMissingBlobsResponse:
        blobs = self.blobs
        missing = [d for d in request.blob_digests if (d.hash, d.size_bytes) not in blobs]
        return re_pb2.FindMissingBlobsResponse(missing_blob_digests=missing)

    def batch_update(self, request: re_pb2.BatchUpdateBlobsRequest) -> re_pb2.BatchUpdateBlobsResponse:
        for r in request.requests:
            self.blobs[(r.digest.hash, r.digest.size_bytes)] = r.data
        return re_pb2.BatchUpdateBlobsResponse(
            responses=[re_pb2.BatchUpdateBlobsResponse.Response(digest=r.digest) for r in request.requests]
        )

    def batch_read(self, request: re_pb2.BatchReadBlobsRequest) -> re_pb2.BatchReadBlobsResponse:
        return re_pb2.BatchReadBlobsResponse(
            responses=[
                re_pb2.BatchReadBlobsResponse.Response(digest=d, data=self.blobs[(d.hash, d.size_bytes)])
                for d in request.digests
            ]
        )

    def get_action(self, request: re_pb2.GetActionResultRequest, context: Any) -> re_pb2.ActionResult | None:
        return self.actions.get((request.action_digest.hash, request.action_digest.size_bytes))

    def update_action(self, request: re_pb2.UpdateActionResultRequest) -> re_pb2.ActionResult:
        self.actions[(request.action_digest.hash, request.action_digest.size_bytes)] = request.action_result
        return request.action_result

    def store(self, resource_name: str, pieces: list[bytes]) -> bs_pb2.WriteResponse:
        # {instance}/uploads/{uuid}/blobs/{hash}/{size}
        parts = resource_name.split("/")
        data = b"".join(pieces)
        self.blobs[(parts[-2], int(parts[-1]))] = data
        return bs_pb2.WriteResponse(committed_size=len(data))

    def chunks(self, resource_name: str) -> Iterator[bs_pb2.ReadResponse]:
        parts = resource_name.split("/")
        data = memoryview(self.blobs[(parts[-2], int(parts[-1]))])
        for start in range(0, len(data), READ_CHUNK):
            yield bs_pb2.ReadResponse(data=bytes(data[start : start + READ_CHUNK]))


class SyncServicers(re_grpc.CapabilitiesServicer, re_grpc.ContentAddressableStorageServicer,
                    re_grpc.ActionCacheServicer, bs_grpc.ByteStreamServicer):
    def __init__(self, memory: Memory) -> None:
        self.m = memory

    def GetCapabilities(self, request: Any, context: Any) -> Any:
        return self.m.capabilities()

    def FindMissingBlobs(self, request: Any, context: Any) -> Any:
        return self.m.find_missing(request)

    def BatchUpdateBlobs(self, request: Any, context: Any) -> Any:
        return self.m.batch_update(request)

    def BatchReadBlobs(self, request: Any, context: Any) -> Any:
        return self.m.batch_read(request)

    def GetActionResult(self, request: Any, context: Any) -> Any:
        result = self.m.get_action(request, context)
        if result is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such action")
        return result

    def UpdateActionResult(self, request: Any, context: Any) -> Any:
        return self.m.update_action(request)

    def Write(self, request_iterator: Iterator[Any], context: Any) -> Any:
        name = ""
        pieces = []
        for request in request_iterator:
            name = name or request.resource_name
            pieces.append(request.data)
        return self.m.store(name, pieces)

    def Read(self, request: Any, context: Any) -> Any:
        yield from self.m.chunks(request.resource_name)


class AioServicers(re_grpc.CapabilitiesServicer, re_grpc.ContentAddressableStorageServicer,
                   re_grpc.ActionCacheServicer, bs_grpc.ByteStreamServicer):
    def __init__(self, memory: Memory) -> None:
        self.m = memory

    async def GetCapabilities(self, request: Any, context: Any) -> Any:
        return self.m.capabilities()

    async def FindMissingBlobs(self, request: Any, context: Any) -> Any:
        return self.m.find_missing(request)

    async def BatchUpdateBlobs(self, request: Any, context: Any) -> Any:
        return self.m.batch_update(request)

    async def BatchReadBlobs(self, request: Any, context: Any) -> Any:
        return self.m.batch_read(request)

    async def GetActionResult(self, request: Any, context: Any) -> Any:
        result = self.m.get_action(request, context)
        if result is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such action")
        return result

    async def UpdateActionResult(self, request: Any, context: Any) -> Any:
        return self.m.update_action(request)

    async def Write(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        name = ""
        pieces = []
        async for request in request_iterator:
            name = name or request.resource_name
            pieces.append(request.data)
        return self.m.store(name, pieces)

    async def Read(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for response in self.m.chunks(request.resource_name):
            yield response


def add_all(servicers: Any, server: Any) -> None:
    re_grpc.add_CapabilitiesServicer_to_server(servicers, server)
    re_grpc.add_ContentAddressableStorageServicer_to_server(servicers, server)
    re_grpc.add_ActionCacheServicer_to_server(servicers, server)
    bs_grpc.add_ByteStreamServicer_to_server(servicers, server)


def serve_sync(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=OPTIONS)
    add_all(SyncServicers(Memory()), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"floor ready: grpc=127.0.0.1:{bound}", flush=True)
    server.wait_for_termination()


async def serve_aio(port: int) -> None:
    server = grpc.aio.server(options=OPTIONS)
    add_all(AioServicers(Memory()), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"floor ready: grpc=127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("aio", "sync"), required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "sync":
        serve_sync(args.port)
    else:
        asyncio.run(serve_aio(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
