"""The chunk store (storage/chunks) under kill -9, through a real `buildvault serve`.

16 clients write large blobs that share chunks over ByteStream, and one write is held open past
its first chunks, when the server is killed. After a restart: every acknowledged blob is
reported present and reads back exactly, every blob reported present (acknowledged or not)
reads back exactly, and the held write's chunks are orphans: CAS blobs no chunk list names.

Orphans are ordinary CAS blobs in the LRU (docs/architecture.md, "The chunk store"): nothing
refers to them, so nothing uses them, and the first eviction pass that must free their bytes
removes them before any blob used since the restart. The test makes that pass happen: a clean
restart under a cap that the next writes exceed by the orphans' bytes; afterwards no orphan is
left and every blob still reported present reads back exactly.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from pathlib import Path

import grpc
import pytest
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, digest, make_stubs, missing, read, upload_name, write, write_requests
from server_process import ServerProcess

from buildvault.remote_apis import re_pb2
from buildvault.storage.chunks import ChunkingParams, cut

pytestmark = pytest.mark.timeout(600)

CLIENTS = 16
PER_CLIENT = 2
SEGMENT = 1 << 20


def make_blobs(seed: int) -> list[bytes]:
    """Blobs of 1 MiB of their own then 5 MiB drawn from 8 shared segments: chunks in common."""
    rng = random.Random(seed)
    segments = [rng.randbytes(SEGMENT) for _ in range(8)]
    return [
        rng.randbytes(SEGMENT) + b"".join(rng.choice(segments) for _ in range(5)) for _ in range(CLIENTS * PER_CLIENT)
    ]


def chunk_files(data_dir: Path) -> dict[str, int]:
    """`<hash>-<size>` -> size of every CAS file (every blob written here is kept as chunks)."""
    found = {}
    base = data_dir / "cas" / "sha256"
    for shard in base.iterdir():
        for name in os.listdir(shard):
            hash_, _, size = name.partition("-")
            if len(hash_) == 64 and size.isdigit():
                found[name] = int(size)
    return found


async def split(stubs, d: re_pb2.Digest) -> list[re_pb2.Digest]:
    reply = await stubs.cas.SplitBlob(
        re_pb2.SplitBlobRequest(blob_digest=d, digest_function=re_pb2.DigestFunction.SHA256)
    )
    return list(reply.chunk_digests)


async def present_blobs_read_back(stubs, blobs: list[bytes]) -> tuple[set[int], set[str]]:
    """Check every blob reported present reads back exactly (and every other is NOT_FOUND);
    return the indices present and the `<hash>-<size>` of every chunk their lists name."""
    digests = [digest(b) for b in blobs]
    gone = await missing(stubs, digests)
    present = {i for i, d in enumerate(digests) if (d.hash, d.size_bytes) not in gone}
    named: set[str] = set()
    for i, d in enumerate(digests):
        if i in present:
            assert await read(stubs, d) == blobs[i], f"blob {i} reported present reads back other bytes"
            named |= {f"{c.hash}-{c.size_bytes}" for c in await split(stubs, d)}
        else:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await read(stubs, d)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
    return present, named


async def test_kill_9_while_16_clients_write_shared_chunks(tmp_path) -> None:
    data_dir = tmp_path / "data"
    # No backlog: each blob is cut as it arrives (what every write does once the backlog is full).
    cut_on_arrival = ["--chunking-backlog", "0"]
    server = ServerProcess(data_dir, name="crash", extra_args=cut_on_arrival).start()
    blobs = make_blobs(35)
    held = os.urandom(6 << 20)  # its first window (4 MiB) is cut and stored before the stream ends
    held_chunks = [bytes(c) for c in cut(held, ChunkingParams())]
    acknowledged: set[int] = set()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            release = asyncio.Event()

            async def held_write() -> None:
                async def stream():
                    for request in write_requests(upload_name(digest(held)), held[: 5 << 20], finish=False):
                        yield request
                    await release.wait()

                await stubs.bytestream.Write(stream())

            holder = asyncio.ensure_future(held_write())
            first = held_chunks[0]
            first_path = data_dir / "cas" / "sha256" / hashlib.sha256(first).hexdigest()[:2]
            first_name = f"{hashlib.sha256(first).hexdigest()}-{len(first)}"
            await asyncio.to_thread(
                wait_for, lambda: (first_path / first_name).is_file(), 60, "the held write's first chunk stored"
            )

            async def client(c: int) -> None:
                for i in range(c * PER_CLIENT, (c + 1) * PER_CLIENT):
                    assert await write(stubs, blobs[i]) == len(blobs[i])
                    acknowledged.add(i)

            tasks = [asyncio.ensure_future(client(c)) for c in range(CLIENTS)]
            await asyncio.to_thread(wait_for, lambda: len(acknowledged) >= CLIENTS // 2, 120, "a few acknowledged")
            server.kill()  # SIGKILL while the rest are in flight
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            release.set()
            held_outcome = await asyncio.gather(holder, return_exceptions=True)
        failed = [e for e in outcomes if isinstance(e, BaseException)]
        assert failed, "every client finished before the kill: the test proves nothing"
        assert all(isinstance(e, grpc.aio.AioRpcError) for e in [*failed, *held_outcome]), failed[:3]

        server.start()
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            present, named = await present_blobs_read_back(stubs, blobs)
            assert acknowledged <= present, f"acknowledged blobs lost: {sorted(acknowledged - present)}"
            assert (digest(held).hash, digest(held).size_bytes) in await missing(stubs, [digest(held)])
        on_disk = chunk_files(data_dir)
        orphans = {name: size for name, size in on_disk.items() if name not in named}
        assert first_name in orphans, "the held write's chunk is no orphan: the test proves nothing"
        assert named <= set(on_disk)

        # The eviction pass. A clean restart keeps the LRU order (the index snapshot): the
        # orphans, used by nobody since the crash, are oldest. With plain LRU (no hold), a buffer
        # blob, then every present blob read (used), then fillers that push the store over its
        # cap by the orphans' bytes: that pass must take the orphans (and at most the buffer).
        server.stop()
        server.extra_args = [*cut_on_arrival, "--eviction-hold", "0"]
        server.start()
        used = server.status()["current_size_bytes"]
        server.stop()
        buffer = os.urandom((2 << 20) - 1)  # just under the chunking threshold: one whole file
        fillers = [os.urandom(1 << 20) for _ in range(-(-sum(orphans.values()) // (1 << 20)) + 1)]
        cap = used + len(buffer) + sum(map(len, fillers)) - sum(orphans.values())
        server.extra_args = [*cut_on_arrival, "--eviction-hold", "0", "--max-size", str(cap)]
        server.start()
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)
            await write(stubs, buffer)
            await present_blobs_read_back(stubs, blobs)  # every present blob (and its chunks) used
            for filler in fillers:
                await write(stubs, filler)
            after, named_after = await present_blobs_read_back(stubs, blobs)
            assert after == present, "an eviction pass took a blob used after the orphans"
            assert not await missing(stubs, [digest(f) for f in fillers])
        left = set(chunk_files(data_dir)) & set(orphans)
        assert not left, f"{len(left)} orphan chunk(s) outlived the eviction pass"
        assert named_after <= set(chunk_files(data_dir))
    finally:
        server.kill()


async def test_kill_9_while_blobs_stored_whole_are_being_chunked(tmp_path) -> None:
    """Chunking after the write: blobs are acknowledged once stored whole, and the server is killed
    while its background task converts them (at least one converted, others waiting). After a
    restart every acknowledged blob reads back exactly, whichever state it was left in (whole,
    listed, or both), and every blob reported present reads back exactly."""
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir, name="convert").start()
    blobs = make_blobs(36) + make_blobs(37)
    acknowledged: set[int] = set()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            stubs = make_stubs(channel)

            async def client(c: int) -> None:
                for i in range(c, len(blobs), CLIENTS):
                    assert await write(stubs, blobs[i]) == len(blobs[i])
                    acknowledged.add(i)

            tasks = [asyncio.ensure_future(client(c)) for c in range(CLIENTS)]

            def converting() -> bool:
                chunking = server.status()["chunking"]
                return chunking["logical_bytes"] > 0 and chunking["backlog_blobs"] > 0

            await asyncio.to_thread(wait_for, converting, 120, "a blob converted and others waiting", 0.02)
            server.kill()
            await asyncio.gather(*tasks, return_exceptions=True)
        whole = {f"{digest(blobs[i]).hash}-{len(blobs[i])}" for i in acknowledged} & set(chunk_files(data_dir))
        assert 0 < len(whole) < len(acknowledged), "not killed mid-conversion: the test proves nothing"

        server.start()
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            present, _ = await present_blobs_read_back(make_stubs(channel), blobs)  # their chunks included
        assert acknowledged <= present, f"acknowledged blobs lost: {sorted(acknowledged - present)}"
    finally:
        server.kill()
