"""An aborted upload is freed at once by reference counting: no cycle through its task's
CancelledError is left for the cyclic GC, which an idle server may not run for minutes
(server/grpc/bytestream.py, `_clear_cancelled_frames`)."""

from __future__ import annotations

import asyncio
import os
import uuid
import weakref
from collections.abc import AsyncIterator

import pytest

from buildvault.digest import Digest, parse_write_resource
from buildvault.remote_apis import bs_pb2
from buildvault.server.errors import InvalidArgument
from buildvault.server.grpc.bytestream import CLOSED, Upload, Uploads, _upload_key
from buildvault.storage.memory import MemoryBlobStore

CHUNK = 64 << 10


async def _stream(requests: list[bs_pb2.WriteRequest]) -> AsyncIterator[bs_pb2.WriteRequest]:
    for request in requests:
        yield request


def _start(uploads: Uploads, data: bytes) -> tuple[Upload, str]:
    digest = Digest.of(data)
    name = f"uploads/{uuid.uuid4()}/blobs/{digest.hash}/{digest.size_bytes}"
    resource = parse_write_resource(name)
    return uploads.start(_upload_key(resource), resource, name), name


async def _feed(upload: Upload, requests: list[bs_pb2.WriteRequest]) -> asyncio.Future[object]:
    stream = _stream(requests)
    return upload.attach(await stream.__anext__(), stream)


async def test_an_aborted_upload_is_freed_without_the_cyclic_gc(no_cyclic_gc: None) -> None:
    uploads = Uploads(MemoryBlobStore(), grace=60.0)
    data = os.urandom(4 * CHUNK)
    upload, name = _start(uploads, data)
    half = [
        bs_pb2.WriteRequest(resource_name=name, write_offset=offset, data=data[offset : offset + CHUNK])
        for offset in range(0, 2 * CHUNK, CHUNK)
    ]
    assert await (await _feed(upload, half)) == CLOSED  # the stream ended without finish_write
    upload.detach()
    upload.abort()  # what the grace timer does
    task = upload.task
    await asyncio.wait([task])
    assert task.cancelled()
    freed = weakref.ref(upload)
    del upload, task
    assert freed() is None, "the aborted upload outlived its last plain reference"
    assert len(uploads) == 0


async def test_a_refused_upload_leaves_the_frames_its_error_is_raised_in() -> None:
    # A refused upload's error reaches its Write handler too: clearing that error's frames would
    # finalize the handler's suspended coroutine, so only cancelled uploads have theirs cleared.
    uploads = Uploads(MemoryBlobStore(), grace=60.0)
    data = os.urandom(2 * CHUNK)
    upload, name = _start(uploads, data)
    wrong_offset = [
        bs_pb2.WriteRequest(resource_name=name, write_offset=0, data=data[:CHUNK]),
        bs_pb2.WriteRequest(resource_name=name, write_offset=7, data=data[CHUNK:]),
    ]
    outcome = await _feed(upload, wrong_offset)
    with pytest.raises(InvalidArgument, match="write_offset 7") as refused:
        await outcome
    await asyncio.wait([upload.task])  # this coroutine goes on after the error passed through it
    assert upload.task.exception() is refused.value
    assert len(uploads) == 0
