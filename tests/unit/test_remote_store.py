"""The store client of a secondary process against the primary's store server, over a real Unix
socket: action entries, per-item batch errors, streams that end early, back-pressure, a primary
that goes away, and the relayed request metrics. (The BlobStore contract itself runs in
test_store_contract.py, "remote-*".)"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from buildvault.digest import Digest
from buildvault.server.metrics import Metrics
from buildvault.server.processes.relay import RelayedMetrics, RelayReceiver
from buildvault.storage import CHUNK_SIZE, DigestMismatch, NotFound, StorageFull, Unavailable, single_chunk
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore
from buildvault.storage.processes.client import RemoteStoreClient
from buildvault.storage.processes.store_server import StoreServer


class CountingStore(MemoryBlobStore):
    """Counts the chunks its reads hand out and whether each read was closed; can refuse writes."""

    def __init__(self) -> None:
        super().__init__()
        self.produced = 0
        self.closed = 0
        self.refuse: Exception | None = None

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        inner = await super().read(digest, offset, limit)

        async def counted() -> AsyncIterator[bytes]:
            try:
                async for chunk in inner:
                    for start in range(0, len(chunk), CHUNK_SIZE):
                        self.produced += 1
                        yield chunk[start : start + CHUNK_SIZE]
            finally:
                self.closed += 1

        return counted()

    async def write(self, digest: Digest, chunks: AsyncIterator[bytes]) -> None:  # type: ignore[override]
        if self.refuse is not None:
            raise self.refuse  # before reading a byte, as a full disk store does
        await super().write(digest, chunks)


@contextlib.asynccontextmanager
async def served(tmp_path: Path, metrics: Metrics | None = None):
    blobs, actions = CountingStore(), MemoryActionStore()
    recorder = RelayReceiver(metrics) if metrics is not None else None
    server = StoreServer(blobs, actions, recorder, str(tmp_path / "store.sock"))
    await server.start()
    client = RemoteStoreClient(server.path, process=1)
    try:
        yield blobs, server, client
    finally:
        await client.aclose()
        await server.stop()


async def test_action_entries_round_trip(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, _, client):
        action = Digest.of(b"action")
        with pytest.raises(NotFound):
            await client.actions.get("ac/main", action)
        await client.actions.put("ac/main", action, b"\x00entry bytes")
        assert await client.actions.get("ac/main", action) == b"\x00entry bytes"
        with pytest.raises(NotFound):  # namespaces stay apart
            await client.actions.get("raw/main", action)


async def test_batches_carry_each_items_outcome(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, _, client):
        good, bad = b"good blob", b"bad blob"
        outcomes = await client.blobs.write_blobs([(Digest.of(good), good), (Digest.of(b"other"), bad)])
        assert outcomes[0] is None and isinstance(outcomes[1], DigestMismatch)
        read = await client.blobs.read_blobs([Digest.of(good), Digest.of(bad)])
        assert read[0] == good and isinstance(read[1], NotFound)


async def test_a_read_left_midway_closes_the_stores_iterator_and_the_next_call_works(tmp_path: Path) -> None:
    async with served(tmp_path) as (blobs, _, client):
        data = os.urandom(8 * CHUNK_SIZE)
        await blobs.write(Digest.of(data), single_chunk(data))
        chunks = await client.blobs.read(Digest.of(data))
        assert await chunks.__anext__() == data[:CHUNK_SIZE]
        await chunks.aclose()  # type: ignore[attr-defined]
        assert await client.blobs.find_missing([Digest.of(data)]) == []
        for _ in range(100):  # the server sees the closed connection on its next write
            if blobs.closed:
                break
            await client.blobs.find_missing([])
        assert blobs.closed == 1


async def test_a_read_is_paced_by_its_consumer(tmp_path: Path) -> None:
    async with served(tmp_path) as (blobs, _, client):
        data = os.urandom(64 * CHUNK_SIZE)
        await blobs.write(Digest.of(data), single_chunk(data))
        chunks = await client.blobs.read(Digest.of(data))
        consumed = [await chunks.__anext__(), await chunks.__anext__()]
        for _ in range(20):  # the server gets every chance to run ahead
            await client.blobs.find_missing([])
        # a chunk or two in flight per side, never the blob
        assert blobs.produced - len(consumed) <= 5, blobs.produced
        rest = b"".join([chunk async for chunk in chunks])
        assert b"".join(consumed) + rest == data


async def test_a_write_refused_at_once_stops_the_sender_and_keeps_the_connection(tmp_path: Path) -> None:
    async with served(tmp_path) as (blobs, _, client):
        blobs.refuse = StorageFull("no room")
        pulled = 0

        async def source() -> AsyncIterator[bytes]:
            nonlocal pulled
            for _ in range(200):
                pulled += 1
                yield b"x" * (256 << 10)

        with pytest.raises(StorageFull, match="no room"):
            await client.blobs.write(Digest.of(b"x" * (50 << 20)), source())
        assert pulled < 20  # 50 MiB were never sent
        blobs.refuse = None
        data = b"after"
        await client.blobs.write(Digest.of(data), single_chunk(data))
        assert await client.blobs.find_missing([Digest.of(data)]) == []


async def test_a_primary_that_went_away_is_unavailable(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, server, client):
        await client.blobs.find_missing([])
        await server.stop()
        with pytest.raises(Unavailable):
            await client.blobs.find_missing([Digest.of(b"a")])
        with pytest.raises(Unavailable):
            await client.blobs.read(Digest.of(b"a"))


async def test_relayed_requests_reach_the_primarys_metrics(tmp_path: Path) -> None:
    primary = Metrics()
    async with served(tmp_path, primary) as (_, _, client):
        relay = RelayedMetrics(client, interval=3600)
        relay.observe_request("grpc", "FindMissingBlobs", "cas", "OK", 0.002)
        relay.observe_request("grpc", "FindMissingBlobs", "cas", "OK", 0.003)
        relay.ac_lookup("grpc", False)
        relay.auth_refused("grpc", "denied")
        await relay.flush()
        await client.blobs.find_missing([])  # after the METRICS frame on the same pool: it was applied

        def value(name: str, **labels: str) -> float | None:
            return primary.registry.get_sample_value(name, labels)

        labels = {"protocol": "grpc", "method": "FindMissingBlobs", "kind": "cas", "status": "OK"}
        assert value("buildvault_requests_total", **labels) == 2
        assert value("buildvault_secondary_requests_total", process="1") == 2
        assert value("buildvault_ac_misses_total", protocol="grpc") == 1
        assert value("buildvault_auth_refusals_total", protocol="grpc", reason="denied") == 1
        assert value("buildvault_store_ipc_requests_total", process="1") == 1


async def test_many_concurrent_calls_share_the_pool(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, _, client):
        blobs = [os.urandom(100 + i) for i in range(64)]
        await asyncio.gather(*(client.blobs.write(Digest.of(b), single_chunk(b)) for b in blobs))
        got = await asyncio.gather(*(client.blobs.read_blobs([Digest.of(b)]) for b in blobs))
        assert [g[0] for g in got] == blobs
