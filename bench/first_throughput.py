#!/usr/bin/env python3
"""First throughput figures through a real `buildvault serve` (disk store, loopback gRPC).

    .venv/bin/python bench/first_throughput.py [--size-mib 64] [--rounds 3] [--target HOST:PORT]

Starts its own server on 127.0.0.1:0 with a temporary data dir unless --target is given.
Reports ByteStream Write (1 MiB and 64 KiB chunks), ByteStream Read, compressed (zstd) Read,
and FindMissingBlobs of 1,000 digests (calls/s). Every read-back is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.harness import cpu_seconds  # noqa: E402
from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2  # noqa: E402

MiB = 1 << 20
OPTIONS = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]


async def write(bs: bs_grpc.ByteStreamStub, data: bytes, chunk: int) -> float:
    digest = hashlib.sha256(data).hexdigest()
    name = f"uploads/{uuid.uuid4()}/blobs/{digest}/{len(data)}"
    view = memoryview(data)

    async def requests():
        for offset in range(0, len(data), chunk):
            end = min(len(data), offset + chunk)
            yield bs_pb2.WriteRequest(
                resource_name=name if offset == 0 else "",
                write_offset=offset,
                data=bytes(view[offset:end]),
                finish_write=end == len(data),
            )

    started = time.perf_counter()
    reply = await bs.Write(requests())
    elapsed = time.perf_counter() - started
    assert reply.committed_size == len(data), reply
    return elapsed


async def read(bs: bs_grpc.ByteStreamStub, data: bytes, compressed: bool = False) -> float:
    digest = hashlib.sha256(data).hexdigest()
    kind = "compressed-blobs/zstd" if compressed else "blobs"
    started = time.perf_counter()
    parts = [r.data async for r in bs.Read(bs_pb2.ReadRequest(resource_name=f"{kind}/{digest}/{len(data)}"))]
    elapsed = time.perf_counter() - started
    got = b"".join(parts)
    if compressed:
        import zstandard

        got = zstandard.ZstdDecompressor().decompress(got, max_output_size=len(data))
    assert got == data, "read-back mismatch"
    return elapsed


async def find_missing(cas: re_grpc.ContentAddressableStorageStub, calls: int) -> float:
    digests = [re_pb2.Digest(hash=hashlib.sha256(os.urandom(16)).hexdigest(), size_bytes=100 + i) for i in range(1000)]
    request = re_pb2.FindMissingBlobsRequest(blob_digests=digests)
    await cas.FindMissingBlobs(request)
    started = time.perf_counter()
    for _ in range(calls):
        reply = await cas.FindMissingBlobs(request)
        assert len(reply.missing_blob_digests) == 1000
    return calls / (time.perf_counter() - started)


async def run(target: str, size: int, rounds: int, server_pid: int | None = None) -> None:
    async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
        await channel.channel_ready()
        bs = bs_grpc.ByteStreamStub(channel)
        cas = re_grpc.ContentAddressableStorageStub(channel)
        rows = []

        async def measure(label: str, nbytes: int, op) -> None:
            times, cpu = [], []
            for _ in range(rounds):
                before = cpu_seconds(server_pid)
                times.append(await op())
                cpu.append(cpu_seconds(server_pid) - before)
            rows.append((label, nbytes, min(times), min(cpu)))

        for chunk in (MiB, 64 << 10):
            await measure(
                f"ByteStream.Write {size // MiB} MiB, {chunk >> 10} KiB chunks",
                size,
                lambda chunk=chunk: write(bs, os.urandom(size), chunk),
            )
        data = os.urandom(size)
        await write(bs, data, MiB)
        await measure(f"ByteStream.Read {size // MiB} MiB", size, lambda: read(bs, data))
        text = b"buildvault throughput line %d\n"
        compressible = b"".join(text % i for i in range(size // 24))[:size]
        await write(bs, compressible, MiB)
        await measure(
            f"ByteStream.Read {size // MiB} MiB zstd (text)", size, lambda: read(bs, compressible, compressed=True)
        )
        for label, nbytes, seconds, cpu in rows:
            server = f", server CPU {cpu * 1000:.0f} ms = {nbytes / cpu / 1e6:.0f} MB/CPU-s" if cpu else ""
            print(f"{label:<48} {nbytes / seconds / 1e6:8.0f} MB/s  ({seconds * 1000:.0f} ms{server})")
        before = cpu_seconds(server_pid)
        rate = await find_missing(cas, 200)
        cpu = (cpu_seconds(server_pid) - before) / 200
        server = f"  (server CPU {cpu * 1000:.2f} ms/call)" if cpu else ""
        print(f"{'FindMissingBlobs, 1000 digests (sequential)':<48} {rate:8.0f} calls/s{server}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target", default=None, help="an already running server (default: start one)")
    args = parser.parse_args()
    if args.target:
        asyncio.run(run(args.target, args.size_mib * MiB, args.rounds))
        return
    from server_process import ServerProcess

    with (
        tempfile.TemporaryDirectory(prefix="buildvault-bench-") as tmp,
        ServerProcess(Path(tmp) / "data", http_address="") as server,
    ):
        asyncio.run(run(server.grpc_address, args.size_mib * MiB, args.rounds, server.pid))


if __name__ == "__main__":
    main()
