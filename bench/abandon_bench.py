#!/usr/bin/env python3
"""Memory held by abandoned half-sent uploads: server RSS while clients keep starting ByteStream
Writes, sending half of each blob and cancelling the call (the upload then stays resumable for
the server's upload grace period), and again some time after the load stops.

    python bench/abandon_bench.py --clients 20 --blob 4MiB --seconds 20 --after 70

Starts its own buildvault (`--max-size 8GiB`, a temporary directory). Prints one JSON line:
uploads abandoned, RSS idle, peak under load, right after, and `--after` seconds later (MiB).
Not a timed test; numbers go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.servers import start_buildvault, stop
from buildvault.config import parse_size
from buildvault.remote_apis import bs_grpc, bs_pb2

CHUNK = 64 << 10


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def abandoner(address: str, stop_at: float, size: int, abandoned: list[int]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        bytestream = bs_grpc.ByteStreamStub(channel)
        while time.monotonic() < stop_at:
            data = os.urandom(size)
            name = f"uploads/{uuid.uuid4()}/blobs/{hashlib.sha256(data).hexdigest()}/{size}"
            sent = asyncio.Event()
            hang = asyncio.Event()  # never set: the stream stays open until the call is cancelled

            async def requests(
                data: bytes = data, name: str = name, sent: asyncio.Event = sent, hang: asyncio.Event = hang
            ):
                for offset in range(0, size // 2, CHUNK):
                    first = name if offset == 0 else ""
                    yield bs_pb2.WriteRequest(
                        resource_name=first, write_offset=offset, data=data[offset : offset + CHUNK]
                    )
                sent.set()
                await hang.wait()

            call = bytestream.Write(requests())
            await sent.wait()
            # The bytes handed to gRPC are on their way; the server has them once its reply
            # would be possible. QueryWriteStatus says when they are committed.
            query = bs_pb2.QueryWriteStatusRequest(resource_name=name)
            while (await bytestream.QueryWriteStatus(query)).committed_size < size // 2:
                await asyncio.sleep(0.01)
            call.cancel()
            abandoned[0] += 1


async def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="buildvault-abandon-") as tmp:
        server = start_buildvault(Path(tmp) / "data", Path(tmp) / "server.log", ["--max-size", "8GiB"])
        try:
            idle = rss_mib(server.pid)
            abandoned = [0]
            stop_at = time.monotonic() + args.seconds
            tasks = [
                asyncio.create_task(abandoner(server.address, stop_at, args.blob, abandoned))
                for _ in range(args.clients)
            ]
            peak = idle
            while not all(task.done() for task in tasks):
                await asyncio.wait(tasks, timeout=0.5)
                peak = max(peak, rss_mib(server.pid))
            await asyncio.gather(*tasks)
            right_after = rss_mib(server.pid)
            await asyncio.sleep(args.after)  # measuring what is left once the grace period passed
            later = rss_mib(server.pid)
        finally:
            stop(server)
    return {
        "clients": args.clients, "blob": args.blob, "seconds": args.seconds, "abandoned": abandoned[0],
        "rss_idle_mib": idle, "rss_peak_mib": peak, "rss_right_after_mib": right_after,
        f"rss_{args.after:g}s_after_mib": later,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--blob", type=parse_size, default=parse_size("4MiB"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--after", type=float, default=70.0, help="seconds to wait after the load")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
