"""The chunk store (storage/chunks) under a tight cap, through a real `buildvault serve`.

Blobs that share chunks are written (with an ActionResult naming each) into a store that holds
about half of their bytes, while readers keep reading the blobs already acknowledged. Eviction is LRU
over chunks and chunk lists alike (docs/architecture.md, "The chunk store"): a read may find its
blob gone (NOT_FOUND, at the start or mid-stream when a chunk goes under it) but never returns
other bytes. Afterwards a blob one of whose chunks went is reported missing by FindMissingBlobs
and its ActionResult is not served (the completeness check), and every blob reported present,
or named by an ActionResult served, reads back exactly.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from reapi_client import CLIENT_OPTIONS, digest, make_stubs, missing, read, write
from server_process import ServerProcess

from buildvault.remote_apis import re_pb2
from buildvault.storage.chunks import ChunkingParams, cut

pytestmark = pytest.mark.timeout(300)

SEGMENT = 1 << 20
BLOBS = 30
WRITERS = 4
READERS = 4


def make_blobs(seed: int) -> list[bytes]:
    """4 MiB blobs: 1 MiB of their own, then 3 MiB drawn from 6 shared segments."""
    rng = random.Random(seed)
    segments = [rng.randbytes(SEGMENT) for _ in range(6)]
    return [rng.randbytes(SEGMENT) + b"".join(rng.choice(segments) for _ in range(3)) for _ in range(BLOBS)]


def action_of(i: int) -> re_pb2.Digest:
    return digest(f"link step {i}".encode())


async def test_tight_cap_with_shared_chunks_never_serves_wrong_bytes(tmp_path) -> None:
    # Cut as they arrive (no backlog): the test is about chunks evicted while blobs are in use.
    tight = ["--max-size", "20MiB", "--eviction-hold", "0", "--chunking-backlog", "0"]
    server = ServerProcess(tmp_path / "data", name="tight", extra_args=tight).start()
    blobs = make_blobs(36)
    digests = [digest(b) for b in blobs]
    acknowledged: list[int] = []
    outcomes = {"whole": 0, "not_found": 0, "refused": 0, "write_refused": 0}
    try:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            queue = list(range(BLOBS))
            done = asyncio.Event()
            first = asyncio.Event()

            async def writer() -> None:
                while queue:
                    i = queue.pop(0)
                    try:
                        assert await write(stubs, blobs[i]) == len(blobs[i])
                    except grpc.aio.AioRpcError as error:
                        # Other writers' chunks pushed some of this blob's out while it was
                        # written: refused, never acknowledged as stored.
                        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                        assert "evicted while it was written" in (error.details() or ""), error
                        outcomes["write_refused"] += 1
                        continue
                    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path=f"lib{i}.so", digest=digests[i])])
                    request = re_pb2.UpdateActionResultRequest(action_digest=action_of(i), action_result=result)
                    try:
                        await stubs.ac.UpdateActionResult(request)
                    except grpc.aio.AioRpcError as error:
                        # Another writer's chunks pushed one of this blob's out meanwhile: the
                        # ActionCache refuses a result naming a blob that is not whole.
                        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
                        outcomes["refused"] += 1
                    acknowledged.append(i)
                    first.set()

            async def reader(seed: int) -> None:
                rng = random.Random(seed)
                await first.wait()
                while not done.is_set():
                    i = rng.choice(acknowledged)
                    try:
                        data = await read(stubs, digests[i])
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.NOT_FOUND, error
                        outcomes["not_found"] += 1
                        continue
                    assert data == blobs[i], f"blob {i} read back other bytes"
                    outcomes["whole"] += 1

            readers = [asyncio.ensure_future(reader(r)) for r in range(READERS)]
            await asyncio.gather(*(writer() for _ in range(WRITERS)))
            done.set()
            await asyncio.gather(*readers)
            assert outcomes["whole"] > 0, outcomes

            gone = await missing(stubs, digests)
            params = ChunkingParams()
            lost_a_chunk = 0
            for i, data in enumerate(blobs):
                chunks = [digest(bytes(c)) for c in cut(data, params)]
                chunk_gone = await missing(stubs, chunks)
                reported_missing = (digests[i].hash, digests[i].size_bytes) in gone
                try:
                    await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action_of(i)))
                    served = True
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.NOT_FOUND
                    served = False
                if chunk_gone:
                    lost_a_chunk += 1
                    assert reported_missing, f"blob {i} lacks {len(chunk_gone)} chunk(s) yet is reported present"
                    assert not served, f"the ActionResult naming blob {i}, which lacks a chunk, was served"
                if not reported_missing or served:
                    assert not chunk_gone
                    assert await read(stubs, digests[i]) == data
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await read(stubs, digests[i])
                    assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert lost_a_chunk > 0, "no blob lost a chunk: the cap was not tight"
            assert len(gone) < BLOBS, "nothing is left: the cap was too tight to prove anything"
    finally:
        server.stop()
