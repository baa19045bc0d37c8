"""Small REAPI client helpers for the integration tests (digests, uploads, reads, status details)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import blake3
import grpc
import pytest
import zstandard
from google.rpc import error_details_pb2, status_pb2
from polling import wait_until

from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2

SHA256 = re_pb2.DigestFunction.SHA256
BLAKE3 = re_pb2.DigestFunction.BLAKE3

CLIENT_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


@dataclass
class Stubs:
    channel: grpc.aio.Channel
    cas: re_grpc.ContentAddressableStorageStub
    ac: re_grpc.ActionCacheStub
    capabilities: re_grpc.CapabilitiesStub
    bytestream: bs_grpc.ByteStreamStub


def make_stubs(channel: grpc.aio.Channel) -> Stubs:
    return Stubs(
        channel=channel,
        cas=re_grpc.ContentAddressableStorageStub(channel),
        ac=re_grpc.ActionCacheStub(channel),
        capabilities=re_grpc.CapabilitiesStub(channel),
        bytestream=bs_grpc.ByteStreamStub(channel),
    )


def digest(data: bytes, function: int = SHA256) -> re_pb2.Digest:
    if function == BLAKE3:
        return re_pb2.Digest(hash=blake3.blake3(data).hexdigest(), size_bytes=len(data))
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def blob(size: int) -> bytes:
    return os.urandom(size)


def upload_name(d: re_pb2.Digest, instance: str = "", compressed: bool = False, fn: str = "") -> str:
    kind = "compressed-blobs/zstd" if compressed else "blobs"
    prefix = f"{instance}/" if instance else ""
    fn_part = f"{fn}/" if fn else ""
    return f"{prefix}uploads/{uuid.uuid4()}/{kind}/{fn_part}{d.hash}/{d.size_bytes}"


def read_name(d: re_pb2.Digest, instance: str = "", compressed: bool = False, fn: str = "") -> str:
    kind = "compressed-blobs/zstd" if compressed else "blobs"
    prefix = f"{instance}/" if instance else ""
    fn_part = f"{fn}/" if fn else ""
    return f"{prefix}{kind}/{fn_part}{d.hash}/{d.size_bytes}"


def write_requests(
    name: str, payload: bytes, chunk: int = 64 << 10, start: int = 0, finish: bool = True
) -> list[bs_pb2.WriteRequest]:
    """Requests carrying payload[start:], offsets counted from `start` (as the wire counts them)."""
    requests = []
    offset = start
    pieces = [payload[i : i + chunk] for i in range(start, len(payload), chunk)] or [b""]
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        requests.append(
            bs_pb2.WriteRequest(
                resource_name=name if index == 0 else "",
                write_offset=offset,
                data=piece,
                finish_write=finish and last,
            )
        )
        offset += len(piece)
    return requests


async def iterate(requests: Iterable[bs_pb2.WriteRequest]) -> AsyncIterator[bs_pb2.WriteRequest]:
    for request in requests:
        yield request


async def query(stubs, name: str) -> bs_pb2.QueryWriteStatusResponse:
    return await stubs.bytestream.QueryWriteStatus(bs_pb2.QueryWriteStatusRequest(resource_name=name))


async def wait_committed(stubs, name: str, want: int, timeout: float = 20.0) -> bs_pb2.QueryWriteStatusResponse:
    """Poll QueryWriteStatus until the server has taken `want` bytes (a readiness signal)."""

    async def taken() -> bs_pb2.QueryWriteStatusResponse | None:
        status = await query(stubs, name)
        return status if status.committed_size >= want else None

    return await wait_until(taken, timeout, f"{want} bytes committed to {name}")


async def write_held_open(
    stubs,
    name: str,
    first: Sequence[bs_pb2.WriteRequest],
    release: asyncio.Event,
    rest: Iterable[bs_pb2.WriteRequest] = (),
):
    """Start a Write that sends `first`; once the server has taken them, return the call with its
    stream held open until `release` is set, after which it sends `rest`."""

    async def stream():
        for request in first:
            yield request
        await release.wait()
        for request in rest:
            yield request

    call = stubs.bytestream.Write(stream())
    sent = first[-1].write_offset + len(first[-1].data)
    status = await wait_committed(stubs, name, sent)
    assert status.committed_size == sent and not status.complete, status
    return call


async def start_and_break(stubs, requests: Sequence[bs_pb2.WriteRequest], name: str) -> None:
    """Send `requests`, keep the stream open until the server has them, then cancel the call."""
    call = await write_held_open(stubs, name, requests, asyncio.Event())
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def write(stubs, data: bytes, *, instance: str = "", chunk: int = 64 << 10, function: int = SHA256) -> int:
    d = digest(data, function)
    fn = "blake3" if function == BLAKE3 else ""
    reply = await stubs.bytestream.Write(iterate(write_requests(upload_name(d, instance, fn=fn), data, chunk)))
    return reply.committed_size


async def write_compressed(stubs, data: bytes, *, chunk: int = 16 << 10) -> int:
    d = digest(data)
    compressed = zstandard.ZstdCompressor().compress(data)
    name = upload_name(d, compressed=True)
    reply = await stubs.bytestream.Write(iterate(write_requests(name, compressed, chunk)))
    return reply.committed_size


async def read(stubs, d: re_pb2.Digest, *, offset: int = 0, limit: int = 0, name: str | None = None) -> bytes:
    resource_name = read_name(d) if name is None else name
    request = bs_pb2.ReadRequest(resource_name=resource_name, read_offset=offset, read_limit=limit)
    return b"".join([r.data async for r in stubs.bytestream.Read(request)])


async def batch_update(stubs, blobs: Iterable[bytes], instance: str = "", function: int = SHA256):
    request = re_pb2.BatchUpdateBlobsRequest(
        instance_name=instance,
        digest_function=function,
        requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(b, function), data=b) for b in blobs],
    )
    reply = await stubs.cas.BatchUpdateBlobs(request)
    assert all(r.status.code == 0 for r in reply.responses), reply
    return reply


async def missing(stubs, digests: Iterable[re_pb2.Digest], function: int = SHA256) -> set[tuple[str, int]]:
    reply = await stubs.cas.FindMissingBlobs(
        re_pb2.FindMissingBlobsRequest(blob_digests=list(digests), digest_function=function)
    )
    return {(d.hash, d.size_bytes) for d in reply.missing_blob_digests}


def key(d: re_pb2.Digest) -> tuple[str, int]:
    return (d.hash, d.size_bytes)


def rich_status(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for k, v in error.trailing_metadata() or ():
        if k == "grpc-status-details-bin":
            return status_pb2.Status.FromString(v)
    return None


def precondition_violations(error: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    status = rich_status(error)
    assert status is not None, "no grpc-status-details-bin trailer"
    out = []
    for detail in status.details:
        failure = error_details_pb2.PreconditionFailure()
        if detail.Unpack(failure):
            out.extend((v.type, v.subject) for v in failure.violations)
    return out
