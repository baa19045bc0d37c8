"""Small blobs as records (storage/disk/records.py) under a real `buildvault serve`: kill -9 in
the middle of 500 concurrent small uploads loses no acknowledged blob or action entry and
exposes nothing corrupt; a store full of entries in use refuses uploads with RESOURCE_EXHAUSTED
while reads go on; a flipped byte in a record is never served and the blob is stored again."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs, missing, read, write
from record_damage import flip_byte_of, record_count
from server_process import ServerProcess

from buildvault.remote_apis import re_pb2

pytestmark = pytest.mark.timeout(300)

UPLOADS = 500


def small_blob(i: int) -> bytes:
    return os.urandom(100 + (i * 37) % 12_000)  # 100 B .. 12 KiB: records


async def upload_one(stubs, i: int, data: bytes) -> None:
    """Alternately BatchUpdateBlobs, ByteStream Write, and an ActionResult naming the blob."""
    if i % 3 == 0:
        await batch_update(stubs, [data])
    elif i % 3 == 1:
        assert await write(stubs, data) == len(data)
    else:
        await batch_update(stubs, [data])
        result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path=f"out{i}", digest=digest(data))])
        request = re_pb2.UpdateActionResultRequest(action_digest=action_of(i), action_result=result)
        await stubs.ac.UpdateActionResult(request)


def action_of(i: int) -> re_pb2.Digest:
    return digest(f"action {i}".encode())


async def test_kill_9_during_500_concurrent_small_uploads_loses_nothing_acknowledged(tmp_path) -> None:
    server = ServerProcess(tmp_path / "data", name="crash").start()
    blobs = [small_blob(i) for i in range(UPLOADS)]
    acknowledged: set[int] = set()
    enough = asyncio.Event()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)

            async def one(i: int) -> None:
                await upload_one(stubs, i, blobs[i])
                acknowledged.add(i)
                if len(acknowledged) >= UPLOADS // 3:
                    enough.set()

            tasks = [asyncio.ensure_future(one(i)) for i in range(UPLOADS)]
            await enough.wait()
            server.kill()  # SIGKILL while the rest are in flight
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [e for e in outcomes if isinstance(e, BaseException)]
        assert failed, "every upload finished before the kill: the test proves nothing"
        assert all(isinstance(e, grpc.aio.AioRpcError) for e in failed), failed[:3]

        server.start()
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            digests = [digest(data) for data in blobs]
            gone = await missing(stubs, digests)
            assert not {(digests[i].hash, digests[i].size_bytes) for i in acknowledged} & gone
            for i, data in enumerate(blobs):  # whatever is there is whole: acknowledged or not
                if (digests[i].hash, digests[i].size_bytes) not in gone:
                    assert await read(stubs, digests[i]) == data
            for i in sorted(acknowledged):
                if i % 3 == 2:
                    reply = await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action_of(i)))
                    assert reply.output_files[0].digest == digests[i]
        assert "records" in os.listdir(server.data_dir)
    finally:
        server.stop()


async def test_a_store_full_of_entries_in_use_refuses_uploads_and_reads_go_on(tmp_path) -> None:
    server = ServerProcess(
        tmp_path / "data", name="full", extra_args=["--max-size", "256KiB", "--eviction-hold", "600"]
    ).start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            stored: list[bytes] = []
            refused = None
            for _ in range(200):  # written within the eviction hold: nothing may be evicted for them
                data = os.urandom(4000)
                reply = await stubs.cas.BatchUpdateBlobs(
                    re_pb2.BatchUpdateBlobsRequest(
                        requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(data), data=data)]
                    )
                )
                code = reply.responses[0].status.code
                if code != 0:
                    refused = code
                    break
                stored.append(data)
            assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await write(stubs, os.urandom(4000))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for data in stored:  # reads keep working
                assert await read(stubs, digest(data)) == data
    finally:
        server.stop()


async def test_a_flipped_byte_in_a_record_is_never_served_and_the_next_upload_stores_it(tmp_path) -> None:
    server = ServerProcess(tmp_path / "data", name="flip").start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            data = os.urandom(5000)
            await batch_update(stubs, [data])
            assert record_count(server.data_dir) == 1
            flip_byte_of(server.data_dir, data)
            reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(data)]))
            assert reply.responses[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert reply.responses[0].data == b""
            assert await missing(stubs, [digest(data)]) == {(digest(data).hash, len(data))}
            await batch_update(stubs, [data])
            assert await read(stubs, digest(data)) == data
    finally:
        server.stop()
