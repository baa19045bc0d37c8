#!/usr/bin/env python3
"""Eviction while serving: how often an ActionCache hit names an output that is gone before the
client reads it, with a small `--max-size` under concurrent writers and readers.

    python bench/eviction_bench.py --max-size 64MiB --writers 8 --readers 8 --seconds 20
    python bench/eviction_bench.py --target HOST:PORT ...     (a server already running)

Writers loop: upload `--outputs` blobs (ByteStream, 64 KiB chunks, sizes uniform in
`--min-blob`..`--max-blob`), then UpdateActionResult naming them. Readers loop: GetActionResult
of one of the last `--window` actions written, and on a hit read every output back in turn
(verified byte for byte), as Bazel downloads a hit's outputs. A hit whose
output read answers NOT_FOUND is a *broken hit*: Bazel fails such a build. Prints one JSON line:
hits, misses, broken hits and their rate (broken / hits), refused writes (RESOURCE_EXHAUSTED).
Not a timed test; numbers go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.servers import start_buildvault, stop
from buildvault.config import parse_size
from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2

CHUNK = 64 << 10


def digest(data: bytes) -> re_pb2.Digest:
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


class Counts:
    def __init__(self) -> None:
        self.writes = self.refused = 0
        self.write_errors: dict[str, int] = {}
        self.hits = self.misses = self.broken = 0


Recent = list[tuple[re_pb2.Digest, dict[str, bytes]]]  # action digest, output hash -> bytes


def requests(data: bytes, name: str):
    for start in range(0, len(data), CHUNK):
        yield bs_pb2.WriteRequest(
            resource_name=name if start == 0 else "",
            write_offset=start,
            data=data[start : start + CHUNK],
            finish_write=start + CHUNK >= len(data),
        )


async def writer(
    stop_at: float,
    bs: bs_grpc.ByteStreamStub,
    ac: re_grpc.ActionCacheStub,
    recent: Recent,
    args: argparse.Namespace,
    counts: Counts,
) -> None:
    rng = random.Random()
    while time.monotonic() < stop_at:
        blobs = [os.urandom(rng.randint(args.min_blob, args.max_blob)) for _ in range(args.outputs)]
        action = digest(os.urandom(32))
        try:
            for data in blobs:
                d = digest(data)
                await bs.Write(requests(data, f"uploads/{uuid.uuid4()}/blobs/{d.hash}/{d.size_bytes}"))
            outputs = [re_pb2.OutputFile(path=f"out{i}", digest=digest(data)) for i, data in enumerate(blobs)]
            result = re_pb2.ActionResult(output_files=outputs)
            await ac.UpdateActionResult(re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                counts.refused += 1
            else:  # FAILED_PRECONDITION: an output was evicted between its upload and the update
                code = e.code().name  # INTERNAL "from Core": the client's side of a refused stream
                counts.write_errors[code] = counts.write_errors.get(code, 0) + 1
            continue
        counts.writes += 1
        recent.append((action, {hashlib.sha256(data).hexdigest(): data for data in blobs}))
        del recent[: -args.window]


async def reader(
    stop_at: float, bs: bs_grpc.ByteStreamStub, ac: re_grpc.ActionCacheStub, recent: Recent, counts: Counts
) -> None:
    rng = random.Random()
    while time.monotonic() < stop_at:
        if not recent:
            await asyncio.sleep(0.01)  # nothing written yet
            continue
        action, contents = rng.choice(recent)
        try:
            result = await ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            counts.misses += 1
            continue
        counts.hits += 1
        for output_file in result.output_files:
            output = output_file.digest
            request = bs_pb2.ReadRequest(resource_name=f"blobs/{output.hash}/{output.size_bytes}")
            try:
                got = b"".join([r.data async for r in bs.Read(request)])
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                counts.broken += 1
                break
            if got != contents[output.hash]:
                raise AssertionError(f"blob {output.hash} read back wrong")


async def run(target: str, args: argparse.Namespace) -> dict[str, object]:
    counts = Counts()
    recent: Recent = []
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        bs, ac = bs_grpc.ByteStreamStub(channel), re_grpc.ActionCacheStub(channel)
        stop_at = time.monotonic() + args.seconds
        await asyncio.gather(
            *(writer(stop_at, bs, ac, recent, args, counts) for _ in range(args.writers)),
            *(reader(stop_at, bs, ac, recent, counts) for _ in range(args.readers)),
        )
    return {
        "max_size": args.max_size, "writers": args.writers, "readers": args.readers, "seconds": args.seconds,
        "window": args.window, "outputs": args.outputs, "blob_sizes": [args.min_blob, args.max_blob],
        "writes": counts.writes, "refused_writes": counts.refused,
        "write_errors": counts.write_errors, "hits": counts.hits, "misses": counts.misses,
        "broken_hits": counts.broken, "broken_rate": round(counts.broken / counts.hits, 4) if counts.hits else None,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="host:port of a running server (default: start buildvault)")
    parser.add_argument("--max-size", default="64MiB", help="the started server's --max-size")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--window", type=int, default=8, help="readers pick among the last N actions written")
    parser.add_argument("--outputs", type=int, default=2, help="output blobs per action")
    parser.add_argument("--min-blob", type=parse_size, default=parse_size("1MiB"))
    parser.add_argument("--max-blob", type=parse_size, default=parse_size("8MiB"))
    args = parser.parse_args()
    parse_size(args.max_size)  # a bad size fails here, not in the server
    if args.target:
        print(json.dumps(asyncio.run(run(args.target, args))))
        return 0
    with tempfile.TemporaryDirectory(prefix="buildvault-eviction-") as tmp:
        server = start_buildvault(Path(tmp) / "data", Path(tmp) / "server.log", ["--max-size", args.max_size])
        try:
            print(json.dumps(asyncio.run(run(server.address, args))))
        finally:
            stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
